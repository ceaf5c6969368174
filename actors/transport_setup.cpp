// The UCX context, worker and wake-up descriptors, made a good guest in the host process,
// and their teardown in reverse order: the one place that configures UCX itself.

#include "actors/transport_impl.hpp"

#include "node.hpp"

#include <dlfcn.h>
#include <netdb.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/epoll.h>
#include <unistd.h>

#include <ucm/api/ucm.h>
#include <ucp/api/ucp.h>
#include <ucs/config/global_opts.h>
#include <ucs/debug/debug.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace ferry {

using transport_detail::Address;
using transport_detail::from_seconds;
using transport_detail::kFrameAmId;
using transport_detail::kLanesAmId;
using transport_detail::kMaxAddressBytes;
using transport_detail::kMaxNodeBytes;
using transport_detail::kReadyAmId;
using transport_detail::ucx_error;

namespace {

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

}  // namespace

Status Transport::Impl::init() {
  make_ucx_a_good_guest();
  FERRY_ASSIGN_OR_RETURN(address_, resolve(opts_.host, opts_.port));

  const std::string& mode = opts_.lanes;
  if (mode == "shm") {
    lane_mode_ = LaneMode::shm;
  } else if (mode == "tcp") {
    lane_mode_ = LaneMode::tcp;
  } else if (mode == "off") {
    lane_mode_ = LaneMode::off;
  } else {
    return Status::invalid_argument(
        "transport: direct lanes (direct-lanes) must be shm, "
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

}  // namespace ferry
