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

#include "actors/transport.hpp"

#include "frame_buffers.hpp"
#include "log.hpp"
#include "node.hpp"

#include <arpa/inet.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <ucm/api/ucm.h>
#include <ucp/api/ucp.h>
#include <ucs/config/global_opts.h>
#include <ucs/debug/debug.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace ferry {

namespace {

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

// The handshake on rank 0's TCP socket (docs/protocol.md, "Joining").
constexpr char kHelloMagic[4] = {'F', 'R', 'Y', 'H'};
constexpr char kReplyMagic[4] = {'F', 'R', 'Y', 'A'};
constexpr uint8_t kHandshakeVersion = 2;
// magic, version, node length (u8), 2 reserved, hello length (u32 LE),
// address length (u32 LE); then hello, address, node
constexpr size_t kHelloHeaderBytes = 16;
// magic, version, verdict, 2 reserved, reply length, address length, session (u64 LE)
constexpr size_t kReplyHeaderBytes = 24;
constexpr uint8_t kVerdictAccepted = 0;
constexpr uint8_t kVerdictRefused = 1;
// A Join is a few hundred bytes, a tcp-only worker address under 200: the
// caps leave room and keep the memory one connection can pin small.
constexpr uint32_t kMaxHelloBytes = 16 << 10;
constexpr uint32_t kMaxReplyBytes = 16 << 10;
constexpr uint32_t kMaxAddressBytes = 4 << 10;
// A node identity: the lane mode, the boot id and the host name.
constexpr size_t kMaxNodeBytes = 255;
// Unauthenticated connections served at once; more are closed at once, and
// their ranks retry. Bounds rank 0's memory and descriptors under a flood.
constexpr size_t kMaxHandshakes = 32;
constexpr int kListenBacklog = 128;
// Fairness of one loop turn against a flood or a firehose.
constexpr int kMaxAcceptsPerTurn = 64;
constexpr size_t kMaxDiscardPerTurn = 64 << 10;
// Log lines about foreign connections, per second; the rest are counted.
constexpr int kForeignLogsPerSecond = 10;

// The longest the loop sleeps in epoll_wait: the resolution of heartbeats,
// silence checks and connect retries.
constexpr auto kMaxPollWait = std::chrono::milliseconds(50);
// A loop iteration this late means our own thread was held up (a slow
// callback, the process stopped): that time is not held against the peers.
constexpr auto kStallThreshold = std::chrono::milliseconds(400);
// Retries of a connect to a rank 0 that is not listening yet back off up to this.
constexpr auto kFirstRetryDelay = std::chrono::milliseconds(50);
constexpr auto kMaxRetryDelay = std::chrono::milliseconds(500);
// stop() waits this long for endpoints to close before destroying the worker.
constexpr auto kCloseGrace = std::chrono::seconds(2);

double seconds(Clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

Clock::duration from_seconds(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

std::string format_seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.3g s", s);
  return buf;
}

bool user_set(const char* ucx_name) {
  return std::getenv((std::string("UCX_") + ucx_name).c_str()) != nullptr;
}

bool handler_is_in_libucs(int signum) {
  struct sigaction current;
  if (sigaction(signum, nullptr, &current) != 0) return false;
  void* fn = (current.sa_flags & SA_SIGINFO) ? reinterpret_cast<void*>(current.sa_sigaction)
                                             : reinterpret_cast<void*>(current.sa_handler);
  if (fn == reinterpret_cast<void*>(SIG_DFL) || fn == reinterpret_cast<void*>(SIG_IGN)) {
    return false;
  }
  Dl_info info;
  return dladdr(fn, &info) != 0 && info.dli_fname != nullptr &&
         std::strstr(info.dli_fname, "libucs") != nullptr;
}

// UCX reads its memory-hook and signal options when libucs is loaded, before
// main(), so UCX_MEM_* and UCX_ERROR_SIGNALS given to ucp_config_modify are
// accepted and silently ignored. A guest in someone else's process undoes
// them here instead, unless the user asked for them in the environment.
void make_ucx_a_good_guest() {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  static bool ucm_done = false;
  if (!ucm_done) {
    ucm_done = true;
    // libucm comes in as a dependency of libucs and is not on our link line,
    // hence dlsym. Its hooks are installed lazily, at the first memory-event
    // registration, so switching them off before ucp_init is in time.
    auto* ucm = static_cast<ucm_global_config_t*>(dlsym(RTLD_DEFAULT, "ucm_global_opts"));
    if (ucm != nullptr) {
      if (!user_set("MEM_MALLOC_HOOKS")) ucm->enable_malloc_hooks = 0;
      if (!user_set("MEM_EVENTS")) ucm->enable_events = 0;
    }
  }
  // Restore the handlers UCX displaced, but only where UCX's handler is still
  // the current one: a handler installed later (Python's faulthandler,
  // Catch2) belongs to someone else and stays.
  if (!user_set("ERROR_SIGNALS")) {
    for (unsigned i = 0; i < ucs_global_opts.error_signals.count; ++i) {
      int signum = ucs_global_opts.error_signals.signals[i];
      if (handler_is_in_libucs(signum)) ucs_debug_disable_signal(signum);
    }
  }
  if (!user_set("DEBUG_SIGNO")) {
    int signum = static_cast<int>(ucs_global_opts.debug_signo);
    if (signum > 0 && handler_is_in_libucs(signum)) ucs_debug_disable_signal(signum);
  }
}

struct Address {
  sockaddr_storage storage{};
  socklen_t length = 0;
  bool loopback = false;
};

Result<Address> resolve(const std::string& host, uint16_t port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  std::string service = std::to_string(port);
  int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &found);
  if (rc != 0 || found == nullptr) {
    return Status::invalid_argument("transport: cannot resolve host '" + host +
                                    "': " + gai_strerror(rc));
  }
  Address a;
  std::memcpy(&a.storage, found->ai_addr, found->ai_addrlen);
  a.length = found->ai_addrlen;
  freeaddrinfo(found);
  if (a.storage.ss_family == AF_INET) {
    auto* in = reinterpret_cast<sockaddr_in*>(&a.storage);
    a.loopback = (ntohl(in->sin_addr.s_addr) >> 24) == 127;
  } else if (a.storage.ss_family == AF_INET6) {
    auto* in6 = reinterpret_cast<sockaddr_in6*>(&a.storage);
    a.loopback = IN6_IS_ADDR_LOOPBACK(&in6->sin6_addr);
  }
  return a;
}

uint16_t port_of(const sockaddr_storage& s) {
  if (s.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in&>(s).sin_port);
  if (s.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6&>(s).sin6_port);
  return 0;
}

std::string ucx_error(const char* what, ucs_status_t status) {
  return std::string(what) + ": " + ucs_status_string(status);
}

void put_le(std::string* out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

uint64_t get_le(const char* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= uint64_t{static_cast<unsigned char>(p[i])} << (8 * i);
  return v;
}

std::string describe(const sockaddr_storage& s) {
  char host[INET6_ADDRSTRLEN] = "?";
  if (s.ss_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in&>(s).sin_addr, host, sizeof(host));
  } else if (s.ss_family == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6&>(s).sin6_addr, host, sizeof(host));
  }
  return std::string(host) + ":" + std::to_string(port_of(s));
}

}  // namespace

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
  void handle_frame(Conn* conn, std::string bytes);
  void mark_ready(Conn* conn);
  void distribute_lanes();
  void install_lanes(const std::string& bytes);
  void lane_ready(Conn* conn);
  void close_lane_now(int32_t rank, const Status& why, bool relay_held);
  void run_commands();
  void on_tick(Clock::time_point now);
  void fail_peer(int32_t rank, Status why);
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
  Address address_;
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
  // (retrying with backoff until stop()) and rejoin with a fresh session.
  bool rejoining_ = false;
  // Rank > 0: when the last hello left and when rank 0's reply to it came
  // (steady clock ns; under mu_), for the timeline's clock offset.
  int64_t hello_sent_ns_ = 0;
  int64_t reply_ns_ = 0;
  int attempts_ = 0;
  std::string last_connect_error_;
  Clock::duration retry_delay_ = kFirstRetryDelay;
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

// --- setup ------------------------------------------------------------------------

Status Transport::Impl::init() {
  make_ucx_a_good_guest();
  FERRY_ASSIGN_OR_RETURN(address_, resolve(opts_.host, opts_.port));

  std::string mode = opts_.lanes;
  if (mode.empty()) {
    const char* env = std::getenv("FERRY_DIRECT_LANES");
    mode = env != nullptr && *env != '\0' ? env : "tcp";
  }
  if (mode == "shm") {
    lane_mode_ = LaneMode::shm;
  } else if (mode == "tcp") {
    lane_mode_ = LaneMode::tcp;
  } else if (mode == "off") {
    lane_mode_ = LaneMode::off;
  } else {
    return Status::invalid_argument(
        "transport: direct lanes (FERRY_DIRECT_LANES) must be shm, "
        "tcp or off, got '" +
        mode + "'");
  }
  if (lane_mode_ != LaneMode::off) {
    node_ = mode + "|" + (opts_.node.empty() ? node_identity() : opts_.node);
    if (node_.size() > kMaxNodeBytes) node_.resize(kMaxNodeBytes);
  }

  // A tcp message longer than one send segment (8 KiB by default) reaches
  // its peer milliseconds late (its later segments wait for some later
  // progress), and a load's exchange of plans is tens of KB: segments as
  // large as the receive side's default send it at once. Set in the
  // environment, unless the user did: UCX reads
  // a transport's settings there when it opens it (ucp_config_modify's did
  // not reach it).
  ::setenv("UCX_TCP_TX_SEG_SIZE", "64K", 0);
  ucp_config_t* config = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
  if (st != UCS_OK) return Status::internal(ucx_error("transport: ucp_config_read", st));
  // Peer-failure detection needs tcp (shared memory lanes do not report a
  // dead peer): the endpoints to and from rank 0 use only tcp whatever the
  // context offers. Shared memory is for shm-mode lanes, and without cma:
  // UCX 1.13 aborts the process (an unhandled error is fatal there) when a
  // cma rendezvous reads from a peer that died, on an endpoint without peer
  // error handling.
  std::vector<std::pair<const char*, const char*>> settings;
  if (!user_set("TLS"))
    settings.emplace_back("TLS", lane_mode_ == LaneMode::shm ? "tcp,posix,sysv" : "tcp");
  if (address_.loopback && !user_set("NET_DEVICES")) settings.emplace_back("NET_DEVICES", "lo");
  for (const auto& [name, value] : settings) {
    st = ucp_config_modify(config, name, value);
    if (st != UCS_OK) log("cannot set UCX_%s=%s: %s", name, value, ucs_status_string(st));
  }
  if (const char* tls = std::getenv("UCX_TLS");
      tls != nullptr && !std::strstr(tls, "tcp") && std::strcmp(tls, "all") != 0) {
    log("UCX_TLS=%s has no tcp: connections between ranks will probably fail", tls);
  }

  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED |
                      UCP_PARAM_FIELD_ESTIMATED_NUM_EPS | UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  params.mt_workers_shared = 0;
  params.estimated_num_eps =
      static_cast<size_t>(opts_.rank == 0 || lane_mode_ != LaneMode::off ? opts_.world_size : 1);
  params.name = "ferry";
  st = ucp_init(&params, config, &context_);
  ucp_config_release(config);
  if (st != UCS_OK) {
    context_ = nullptr;
    return Status::internal(ucx_error("transport: ucp_init", st));
  }

  ucp_worker_params_t wparams{};
  wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wparams.thread_mode = UCS_THREAD_MODE_SINGLE;
  st = ucp_worker_create(context_, &wparams, &worker_);
  if (st != UCS_OK) {
    worker_ = nullptr;
    return Status::internal(ucx_error("transport: ucp_worker_create", st));
  }

  using Handler =
      ucs_status_t (*)(void*, const void*, size_t, void*, size_t, const ucp_am_recv_param_t*);
  for (auto [id, cb] : {std::pair<unsigned, Handler>{kFrameAmId, &Impl::on_frame_am},
                        std::pair<unsigned, Handler>{kReadyAmId, &Impl::on_ready_am},
                        std::pair<unsigned, Handler>{kLanesAmId, &Impl::on_lanes_am}}) {
    ucp_am_handler_param_t am{};
    am.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                    UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    am.id = id;
    am.flags = UCP_AM_FLAG_WHOLE_MSG;
    am.cb = cb;
    am.arg = this;
    st = ucp_worker_set_am_recv_handler(worker_, &am);
    if (st != UCS_OK) {
      return Status::internal(ucx_error("transport: ucp_worker_set_am_recv_handler", st));
    }
  }

  ucp_address_t* addr = nullptr;
  size_t addr_len = 0;
  st = ucp_worker_get_address(worker_, &addr, &addr_len);
  if (st != UCS_OK) return Status::internal(ucx_error("transport: ucp_worker_get_address", st));
  my_address_.assign(reinterpret_cast<const char*>(addr), addr_len);
  ucp_worker_release_address(worker_, addr);
  if (my_address_.empty() || my_address_.size() > kMaxAddressBytes) {
    return Status::internal("transport: this worker's UCX address has " +
                            std::to_string(my_address_.size()) + " bytes; the limit is " +
                            std::to_string(kMaxAddressBytes));
  }

  int efd = -1;
  st = ucp_worker_get_efd(worker_, &efd);
  if (st != UCS_OK) return Status::internal(ucx_error("transport: ucp_worker_get_efd", st));
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  if (epoll_fd_ < 0) return Status::from_errno(errno, "epoll_create1", "transport");
  sock_epoll_ = epoll_create1(EPOLL_CLOEXEC);
  if (sock_epoll_ < 0) return Status::from_errno(errno, "epoll_create1", "transport");
  for (int fd : {efd, sock_epoll_}) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
      return Status::from_errno(errno, "epoll_ctl", "transport wake-up fd");
    }
  }

  if (opts_.rank == 0 && opts_.world_size > 1) FERRY_RETURN_IF_ERROR(open_listener());
  joined_address_.resize(static_cast<size_t>(opts_.world_size));
  joined_node_.resize(static_cast<size_t>(opts_.world_size));

  auto now = Clock::now();
  last_tick_ = now;
  foreign_window_ = now;
  next_heartbeat_ = now + from_seconds(opts_.heartbeat_interval_s);
  connect_deadline_ = now + from_seconds(opts_.connect_timeout_s);
  next_attempt_ = now;
  return Status::ok_status();
}

Status Transport::Impl::open_listener() {
  const std::string where = opts_.host + ":" + std::to_string(opts_.port);
  listen_fd_ = socket(address_.storage.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (listen_fd_ < 0) return Status::from_errno(errno, "socket", "rank 0 listening on " + where);
  // A restarted job reuses its port while the last run's connections sit in TIME_WAIT.
  int one = 1;
  setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (bind(listen_fd_, reinterpret_cast<const sockaddr*>(&address_.storage), address_.length) !=
          0 ||
      listen(listen_fd_, kListenBacklog) != 0) {
    return Status::io_error("rank 0: cannot listen on " + where + ": " + std::strerror(errno));
  }
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  if (getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&bound), &len) != 0) {
    return Status::from_errno(errno, "getsockname", "rank 0 listening on " + where);
  }
  port_ = port_of(bound);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = 0;
  if (epoll_ctl(sock_epoll_, EPOLL_CTL_ADD, listen_fd_, &ev) != 0) {
    return Status::from_errno(errno, "epoll_ctl", "rank 0 listening socket");
  }
  return Status::ok_status();
}

void Transport::Impl::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_) return;
    stopped_ = true;
    if (worker_ != nullptr && thread_.joinable()) ucp_worker_signal(worker_);
    cv_.notify_all();
  }
  if (thread_.joinable()) thread_.join();
}

void Transport::Impl::teardown() {
  for (auto& [id, h] : handshakes_) close(h.fd);
  handshakes_.clear();
  client_handshake_ = 0;
  if (listen_fd_ >= 0) {
    close(listen_fd_);
    listen_fd_ = -1;
  }
  if (worker_ != nullptr) {
    ucp_worker_destroy(worker_);
    worker_ = nullptr;
  }
  // Whatever UCX did not complete is ours to free once the worker is gone.
  for (SendOp* op : sends_) {
    uncount_queued(op->queued);
    delete op;
  }
  sends_.clear();
  for (RecvOp* op : recvs_) delete op;
  recvs_.clear();
  conns_.clear();
  by_session_.clear();
  if (context_ != nullptr) {
    ucp_cleanup(context_);
    context_ = nullptr;
  }
  for (int* fd : {&sock_epoll_, &epoll_fd_}) {
    if (*fd >= 0) close(*fd);
    *fd = -1;
  }
}

// --- caller-facing ----------------------------------------------------------------

bool Transport::Impl::all_peers_up_locked() const {
  if (opts_.rank != 0) return peers_[0].state == PeerInfo::up && ack_delivered_;
  for (int32_t r = 1; r < opts_.world_size; ++r) {
    if (peers_[r].state != PeerInfo::up) return false;
  }
  return true;
}

std::string Transport::Impl::missing_peers_locked() const {
  std::string out;
  int missing = 0;
  for (int32_t r = 0; r < opts_.world_size; ++r) {
    if (r == opts_.rank || (opts_.rank != 0 && r != 0)) continue;
    if (peers_[r].state == PeerInfo::up) continue;
    out += (missing++ == 0 ? "" : ", ") + std::to_string(r);
  }
  return (missing == 1 ? "rank " : "ranks ") + out;
}

Status Transport::Impl::wait_peers(double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  auto deadline = Clock::now() + from_seconds(std::max(0.0, timeout_s));
  auto failure = [this]() -> const PeerInfo* {
    for (const auto& p : peers_) {
      if (p.state == PeerInfo::failed) return &p;
    }
    return nullptr;
  };
  cv_.wait_until(lock, deadline,
                 [&] { return stopped_ || failure() != nullptr || all_peers_up_locked(); });
  if (const PeerInfo* f = failure()) return f->why;
  if (all_peers_up_locked()) return Status::ok_status();
  if (stopped_)
    return Status::aborted("rank " + std::to_string(opts_.rank) + ": transport stopped");
  std::string what = opts_.rank == 0 ? "rank 0: timed out after " + format_seconds(timeout_s) +
                                           " waiting for " + missing_peers_locked() + " to join"
                                     : "rank " + std::to_string(opts_.rank) + ": timed out after " +
                                           format_seconds(timeout_s) + " waiting for rank 0 at " +
                                           opts_.host + ":" + std::to_string(opts_.port);
  return Status::timeout(what);
}

// The ranks whose lane is announced but not up yet, "" when none (mu_ held).
std::string Transport::Impl::pending_lanes_locked() const {
  std::string out;
  for (size_t r = 0; r < lanes_.size(); ++r)
    if (lanes_[r].state == LaneInfo::open && !lanes_[r].up)
      out += (out.empty() ? "" : ", ") + std::to_string(r);
  return out;
}

Status Transport::Impl::wait_lanes(double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  if (cv_.wait_until(lock, Clock::now() + from_seconds(std::max(0.0, timeout_s)),
                     [&] { return stopped_ || pending_lanes_locked().empty(); }))
    return Status::ok_status();
  return Status::timeout("rank " + std::to_string(opts_.rank) + ": the direct lane(s) to rank(s) " +
                         pending_lanes_locked() + " did not come up within " +
                         format_seconds(timeout_s));
}

Status Transport::Impl::send(int32_t to_rank, std::string frame) {
  const std::string me = "rank " + std::to_string(opts_.rank);
  if (to_rank < 0 || to_rank >= opts_.world_size) {
    return Status::invalid_argument(me + ": send to rank " + std::to_string(to_rank) +
                                    ": world size is " + std::to_string(opts_.world_size));
  }
  if (to_rank == opts_.rank) {
    return Status::invalid_argument(me + ": send to itself");
  }
  if (frame.size() > opts_.max_frame_bytes) {
    return Status::invalid_argument(me + ": send to rank " + std::to_string(to_rank) + ": " +
                                    std::to_string(frame.size()) + "-byte frame, the limit is " +
                                    std::to_string(opts_.max_frame_bytes));
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (stopped_) return Status::aborted(me + ": send: transport stopped");
  if (refused_) return Status::aborted(me + ": send: rank 0 refused this rank");
  if (opts_.rank != 0 && to_rank != 0) {
    const LaneInfo& lane = lanes_[to_rank];
    if (lane.state == LaneInfo::failed) {
      return Status::aborted(me + ": send to rank " + std::to_string(to_rank) +
                             ": its direct lane closed: " + lane.why.message());
    }
    if (lane.state != LaneInfo::open) {
      return Status::not_found(me + ": send to rank " + std::to_string(to_rank) +
                               ": no direct lane to it (frames to it go through rank 0)" +
                               (lane.state == LaneInfo::closed ? ": " + lane.why.message() : ""));
    }
  } else {
    const PeerInfo& peer = peers_[to_rank];
    if (peer.state == PeerInfo::failed) {
      return Status::aborted(me + ": send to failed peer: " + peer.why.message());
    }
    if (peer.state != PeerInfo::up) {
      return Status::not_found(me + ": send to rank " + std::to_string(to_rank) +
                               ": not connected (yet)");
    }
  }
  count_queued(frame.size());
  commands_.push_back(Command{Command::send, to_rank, std::move(frame), 0, Status()});
  // Under mu_: the worker outlives every send() that saw stopped_ == false.
  ucp_worker_signal(worker_);
  return Status::ok_status();
}

int32_t Transport::Impl::next_hop(int32_t to_rank) {
  if (opts_.rank == 0 || to_rank <= 0 || to_rank >= opts_.world_size) return to_rank;
  std::lock_guard<std::mutex> lock(mu_);
  const auto state = lanes_[to_rank].state;
  return state == LaneInfo::open || state == LaneInfo::failed ? to_rank : 0;
}

void Transport::Impl::close_lane(int32_t rank, const Status& why) {
  if (opts_.rank == 0 || rank <= 0 || rank >= opts_.world_size || rank == opts_.rank) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (stopped_ || lanes_[rank].state != LaneInfo::open) return;
  // Closed for callers at once: no frame queued from now on goes to it.
  lanes_[rank].state = LaneInfo::failed;
  lanes_[rank].why = why;
  cv_.notify_all();
  commands_.push_back(Command{Command::close_lane, rank, {}, 0, why});
  ucp_worker_signal(worker_);
}

std::string Transport::Impl::lane_info(int32_t rank) {
  if (rank < 0 || rank >= opts_.world_size) return "";
  std::lock_guard<std::mutex> lock(mu_);
  return lanes_[rank].info;
}

Status Transport::Impl::send_on_lane(int32_t to_rank, std::string frame, uint64_t session) {
  if (to_rank <= 0 || to_rank >= opts_.world_size || to_rank == opts_.rank)
    return Status::invalid_argument("send_on_lane_for_test: no lane to rank " +
                                    std::to_string(to_rank));
  std::lock_guard<std::mutex> lock(mu_);
  if (stopped_ || lanes_[to_rank].state != LaneInfo::open)
    return Status::not_found("send_on_lane_for_test: no open lane to rank " +
                             std::to_string(to_rank));
  commands_.push_back(Command{Command::forged, to_rank, std::move(frame), session, Status()});
  ucp_worker_signal(worker_);
  return Status::ok_status();
}

// --- UCX callbacks ----------------------------------------------------------------

void Transport::Impl::on_ep_error(void* arg, ucp_ep_h, ucs_status_t status) {
  auto* conn = static_cast<Conn*>(arg);
  conn->owner->events_.push_back(Event{Event::error, conn->id, {}, status});
}

Transport::Impl::Conn* Transport::Impl::conn_for_session(const void* header, size_t header_length) {
  if (header == nullptr || header_length != sizeof(uint64_t)) return nullptr;
  uint64_t session = get_le(static_cast<const char*>(header), sizeof(uint64_t));
  auto it = by_session_.find(session);
  if (it == by_session_.end() || it->second->closing) return nullptr;
  return it->second;
}

ucs_status_t Transport::Impl::on_ready_am(void* arg, const void* header, size_t header_length,
                                          void*, size_t, const ucp_am_recv_param_t*) {
  auto* self = static_cast<Impl*>(arg);
  Conn* conn = self->conn_for_session(header, header_length);
  if (conn == nullptr) {
    // Not counted as foreign: the first `ready` on a lane reaches a peer that
    // has not learnt the lane yet whenever this end learnt it first.
    return UCS_OK;
  }
  self->events_.push_back(Event{Event::ready, conn->id, {}, UCS_OK});
  return UCS_OK;
}

ucs_status_t Transport::Impl::on_lanes_am(void* arg, const void* header, size_t header_length,
                                          void* data, size_t length,
                                          const ucp_am_recv_param_t* param) {
  auto* self = static_cast<Impl*>(arg);
  Conn* conn = self->conn_for_session(header, header_length);
  // Only rank 0 hands out lanes, on its own endpoint.
  if (conn == nullptr || conn->lane || conn->rank != 0 || self->opts_.rank == 0) {
    ++self->stray_messages_;
    return UCS_OK;
  }
  return self->receive(conn, Event::lanes, data, length, param);
}

ucs_status_t Transport::Impl::on_frame_am(void* arg, const void* header, size_t header_length,
                                          void* data, size_t length,
                                          const ucp_am_recv_param_t* param) {
  auto* self = static_cast<Impl*>(arg);
  // Who it is comes first, how long second: nothing is allocated for a
  // message that is not from a joined peer, or that is over the cap.
  // Returning UCS_OK drops a rendezvous descriptor too.
  Conn* conn = self->conn_for_session(header, header_length);
  if (conn == nullptr) {
    ++self->stray_messages_;
    return UCS_OK;
  }
  return self->receive(conn, Event::frame, data, length, param);
}

ucs_status_t Transport::Impl::receive(Conn* conn, Event::Kind kind, void* data, size_t length,
                                      const ucp_am_recv_param_t* param) {
  if (length > opts_.max_frame_bytes) {
    events_.push_back(Event{Event::oversize, conn->id, {}, UCS_OK, length});
    return UCS_OK;
  }
  if (!(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
    events_.push_back(
        Event{kind, conn->id, std::string(static_cast<const char*>(data), length), UCS_OK});
    return UCS_OK;
  }
  // A large frame: only its announcement is here; fetch the bytes into the
  // string that will be delivered, so they are copied once (a buffer an
  // earlier frame used: FrameBuffers).
  auto* op = new RecvOp{this, conn->id, buffers_->take(length), kind};
  recvs_.insert(op);
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.recv_am = &Impl::on_recv_done;
  p.user_data = op;
  ucs_status_ptr_t req = ucp_am_recv_data_nbx(worker_, data, op->bytes.data(), length, &p);
  if (req == nullptr) {
    events_.push_back(Event{kind, conn->id, std::move(op->bytes), UCS_OK});
    recvs_.erase(op);
    delete op;
  } else if (UCS_PTR_IS_ERR(req)) {
    log("cannot receive a %zu-byte frame: %s", length, ucs_status_string(UCS_PTR_STATUS(req)));
    recvs_.erase(op);
    delete op;
  }
  return UCS_INPROGRESS;
}

void Transport::Impl::on_send_done(void* request, ucs_status_t, void* user_data) {
  // A failed send needs no action here: the endpoint's error callback reports the peer.
  auto* op = static_cast<SendOp*>(user_data);
  op->owner->end_send(op);
  ucp_request_free(request);
}

void Transport::Impl::end_send(SendOp* op) {
  sends_.erase(op);
  uncount_queued(op->queued);
  buffers_->give(std::move(op->bytes));  // encoded in one (protocol.cpp)
  delete op;
}

void Transport::Impl::on_recv_done(void* request, ucs_status_t status, size_t length,
                                   void* user_data) {
  auto* op = static_cast<RecvOp*>(user_data);
  Impl* self = op->owner;
  if (status == UCS_OK) {
    // Never more than was allocated: UCX copies at most the announced length.
    op->bytes.resize(std::min(length, op->bytes.size()));
    self->events_.push_back(Event{op->kind, op->conn_id, std::move(op->bytes), UCS_OK});
  } else if (!self->stopping_ && status != UCS_ERR_CANCELED) {
    self->log("lost a %zu-byte frame: %s", op->bytes.size(), ucs_status_string(status));
  }
  self->recvs_.erase(op);
  delete op;
  ucp_request_free(request);
}

// --- the progress thread ------------------------------------------------------------

void Transport::Impl::run() {
  epoll_event ev;
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopped_) break;
    }
    unsigned progressed = ucp_worker_progress(worker_);
    dispatch_events();
    service_sockets();
    run_commands();
    auto now = Clock::now();
    on_tick(now);
    reap_closed();
    if (progressed != 0 || !events_.empty()) continue;

    ucs_status_t st = ucp_worker_arm(worker_);
    if (st == UCS_ERR_BUSY) continue;
    if (st != UCS_OK) {
      log("ucp_worker_arm: %s", ucs_status_string(st));
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!commands_.empty() || stopped_) continue;
    }
    auto wait = std::min<Clock::duration>(kMaxPollWait, next_heartbeat_ - Clock::now());
    int wait_ms = static_cast<int>(
        std::ceil(std::max(0.0, std::chrono::duration<double, std::milli>(wait).count())));
    if (epoll_wait(epoll_fd_, &ev, 1, wait_ms) < 0 && errno != EINTR) {
      log("epoll_wait: %s", std::strerror(errno));
      std::this_thread::sleep_for(kMaxPollWait);
    }
  }
  shutdown_endpoints();
  teardown();
}

void Transport::Impl::dispatch_events() {
  while (!events_.empty()) {
    std::vector<Event> batch;
    batch.swap(events_);
    for (Event& e : batch) {
      Conn* conn = find_conn(e.conn_id);
      if (conn == nullptr || conn->closing) continue;
      switch (e.kind) {
        case Event::frame:
          handle_frame(conn, std::move(e.bytes));
          continue;
        case Event::ready:
          conn->last_rx = Clock::now();
          if (conn->lane) {
            lane_ready(conn);
          } else {
            mark_ready(conn);
          }
          continue;
        case Event::lanes:
          conn->last_rx = Clock::now();
          install_lanes(e.bytes);
          continue;
        case Event::oversize: {
          Status why = Status::invalid_argument(
              "rank " + std::to_string(conn->rank) + " announced a " + std::to_string(e.announced) +
              "-byte frame; the limit is " + std::to_string(opts_.max_frame_bytes));
          // Whether a rank failed is rank 0's word: a lane only closes.
          if (conn->lane) {
            log("closed the direct lane to rank %d: %s", conn->rank, why.message().c_str());
            close_lane_now(conn->rank, why, false);
            continue;
          }
          fail_peer(conn->rank, std::move(why));
          break;
        }
        case Event::error: {
          Status why = Status::aborted("rank " + std::to_string(conn->rank) +
                                       ": connection lost: " + ucs_status_string(e.status));
          if (conn->lane) {
            log("closed the direct lane to rank %d: %s", conn->rank, why.message().c_str());
            close_lane_now(conn->rank, why, false);
            continue;
          }
          fail_peer(conn->rank, std::move(why));
          break;
        }
      }
      drop_conn(conn, /*force=*/true);
    }
  }
}

void Transport::Impl::mark_ready(Conn* conn) {
  if (conn->phase == Phase::up) return;
  conn->phase = Phase::up;
  if (conn->lane) {
    // What UCX chose for this lane, for lane_info() and the logs.
    std::string info;
    char* text = nullptr;
    size_t size = 0;
    if (FILE* f = open_memstream(&text, &size)) {
      ucp_ep_print_info(conn->ep, f);
      std::fclose(f);
      if (text != nullptr) info.assign(text, size);
    }
    std::free(text);
    if (std::getenv("FERRY_LANE_INFO") != nullptr) {
      log("direct lane to rank %d is up:\n%s", conn->rank, info.c_str());
    }
    std::lock_guard<std::mutex> lock(mu_);
    lanes_[conn->rank].info = std::move(info);
    lanes_[conn->rank].up = true;
    cv_.notify_all();
  }
  while (!conn->held.empty()) {
    Held h = std::move(conn->held.front());
    conn->held.pop_front();
    send_am(conn, h.am_id, std::move(h.bytes), h.queued);
  }
}

// A `ready` on a lane: the peer knows the session. The first one brings the
// lane up and is answered, since our own first `ready` may have reached the
// peer before it knew the lane (and been dropped there).
void Transport::Impl::lane_ready(Conn* conn) {
  if (conn->phase == Phase::up) return;
  mark_ready(conn);
  send_am(conn, kReadyAmId, std::string());
}

// Rank 0, once every rank joined: each rank learns the ranks of its node,
// their worker addresses and one session per pair. Sent on rank 0's endpoint
// to the rank, after the rank's `ready` (held until then like a frame).
void Transport::Impl::distribute_lanes() {
  if (lanes_done_) return;
  lanes_done_ = true;
  const int32_t n = opts_.world_size;
  std::vector<std::string> body(static_cast<size_t>(n));
  std::vector<uint32_t> count(static_cast<size_t>(n), 0);
  for (int32_t a = 1; a < n; ++a) {
    for (int32_t b = a + 1; b < n; ++b) {
      if (joined_node_[a].empty() || joined_node_[a] != joined_node_[b]) continue;
      uint64_t session = 0;
      while (session == 0 || issued_.count(session) != 0) session = rng_();
      issued_.insert(session);
      for (auto [me, peer] : {std::pair<int32_t, int32_t>{a, b}, {b, a}}) {
        std::string& out = body[me];
        put_le(&out, static_cast<uint64_t>(peer), 4);
        put_le(&out, session, 8);
        put_le(&out, joined_address_[peer].size(), 4);
        out += joined_address_[peer];
        ++count[me];
      }
    }
  }
  for (int32_t r = 1; r < n; ++r) {
    Conn* conn = by_rank_[r];
    if (count[r] == 0 || conn == nullptr || conn->closing) continue;
    std::string msg;
    put_le(&msg, count[r], 4);
    msg += body[r];
    if (conn->phase == Phase::joining) {
      conn->held.push_back(Held{kLanesAmId, std::move(msg), false});
    } else {
      send_am(conn, kLanesAmId, std::move(msg));
    }
  }
}

// A rank > 0: rank 0's list of lanes. Anything malformed leaves this rank
// without lanes (everything goes through rank 0), with one log line.
void Transport::Impl::install_lanes(const std::string& bytes) {
  if (lanes_done_ || stopping_) return;
  lanes_done_ = true;
  struct Entry {
    int32_t rank;
    uint64_t session;
    std::string address;
  };
  std::vector<Entry> entries;
  std::string bad;
  size_t at = 4;
  const uint64_t count = bytes.size() >= 4 ? get_le(bytes.data(), 4) : 0;
  if (bytes.size() < 4 || count >= static_cast<uint64_t>(opts_.world_size)) {
    bad = "bad lane count";
  }
  std::vector<bool> seen(static_cast<size_t>(opts_.world_size), false);
  for (uint64_t i = 0; bad.empty() && i < count; ++i) {
    if (bytes.size() - at < 16) {
      bad = "truncated";
      break;
    }
    Entry e;
    const uint64_t rank = get_le(&bytes[at], 4);
    e.session = get_le(&bytes[at + 4], 8);
    const uint64_t len = get_le(&bytes[at + 12], 4);
    at += 16;
    if (rank == 0 || rank >= static_cast<uint64_t>(opts_.world_size) ||
        static_cast<int32_t>(rank) == opts_.rank || seen[rank]) {
      bad = "rank " + std::to_string(rank) + " out of range or repeated";
    } else if (e.session == 0 || by_session_.count(e.session) != 0) {
      bad = "session in use";
    } else if (len == 0 || len > kMaxAddressBytes || bytes.size() - at < len) {
      bad = "worker address of " + std::to_string(len) + " bytes";
    } else {
      seen[rank] = true;
      e.rank = static_cast<int32_t>(rank);
      e.address = bytes.substr(at, len);
      at += len;
      entries.push_back(std::move(e));
    }
  }
  if (bad.empty() && at != bytes.size()) bad = "trailing bytes";
  if (!bad.empty()) {
    log("ignored rank 0's list of direct lanes (%s): frames to other ranks go through rank 0",
        bad.c_str());
    return;
  }
  for (const Entry& e : entries) {
    Result<Conn*> conn = connect_to(e.rank, e.address, e.session, /*lane=*/true);
    if (!conn.ok()) {
      log("no direct lane to rank %d (frames to it go through rank 0): %s", e.rank,
          conn.status().to_string().c_str());
      continue;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      lanes_[e.rank].state = LaneInfo::open;
    }
    send_am(*conn, kReadyAmId, std::string());
  }
}

// Closes the lane to `rank` here (progress thread). Frames held for it are
// dropped, or (`relay_held`, the lane never came up) go to rank 0, which
// passes them on as it does any frame for another rank.
void Transport::Impl::close_lane_now(int32_t rank, const Status& why, bool relay_held) {
  Conn* conn = by_rank_[rank];
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (lanes_[rank].state == LaneInfo::open) {
      lanes_[rank].state = LaneInfo::closed;
      lanes_[rank].why = why;
      cv_.notify_all();
    }
  }
  if (conn == nullptr || !conn->lane || conn->closing) return;
  Conn* hub = by_rank_[0];
  if (relay_held && hub != nullptr && !hub->closing) {
    while (!conn->held.empty()) {
      Held h = std::move(conn->held.front());
      conn->held.pop_front();
      if (h.am_id == kFrameAmId) {
        send_am(hub, kFrameAmId, std::move(h.bytes), h.queued);
      } else if (h.queued) {
        uncount_queued(h.bytes.size());
      }
    }
  }
  drop_conn(conn, /*force=*/true);
}

void Transport::Impl::handle_frame(Conn* conn, std::string bytes) {
  conn->last_rx = Clock::now();
  // The peer's own ready message normally comes first; a frame from it
  // proves the same.
  mark_ready(conn);
  if (!stopping_ && cb_.on_frame) cb_.on_frame(conn->rank, std::move(bytes));
}

void Transport::Impl::run_commands() {
  std::deque<Command> batch;
  {
    std::lock_guard<std::mutex> lock(mu_);
    batch.swap(commands_);
  }
  for (Command& c : batch) {
    if (c.kind == Command::close_lane) {
      close_lane_now(c.rank, c.why, false);
      continue;
    }
    Conn* conn = by_rank_[c.rank];
    const bool queued = c.kind == Command::send;
    // A peer that failed since send() returned: on_peer_failed says so (or,
    // for a lane, the layer above closed it).
    if (conn == nullptr || conn->closing || (c.kind == Command::forged && !conn->lane)) {
      if (queued) uncount_queued(c.frame.size());
      continue;
    }
    if (c.kind == Command::forged) {
      // Tests: the frame as a stranger who guessed this lane would send it.
      const uint64_t real = conn->session;
      conn->session = c.session;
      send_am(conn, kFrameAmId, std::move(c.frame));
      conn->session = real;
      continue;
    }
    if (conn->phase == Phase::joining) {
      conn->held.push_back(Held{kFrameAmId, std::move(c.frame), true});
    } else {
      send_am(conn, kFrameAmId, std::move(c.frame), true);
    }
  }
}

void Transport::Impl::on_tick(Clock::time_point now) {
  if (now - last_tick_ > kStallThreshold) {
    for (auto& [id, conn] : conns_) conn->last_rx += now - last_tick_;
    for (auto& [id, h] : handshakes_) h.deadline += now - last_tick_;
    if (pending_join_) pending_join_->deadline += now - last_tick_;
  }
  last_tick_ = now;

  if (opts_.rank != 0 && !connected_once_ && !reported_[0]) {
    if (now >= connect_deadline_) {
      if (client_handshake_ != 0) close_handshake(client_handshake_);
      std::string why = "rank " + std::to_string(opts_.rank) + ": could not connect to rank 0 at " +
                        opts_.host + ":" + std::to_string(opts_.port) + " within " +
                        format_seconds(opts_.connect_timeout_s) + " (" + std::to_string(attempts_) +
                        " attempts";
      if (!last_connect_error_.empty()) why += "; last error: " + last_connect_error_;
      fail_peer(0, Status::timeout(why + ")"));
    } else if (client_handshake_ == 0 && now >= next_attempt_) {
      connect_attempt(now);
    }
  }
  if (rejoining_ && reported_[0]) {
    auto h = client_handshake_ != 0 ? handshakes_.find(client_handshake_) : handshakes_.end();
    if (h != handshakes_.end() && now >= h->second.deadline) {
      retry_connect("no reply from rank 0 within " + format_seconds(opts_.handshake_timeout_s));
    } else if (client_handshake_ == 0 && !pending_join_ && now >= next_attempt_) {
      connect_attempt(now);
    }
  }
  if (pending_join_ && (!reported_[0] || rejoining_) && now >= next_attempt_) connect_rank0(now);

  // Rank 0's deadline per connection; a rank's attempt is bounded by its
  // connect deadline above.
  if (opts_.rank == 0) {
    std::vector<uint64_t> late;
    for (auto& [id, h] : handshakes_) {
      if (now >= h.deadline) late.push_back(id);
    }
    for (uint64_t id : late) {
      Handshake& h = handshakes_.at(id);
      if (h.stage != Handshake::lingering) {
        log_foreign("closed a connection from %s: no complete hello within %s (%zu bytes came)",
                    h.from.c_str(), format_seconds(opts_.handshake_timeout_s).c_str(), h.in.size());
      }
      close_handshake(id);
    }
  }

  if (now >= next_heartbeat_) {
    next_heartbeat_ = now + from_seconds(opts_.heartbeat_interval_s);
    for (Conn* conn : by_rank_) {
      if (conn != nullptr && !conn->closing && !conn->lane && conn->phase == Phase::up) {
        send_am(conn, kFrameAmId, heartbeat_);
      }
    }
  }

  // A peer failed by us keeps sending until it notices: count, log seldom.
  if (stray_messages_ > 0 && now >= next_stray_log_) {
    log_foreign("dropped %zu UCX message(s) without a valid session", stray_messages_);
    stray_messages_ = 0;
    next_stray_log_ = now + std::chrono::seconds(5);
  }

  // A lane that does not come up is given up: what waits for it goes to
  // rank 0. Lanes are never silent-checked: liveness is rank 0's.
  std::vector<int32_t> late_lanes;
  for (auto& [id, conn] : conns_) {
    if (conn->lane && !conn->closing && conn->phase == Phase::joining && now >= conn->due)
      late_lanes.push_back(conn->rank);
  }
  for (int32_t rank : late_lanes) {
    log("the direct lane to rank %d did not come up within %s; frames to it go through rank 0",
        rank, format_seconds(opts_.handshake_timeout_s).c_str());
    close_lane_now(
        rank,
        Status::timeout("the direct lane to rank " + std::to_string(rank) + " did not come up"),
        true);
  }

  const auto limit = from_seconds(opts_.heartbeat_timeout_s);
  std::vector<Conn*> silent;
  for (auto& [id, conn] : conns_) {
    if (!conn->closing && !conn->lane && now - conn->last_rx > limit) silent.push_back(conn.get());
  }
  for (Conn* conn : silent) {
    const char* what = conn->phase == Phase::up ? " silent for " : " joined but not connected for ";
    fail_peer(conn->rank, Status::timeout("rank " + std::to_string(conn->rank) + what +
                                          format_seconds(seconds(now - conn->last_rx)) +
                                          " (heartbeat timeout " +
                                          format_seconds(opts_.heartbeat_timeout_s) + ")"));
    drop_conn(conn, /*force=*/true);
  }
}

void Transport::Impl::fail_peer(int32_t rank, Status why) {
  if (reported_[rank]) return;
  reported_[rank] = true;
  {
    std::lock_guard<std::mutex> lock(mu_);
    peers_[rank].state = PeerInfo::failed;
    peers_[rank].why = why;
    cv_.notify_all();
  }
  if (!stopping_ && cb_.on_peer_failed) cb_.on_peer_failed(rank, std::move(why));
  if (opts_.rank != 0 && rank == 0 && connected_once_ && !stopping_) {
    // The job may outlive a partition: ask rank 0 again until stop().
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (refused_) return;
      ack_delivered_ = false;
    }
    rejoining_ = true;
    pending_join_.reset();
    if (client_handshake_ != 0) close_handshake(client_handshake_);
    retry_delay_ = kFirstRetryDelay;
    next_attempt_ = Clock::now() + retry_delay_;
  }
}

Result<Transport::Impl::Conn*> Transport::Impl::connect_to(int32_t rank, const std::string& address,
                                                           uint64_t session, bool lane) {
  auto owned = std::make_unique<Conn>();
  Conn* conn = owned.get();
  conn->owner = this;
  conn->id = next_conn_id_++;
  conn->session = session;
  conn->rank = rank;
  conn->lane = lane;
  conn->phase = opts_.rank == 0 || lane ? Phase::joining : Phase::up;
  conn->last_rx = Clock::now();
  conn->due = conn->last_rx + from_seconds(opts_.handshake_timeout_s);
  // Every endpoint of the star has peer error handling: that is how a rank's
  // death is seen. A lane in shm mode has none, so UCX may use shared memory
  // for it (both ends of a lane use one mode: UCX refuses a mismatch).
  conn->peer_mode = !lane || lane_mode_ == LaneMode::tcp;
  ucp_ep_params_t p{};
  p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
  p.address = reinterpret_cast<const ucp_address_t*>(address.data());
  if (conn->peer_mode) {
    p.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
    p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    p.err_handler.cb = &Impl::on_ep_error;
    p.err_handler.arg = conn;
  }
  ucs_status_t st = ucp_ep_create(worker_, &p, &conn->ep);
  if (st != UCS_OK) {
    return Status::io_error(
        ucx_error(("rank " + std::to_string(opts_.rank) + ": cannot connect to rank " +
                   std::to_string(rank) + " by worker address")
                      .c_str(),
                  st));
  }
  conns_.emplace(conn->id, std::move(owned));
  by_session_[session] = conn;
  by_rank_[rank] = conn;
  return conn;
}

void Transport::Impl::drop_conn(Conn* conn, bool force) {
  if (conn->closing) return;
  conn->closing = true;
  for (const Held& h : conn->held)
    if (h.queued) uncount_queued(h.bytes.size());
  conn->held.clear();
  if (conn->rank >= 0 && by_rank_[conn->rank] == conn) by_rank_[conn->rank] = nullptr;
  auto s = by_session_.find(conn->session);
  if (s != by_session_.end() && s->second == conn) by_session_.erase(s);
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  // Lanes are closed by flush even when forced: UCX 1.13 aborts the process
  // (a debug assertion, dropped upstream later) when a forced close purges a
  // wireup reply still queued to a peer that stopped answering mid-wireup,
  // which a lane to a hung rank can be. The flush ends with the lane's
  // error, and reap_closed releases it then.
  p.flags = force && conn->peer_mode && !conn->lane ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  ucs_status_ptr_t req = ucp_ep_close_nbx(conn->ep, &p);
  if (req == nullptr || UCS_PTR_IS_ERR(req)) {
    // Closed at once; on error UCX has released the endpoint all the same.
    erase_conn(conn);
  } else if (force && !conn->peer_mode) {
    // A lane without peer error handling cannot be closed by force: its
    // flush waits for a peer that may be dead. Nothing of ours is needed
    // once it is released (no error callback points at the Conn): UCX ends
    // it, at the latest with the worker.
    ucp_request_free(req);
    erase_conn(conn);
  } else {
    conn->close_request = req;
  }
}

void Transport::Impl::reap_closed() {
  for (auto it = conns_.begin(); it != conns_.end();) {
    Conn* conn = it->second.get();
    ++it;
    if (conn->close_request != nullptr &&
        ucp_request_check_status(conn->close_request) != UCS_INPROGRESS) {
      ucp_request_free(conn->close_request);
      erase_conn(conn);
    }
  }
}

void Transport::Impl::erase_conn(Conn* conn) {
  for (const Held& h : conn->held)
    if (h.queued) uncount_queued(h.bytes.size());
  conns_.erase(conn->id);
}

void Transport::Impl::send_am(Conn* conn, unsigned am_id, std::string bytes, bool queued) {
  auto* op = new SendOp{this, 0, std::move(bytes)};
  op->queued = queued ? op->bytes.size() : 0;
  sends_.insert(op);
  // Little endian on the wire whatever this host is.
  std::string header;
  put_le(&header, conn->session, sizeof(uint64_t));
  std::memcpy(&op->session, header.data(), sizeof(uint64_t));
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.send = &Impl::on_send_done;
  p.user_data = op;
  ucs_status_ptr_t req = ucp_am_send_nbx(conn->ep, am_id, &op->session, sizeof(op->session),
                                         op->bytes.data(), op->bytes.size(), &p);
  if (req == nullptr || UCS_PTR_IS_ERR(req)) end_send(op);
}

void Transport::Impl::shutdown_endpoints() {
  // Frames queued before stop() still go out: the flush below waits for them.
  run_commands();
  stopping_ = true;
  while (!handshakes_.empty()) close_handshake(handshakes_.begin()->first);
  if (listen_fd_ >= 0) {
    close(listen_fd_);
    listen_fd_ = -1;
  }
  std::vector<Conn*> open;
  for (auto& [id, conn] : conns_) {
    if (!conn->closing) open.push_back(conn.get());
  }
  for (Conn* conn : open) drop_conn(conn, /*force=*/conn->phase != Phase::up);
  auto deadline = Clock::now() + kCloseGrace;
  while (!conns_.empty() && Clock::now() < deadline) {
    if (ucp_worker_progress(worker_) == 0)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    events_.clear();
    reap_closed();
  }
  if (!conns_.empty()) {
    log("%zu endpoint(s) still closing after %s; destroying the worker anyway", conns_.size(),
        format_seconds(seconds(kCloseGrace)).c_str());
    // UCX asserts that a close still in progress when the worker goes was
    // released by its owner.
    for (auto& [id, conn] : conns_) {
      if (conn->close_request != nullptr) ucp_request_free(conn->close_request);
      conn->close_request = nullptr;
    }
  }
}

// --- the handshake socket -------------------------------------------------------------

void Transport::Impl::service_sockets() {
  epoll_event evs[64];
  int n = epoll_wait(sock_epoll_, evs, 64, 0);
  for (int i = 0; i < n; ++i) {
    if (evs[i].data.u64 == 0) {
      accept_connections();
    } else {
      service_handshake(evs[i].data.u64);
    }
  }
}

void Transport::Impl::watch(uint64_t id, const Handshake& h) {
  epoll_event ev{};
  ev.events =
      (h.stage == Handshake::connecting || h.stage == Handshake::sending) ? EPOLLOUT : EPOLLIN;
  ev.data.u64 = id;
  if (epoll_ctl(sock_epoll_, EPOLL_CTL_MOD, h.fd, &ev) != 0 &&
      epoll_ctl(sock_epoll_, EPOLL_CTL_ADD, h.fd, &ev) != 0) {
    log("epoll_ctl on a handshake socket: %s", std::strerror(errno));
  }
}

void Transport::Impl::close_handshake(uint64_t id) {
  auto it = handshakes_.find(id);
  if (it == handshakes_.end()) return;
  // Closing removes it from the epoll set: nobody else holds the descriptor.
  close(it->second.fd);
  handshakes_.erase(it);
  if (client_handshake_ == id) client_handshake_ = 0;
}

void Transport::Impl::accept_connections() {
  for (int i = 0; i < kMaxAcceptsPerTurn; ++i) {
    sockaddr_storage from{};
    socklen_t len = sizeof(from);
    int fd =
        accept4(listen_fd_, reinterpret_cast<sockaddr*>(&from), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR && errno != ECONNABORTED) {
        log_foreign("accept on port %u: %s", static_cast<unsigned>(port_), std::strerror(errno));
      }
      return;
    }
    if (handshakes_.size() >= kMaxHandshakes) {
      close(fd);
      log_foreign("closed a connection from %s: %zu handshakes already in progress",
                  describe(from).c_str(), handshakes_.size());
      continue;
    }
    uint64_t id = next_handshake_id_++;
    Handshake& h = handshakes_[id];
    h.fd = fd;
    h.from = describe(from);
    h.stage = Handshake::receiving;
    h.want = kHelloHeaderBytes;
    h.deadline = Clock::now() + from_seconds(opts_.handshake_timeout_s);
    watch(id, h);
  }
}

bool Transport::Impl::pump_out(Handshake& h) {
  while (h.sent < h.out.size()) {
    ssize_t n = ::send(h.fd, h.out.data() + h.sent, h.out.size() - h.sent, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno == EAGAIN || errno == EWOULDBLOCK;
    }
    h.sent += static_cast<size_t>(n);
  }
  return true;
}

// Reads at most up to h.want (or, lingering, discards up to `limit` bytes).
// Returns 1 on progress or nothing to read yet, 0 at end of stream, -1 on error.
int Transport::Impl::pump_in(Handshake& h, size_t limit) {
  char buf[4096];
  size_t budget = limit;
  for (;;) {
    size_t room = h.stage == Handshake::lingering ? sizeof(buf) : h.want - h.in.size();
    room = std::min({room, sizeof(buf), budget});
    if (room == 0) return 1;
    ssize_t n = recv(h.fd, buf, room, 0);
    if (n == 0) return 0;
    if (n < 0) {
      if (errno == EINTR) continue;
      return (errno == EAGAIN || errno == EWOULDBLOCK) ? 1 : -1;
    }
    budget -= static_cast<size_t>(n);
    if (h.stage != Handshake::lingering) h.in.append(buf, static_cast<size_t>(n));
  }
}

void Transport::Impl::service_handshake(uint64_t id) {
  auto it = handshakes_.find(id);
  if (it == handshakes_.end()) return;
  Handshake& h = it->second;
  const bool client = id == client_handshake_;
  if (h.stage == Handshake::connecting) {
    int err = 0;
    socklen_t len = sizeof(err);
    if (getsockopt(h.fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
    if (err != 0) return retry_connect(std::strerror(err));
    h.stage = Handshake::sending;
  }
  if (h.stage == Handshake::sending) {
    if (!pump_out(h)) {
      if (client) return retry_connect(std::string("sending the hello: ") + std::strerror(errno));
      log_foreign("closed a connection from %s: the reply could not be sent: %s", h.from.c_str(),
                  std::strerror(errno));
      return close_handshake(id);
    }
    if (h.sent < h.out.size()) return watch(id, h);
    if (client) {
      h.stage = Handshake::receiving;
      h.want = kReplyHeaderBytes;
      std::lock_guard<std::mutex> lock(mu_);
      hello_sent_ns_ = Clock::now().time_since_epoch() / std::chrono::nanoseconds(1);
    } else {
      // Our half closed, theirs read until they hang up: closing with their
      // bytes unread would reset the connection and could destroy the reply.
      shutdown(h.fd, SHUT_WR);
      h.stage = Handshake::lingering;
    }
    watch(id, h);
  }
  if (h.stage == Handshake::lingering) {
    if (pump_in(h, kMaxDiscardPerTurn) <= 0) close_handshake(id);
    return;
  }
  // receiving
  const size_t header = client ? kReplyHeaderBytes : kHelloHeaderBytes;
  int r = pump_in(h, SIZE_MAX);
  if (!h.header_checked && h.in.size() == header) {
    h.header_checked = true;
    // Every length is checked here, before a byte of what it announces is read.
    const char* magic = client ? kReplyMagic : kHelloMagic;
    uint32_t body = static_cast<uint32_t>(get_le(&h.in[8], 4));
    uint32_t addr = static_cast<uint32_t>(get_le(&h.in[12], 4));
    // The hello's node length is a byte: never over kMaxNodeBytes.
    uint32_t node = client ? 0 : static_cast<uint8_t>(h.in[5]);
    const uint32_t max_body = client ? kMaxReplyBytes : kMaxHelloBytes;
    std::string bad;
    if (std::memcmp(h.in.data(), magic, 4) != 0) {
      bad = "not a Ferry handshake";
    } else if (static_cast<uint8_t>(h.in[4]) != kHandshakeVersion) {
      bad = "handshake version " + std::to_string(static_cast<uint8_t>(h.in[4])) + ", expected " +
            std::to_string(kHandshakeVersion);
    } else if (body > max_body) {
      bad = "announced " + std::to_string(body) + " bytes of hello, the limit is " +
            std::to_string(max_body);
    } else if (addr > kMaxAddressBytes || (!client && addr == 0)) {
      bad = "announced a " + std::to_string(addr) + "-byte worker address, the limit is " +
            std::to_string(kMaxAddressBytes);
    }
    if (!bad.empty()) {
      if (client) return retry_connect("rank 0's reply: " + bad);
      log_foreign("closed a connection from %s: %s", h.from.c_str(), bad.c_str());
      return close_handshake(id);
    }
    h.want = header + body + addr + node;
    if (r > 0) r = pump_in(h, SIZE_MAX);
  }
  if (h.header_checked && h.in.size() == h.want) {
    return client ? on_reply(id) : on_hello(id);
  }
  if (r <= 0) {
    std::string why = r == 0 ? "closed" : std::strerror(errno);
    if (client) return retry_connect("rank 0 " + why + " the connection before its reply");
    log_foreign("closed a connection from %s: it went away after %zu bytes of its hello (%s)",
                h.from.c_str(), h.in.size(), why.c_str());
    close_handshake(id);
  }
}

void Transport::Impl::on_hello(uint64_t id) {
  Handshake& h = handshakes_.at(id);
  const uint32_t body = static_cast<uint32_t>(get_le(&h.in[8], 4));
  const uint32_t addr = static_cast<uint32_t>(get_le(&h.in[12], 4));
  const std::string hello = h.in.substr(kHelloHeaderBytes, body);
  const std::string address = h.in.substr(kHelloHeaderBytes + body, addr);
  const std::string node = h.in.substr(kHelloHeaderBytes + body + addr);
  std::string reply;
  Result<int32_t> verdict = cb_.accept(hello, &reply);
  if (reply.size() > kMaxReplyBytes) reply.resize(kMaxReplyBytes);
  std::string out(kReplyMagic, 4);
  out.push_back(static_cast<char>(kHandshakeVersion));
  if (!verdict.ok()) {
    log_foreign("refused a connection from %s: %s", h.from.c_str(),
                verdict.status().to_string().c_str());
    if (reply.empty()) return close_handshake(id);
    out.push_back(static_cast<char>(kVerdictRefused));
    out.append(2, '\0');
    put_le(&out, reply.size(), 4);
    put_le(&out, 0, 4);
    put_le(&out, 0, 8);
    out += reply;
  } else {
    int32_t rank = *verdict;
    bool valid = rank >= 1 && rank < opts_.world_size;
    // A rank we failed (a partition, say) may come back with the job's
    // token: it gets a fresh session, so late messages of its old one stay dropped.
    bool rejoin = false;
    if (valid) {
      std::lock_guard<std::mutex> lock(mu_);
      rejoin = peers_[rank].state == PeerInfo::failed;
      valid = peers_[rank].state == PeerInfo::absent || rejoin;
    }
    if (!valid) {
      log_foreign(
          "refused a connection from %s: accept() gave rank %d, which is out of range or "
          "already joined",
          h.from.c_str(), rank);
      return close_handshake(id);
    }
    uint64_t session = 0;
    while (session == 0 || issued_.count(session) != 0) session = rng_();
    issued_.insert(session);
    Result<Conn*> conn = connect_to(rank, address, session);
    if (!conn.ok()) {
      log("refused rank %d from %s: %s", rank, h.from.c_str(), conn.status().to_string().c_str());
      return close_handshake(id);
    }
    out.push_back(static_cast<char>(kVerdictAccepted));
    out.append(2, '\0');
    put_le(&out, reply.size(), 4);
    put_le(&out, my_address_.size(), 4);
    put_le(&out, session, 8);
    out += reply;
    out += my_address_;
    joined_address_[rank] = address;
    joined_node_[rank] = node;
    bool all = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      peers_[rank].state = PeerInfo::up;
      peers_[rank].why = Status();
      all = all_peers_up_locked();
      cv_.notify_all();
    }
    if (rejoin) {
      reported_[rank] = false;
      log("rank %d rejoined from %s with a new session", rank, h.from.c_str());
      if (!stopping_ && cb_.on_peer_rejoined) cb_.on_peer_rejoined(rank);
    } else if (all) {
      // Before wait_peers() can return here: the lanes reach every rank
      // ahead of any frame the layer above sends it once all joined.
      distribute_lanes();
    }
  }
  h.in.clear();
  h.in.shrink_to_fit();
  h.out = std::move(out);
  h.sent = 0;
  h.stage = Handshake::sending;
  service_handshake(id);
}

void Transport::Impl::on_reply(uint64_t id) {
  Handshake& h = handshakes_.at(id);
  const uint8_t verdict = static_cast<uint8_t>(h.in[5]);
  const uint32_t body = static_cast<uint32_t>(get_le(&h.in[8], 4));
  const uint64_t session = get_le(&h.in[16], 8);
  std::string reply = h.in.substr(kReplyHeaderBytes, body);
  const std::string address = h.in.substr(kReplyHeaderBytes + body);
  if (verdict == kVerdictAccepted && (address.empty() || session == 0)) {
    return retry_connect("rank 0's reply: accepted without a worker address or session");
  }
  if (verdict != kVerdictAccepted && verdict != kVerdictRefused) {
    return retry_connect("rank 0's reply: unknown verdict " + std::to_string(verdict));
  }
  close_handshake(id);
  if (rejoining_ && verdict != kVerdictAccepted) {
    // The reply is a JoinAck with rank 0's reason; the job goes on without it.
    log("rank 0 refused this rank's rejoin; rank 0 stays failed");
    rejoining_ = false;
    return;
  }
  connected_once_ = true;
  {
    std::lock_guard<std::mutex> lock(mu_);
    reply_ns_ = Clock::now().time_since_epoch() / std::chrono::nanoseconds(1);
  }
  if (verdict == kVerdictAccepted) {
    const auto now = Clock::now();
    // Rank 0 fails a rank that has not reached it heartbeat_timeout_s after
    // its accept; leave its first message time to arrive before that.
    pending_join_ = PendingJoin{address, session, std::move(reply),
                                now + from_seconds(0.8 * opts_.heartbeat_timeout_s)};
    retry_delay_ = kFirstRetryDelay;
    return connect_rank0(now);
  }
  finish_join(/*refused=*/true, std::move(reply));
}

// UCX's connect to rank 0's worker can be refused although rank 0 is up and
// just answered (seen once in CI on loopback; UCX retries such a refusal
// only when it comes asynchronously): try again until rank 0 would give up.
void Transport::Impl::connect_rank0(Clock::time_point now) {
  PendingJoin& p = *pending_join_;
  ++p.attempts;
  Result<Conn*> conn = connect_to(0, p.address, p.session);
  if (!conn.ok()) {
    if (now >= p.deadline && rejoining_) {
      log("rejoining rank 0: %s (%d attempts); asking again", conn.status().message().c_str(),
          p.attempts);
      pending_join_.reset();
      next_attempt_ = now + retry_delay_;
      return;
    }
    if (now >= p.deadline) {
      Status why = Status::io_error(conn.status().message() + " (" + std::to_string(p.attempts) +
                                    " attempts)");
      pending_join_.reset();
      return fail_peer(0, std::move(why));
    }
    if (p.attempts == 1) log("%s; trying again", conn.status().message().c_str());
    next_attempt_ = now + retry_delay_;
    retry_delay_ = std::min<Clock::duration>(retry_delay_ * 2, kMaxRetryDelay);
    return;
  }
  send_am(*conn, kReadyAmId, std::string());
  std::string reply = std::move(p.reply);
  pending_join_.reset();
  finish_join(/*refused=*/false, std::move(reply));
}

void Transport::Impl::finish_join(bool refused, std::string reply) {
  {
    // Rank 0 is up before on_frame runs (so it may answer with send()), but
    // wait_peers() returns only after it, so the layer above has seen the
    // ack by then.
    std::lock_guard<std::mutex> lock(mu_);
    peers_[0].state = PeerInfo::up;
    refused_ = refused;
  }
  if (!stopping_ && cb_.on_frame && !reply.empty()) cb_.on_frame(0, std::move(reply));
  {
    std::lock_guard<std::mutex> lock(mu_);
    ack_delivered_ = true;
    cv_.notify_all();
  }
  if (rejoining_ && !refused) {
    rejoining_ = false;
    reported_[0] = false;
    log("rejoined rank 0 with a new session");
    if (!stopping_ && cb_.on_peer_rejoined) cb_.on_peer_rejoined(0);
  }
}

void Transport::Impl::connect_attempt(Clock::time_point now) {
  ++attempts_;
  int fd = socket(address_.storage.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    last_connect_error_ = std::string("socket: ") + std::strerror(errno);
    next_attempt_ = now + retry_delay_;
    retry_delay_ = std::min<Clock::duration>(retry_delay_ * 2, kMaxRetryDelay);
    return;
  }
  uint64_t id = next_handshake_id_++;
  Handshake& h = handshakes_[id];
  h.fd = fd;
  h.from = describe(address_.storage);
  // A rejoin has no overall deadline: each attempt has its own.
  h.deadline = rejoining_ ? now + from_seconds(opts_.handshake_timeout_s) : connect_deadline_;
  h.out.assign(kHelloMagic, 4);
  h.out.push_back(static_cast<char>(kHandshakeVersion));
  h.out.push_back(static_cast<char>(node_.size()));
  h.out.append(2, '\0');
  put_le(&h.out, hello_.size(), 4);
  put_le(&h.out, my_address_.size(), 4);
  h.out += hello_;
  h.out += my_address_;
  h.out += node_;
  client_handshake_ = id;
  int rc = connect(fd, reinterpret_cast<const sockaddr*>(&address_.storage), address_.length);
  if (rc != 0 && errno != EINPROGRESS) return retry_connect(std::strerror(errno));
  h.stage = rc == 0 ? Handshake::sending : Handshake::connecting;
  watch(id, h);
}

void Transport::Impl::retry_connect(const std::string& why) {
  if (client_handshake_ != 0) close_handshake(client_handshake_);
  last_connect_error_ = why;
  next_attempt_ = Clock::now() + retry_delay_;
  retry_delay_ = std::min<Clock::duration>(retry_delay_ * 2, kMaxRetryDelay);
}

Transport::Impl::Conn* Transport::Impl::find_conn(uint64_t id) {
  auto it = conns_.find(id);
  return it == conns_.end() ? nullptr : it->second.get();
}

void Transport::Impl::vlog(const char* fmt, va_list args) {
  char buf[512];
  std::vsnprintf(buf, sizeof(buf), fmt, args);
  log_printf(opts_.logger, LogLevel::warning, "ferry transport (rank %d): %s", opts_.rank, buf);
}

void Transport::Impl::log(const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  vlog(fmt, args);
  va_end(args);
}

// One line per foreign connection, but a flood must not turn into a flood of
// log lines: past kForeignLogsPerSecond the lines are only counted.
void Transport::Impl::log_foreign(const char* fmt, ...) {
  auto now = Clock::now();
  if (now - foreign_window_ >= std::chrono::seconds(1)) {
    if (foreign_suppressed_ > 0) {
      log("%zu more line(s) about foreign connections suppressed", foreign_suppressed_);
    }
    foreign_window_ = now;
    foreign_logged_ = 0;
    foreign_suppressed_ = 0;
  }
  if (++foreign_logged_ > kForeignLogsPerSecond) {
    ++foreign_suppressed_;
    return;
  }
  va_list args;
  va_start(args, fmt);
  vlog(fmt, args);
  va_end(args);
}

// --- Transport --------------------------------------------------------------------

Result<std::unique_ptr<Transport>> Transport::start(const TransportOptions& options,
                                                    std::string hello, std::string heartbeat,
                                                    TransportCallbacks callbacks) {
  const auto& o = options;
  if (o.world_size < 1) {
    return Status::invalid_argument("transport: world_size must be >= 1, got " +
                                    std::to_string(o.world_size));
  }
  if (o.rank < 0 || o.rank >= o.world_size) {
    return Status::invalid_argument("transport: rank " + std::to_string(o.rank) +
                                    " outside world size " + std::to_string(o.world_size));
  }
  if (o.rank != 0 && o.port == 0) {
    return Status::invalid_argument("transport: rank " + std::to_string(o.rank) +
                                    " needs rank 0's port (got 0)");
  }
  if (!(o.heartbeat_interval_s > 0) || !(o.heartbeat_timeout_s > o.heartbeat_interval_s)) {
    return Status::invalid_argument(
        "transport: need 0 < heartbeat_interval_s < heartbeat_timeout_s, got " +
        std::to_string(o.heartbeat_interval_s) + " and " + std::to_string(o.heartbeat_timeout_s));
  }
  if (!(o.connect_timeout_s > 0)) {
    return Status::invalid_argument("transport: connect_timeout_s must be > 0, got " +
                                    std::to_string(o.connect_timeout_s));
  }
  if (!(o.handshake_timeout_s > 0)) {
    return Status::invalid_argument("transport: handshake_timeout_s must be > 0, got " +
                                    std::to_string(o.handshake_timeout_s));
  }
  if (o.max_frame_bytes == 0) {
    return Status::invalid_argument("transport: max_frame_bytes must be > 0");
  }
  if (o.rank == 0 && o.world_size > 1 && !callbacks.accept) {
    return Status::invalid_argument("transport: rank 0 needs an accept callback");
  }
  auto impl =
      std::make_unique<Impl>(options, std::move(hello), std::move(heartbeat), std::move(callbacks));
  FERRY_RETURN_IF_ERROR(impl->init());
  impl->launch();
  return std::unique_ptr<Transport>(new Transport(std::move(impl)));
}

Transport::Transport(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Transport::~Transport() {
  stop();
}
Status Transport::wait_peers(double timeout_s) {
  return impl_->wait_peers(timeout_s);
}
Status Transport::wait_lanes(double timeout_s) {
  return impl_->wait_lanes(timeout_s);
}
uint16_t Transport::port() const {
  return impl_->port();
}
Status Transport::send(int32_t to_rank, std::string frame) {
  return impl_->send(to_rank, std::move(frame));
}
int32_t Transport::next_hop(int32_t to_rank) {
  return impl_->next_hop(to_rank);
}
void Transport::close_lane(int32_t rank, const Status& why) {
  impl_->close_lane(rank, why);
}
std::string Transport::lane_info(int32_t rank) {
  return impl_->lane_info(rank);
}
Status Transport::send_on_lane_for_test(int32_t to_rank, uint64_t session, std::string frame) {
  return impl_->send_on_lane(to_rank, std::move(frame), session);
}
std::pair<int64_t, int64_t> Transport::join_round_trip() {
  return impl_->join_round_trip();
}
uint64_t Transport::take_queued_peak() {
  return impl_->take_queued_peak();
}
void Transport::stop() {
  impl_->stop();
}

}  // namespace ferry
