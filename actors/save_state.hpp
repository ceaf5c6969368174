// The state a SaveHandle shares with the actors driving its save. Written by
// the planner's thread, read by the caller's: everything under `mu`, except
// the progress counters, which are atomics so progress lines never block.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <vector>

#include "ferry/device.hpp"
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
  // Every copy of the snapshot is queued with the device (not necessarily
  // done): what wait_snapshot(stream) waits for on the host before it orders
  // the caller's stream after the copies.
  bool copies_issued = false;
  bool done = false;
  Status snapshot_status;
  Status status;
  std::string path;
  std::vector<std::string> warnings;  // after the commit point: the save still succeeded
  SaveMetrics metrics;
  // A save driven in steps (SavePlanner) stops for its caller after each;
  // these say a step is done (or `done` that the save ended).
  bool planned = false;   // the global plan arrived: all_plans holds every rank's
  std::string all_plans;  // encode_save_plans
  bool written = false;   // this rank's files and the pending directory are durable

  double ms_since_start() const {
    return std::chrono::duration<double, std::milli>(clock::now() - started).count();
  }

  // For wait_snapshot(stream): the saved tensors and the backend copying them.
  StateDict sd;
  std::shared_ptr<DeviceBackend> device;

  void mark_copies_issued() {
    std::lock_guard<std::mutex> lock(mu);
    copies_issued = true;
    cv.notify_all();
  }

  // Replica check: the caller's tensors are being hashed, so a GPU stream
  // must not be let go at copies_issued alone (wait_snapshot(stream)).
  bool hashing = false;
  void set_hashing(bool on) {
    std::lock_guard<std::mutex> lock(mu);
    hashing = on;
    cv.notify_all();
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
  // REQUIRES: nothing of Ferry touches the caller's tensors or this save's
  // files any more (the waits return here, and the caller may free them).
  void finish(const Status& st, const std::string& committed_path,
              std::vector<std::string> post_commit_warnings = {}) {
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
    warnings = std::move(post_commit_warnings);
    metrics.total_ms = ms_since_start();
    cv.notify_all();
  }

  void mark_planned(std::string all) {
    std::lock_guard<std::mutex> lock(mu);
    planned = true;
    all_plans = std::move(all);
    cv.notify_all();
  }

  void mark_written() {
    std::lock_guard<std::mutex> lock(mu);
    written = true;
    cv.notify_all();
  }

  template <class F>
  void update_metrics(F&& f) {
    std::lock_guard<std::mutex> lock(mu);
    f(metrics);
  }
};

}  // namespace ferry::detail
