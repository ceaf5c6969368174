// What every actor of one rank shares: the settings and the objects built
// once at start (filesystem, device, staging pool). Immutable after start,
// so it is handed around as shared_ptr<const RankContext>.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "actors/share_window.hpp"
#include "ferry/device.hpp"
#include "ferry/filesystem.hpp"
#include "ferry/options.hpp"
#include "frame_buffers.hpp"
#include "log.hpp"
#include "manifest_cache.hpp"
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

// The runtime's actor threads: each says which blocking call it is in (a
// commit, a gc) and when it has ended. Shutdown waits for them a bounded
// time, then leaves the stuck ones running and names what they are in.
class ActorThreads {
 public:
  void started(const std::string& name) {
    std::lock_guard<std::mutex> lock(mu_);
    running_[name];
  }
  void ended(const std::string& name) {
    std::lock_guard<std::mutex> lock(mu_);
    running_.erase(name);
    cv_.notify_all();
  }
  void doing(const std::string& name, std::string what) {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = running_.find(name); it != running_.end()) it->second = std::move(what);
  }
  // "<name> (in <call>)" of each still running after `timeout`.
  std::vector<std::string> wait_ended(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, timeout, [this] { return running_.empty(); });
    std::vector<std::string> out;
    for (const auto& [name, what] : running_)
      out.push_back(what.empty() ? name : name + " (in " + what + ")");
    return out;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::string> running_;
};

// Marks what an actor thread is blocked in for the duration of a scope.
class Doing {
 public:
  Doing(ActorThreads& threads, std::string name, std::string what)
      : threads_(threads), name_(std::move(name)) {
    threads_.doing(name_, std::move(what));
  }
  ~Doing() { threads_.doing(name_, ""); }
  Doing(const Doing&) = delete;
  Doing& operator=(const Doing&) = delete;

 private:
  ActorThreads& threads_;
  std::string name_;
};

// The timeline's clock (trace-dir): this rank's offset to rank 0's clock and
// how far it may be off, set once as the rank joins (zeros on rank 0).
struct TraceClock {
  std::atomic<int64_t> offset_ns{0};
  std::atomic<int64_t> error_ns{0};
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
  // Declares `root` on fs once for this runtime's life (its saves and loads
  // there may run on after the call that named it); released when it ends.
  void hold_root(const std::string& root) {
    std::lock_guard<std::mutex> lock(roots_mu);
    if (roots.find(root) == roots.end()) roots.emplace(root, RootHold(fs, root));
  }
  std::mutex roots_mu;
  std::map<std::string, RootHold> roots;
  std::shared_ptr<DeviceBackend> device;
  std::shared_ptr<StagingPool> pool;
  // Flow control of the replicated bytes this rank sends others in a load:
  // readers wait in it, the link feeds it acks and failures.
  std::shared_ptr<ShareWindows> shares = std::make_shared<ShareWindows>();
  std::shared_ptr<Stragglers> stragglers = std::make_shared<Stragglers>();
  std::shared_ptr<ActorThreads> threads = std::make_shared<ActorThreads>();
  std::shared_ptr<TraceClock> trace_clock = std::make_shared<TraceClock>();
  std::string host;  // this rank's host name, for the timeline
  // This runtime's own, never another's in the same process: what it knows
  // of manifests, and the buffers its large frames reuse.
  std::shared_ptr<ManifestCache> manifests = std::make_shared<ManifestCache>();
  std::shared_ptr<FrameBuffers> frames = std::make_shared<FrameBuffers>();
  Logger log = log_to_stderr;  // RuntimeArgs::logger, never empty
};

// The name the coordinator has in ActorThreads.
inline constexpr char kCoordinatorThread[] = "rank 0's coordinator";

using ContextPtr = std::shared_ptr<const RankContext>;

}  // namespace ferry
