// Transport: carries opaque byte frames between the ranks of one job, in a
// star (rank 0 listens, every other rank connects to rank 0), plus direct
// lanes between the ranks of one node. The only code in Ferry that knows UCX;
// it knows nothing about the bytes it carries (the layer above hands it
// pre-encoded Cap'n Proto messages).
//
// Rank 0 exposes no UCX listener: UCX 1.13's socket connection manager aborts
// the process on a few crafted bytes. It listens on a small TCP socket of its
// own instead, where a rank presents its hello (the Join), its UCX worker
// address and its node; only a rank that accept() lets in learns rank 0's
// worker address and a session number, and both sides then connect UCX
// endpoints by worker address. UCX frames without that session number are
// dropped unread. docs/protocol.md ("Joining", "Direct lanes") has the wire
// format.
//
// Direct lanes: once every rank joined, rank 0 sends each rank the worker
// addresses of the other ranks on its node (same node identity in the hello)
// and one session number per pair; both ends of a pair create an endpoint to
// the other's address (UCX joins the two into one connection). A lane only
// carries frames: liveness stays with rank 0 (no heartbeats, no failure
// reports on lanes); the layer above closes a lane when rank 0 reports its
// peer failed or gone (close_lane). In "tcp" mode (the default) lanes have
// peer error handling and UCX uses tcp for them; in "shm" mode they have none,
// so UCX may pick shared memory (it excludes shm from endpoints with it), and
// cma is left out of the context (UCX 1.13 aborts on a cma read from a dead
// peer when nothing handles the error).
//
// clang-format off
// Connection life, seen from rank 0:
//
//   tcp accepted --whole hello, accept() ok--> joining --first UCX message--> up
//     |   (at most kMaxHandshakes at once,        (frames to it held)          |
//     |    handshake_timeout_s each)                                 error/silence
//     +--malformed, oversized, slow: closed, one log line                      v
//     +--accept() error: reply sent, closed                 failed (on_peer_failed once)
//
// and from a rank R > 0:
//
//   tcp connecting --hello sent, reply--> up --error/silence--> failed --hello again--> up
//     |   ^             |  (the reply is the first frame;      (on_peer_failed(0) once;
//     |   |             |                                       rank 0 takes a failed rank
//     |   |             |                                       back: on_peer_rejoined;
//     |   |             |                                       none by rejoin_timeout_s:
//     |   |             |                                       lost, on_peer_failed(0) again)
//     |   |             |   a refused UCX connect to rank 0 is retried
//     |   |             |   until 0.8 heartbeat_timeout_s, then failed)
//     |   |             +--refused: the reply is the first frame; sends fail.
//     +---+ no answer, closed early: retry until connect_timeout_s, then failed
//           (on_peer_failed(0, timeout)).
//
// A lane of rank R to rank S (both > 0, same node), on R:
//
//   lanes message from rank 0 --> joining --ready (or a frame) from S--> up
//     (endpoint created, `ready` sent;  (frames held)  (ready echoed once)  |
//      S may not know the session yet)     |                               |
//        not up within handshake_timeout_s,|          lane error           |
//        held frames go to rank 0          v                               |
//                    closed (frames for S go through rank 0) <-------------+
//   close_lane(S) from any state --> failed (frames for S fail, naming why)
// clang-format on
//
// Threading: one progress thread owns the UCX worker and the sockets. send(),
// next_hop(), close_lane(), wait_peers() and wait_lanes() may be called from any thread;
// callbacks run on the progress thread and must be quick. No callback runs
// once stop() has begun.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "ferry/logger.hpp"
#include "ferry/status.hpp"

namespace ferry {

class FrameBuffers;

struct TransportOptions {
  int32_t rank = 0;
  int32_t world_size = 1;
  std::string host = "127.0.0.1";   // rank 0's address (MASTER_ADDR); rank 0 listens on it
  uint16_t port = 0;                // rank 0 listens here; 0 on rank 0 = pick a free port (port())
  double connect_timeout_s = 30;    // non-zero ranks retry connecting until this deadline
  double heartbeat_interval_s = 1;  // send `heartbeat` bytes to every peer this often
  double heartbeat_timeout_s = 10;  // a peer silent (no frame at all) this long is failed
  // Rank 0 closes a connection that has not delivered its whole hello (or
  // taken its whole reply) this long after it was accepted.
  double handshake_timeout_s = 5;
  // A rank > 0 whose rank 0 failed asks to rejoin this long, then gives rank
  // 0 up (on_peer_failed(0) a second time, naming it lost).
  double rejoin_timeout_s = 300;
  // The largest frame either way: send() refuses a larger one, and a peer
  // that announces one is failed before anything is allocated for it.
  uint64_t max_frame_bytes = uint64_t{1} << 30;
  // Direct lanes between the ranks of one node: "tcp" (endpoints with peer
  // error handling: UCX uses tcp, and a lane closes by force), "shm" (without
  // it, so UCX may use shared memory: posix or sysv, no cma), or "off"
  // (frames between ranks > 0 go through rank 0; the setting direct-lanes).
  // Two ranks get a lane only if both ask for the same mode on the same node.
  std::string lanes = "tcp";
  bool lane_info = false;  // log each lane's UCX transports as it comes up
  // This rank's node; empty: the kernel's boot id and the host name.
  std::string node;
  // Where large received frames take their memory and sent ones return it
  // (the runtime's, shared with its encoders); null: the transport's own.
  std::shared_ptr<FrameBuffers> frame_buffers;
  Logger logger;  // where its log lines go; unset: stderr
};

struct TransportCallbacks {
  // Rank 0 only (REQUIRED there): the hello of a new connection (the Join),
  // before anything else of that process is accepted. Return the peer's rank,
  // or an error; on error the transport sends *reply (if non-empty) and closes
  // the connection. On success *reply (if non-empty) reaches the peer as its
  // first frame (the JoinAck). A rank outside [1, world_size) or one already
  // joined is refused without a reply. *reply is capped at 16 KiB.
  std::function<Result<int32_t>(const std::string& hello, std::string* reply)> accept;
  // Every frame after the hello, heartbeats included. On ranks > 0 the first
  // frame from rank 0 (the JoinAck) arrives here before wait_peers() returns.
  std::function<void(int32_t from_rank, std::string frame)> on_frame;
  // Once per peer, as soon as its endpoint fails or it has been silent for
  // heartbeat_timeout_s. A peer that closes its end gracefully is reported
  // too: the layer above knows whether that was expected. On a rank > 0,
  // rank 0 once more when rejoining it gave up (rejoin_timeout_s), naming it lost.
  std::function<void(int32_t rank, Status why)> on_peer_failed;
  // A failed peer is back (after a partition, say): on rank 0 a failed rank
  // whose hello accept() let in again; on a rank > 0, rank 0 once it took
  // our hello again (a rank > 0 keeps asking, with backoff, after rank 0
  // failed, for rejoin_timeout_s). It has a new session; on_peer_failed may report it again.
  // Lanes that close_lane() closed stay so (sends on them fail).
  std::function<void(int32_t rank)> on_peer_rejoined;
};

class Transport {
 public:
  // Creates the UCX context and worker (and on rank 0 the listening socket, so
  // a port already in use is an error here), then starts the progress thread.
  // Ranks > 0 present `hello` on every connection attempt; rank 0 hands it to
  // accept() (capped at 16 KiB).
  // Callbacks run on the progress thread: they must be quick, may call send(),
  // and must not call wait_peers() or stop().
  static Result<std::unique_ptr<Transport>> start(const TransportOptions& options,
                                                  std::string hello, std::string heartbeat,
                                                  TransportCallbacks callbacks);

  // Rank 0: until all world_size-1 peers were accepted; other ranks: until
  // connected and the first frame from rank 0 (the ack) arrived. Returns the
  // failure of a peer that failed (connect deadline included), or
  // Status::timeout naming the missing ranks. Thread-safe.
  Status wait_peers(double timeout_s);

  // A rank > 0, after wait_peers(): until each direct lane rank 0 announced
  // is up or closed (a lane that does not come up closes after
  // handshake_timeout_s), or timeout_s passed (Status::timeout naming the
  // ranks). A rank that dies while its lanes are still wiring up can make
  // UCX 1.13 abort its peers (an assertion in its tcp transport), so the
  // start barrier includes the lanes. Thread-safe.
  Status wait_lanes(double timeout_s);

  // The listening port on rank 0 (the chosen one when options.port was 0);
  // 0 on other ranks and on a rank 0 with world_size 1 (nothing to listen for).
  uint16_t port() const;

  // Queues `frame` for `to_rank` and returns at once; frames to one peer
  // arrive in order. A rank > 0 reaches another rank > 0 only by a direct
  // lane (next_hop says whether there is one; while it comes up, frames are
  // held, and if it does not, they go to rank 0). Errors: a rank out of
  // range, this rank, a rank > 0 without a lane from a rank > 0, a frame over
  // max_frame_bytes, a peer not (yet) connected, failed or that refused this
  // rank, or a stopped transport. A peer that fails after this returns is
  // reported through on_peer_failed only. Thread-safe.
  Status send(int32_t to_rank, std::string frame);

  // Where a frame for `to_rank` goes first: `to_rank` itself from rank 0, to
  // rank 0, or over a direct lane that is up or coming up (or that
  // close_lane() closed: send() then fails, naming why); otherwise 0 (rank
  // 0 passes it on). Thread-safe.
  int32_t next_hop(int32_t to_rank);

  // The layer above learned that `rank` failed or left: the lane to it
  // closes (frames held or queued for it are dropped; by force where the lane
  // has peer error handling, else abandoned to UCX) and later sends to it
  // fail with `why`. No-op without an open lane. Thread-safe.
  void close_lane(int32_t rank, const Status& why);

  // UCX's description of the lane to `rank` (ucp_ep_print_info: the
  // transports its UCX lanes use), taken when it came up; "" while none is up.
  std::string lane_info(int32_t rank);

  // A rank > 0: when its accepted hello was sent and when rank 0's reply
  // came (steady clock, ns), for a clock offset against rank 0's; zeros
  // before. Thread-safe.
  std::pair<int64_t, int64_t> join_round_trip();

  // Tests only: sends `frame` on the lane to `to_rank` with `session` in
  // place of the pair's session (the receiver must drop it unread).
  Status send_on_lane_for_test(int32_t to_rank, uint64_t session, std::string frame);

  // The most bytes of frames queued at once (handed to send(), not yet sent)
  // since the previous call, which starts the count again from what is
  // queued now. Flow control bounds it during a load. Thread-safe.
  uint64_t take_queued_peak();

  // Sends what is already queued, closes the endpoints (flushing to live
  // peers, bounded to a couple of seconds), closes the sockets, destroys the worker
  // and the context, and joins the thread. Idempotent; also run by the
  // destructor. REQUIRES: not called from a callback.
  void stop();

  ~Transport();
  Transport(const Transport&) = delete;
  Transport& operator=(const Transport&) = delete;

 private:
  class Impl;
  explicit Transport(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ferry
