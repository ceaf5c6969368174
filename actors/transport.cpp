// Transport over UCX active messages; see transport.hpp for the contract.
//
// All UCX calls after start() happen on the progress thread, the worker runs
// in single-thread mode. UCX callbacks (connection requests, endpoint errors,
// arriving frames) only record events; the loop acts on them after
// ucp_worker_progress returns, so endpoints are never created or closed from
// inside a UCX callback and user callbacks never run inside UCX.

#include "actors/transport.hpp"

#include <arpa/inet.h>
#include <dlfcn.h>
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
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace ferry {

namespace {

using Clock = std::chrono::steady_clock;

// Both ends register and send on this active-message id. Small, because UCP
// keeps its handlers in an array indexed by id.
constexpr unsigned kFrameAmId = 1;

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

}  // namespace

class Transport::Impl {
 public:
  Impl(TransportOptions o, std::string hello, std::string heartbeat, TransportCallbacks cb)
      : opts_(std::move(o)),
        hello_(std::move(hello)),
        heartbeat_(std::move(heartbeat)),
        cb_(std::move(cb)),
        peers_(static_cast<size_t>(opts_.world_size)),
        by_rank_(static_cast<size_t>(opts_.world_size), nullptr),
        reported_(static_cast<size_t>(opts_.world_size), false) {}

  ~Impl() {
    stop();
    // Only reached without a thread when start() failed half way.
    teardown_ucx();
  }

  Status init();
  void launch() {
    thread_ = std::thread([this] { run(); });
  }
  Status wait_peers(double timeout_s);
  Status send(int32_t to_rank, std::string frame);
  void stop();
  uint16_t port() const { return port_; }

 private:
  enum class Phase {
    awaiting_hello,  // rank 0: connected, no frame yet
    connecting,      // rank > 0: endpoint created, no frame from rank 0 yet
    up,
    refused,  // rank 0: hello refused, reply sent, waiting for the client to hang up
  };

  // One endpoint. Owned by conns_ until its close request completed, because
  // UCX holds a pointer to it (error-callback argument) until then.
  struct Conn {
    Impl* owner = nullptr;
    uint64_t id = 0;
    ucp_ep_h ep = nullptr;
    Phase phase = Phase::awaiting_hello;
    int32_t rank = -1;
    Clock::time_point last_rx;
    bool closing = false;
    void* close_request = nullptr;
  };

  struct Event {
    enum Kind { frame, error } kind;
    uint64_t conn_id;
    std::string bytes;    // frame
    ucs_status_t status;  // error
  };

  // A frame in UCX's hands; freed by its completion callback (or after the
  // worker is destroyed, if UCX never completed it).
  struct SendOp {
    Impl* owner;
    std::string bytes;
  };
  struct RecvOp {
    Impl* owner;
    uint64_t conn_id;
    std::string bytes;
  };

  struct PeerInfo {
    enum State { absent, up, failed } state = absent;
    Status why;
  };

  struct Command {
    int32_t rank;
    std::string frame;
  };

  // UCX callbacks (progress thread, inside ucp_worker_progress).
  static void on_conn_request(ucp_conn_request_h request, void* arg);
  static void on_ep_error(void* arg, ucp_ep_h ep, ucs_status_t status);
  static ucs_status_t on_am(void* arg, const void* header, size_t header_length, void* data,
                            size_t length, const ucp_am_recv_param_t* param);
  static void on_send_done(void* request, ucs_status_t status, void* user_data);
  static void on_recv_done(void* request, ucs_status_t status, size_t length, void* user_data);

  // Progress thread.
  void run();
  void dispatch_events();
  void accept_pending_connections();
  void handle_frame(Conn* conn, std::string bytes);
  void handle_hello(Conn* conn, const std::string& hello);
  void run_commands();
  void on_tick(Clock::time_point now);
  void connect_attempt(Clock::time_point now);
  void fail_peer(int32_t rank, Status why);
  void drop_conn(Conn* conn, bool force);
  void reap_closed();
  void erase_conn(Conn* conn);
  void send_frame(Conn* conn, std::string bytes);
  void shutdown_endpoints();
  void teardown_ucx();
  Conn* new_conn(Phase phase, int32_t rank);
  Conn* find(uint64_t id);
  void log(const char* fmt, ...) __attribute__((format(printf, 2, 3)));

  bool all_peers_up_locked() const;
  std::string missing_peers_locked() const;

  const TransportOptions opts_;
  const std::string hello_;
  const std::string heartbeat_;
  const TransportCallbacks cb_;
  Address address_;
  uint16_t port_ = 0;

  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  ucp_listener_h listener_ = nullptr;
  int epoll_fd_ = -1;
  std::thread thread_;

  // Shared with callers; guarded by mu_.
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<PeerInfo> peers_;
  std::deque<Command> commands_;
  bool stopped_ = false;
  bool ack_delivered_ = false;  // rank > 0: rank 0's first frame went through on_frame

  // Progress thread only (and teardown after it is joined).
  bool stopping_ = false;  // no user callbacks from here on
  uint64_t next_conn_id_ = 1;
  std::map<uint64_t, std::unique_ptr<Conn>> conns_;
  std::unordered_map<ucp_ep_h, Conn*> by_ep_;
  std::vector<Conn*> by_rank_;
  std::vector<bool> reported_;
  std::vector<Event> events_;
  std::vector<ucp_conn_request_h> conn_requests_;
  std::unordered_set<SendOp*> sends_;
  std::unordered_set<RecvOp*> recvs_;
  Clock::time_point last_tick_;
  Clock::time_point next_heartbeat_;
  std::map<uint64_t, Clock::time_point> refused_at_;
  // Rank > 0: connecting to rank 0.
  Clock::time_point connect_deadline_;
  Clock::time_point next_attempt_;
  Clock::duration retry_delay_ = kFirstRetryDelay;
  int attempts_ = 0;
  std::string last_connect_error_;
  bool connected_once_ = false;
};

// --- start / stop ---------------------------------------------------------------

Status Transport::Impl::init() {
  make_ucx_a_good_guest();
  FERRY_ASSIGN_OR_RETURN(address_, resolve(opts_.host, opts_.port));

  ucp_config_t* config = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
  if (st != UCS_OK) return Status::internal(ucx_error("transport: ucp_config_read", st));
  // Peer-failure detection on client-server endpoints needs tcp (shared
  // memory lanes do not report a dead peer), and the control plane needs
  // nothing else.
  std::vector<std::pair<const char*, const char*>> settings;
  if (!user_set("TLS")) settings.emplace_back("TLS", "tcp");
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
  params.estimated_num_eps = static_cast<size_t>(opts_.rank == 0 ? opts_.world_size : 1);
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

  ucp_am_handler_param_t am{};
  am.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                  UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
  am.id = kFrameAmId;
  am.flags = UCP_AM_FLAG_WHOLE_MSG;
  am.cb = &Impl::on_am;
  am.arg = this;
  st = ucp_worker_set_am_recv_handler(worker_, &am);
  if (st != UCS_OK) {
    return Status::internal(ucx_error("transport: ucp_worker_set_am_recv_handler", st));
  }

  int efd = -1;
  st = ucp_worker_get_efd(worker_, &efd);
  if (st != UCS_OK) return Status::internal(ucx_error("transport: ucp_worker_get_efd", st));
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  if (epoll_fd_ < 0) return Status::from_errno(errno, "epoll_create1", "transport");
  epoll_event ev{};
  ev.events = EPOLLIN;
  if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, efd, &ev) != 0) {
    return Status::from_errno(errno, "epoll_ctl", "transport worker fd");
  }

  const std::string where = opts_.host + ":" + std::to_string(opts_.port);
  if (opts_.rank == 0 && opts_.world_size > 1) {
    ucp_listener_params_t lp{};
    lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&address_.storage);
    lp.sockaddr.addrlen = address_.length;
    lp.conn_handler.cb = &Impl::on_conn_request;
    lp.conn_handler.arg = this;
    st = ucp_listener_create(worker_, &lp, &listener_);
    if (st != UCS_OK) {
      listener_ = nullptr;
      return Status::io_error(ucx_error(("rank 0: cannot listen on " + where).c_str(), st));
    }
    ucp_listener_attr_t attr{};
    attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    st = ucp_listener_query(listener_, &attr);
    if (st != UCS_OK) return Status::internal(ucx_error("transport: ucp_listener_query", st));
    port_ = port_of(attr.sockaddr);
  }

  auto now = Clock::now();
  last_tick_ = now;
  next_heartbeat_ = now + from_seconds(opts_.heartbeat_interval_s);
  connect_deadline_ = now + from_seconds(opts_.connect_timeout_s);
  next_attempt_ = now;
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

void Transport::Impl::teardown_ucx() {
  if (listener_ != nullptr) {
    ucp_listener_destroy(listener_);
    listener_ = nullptr;
  }
  if (worker_ != nullptr) {
    ucp_worker_destroy(worker_);
    worker_ = nullptr;
  }
  // Whatever UCX did not complete is ours to free once the worker is gone.
  for (SendOp* op : sends_) delete op;
  sends_.clear();
  for (RecvOp* op : recvs_) delete op;
  recvs_.clear();
  conns_.clear();
  by_ep_.clear();
  if (context_ != nullptr) {
    ucp_cleanup(context_);
    context_ = nullptr;
  }
  if (epoll_fd_ >= 0) {
    close(epoll_fd_);
    epoll_fd_ = -1;
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

Status Transport::Impl::send(int32_t to_rank, std::string frame) {
  const std::string me = "rank " + std::to_string(opts_.rank);
  if (to_rank < 0 || to_rank >= opts_.world_size) {
    return Status::invalid_argument(me + ": send to rank " + std::to_string(to_rank) +
                                    ": world size is " + std::to_string(opts_.world_size));
  }
  if (to_rank == opts_.rank) {
    return Status::invalid_argument(me + ": send to itself");
  }
  if (opts_.rank != 0 && to_rank != 0) {
    return Status::invalid_argument(me + ": send to rank " + std::to_string(to_rank) +
                                    ": ranks other than 0 only talk to rank 0");
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (stopped_) return Status::aborted(me + ": send: transport stopped");
  const PeerInfo& peer = peers_[to_rank];
  if (peer.state == PeerInfo::failed) {
    return Status::aborted(me + ": send to failed peer: " + peer.why.message());
  }
  if (peer.state != PeerInfo::up) {
    return Status::not_found(me + ": send to rank " + std::to_string(to_rank) +
                             ": not connected (yet)");
  }
  commands_.push_back(Command{to_rank, std::move(frame)});
  // Under mu_: the worker outlives every send() that saw stopped_ == false.
  ucp_worker_signal(worker_);
  return Status::ok_status();
}

// --- UCX callbacks ----------------------------------------------------------------

void Transport::Impl::on_conn_request(ucp_conn_request_h request, void* arg) {
  static_cast<Impl*>(arg)->conn_requests_.push_back(request);
}

void Transport::Impl::on_ep_error(void* arg, ucp_ep_h, ucs_status_t status) {
  auto* conn = static_cast<Conn*>(arg);
  conn->owner->events_.push_back(Event{Event::error, conn->id, {}, status});
}

ucs_status_t Transport::Impl::on_am(void* arg, const void*, size_t, void* data, size_t length,
                                    const ucp_am_recv_param_t* param) {
  auto* self = static_cast<Impl*>(arg);
  Conn* conn = nullptr;
  if (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) {
    auto it = self->by_ep_.find(param->reply_ep);
    if (it != self->by_ep_.end()) conn = it->second;
  }
  // Returning UCS_OK drops a rendezvous descriptor too.
  if (conn == nullptr) {
    self->log("dropped a %zu-byte frame from an unknown endpoint", length);
    return UCS_OK;
  }
  if (conn->closing) return UCS_OK;
  if (!(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
    self->events_.push_back(
        Event{Event::frame, conn->id, std::string(static_cast<const char*>(data), length), UCS_OK});
    return UCS_OK;
  }
  // A large frame: only its announcement is here; fetch the bytes into the
  // string that will be delivered, so they are copied once.
  auto* op = new RecvOp{self, conn->id, std::string(length, '\0')};
  self->recvs_.insert(op);
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.recv_am = &Impl::on_recv_done;
  p.user_data = op;
  ucs_status_ptr_t req = ucp_am_recv_data_nbx(self->worker_, data, op->bytes.data(), length, &p);
  if (req == nullptr) {
    self->events_.push_back(Event{Event::frame, conn->id, std::move(op->bytes), UCS_OK});
    self->recvs_.erase(op);
    delete op;
  } else if (UCS_PTR_IS_ERR(req)) {
    self->log("cannot receive a %zu-byte frame: %s", length,
              ucs_status_string(UCS_PTR_STATUS(req)));
    self->recvs_.erase(op);
    delete op;
  }
  return UCS_INPROGRESS;
}

void Transport::Impl::on_send_done(void* request, ucs_status_t, void* user_data) {
  // A failed send needs no action here: the endpoint's error callback reports the peer.
  auto* op = static_cast<SendOp*>(user_data);
  op->owner->sends_.erase(op);
  delete op;
  ucp_request_free(request);
}

void Transport::Impl::on_recv_done(void* request, ucs_status_t status, size_t length,
                                   void* user_data) {
  auto* op = static_cast<RecvOp*>(user_data);
  Impl* self = op->owner;
  if (status == UCS_OK) {
    op->bytes.resize(length);
    self->events_.push_back(Event{Event::frame, op->conn_id, std::move(op->bytes), UCS_OK});
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
    accept_pending_connections();
    dispatch_events();
    run_commands();
    auto now = Clock::now();
    on_tick(now);
    reap_closed();
    if (progressed != 0 || !events_.empty() || !conn_requests_.empty()) continue;

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
  teardown_ucx();
}

void Transport::Impl::accept_pending_connections() {
  std::vector<ucp_conn_request_h> requests;
  requests.swap(conn_requests_);
  for (ucp_conn_request_h request : requests) {
    Conn* conn = new_conn(Phase::awaiting_hello, -1);
    ucp_ep_params_t p{};
    p.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                   UCP_EP_PARAM_FIELD_ERR_HANDLER;
    p.conn_request = request;
    p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    p.err_handler.cb = &Impl::on_ep_error;
    p.err_handler.arg = conn;
    ucs_status_t st = ucp_ep_create(worker_, &p, &conn->ep);
    if (st != UCS_OK) {
      log("cannot accept a connection: %s", ucs_status_string(st));
      conns_.erase(conn->id);
      continue;
    }
    by_ep_[conn->ep] = conn;
  }
}

void Transport::Impl::dispatch_events() {
  while (!events_.empty()) {
    std::vector<Event> batch;
    batch.swap(events_);
    for (Event& e : batch) {
      Conn* conn = find(e.conn_id);
      if (conn == nullptr || conn->closing) continue;
      if (e.kind == Event::frame) {
        handle_frame(conn, std::move(e.bytes));
        continue;
      }
      // An endpoint error.
      if (conn->phase == Phase::up) {
        fail_peer(conn->rank, Status::aborted("rank " + std::to_string(conn->rank) +
                                              ": connection lost: " + ucs_status_string(e.status)));
      } else if (conn->phase == Phase::connecting) {
        // Usually rank 0 is not listening yet: retry until the deadline.
        last_connect_error_ = ucs_status_string(e.status);
        next_attempt_ = Clock::now() + retry_delay_;
        retry_delay_ = std::min<Clock::duration>(retry_delay_ * 2, kMaxRetryDelay);
      } else if (conn->phase == Phase::awaiting_hello) {
        log("a connection closed before its hello: %s", ucs_status_string(e.status));
      }
      drop_conn(conn, /*force=*/true);
    }
  }
}

void Transport::Impl::handle_frame(Conn* conn, std::string bytes) {
  conn->last_rx = Clock::now();
  switch (conn->phase) {
    case Phase::awaiting_hello:
      handle_hello(conn, bytes);
      return;
    case Phase::refused:
      return;
    case Phase::connecting: {
      // The first frame from rank 0 is its answer to our hello. Rank 0 is up
      // before on_frame runs (so it may answer with send()), but wait_peers()
      // returns only after it, so the layer above has seen the ack by then.
      conn->phase = Phase::up;
      connected_once_ = true;
      {
        std::lock_guard<std::mutex> lock(mu_);
        peers_[0].state = PeerInfo::up;
      }
      if (!stopping_ && cb_.on_frame) cb_.on_frame(0, std::move(bytes));
      std::lock_guard<std::mutex> lock(mu_);
      ack_delivered_ = true;
      cv_.notify_all();
      return;
    }
    case Phase::up:
      if (!stopping_ && cb_.on_frame) cb_.on_frame(conn->rank, std::move(bytes));
      return;
  }
}

void Transport::Impl::handle_hello(Conn* conn, const std::string& hello) {
  std::string reply;
  Result<int32_t> verdict = cb_.accept(hello, &reply);
  if (!verdict.ok()) {
    log("refused a connection: %s", verdict.status().to_string().c_str());
    conn->phase = Phase::refused;
    refused_at_[conn->id] = Clock::now();
    // Kept open: closing now could overtake the reply, which travels on
    // another socket than the disconnect. The client hangs up after reading
    // it, or the silence check closes it.
    if (!reply.empty()) send_frame(conn, std::move(reply));
    return;
  }
  int32_t rank = *verdict;
  bool valid = rank >= 1 && rank < opts_.world_size;
  if (valid) {
    std::lock_guard<std::mutex> lock(mu_);
    valid = peers_[rank].state == PeerInfo::absent;
  }
  if (!valid) {
    log("refused a connection: accept() gave rank %d, which is out of range or already joined",
        rank);
    drop_conn(conn, /*force=*/true);
    return;
  }
  conn->rank = rank;
  conn->phase = Phase::up;
  by_rank_[rank] = conn;
  if (!reply.empty()) send_frame(conn, std::move(reply));
  std::lock_guard<std::mutex> lock(mu_);
  peers_[rank].state = PeerInfo::up;
  cv_.notify_all();
}

void Transport::Impl::run_commands() {
  std::deque<Command> batch;
  {
    std::lock_guard<std::mutex> lock(mu_);
    batch.swap(commands_);
  }
  for (Command& c : batch) {
    Conn* conn = by_rank_[c.rank];
    // A peer that failed since send() returned: on_peer_failed says so.
    if (conn == nullptr || conn->closing || conn->phase != Phase::up) continue;
    send_frame(conn, std::move(c.frame));
  }
}

void Transport::Impl::on_tick(Clock::time_point now) {
  if (now - last_tick_ > kStallThreshold) {
    for (auto& [id, conn] : conns_) conn->last_rx += now - last_tick_;
  }
  last_tick_ = now;

  if (opts_.rank != 0 && !connected_once_ && !reported_[0]) {
    if (now >= connect_deadline_) {
      if (by_rank_[0] != nullptr) drop_conn(by_rank_[0], /*force=*/true);
      std::string why = "rank " + std::to_string(opts_.rank) + ": could not connect to rank 0 at " +
                        opts_.host + ":" + std::to_string(opts_.port) + " within " +
                        format_seconds(opts_.connect_timeout_s) + " (" + std::to_string(attempts_) +
                        " attempts";
      if (!last_connect_error_.empty()) why += "; last error: " + last_connect_error_;
      fail_peer(0, Status::timeout(why + ")"));
    } else if (by_rank_[0] == nullptr && now >= next_attempt_) {
      connect_attempt(now);
    }
  }

  if (now >= next_heartbeat_) {
    next_heartbeat_ = now + from_seconds(opts_.heartbeat_interval_s);
    for (Conn* conn : by_rank_) {
      if (conn != nullptr && !conn->closing && conn->phase == Phase::up) {
        send_frame(conn, heartbeat_);
      }
    }
  }

  const auto limit = from_seconds(opts_.heartbeat_timeout_s);
  std::vector<Conn*> silent;
  for (auto& [id, conn] : conns_) {
    if (conn->closing) continue;
    if (conn->phase == Phase::up || conn->phase == Phase::awaiting_hello) {
      if (now - conn->last_rx > limit) silent.push_back(conn.get());
    } else if (conn->phase == Phase::refused) {
      if (now - refused_at_[conn->id] > limit) silent.push_back(conn.get());
    }
  }
  for (Conn* conn : silent) {
    if (conn->phase == Phase::up) {
      fail_peer(conn->rank, Status::timeout("rank " + std::to_string(conn->rank) + " silent for " +
                                            format_seconds(seconds(now - conn->last_rx)) +
                                            " (heartbeat timeout " +
                                            format_seconds(opts_.heartbeat_timeout_s) + ")"));
    } else if (conn->phase == Phase::awaiting_hello) {
      log("closed a connection that sent no hello within %s",
          format_seconds(opts_.heartbeat_timeout_s).c_str());
    }
    drop_conn(conn, /*force=*/true);
  }
}

void Transport::Impl::connect_attempt(Clock::time_point now) {
  ++attempts_;
  Conn* conn = new_conn(Phase::connecting, 0);
  conn->last_rx = now;
  ucp_ep_params_t p{};
  p.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                 UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
  p.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
  p.sockaddr.addr = reinterpret_cast<const sockaddr*>(&address_.storage);
  p.sockaddr.addrlen = address_.length;
  p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  p.err_handler.cb = &Impl::on_ep_error;
  p.err_handler.arg = conn;
  ucs_status_t st = ucp_ep_create(worker_, &p, &conn->ep);
  if (st != UCS_OK) {
    last_connect_error_ = ucs_status_string(st);
    conns_.erase(conn->id);
    next_attempt_ = now + retry_delay_;
    retry_delay_ = std::min<Clock::duration>(retry_delay_ * 2, kMaxRetryDelay);
    return;
  }
  by_ep_[conn->ep] = conn;
  by_rank_[0] = conn;
  // Queued by UCX until the connection is wired up.
  send_frame(conn, hello_);
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
}

void Transport::Impl::drop_conn(Conn* conn, bool force) {
  if (conn->closing) return;
  conn->closing = true;
  if (conn->rank >= 0 && by_rank_[conn->rank] == conn) by_rank_[conn->rank] = nullptr;
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  ucs_status_ptr_t req = ucp_ep_close_nbx(conn->ep, &p);
  if (req == nullptr || UCS_PTR_IS_ERR(req)) {
    // Closed at once; on error UCX has released the endpoint all the same.
    erase_conn(conn);
  } else {
    conn->close_request = req;
  }
}

void Transport::Impl::reap_closed() {
  for (auto it = conns_.begin(); it != conns_.end();) {
    Conn* conn = it->second.get();
    if (conn->close_request != nullptr &&
        ucp_request_check_status(conn->close_request) != UCS_INPROGRESS) {
      ucp_request_free(conn->close_request);
      ++it;
      erase_conn(conn);
    } else {
      ++it;
    }
  }
}

void Transport::Impl::erase_conn(Conn* conn) {
  auto ep = by_ep_.find(conn->ep);
  if (ep != by_ep_.end() && ep->second == conn) by_ep_.erase(ep);
  refused_at_.erase(conn->id);
  conns_.erase(conn->id);
}

void Transport::Impl::send_frame(Conn* conn, std::string bytes) {
  auto* op = new SendOp{this, std::move(bytes)};
  sends_.insert(op);
  ucp_request_param_t p{};
  p.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  // The receiver learns which endpoint (hence which rank) a frame came from
  // through the reply endpoint.
  p.flags = UCP_AM_SEND_FLAG_REPLY;
  p.cb.send = &Impl::on_send_done;
  p.user_data = op;
  ucs_status_ptr_t req =
      ucp_am_send_nbx(conn->ep, kFrameAmId, nullptr, 0, op->bytes.data(), op->bytes.size(), &p);
  if (req == nullptr || UCS_PTR_IS_ERR(req)) {
    sends_.erase(op);
    delete op;
  }
}

void Transport::Impl::shutdown_endpoints() {
  // Frames queued before stop() still go out: the flush below waits for them.
  run_commands();
  stopping_ = true;
  if (listener_ != nullptr) {
    for (ucp_conn_request_h request : conn_requests_) ucp_listener_reject(listener_, request);
    conn_requests_.clear();
    ucp_listener_destroy(listener_);
    listener_ = nullptr;
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
  }
}

Transport::Impl::Conn* Transport::Impl::new_conn(Phase phase, int32_t rank) {
  auto conn = std::make_unique<Conn>();
  conn->owner = this;
  conn->id = next_conn_id_++;
  conn->phase = phase;
  conn->rank = rank;
  conn->last_rx = Clock::now();
  Conn* raw = conn.get();
  conns_.emplace(raw->id, std::move(conn));
  return raw;
}

Transport::Impl::Conn* Transport::Impl::find(uint64_t id) {
  auto it = conns_.find(id);
  return it == conns_.end() ? nullptr : it->second.get();
}

void Transport::Impl::log(const char* fmt, ...) {
  char buf[512];
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(buf, sizeof(buf), fmt, args);
  va_end(args);
  std::fprintf(stderr, "ferry transport (rank %d): %s\n", opts_.rank, buf);
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
uint16_t Transport::port() const {
  return impl_->port();
}
Status Transport::send(int32_t to_rank, std::string frame) {
  return impl_->send(to_rank, std::move(frame));
}
void Transport::stop() {
  impl_->stop();
}

}  // namespace ferry
