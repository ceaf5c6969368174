// The progress loop and its clock: heartbeats, silence and deadlines, a late lane, and
// failing a peer (which sets a rank > 0 rejoining); what decides a peer is gone.

#include "actors/transport_impl.hpp"

#include <sys/epoll.h>

#include <ucp/api/ucp.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace ferry {

using transport_detail::format_seconds;
using transport_detail::from_seconds;
using transport_detail::kFirstRetryDelay;
using transport_detail::kFrameAmId;
using transport_detail::seconds;

namespace {

// The longest the loop sleeps in epoll_wait: the resolution of heartbeats,
// silence checks and connect retries.
constexpr auto kMaxPollWait = std::chrono::milliseconds(50);
// A loop iteration this late means our own thread was held up (a slow
// callback, the process stopped): that time is not held against the peers.
constexpr auto kStallThreshold = std::chrono::milliseconds(400);

}  // namespace

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

void Transport::Impl::on_tick(Clock::time_point now) {
  if (now - last_tick_ > kStallThreshold) {
    for (auto& [id, conn] : conns_) conn->last_rx += now - last_tick_;
    for (auto& [id, h] : handshakes_) h.deadline += now - last_tick_;
    if (pending_join_) pending_join_->deadline += now - last_tick_;
    rejoin_since_ += now - last_tick_;
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
  if (rejoining_ && now - rejoin_since_ >= from_seconds(opts_.rejoin_timeout_s)) {
    give_up_rejoin(now);
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
  const std::string what = why.message();
  if (!stopping_ && cb_.on_peer_failed) cb_.on_peer_failed(rank, std::move(why));
  if (opts_.rank != 0 && rank == 0 && connected_once_ && !stopping_) {
    // The job may outlive a partition: ask rank 0 again, for rejoin_timeout_s.
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (refused_) return;
      ack_delivered_ = false;
    }
    log("rank 0 lost (%s); asking it to take this rank back for up to %s", what.c_str(),
        format_seconds(opts_.rejoin_timeout_s).c_str());
    rejoining_ = true;
    rejoin_since_ = Clock::now();
    rejoin_attempts_ = 0;
    rejoin_cause_.clear();
    rejoin_logged_cause_.clear();
    pending_join_.reset();
    if (client_handshake_ != 0) close_handshake(client_handshake_);
    retry_delay_ = kFirstRetryDelay;
    next_attempt_ = Clock::now() + retry_delay_;
  }
}

// A line for the first failed attempt, a new cause, or every kRejoinLogEvery-th:
// a rank 0 gone for good must not fill the log.
void Transport::Impl::rejoin_failed(const std::string& why) {
  constexpr int kRejoinLogEvery = 20;
  ++rejoin_attempts_;
  rejoin_cause_ = why;
  if (why == rejoin_logged_cause_ && rejoin_attempts_ % kRejoinLogEvery != 0) return;
  rejoin_logged_cause_ = why;
  const double left = opts_.rejoin_timeout_s - seconds(Clock::now() - rejoin_since_);
  log("rejoining rank 0: attempt %d failed: %s; asking again (for %s more)", rejoin_attempts_,
      why.c_str(), format_seconds(std::max(0.0, left)).c_str());
}

void Transport::Impl::give_up_rejoin(Clock::time_point now) {
  rejoining_ = false;
  pending_join_.reset();
  if (client_handshake_ != 0) close_handshake(client_handshake_);
  std::string why = "rank 0 lost: this rank asked it to take it back for " +
                    format_seconds(seconds(now - rejoin_since_)) + " (" +
                    std::to_string(rejoin_attempts_) + " attempts";
  if (!rejoin_cause_.empty()) why += "; last: " + rejoin_cause_;
  why += ") and gave up (rejoin-timeout " + format_seconds(opts_.rejoin_timeout_s) + ")";
  log("%s", why.c_str());
  Status st = Status::aborted(why);
  {
    std::lock_guard<std::mutex> lock(mu_);
    peers_[0].why = st;
    cv_.notify_all();
  }
  if (!stopping_ && cb_.on_peer_failed) cb_.on_peer_failed(0, std::move(st));
}

}  // namespace ferry
