// The facade a training job uses. Declared here, implemented in
// actors/runtime.cpp where the actor system lives.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ferry/export_macro.hpp"
#include "ferry/load_report.hpp"
#include "ferry/logger.hpp"
#include "ferry/options.hpp"
#include "ferry/save_options.hpp"
#include "ferry/status.hpp"
#include "ferry/tensor.hpp"

namespace ferry {

class Filesystem;
class DeviceBackend;

namespace detail {
struct SaveState;
struct RuntimeAccess;  // actors/runtime_access.hpp: SavePlanner's way in
}  // namespace detail

// Returned by save_async at once. Copyable; all copies see the same save.
// The snapshot contract: the saved tensors must not change from save_async
// until wait_snapshot() returns (or a stream that wait_snapshot(stream) made
// wait has passed that point). Ferry cannot see a change in release builds:
// the checkpoint then holds a mix of old and new bytes. Debug builds (NDEBUG
// not defined, or ferry.verify-snapshot = true) checksum each host tensor's
// bytes before and after its copy and fail the save naming the tensor that
// changed; SaveOptions::
// snapshot_check lets a caller that can tell (tensor versions) do the same.
// Waits never throw: errors come back as a Status. A failed save is reported
// only once nothing of Ferry touches the caller's tensors again: after a
// wait returned an error, the caller may free them (except the tensors an
// abandoned checkpoint_fn was handed: it may read them until it returns).
// Every save ends by its phase deadlines, a write or checkpoint_fn that never
// returns included (its writer thread is abandoned). If Ferry's actors die,
// every wait ends with an error.
class FERRY_EXPORT SaveHandle {
 public:
  SaveHandle() = default;
  explicit SaveHandle(std::shared_ptr<detail::SaveState> s) : s_(std::move(s)) {}

  // Blocks until every byte is off the caller's tensors (they may be mutated
  // afterwards), or the save failed before that.
  Status wait_snapshot() const;
  // Blocks until the checkpoint is committed (or failed).
  Status wait_committed() const;
  // The same, for at most `timeout`: Status::timeout when it passed first
  // (the save goes on; wait again or poll).
  Status wait_snapshot(std::chrono::milliseconds timeout) const;
  Status wait_committed(std::chrono::milliseconds timeout) const;
  // Stream-ordered wait: makes the caller's CUDA stream (a cudaStream_t on
  // `stream_device`; nullptr: the legacy default stream) wait, on the GPU,
  // for the copies off the device tensors, so kernels queued on it afterwards
  // may mutate them; the host does not wait for the copies. It waits only
  // until every copy is queued with the device (planning, and with a pool
  // smaller than the state until (state - pool) bytes are written). Host
  // tensors in the save are waited for on the host, as by wait_snapshot().
  // A copy that fails after this returned fails the save: wait_committed
  // reports it.
  Status wait_snapshot(void* stream, const Device& stream_device = Device::cuda(0)) const;
  bool snapshot_done() const;
  bool done() const;
  uint64_t step() const;
  std::string path() const;  // the committed directory (once done)
  // Failures after the commit point (ROOT fsync, LATEST, retention), once
  // done: the save is committed all the same (wait_committed is ok). Also
  // logged once by rank 0 (RuntimeArgs::logger; stderr by default).
  std::vector<std::string> warnings() const;
  SaveMetrics metrics() const;
  uint64_t bytes_persisted() const;  // written so far (for progress lines)
  uint64_t bytes_total() const;
  bool valid() const { return s_ != nullptr; }

 private:
  std::shared_ptr<detail::SaveState> s_;
};

struct RuntimeArgs {
  std::vector<Setting> settings;  // code options: highest precedence
  std::string config_file;        // explicit actor config file, "" = caf-application.ini if present
  std::vector<std::string> argv;  // extra CAF command line (e.g. --config-file=...)
  int32_t rank = 0;
  int32_t world_size = 1;
  std::shared_ptr<Filesystem> fs;         // default: POSIX
  std::shared_ptr<DeviceBackend> device;  // default: host (+ CUDA when available)
  // Where this runtime's messages go (ferry/logger.hpp); unset: stderr, one
  // line each (log_to_stderr).
  Logger logger;

  RuntimeArgs& set(const std::string& key, const std::string& value) {
    settings.push_back({key, value, "code"});
    return *this;
  }
};

class FERRY_EXPORT Runtime {
 public:
  // Starts the actor system, validates options, maps the staging pool (faulted
  // in the background, so start does not grow with the pool). Errors name the
  // bad key/value.
  static Result<std::unique_ptr<Runtime>> create(RuntimeArgs args);
  // create() with rank and world size from the torchrun-style environment.
  static Result<std::unique_ptr<Runtime>> from_env(RuntimeArgs args = {});
  // Waits (bounded) for an in-flight save, then stops the actors. Threads
  // stuck in a call that never returns (a stalled disk, a checkpoint_fn) are
  // left running after a short wait, with what they use: it always returns.
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  // Starts a checkpoint of `sd` at `step` and returns at once. The views'
  // memory must not change until wait_snapshot() (see SaveHandle: a change
  // makes a torn checkpoint; debug builds detect it for host tensors). One save is in flight at a
  // time: a second call waits for the first's snapshot, or fails fast
  // (busy) when configured. An empty `sd` is invalid_argument. Saves are
  // collective: every rank passes the same step, root and overwrite flag (a
  // rank that differs fails the save on every rank).
  SaveHandle save_async(const StateDict& sd, uint64_t step, const SaveOptions& opts = {});

  // Fills `sd`'s tensors from the checkpoint at `path` (a step directory, or
  // a root: then its latest). Shards may differ from the saved ones. A key
  // the checkpoint lacks is an error naming it; a checkpoint tensor the state
  // dict does not ask for is left out (one warning to the logger lists them;
  // load_report() returns the list instead). With several ranks every rank calls load with the
  // same path (ranks naming different checkpoints fail at once, naming
  // them) and every rank ends with the same outcome: the first error,
  // naming the rank it came from, or success once every rank succeeded.
  // After an error the tensors may hold part of what was read (a block found
  // corrupt included; the error names the tensors holding bytes that did
  // not pass their checksum): load again before using them.
  Status load(StateDict& sd, const std::string& path);
  // load(), and on success what it restored.
  Result<LoadReport> load_report(StateDict& sd, const std::string& path);
  // The checkpoint a load of `path` reads now (a root: its latest), as rank
  // 0 resolves it for every rank: `path` of the step directory and `step`
  // filled, nothing loaded. With several ranks every rank calls it, in the
  // same order; each gets the same answer, and loading the returned path
  // then reads that checkpoint whatever commits meanwhile (what a caller
  // that reads the manifest before loading needs).
  Result<LoadReport> resolve(const std::string& path);

  // Path of the latest committed checkpoint under `root` (default: the
  // configured root); "" when there is none.
  std::string latest(const std::string& root = "") const;
  // Like latest(), but re-reads and verifies checkpoints from the newest
  // back, returning the newest one that is intact ("" when none is).
  std::string latest_valid(const std::string& root = "") const;

  const Options& options() const;
  int32_t rank() const;
  int32_t world_size() const;

  struct Impl;

 private:
  friend struct detail::RuntimeAccess;
  explicit Runtime(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ferry
