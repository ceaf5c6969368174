// Transport::Impl, the one class behind Transport: private to its pieces, transport*.cpp
// (one seam a file), so each sees the whole state and none copies a helper.
//
// Transport over UCX active messages, joined through a TCP handshake of our
// own; see transport.hpp for the contract and docs/protocol.md for the wire
// format.
//
// All UCX calls and all socket I/O after start() happen on the progress
// thread, the worker runs in single-thread mode. UCX callbacks (endpoint
// errors, arriving frames) only record events; the loop acts on them after
// ucp_worker_progress returns, so endpoints are never created or closed from
// inside a UCX callback and user callbacks never run inside UCX.
//
// What a process outside the job can reach: rank 0's handshake socket and
// the sockets UCX's tcp transport listens on (for endpoints by worker
// address; UCX's own short, fixed-size wire-up). On the handshake socket every
// length is checked against a cap before anything is buffered, every
// connection has a deadline, and only kMaxHandshakes are served at once.
// UCX messages carry the session number rank 0 handed out with its worker
// address (or, on a direct lane, the pair's session it handed out with the
// lane); without it a message is dropped before its length is looked at.
#pragma once

#include "actors/transport.hpp"

#include "frame_buffers.hpp"

#include <sys/socket.h>

#include <ucp/api/ucp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace ferry {

// What more than one piece of Transport::Impl uses; each piece names its own.
namespace transport_detail {

using Clock = std::chrono::steady_clock;

// Both ends register and send on these active-message ids. Small, because UCP
// keeps its handlers in an array indexed by id. A frame carries the layer
// above's bytes; "ready" (no payload) is a rank's first message on its new
// endpoint: rank 0 holds frames to it until then, because a frame that
// overtook the handshake reply would find no session to match.
// "lanes" (rank 0 to a rank, once every rank joined) lists the direct lanes
// of that rank: peer, session, worker address (docs/protocol.md).
constexpr unsigned kFrameAmId = 1;
constexpr unsigned kReadyAmId = 2;
constexpr unsigned kLanesAmId = 3;

// The longest worker address either side takes (hello, reply, lanes): a
// tcp-only one is under 200 bytes.
constexpr uint32_t kMaxAddressBytes = 4 << 10;
// A node identity: the lane mode, the boot id and the host name.
constexpr size_t kMaxNodeBytes = 255;
// Retries of a connect to a rank 0 that is not listening yet back off up to this.
constexpr auto kFirstRetryDelay = std::chrono::milliseconds(50);
constexpr auto kMaxRetryDelay = std::chrono::milliseconds(500);

inline double seconds(Clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

inline Clock::duration from_seconds(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

inline std::string format_seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.3g s", s);
  return buf;
}

struct Address {
  sockaddr_storage storage{};
  socklen_t length = 0;
  bool loopback = false;
};

inline std::string ucx_error(const char* what, ucs_status_t status) {
  return std::string(what) + ": " + ucs_status_string(status);
}

inline void put_le(std::string* out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

inline uint64_t get_le(const char* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= uint64_t{static_cast<unsigned char>(p[i])} << (8 * i);
  return v;
}

}  // namespace transport_detail

class Transport::Impl {
 public:
  Impl(TransportOptions o, std::string hello, std::string heartbeat, TransportCallbacks cb)
      : opts_(std::move(o)),
        buffers_(opts_.frame_buffers ? opts_.frame_buffers : std::make_shared<FrameBuffers>()),
        hello_(std::move(hello)),
        heartbeat_(std::move(heartbeat)),
        cb_(std::move(cb)),
        peers_(static_cast<size_t>(opts_.world_size)),
        lanes_(static_cast<size_t>(opts_.world_size)),
        by_rank_(static_cast<size_t>(opts_.world_size), nullptr),
        reported_(static_cast<size_t>(opts_.world_size), false),
        rng_(std::random_device{}()) {}

  ~Impl() {
    stop();
    // Only reached without a thread when start() failed half way.
    teardown();
  }

  Status init();
  void launch() {
    thread_ = std::thread([this] { run(); });
  }
  Status wait_peers(double timeout_s);
  Status wait_lanes(double timeout_s);
  std::string pending_lanes_locked() const;
  Status send(int32_t to_rank, std::string frame);
  Status send_on_lane(int32_t to_rank, std::string frame, uint64_t session);
  int32_t next_hop(int32_t to_rank);
  void close_lane(int32_t rank, const Status& why);
  std::string lane_info(int32_t rank);
  void stop();
  uint16_t port() const { return port_; }
  uint64_t take_queued_peak() {
    const uint64_t now = queued_.load();
    return std::max(now, peak_.exchange(now));
  }
  std::pair<int64_t, int64_t> join_round_trip() {
    std::lock_guard<std::mutex> lock(mu_);
    return {hello_sent_ns_, reply_ns_};
  }

 private:
  using Clock = transport_detail::Clock;

  enum class Phase {
    joining,  // rank 0: accepted, endpoint created, no message from the peer on it yet;
              // a lane: created, no message from the peer on it yet
    up,
  };

  // What a lane's endpoint is for: frames only (see transport.hpp).
  enum class LaneMode { off, tcp, shm };

  // A message waiting for its endpoint to come up.
  struct Held {
    unsigned am_id;
    std::string bytes;
    bool queued;  // counted in queued_ (a frame from send())
  };

  // One endpoint. Owned by conns_ until its close request completed, because
  // UCX holds a pointer to it (error-callback argument) until then.
  struct Conn {
    Impl* owner = nullptr;
    uint64_t id = 0;
    uint64_t session = 0;  // in every message both ways; rank 0 chose it
    ucp_ep_h ep = nullptr;
    Phase phase = Phase::up;
    int32_t rank = -1;
    Clock::time_point last_rx;
    bool lane = false;      // a direct lane between two ranks > 0
    bool peer_mode = true;  // created with peer error handling (may be closed by force)
    Clock::time_point due;  // a lane: up by then, or its frames go to rank 0
    bool closing = false;
    void* close_request = nullptr;
    std::deque<Held> held;  // messages sent while joining
  };

  // One connection on the handshake socket: rank 0's side of a rank joining,
  // or a rank's side of its attempt.
  struct Handshake {
    enum Stage {
      connecting,  // rank > 0: non-blocking connect in progress
      sending,     // writing `out`
      receiving,   // reading a header, then the lengths it announced
      lingering,   // rank 0: reply written and our side shut; wait for the peer to hang up
    } stage = receiving;
    int fd = -1;
    std::string from;  // the peer's address, for logs
    std::string in;
    size_t want = 0;  // in.size() when the current part is complete
    bool header_checked = false;
    std::string out;
    size_t sent = 0;
    Clock::time_point deadline;
  };

  struct Event {
    enum Kind { frame, ready, lanes, error, oversize } kind;
    uint64_t conn_id;
    std::string bytes;     // frame
    ucs_status_t status;   // error
    size_t announced = 0;  // oversize
  };

  // A message in UCX's hands; freed by its completion callback (or after the
  // worker is destroyed, if UCX never completed it). The header points into it.
  struct SendOp {
    Impl* owner;
    uint64_t session;
    std::string bytes;
    uint64_t queued = 0;  // what it counts in queued_ (frames from send())
  };
  struct RecvOp {
    Impl* owner;
    uint64_t conn_id;
    std::string bytes;
    Event::Kind kind;  // frame or lanes
  };

  struct PeerInfo {
    enum State { absent, up, failed } state = absent;
    Status why;
  };

  // A lane as callers see it (guarded by mu_). `open`: announced by rank 0;
  // frames for its peer go on it. `failed`: closed by the layer above (its
  // peer failed): frames for the peer fail. `closed`: given up or lost on
  // its own: frames for the peer go through rank 0.
  struct LaneInfo {
    enum State { none, open, failed, closed } state = none;
    Status why;        // failed, closed
    std::string info;  // ucp_ep_print_info once up
    bool up = false;   // the peer's `ready` (or a frame) came on it
  };

  struct Command {
    enum Kind { send, close_lane, forged } kind = send;
    int32_t rank;
    std::string frame;
    uint64_t session = 0;  // forged
    Status why;            // close_lane
  };

  // UCX callbacks (progress thread, inside ucp_worker_progress).
  static void on_ep_error(void* arg, ucp_ep_h ep, ucs_status_t status);
  static ucs_status_t on_frame_am(void* arg, const void* header, size_t header_length, void* data,
                                  size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t on_ready_am(void* arg, const void* header, size_t header_length, void* data,
                                  size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t on_lanes_am(void* arg, const void* header, size_t header_length, void* data,
                                  size_t length, const ucp_am_recv_param_t* param);
  ucs_status_t receive(Conn* conn, Event::Kind kind, void* data, size_t length,
                       const ucp_am_recv_param_t* param);
  static void on_send_done(void* request, ucs_status_t status, void* user_data);
  // The end of a send, however it ended: UCX holds its bytes no longer.
  void end_send(SendOp* op);
  static void on_recv_done(void* request, ucs_status_t status, size_t length, void* user_data);
  Conn* conn_for_session(const void* header, size_t header_length);

  // Progress thread: UCX.
  void run();
  void dispatch_events();
  // A connection's UCX end failed (error, oversize frame): a lane closes, a peer fails.
  void lose_conn(Conn* conn, Status why);
  void handle_frame(Conn* conn, std::string bytes);
  void mark_ready(Conn* conn);
  void distribute_lanes();
  void install_lanes(const std::string& bytes);
  void lane_ready(Conn* conn);
  void close_lane_now(int32_t rank, const Status& why, bool relay_held);
  void run_commands();
  void on_tick(Clock::time_point now);
  void fail_peer(int32_t rank, Status why);
  // Rank > 0, rejoining: one attempt failed (logged seldom); past the limit, give up.
  void rejoin_failed(const std::string& why);
  void give_up_rejoin(Clock::time_point now);
  Result<Conn*> connect_to(int32_t rank, const std::string& address, uint64_t session,
                           bool lane = false);
  void drop_conn(Conn* conn, bool force);
  void reap_closed();
  void erase_conn(Conn* conn);
  void send_am(Conn* conn, unsigned am_id, std::string bytes, bool queued = false);
  void shutdown_endpoints();
  void teardown();

  // Progress thread: the handshake socket.
  Status open_listener();
  void service_sockets();
  void accept_connections();
  void service_handshake(uint64_t id);
  bool pump_out(Handshake& h);
  int pump_in(Handshake& h, size_t limit);
  void on_hello(uint64_t id);
  void on_reply(uint64_t id);
  void connect_attempt(Clock::time_point now);
  void connect_rank0(Clock::time_point now);
  void finish_join(bool refused, std::string reply);
  void retry_connect(const std::string& why);
  void watch(uint64_t id, const Handshake& h);
  void close_handshake(uint64_t id);
  Conn* find_conn(uint64_t id);

  void log(const char* fmt, ...) __attribute__((format(printf, 2, 3)));
  void log_foreign(const char* fmt, ...) __attribute__((format(printf, 2, 3)));
  void vlog(const char* fmt, va_list args);

  bool all_peers_up_locked() const;
  std::string missing_peers_locked() const;

  const TransportOptions opts_;
  const std::shared_ptr<FrameBuffers> buffers_;
  const std::string hello_;
  const std::string heartbeat_;
  const TransportCallbacks cb_;
  transport_detail::Address address_;
  uint16_t port_ = 0;

  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::string my_address_;  // this worker's UCX address
  LaneMode lane_mode_ = LaneMode::shm;
  std::string node_;     // sent in the hello: lane mode and node; "" without lanes
  int epoll_fd_ = -1;    // the loop sleeps on it: the worker's fd and sock_epoll_
  int sock_epoll_ = -1;  // the handshake sockets; polled without sleeping every turn
  int listen_fd_ = -1;   // rank 0
  std::thread thread_;

  // Shared with callers; guarded by mu_.
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopped_ = false;
  std::vector<PeerInfo> peers_;
  std::vector<LaneInfo> lanes_;
  std::deque<Command> commands_;
  bool ack_delivered_ = false;  // rank > 0: rank 0's reply went to on_frame
  bool refused_ = false;        // rank > 0: rank 0 refused us

  // Bytes of frames handed to send() and not yet sent (or dropped), and
  // their high-water mark since take_queued_peak().
  std::atomic<uint64_t> queued_{0};
  std::atomic<uint64_t> peak_{0};
  void count_queued(uint64_t n) {
    const uint64_t v = queued_.fetch_add(n) + n;
    uint64_t p = peak_.load();
    while (v > p && !peak_.compare_exchange_weak(p, v)) {
    }
  }
  void uncount_queued(uint64_t n) { queued_.fetch_sub(n); }

  // Progress thread only.
  std::map<uint64_t, std::unique_ptr<Conn>> conns_;
  std::unordered_map<uint64_t, Conn*> by_session_;
  std::vector<Conn*> by_rank_;
  std::vector<bool> reported_;
  std::vector<Event> events_;
  std::unordered_set<SendOp*> sends_;
  std::unordered_set<RecvOp*> recvs_;
  std::map<uint64_t, Handshake> handshakes_;
  // rank 0: what each rank presented at its join, for the lanes.
  std::vector<std::string> joined_address_;
  std::vector<std::string> joined_node_;
  std::unordered_set<uint64_t> issued_;  // rank 0: every session handed out
  bool lanes_done_ = false;              // rank 0: sent; a rank > 0: received (once only)
  uint64_t client_handshake_ = 0;        // rank > 0: the attempt in progress, 0 when none
  // rank > 0: accepted by rank 0, our endpoint to it not created yet.
  struct PendingJoin {
    std::string address;
    uint64_t session = 0;
    std::string reply;
    Clock::time_point deadline;
    int attempts = 0;
  };
  std::optional<PendingJoin> pending_join_;
  uint64_t next_conn_id_ = 1;
  uint64_t next_handshake_id_ = 1;  // 0 is the listening socket in sock_epoll_
  std::mt19937_64 rng_;
  bool stopping_ = false;
  bool connected_once_ = false;
  // rank > 0: rank 0 failed after we joined; we present our hello again
  // (retrying with backoff until rejoin_timeout_s) and rejoin with a fresh session.
  bool rejoining_ = false;
  Clock::time_point rejoin_since_;
  int rejoin_attempts_ = 0;
  std::string rejoin_logged_cause_;  // the last failed attempt's cause that was logged
  std::string rejoin_cause_;         // the last failed attempt's cause
  // Rank > 0: when the last hello left and when rank 0's reply to it came
  // (steady clock ns; under mu_), for the timeline's clock offset.
  int64_t hello_sent_ns_ = 0;
  int64_t reply_ns_ = 0;
  int attempts_ = 0;
  std::string last_connect_error_;
  Clock::duration retry_delay_ = transport_detail::kFirstRetryDelay;
  Clock::time_point next_attempt_;
  Clock::time_point connect_deadline_;
  Clock::time_point next_heartbeat_;
  Clock::time_point last_tick_;
  Clock::time_point foreign_window_;
  int foreign_logged_ = 0;
  size_t foreign_suppressed_ = 0;
  size_t stray_messages_ = 0;
  Clock::time_point next_stray_log_;
};

}  // namespace ferry
