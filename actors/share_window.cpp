#include "actors/share_window.hpp"

#include <algorithm>
#include <cstdio>

namespace ferry {

namespace {

// Enough to recognise the acks still in flight when a load ends; loads run
// one at a time per rank.
constexpr size_t kEndedKept = 16;

std::string rank_name(int32_t r) {
  return "rank " + std::to_string(r);
}

// What a window toward `from` says once `from` refused more bytes.
Status refused(int32_t from, const Status& why) {
  return why.with_context(rank_name(from) + " takes no more bytes: ");
}

std::string seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", s);
  return buf;
}

}  // namespace

void ShareWindows::open(int32_t me, const std::string& load,
                        const std::vector<int32_t>& receivers) {
  std::lock_guard<std::mutex> l(mu_);
  Load& ld = loads_[load];
  ld.me = me;
  const auto now = Clock::now();
  for (int32_t r : receivers) {
    Window& w = ld.to[r];
    w.last_ack = now;
    if (auto f = failed_.find(r); f != failed_.end()) w.closed = f->second;
    if (!every_failed_.ok()) w.closed = every_failed_;
    for (const Refusal& e : early_)
      if (e.load == load && e.from == r && w.closed.ok()) w.closed = refused(r, e.why);
  }
}

Status ShareWindows::acquire(const std::string& load, int32_t to, uint64_t bytes, uint64_t window,
                             double timeout_s) {
  const auto limit = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(std::max(0.0, timeout_s)));
  const auto began = Clock::now();
  std::unique_lock<std::mutex> l(mu_);
  for (;;) {
    auto it = loads_.find(load);
    if (it == loads_.end()) {
      for (const auto& [id, why] : ended_)
        if (id == load && !why.ok())
          return Status(why.code(),
                        "stopped sending shared bytes to " + rank_name(to) + ": " + why.message());
      return Status::aborted("stopped sending shared bytes to " + rank_name(to) + ": load " + load +
                             " ended");
    }
    auto w = it->second.to.find(to);
    if (w == it->second.to.end())
      return Status::internal("load " + load + " sends no shared bytes to " + rank_name(to));
    Window& win = w->second;
    if (!win.closed.ok())
      return Status(win.closed.code(), "stopped sending shared bytes to " + rank_name(to) + ": " +
                                           win.closed.message());
    if (win.outstanding == 0 || win.outstanding + bytes <= window) {
      win.outstanding += bytes;
      return Status();
    }
    // The clock restarts with every ack: a slow receiver that keeps taking
    // bytes is not a dead one.
    const auto deadline = std::max(began, win.last_ack) + limit;
    if (Clock::now() >= deadline)
      return Status::timeout(rank_name(to) + " took none of the shared bytes " +
                             rank_name(it->second.me) + " sent it for " + seconds(timeout_s) +
                             " s (write-timeout); " + std::to_string(win.outstanding) +
                             " bytes unacknowledged");
    cv_.wait_until(l, deadline);
  }
}

Status ShareWindows::ack(const std::string& load, int32_t from, uint64_t bytes,
                         const Status& status) {
  std::lock_guard<std::mutex> l(mu_);
  auto it = loads_.find(load);
  if (it == loads_.end()) {
    for (const auto& e : ended_)
      if (e.first == load) return Status();
    if (!status.ok()) {
      early_.push_back({load, from, status});
      if (early_.size() > kEndedKept) early_.pop_front();
      return Status();
    }
    return Status::invalid_argument("ShareAck for load '" + load +
                                    "', which sends no shared bytes from here");
  }
  auto w = it->second.to.find(from);
  if (w == it->second.to.end())
    return Status::invalid_argument("ShareAck from " + rank_name(from) + " for load '" + load +
                                    "', which sends it no shared bytes");
  Window& win = w->second;
  if (bytes > win.outstanding)
    return Status::invalid_argument("ShareAck from " + rank_name(from) + " for load '" + load +
                                    "' acknowledges " + std::to_string(bytes) + " bytes, but " +
                                    std::to_string(win.outstanding) + " are outstanding");
  win.outstanding -= bytes;
  win.last_ack = Clock::now();
  if (!status.ok() && win.closed.ok()) win.closed = refused(from, status);
  cv_.notify_all();
  return Status();
}

void ShareWindows::fail_rank(int32_t rank, const Status& why, bool every) {
  std::lock_guard<std::mutex> l(mu_);
  const Status reason = why.ok() ? Status::aborted(rank_name(rank) + " failed") : why;
  failed_.emplace(rank, reason);
  if (every && every_failed_.ok()) every_failed_ = reason;
  for (auto& [id, ld] : loads_)
    for (auto& [to, w] : ld.to)
      if ((every || to == rank) && w.closed.ok()) w.closed = reason;
  cv_.notify_all();
}

void ShareWindows::rejoined(int32_t rank) {
  std::lock_guard<std::mutex> l(mu_);
  failed_.erase(rank);
  if (rank == 0) every_failed_ = Status();
}

// `load` by value: close_all passes the key of the entry this erases.
void ShareWindows::end_locked(std::string load, const Status& why) {
  if (loads_.erase(load) == 0) return;
  ended_.emplace_back(std::move(load), why);
  if (ended_.size() > kEndedKept) ended_.pop_front();
}

void ShareWindows::close(const std::string& load, const Status& why) {
  std::lock_guard<std::mutex> l(mu_);
  end_locked(load, why);
  cv_.notify_all();
}

void ShareWindows::close_all(const Status& why) {
  std::lock_guard<std::mutex> l(mu_);
  while (!loads_.empty()) end_locked(loads_.begin()->first, why);
  cv_.notify_all();
}

std::optional<Status> ShareWindows::failure(int32_t rank) {
  std::lock_guard<std::mutex> l(mu_);
  auto it = failed_.find(rank);
  if (it == failed_.end()) return std::nullopt;
  return it->second;
}

uint64_t ShareWindows::outstanding(const std::string& load, int32_t to) {
  std::lock_guard<std::mutex> l(mu_);
  auto it = loads_.find(load);
  if (it == loads_.end()) return 0;
  auto w = it->second.to.find(to);
  return w == it->second.to.end() ? 0 : w->second.outstanding;
}

}  // namespace ferry
