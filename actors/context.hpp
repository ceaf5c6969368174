// What every actor of one rank shares: the settings and the objects built
// once at start (filesystem, device, staging pool). Immutable after start,
// so it is handed around as shared_ptr<const RankContext>.
#pragma once

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>

#include "actors/share_window.hpp"
#include "ferry/device.hpp"
#include "ferry/filesystem.hpp"
#include "ferry/options.hpp"
#include "pool.hpp"

namespace ferry {

// Writer threads the planner abandoned inside a blocking call (a stalled
// disk, a checkpoint_fn that never returns): each ends when its call does.
// Shutdown waits for them a bounded time, then leaves them running.
class Stragglers {
 public:
  void add() {
    std::lock_guard<std::mutex> lock(mu_);
    ++n_;
  }
  void done() {
    std::lock_guard<std::mutex> lock(mu_);
    --n_;
    cv_.notify_all();
  }
  // True once none is left, false if some still are after `timeout`.
  bool wait_none(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, timeout, [this] { return n_ == 0; });
  }
  int count() const {
    std::lock_guard<std::mutex> lock(mu_);
    return n_;
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  int n_ = 0;
};

struct RankContext {
  Options opts;
  int32_t rank = 0;
  int32_t world_size = 1;
  std::string job_id;
  // The same on every rank of one job run, different across runs: with the
  // step and the save's sequence number it makes a checkpoint id all ranks
  // agree on without a round trip.
  uint64_t run_salt = 0;
  std::shared_ptr<Filesystem> fs;
  std::shared_ptr<DeviceBackend> device;
  std::shared_ptr<StagingPool> pool;
  // Flow control of the replicated bytes this rank sends others in a load:
  // readers wait in it, the link feeds it acks and failures.
  std::shared_ptr<ShareWindows> shares = std::make_shared<ShareWindows>();
  std::shared_ptr<Stragglers> stragglers = std::make_shared<Stragglers>();
};

using ContextPtr = std::shared_ptr<const RankContext>;

}  // namespace ferry
