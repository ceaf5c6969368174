// Transport's front: start()'s checks, the calls callers make on any thread (peers,
// send, stop) and the log lines; the progress thread's seams are in transport_*.cpp.

#include "actors/transport.hpp"

#include "actors/transport_impl.hpp"
#include "log.hpp"

#include <ucp/api/ucp.h>

#include <algorithm>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

namespace ferry {

using transport_detail::format_seconds;
using transport_detail::from_seconds;

namespace {

// Log lines about foreign connections, per second; the rest are counted.
constexpr int kForeignLogsPerSecond = 10;

}  // namespace

// --- caller-facing ----------------------------------------------------------------

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

// --- logs ---------------------------------------------------------------------------

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
  if (!(o.rejoin_timeout_s > 0)) {
    return Status::invalid_argument("transport: rejoin_timeout_s must be > 0, got " +
                                    std::to_string(o.rejoin_timeout_s));
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
