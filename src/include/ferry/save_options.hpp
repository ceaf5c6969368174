// What a caller asks of one save and what it reports back: plain values the
// core (src/) reads without the runtime (ferry/runtime.hpp includes this).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ferry/status.hpp"
#include "ferry/tensor.hpp"

namespace ferry {

struct SaveOptions {
  bool overwrite = false;  // replace an existing step instead of failing
  std::vector<std::pair<std::string, std::string>> metadata;  // stored in the manifest
  std::string root;  // overrides Options::root for this save
  // The caller's CUDA stream (a cudaStream_t) and the device it belongs to:
  // device copies are ordered after the work queued on it before
  // save_async. nullptr: the legacy default stream.
  void* stream = nullptr;
  Device stream_device = Device::cuda(0);
  // Unset: the configured ferry.filename-prefix / shard-size / compress.
  // Bad values fail the save with an error naming the field.
  std::optional<std::string> filename_prefix;  // data files <prefix>-<rank>-<k>.<ext>
  std::optional<int64_t> shard_size;           // most data bytes per file; must be > 0
  std::optional<std::string> compress;         // none, true, zstd, zstd:<level>
  // Called once when this rank's snapshot has ended (every byte is off the
  // tensors), on one of Ferry's threads, before wait_snapshot() returns; an
  // error fails the save with its message. Lets a caller that can see
  // mutations (the Python package compares torch's tensor versions) refuse
  // a torn snapshot. It must not wait for this save.
  std::function<Status()> snapshot_check;
};

// Figures of one save, filled in as it goes.
struct SaveMetrics {
  double save_async_ms = 0;  // time inside save_async
  double plan_ms = 0;        // local + global plan and layout
  double snapshot_ms = 0;    // save_async -> last byte off the tensors
  double write_ms = 0;       // first block written -> all files fsynced
  double commit_ms = 0;      // manifest + renames + LATEST
  double total_ms = 0;       // save_async -> committed
  uint64_t bytes = 0;        // data bytes this rank wrote
  uint64_t files = 0;
  int32_t slowest_rank = -1;    // the rank whose files were durable last
  double slowest_rank_ms = 0;   // its save_async -> durable time
  double replica_check_ms = 0;  // hashing this rank's replicated tensors (replica-check)
  double persist_gbps() const { return total_ms > 0 ? bytes / (total_ms * 1e6) : 0; }
};

}  // namespace ferry
