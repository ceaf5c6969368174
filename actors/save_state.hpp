// The state a SaveHandle shares with the actors driving its save. Written by
// the planner's thread, read by the caller's: everything under `mu`, except
// the progress counters, which are atomics so progress lines never block.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>

#include "ferry/runtime.hpp"

namespace ferry::detail {

struct SaveState {
  using clock = std::chrono::steady_clock;

  uint64_t step = 0;
  clock::time_point started = clock::now();

  std::atomic<uint64_t> bytes_persisted{0};
  std::atomic<uint64_t> bytes_total{0};

  mutable std::mutex mu;
  std::condition_variable cv;
  bool snapshot_done = false;
  bool done = false;
  Status snapshot_status;
  Status status;
  std::string path;
  SaveMetrics metrics;

  double ms_since_start() const {
    return std::chrono::duration<double, std::milli>(clock::now() - started).count();
  }

  // Idempotent: the first call wins.
  void finish_snapshot(const Status& st) {
    std::lock_guard<std::mutex> lock(mu);
    if (snapshot_done) return;
    snapshot_done = true;
    snapshot_status = st;
    metrics.snapshot_ms = ms_since_start();
    cv.notify_all();
  }

  // Ends the save; an unfinished snapshot ends with the same status.
  void finish(const Status& st, const std::string& committed_path) {
    std::lock_guard<std::mutex> lock(mu);
    if (done) return;
    if (!snapshot_done) {
      snapshot_done = true;
      snapshot_status = st;
      metrics.snapshot_ms = ms_since_start();
    }
    done = true;
    status = st;
    path = committed_path;
    metrics.total_ms = ms_since_start();
    cv.notify_all();
  }

  template <class F>
  void update_metrics(F&& f) {
    std::lock_guard<std::mutex> lock(mu);
    f(metrics);
  }
};

}  // namespace ferry::detail
