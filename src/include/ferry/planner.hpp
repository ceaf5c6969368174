// The save planner as a public API, in the shape PyTorch's distributed
// checkpoint users know: see (and adjust) the plan before anything is
// written, then write and commit in steps.
//
//   ferry::SavePlanner planner(rt, sd, "rank");      // root and step default
//   auto global = planner.create_global_plan();      // collective; every rank's plan
//   auto wrote = planner.save_on_this_process((*global)[rt.rank()]);
//   auto path = planner.barrier();                   // rank 0 commits; every rank gets the path
//
// This is the same save that Runtime::save_async runs (save_async is the
// sequence above with nothing to wait for between the steps): the same
// coordinator, plan cache, files, commit, crash guarantees and timeouts.
// Between the steps the save is in its write phase: a rank that does not
// reach barrier() within write-timeout aborts the checkpoint on every rank.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ferry/export_macro.hpp"
#include "ferry/runtime.hpp"
#include "ferry/status.hpp"
#include "ferry/tensor.hpp"

namespace ferry {

// Who writes a tensor region several ranks hold (a replica group).
enum class OwnerPolicy : uint8_t {
  balanced,     // spread replica groups so every rank writes about as much
  lowest_rank,  // the lowest rank of each group writes it (DCP's behaviour)
};

// One state dict entry of a rank, as planned.
struct PlanItem {
  std::string key;
  DType dtype = DType::f32;
  std::vector<int64_t> global_shape;
  std::vector<int64_t> offsets;  // the region of the global tensor this rank holds
  std::vector<int64_t> sizes;
  uint64_t nbytes = 0;
  uint32_t entry = 0;  // index of the entry in the rank's state dict
};

// What one rank holds, before the ranks agree who writes what.
struct FERRY_EXPORT LocalSavePlan {
  int32_t rank = 0;
  std::vector<PlanItem> items;

  std::string to_string() const;  // one line per item
  std::string to_bytes() const;
  // Errors name what is malformed (truncated, bad dtype, region outside its shape).
  static Result<LocalSavePlan> from_bytes(const std::string& bytes);
};

// One piece a rank writes: all of one of its items, or a dim-0 slice of it.
struct PlannedWrite {
  uint32_t item = 0;  // index into SavePlan::items
  std::vector<int64_t> offsets;
  std::vector<int64_t> sizes;
  uint64_t nbytes = 0;
  uint32_t file = 0;  // index into SavePlan::files
};

// One rank's part of the global plan.
struct FERRY_EXPORT SavePlan {
  int32_t rank = 0;
  std::vector<PlanItem> items;               // the rank's local plan
  std::vector<std::vector<int32_t>> owners;  // per item: the ranks that write (part of) it
  std::vector<PlannedWrite> writes;          // in the order the rank writes them
  std::vector<std::string> files;            // exactly the data files it writes (may be none)
  uint64_t bytes = 0;                        // sum of writes[].nbytes

  std::string to_string() const;  // items, owners, files and bytes, one line each
  std::string to_bytes() const;
  static Result<SavePlan> from_bytes(const std::string& bytes);
};

namespace plan {
// The global plan from every rank's local plan (plans[r].rank == r), with no
// job: what the coordinator computes, for plans gathered by any means. The
// files are named and cut as a save with `files`' filename_prefix,
// shard_size and compress would write them (unset: "rank", no cap, raw).
// Errors (invalid_argument) name the key and the ranks, or the option.
FERRY_EXPORT Result<std::vector<SavePlan>> global_plan(
    const std::vector<LocalSavePlan>& local_plans, OwnerPolicy policy = OwnerPolicy::balanced,
    const SaveOptions& files = {});
// A rank's local plan of a state dict, with no job.
FERRY_EXPORT Result<LocalSavePlan> local_plan(const StateDict& sd, int32_t rank);
}  // namespace plan

// save_on_this_process's answer: wait() returns once this rank's files are
// durable (or the save failed; the error names the rank and the phase).
class FERRY_EXPORT WriteHandle {
 public:
  WriteHandle() = default;
  explicit WriteHandle(std::shared_ptr<detail::SaveState> s) : s_(std::move(s)) {}
  Status wait() const;
  Status wait(std::chrono::milliseconds timeout) const;  // Status::timeout if it passed first
  bool done() const;
  SaveHandle save() const { return SaveHandle(s_); }

 private:
  std::shared_ptr<detail::SaveState> s_;
};

// Writes one rank's data file itself, instead of Ferry's writers (called
// once per file of the rank's plan; the files are plain safetensors, so a
// compress option does not apply to them). `planned`
// holds exactly the tensors the global plan gives this rank, keyed by the
// entry names the checkpoint records ("key@offsets"), as host views of the
// caller's memory; the function must write them as a safetensors file at
// `filename` (any entry order and padding; e.g. safetensors' save_file).
// Ferry then reads the file back, checks it holds exactly those entries,
// records sizes and checksums of what is there, fsyncs it and commits as
// usual. A non-ok Status, an exception, or no file fails the checkpoint on
// every rank. Tensors the function cannot read in place (strided views, or
// on a GPU) are first copied to host memory, one file's worth at a time. A
// function still running at the write deadline is abandoned: the checkpoint
// fails (naming it and its file) and the runtime goes on, but the function
// may read the tensors it was handed until it returns: keep them alive.
using CheckpointFn = std::function<Status(const StateDict& planned, const std::string& filename)>;

struct SavePlannerOptions {
  SaveOptions save;  // overwrite, metadata, stream (SavePlanner's root wins over save.root)
  // Runs on this rank's local plan before it is sent to rank 0. It may drop
  // items (they are not saved) and rename keys; it may not add items or
  // change an item's dtype, shape or region (an error naming the item). A
  // Status it returns aborts the checkpoint on every rank.
  std::function<Status(LocalSavePlan&)> transform_local_plan;
  CheckpointFn checkpoint_fn;  // unset: Ferry writes the files
  // Who writes replicated tensors; unset: the configured owner-policy. Every
  // rank must pass the same (a rank that differs fails the checkpoint).
  std::optional<OwnerPolicy> owner_policy;
};

// One checkpoint, driven in steps. Every rank builds one and calls the
// collective steps (create_global_plan, barrier) in the same order. The
// state dict's memory must not change until save_on_this_process's wait()
// returned. Not thread-safe; one planner per checkpoint.
class FERRY_EXPORT SavePlanner {
 public:
  // `filename_prefix`: data files are <prefix>-<rank>-<k>; "" = the
  // options' (SaveOptions::filename_prefix, else ferry.filename-prefix).
  // `root`: "" = SaveOptions::root, else ferry.root; with none of them, the
  // directory part of `filename_prefix` is the root (the working directory
  // for a bare name) and its last part the prefix, as DCP reads it.
  // `step`: nullopt = one more than the latest committed step under the
  // root, 0 in an empty root.
  SavePlanner(Runtime& rt, const StateDict& sd, std::string filename_prefix = "",
              SavePlannerOptions options = {}, std::string root = "",
              std::optional<uint64_t> step = std::nullopt);
  ~SavePlanner();
  SavePlanner(const SavePlanner&) = delete;
  SavePlanner& operator=(const SavePlanner&) = delete;

  // This rank's local plan, after transform_local_plan. No communication.
  Result<LocalSavePlan> create_local_plan();
  // Collective: sends the local plan to rank 0 and returns every rank's part
  // of the global plan (index r is rank r's). Nothing is written yet.
  Result<std::vector<SavePlan>> create_global_plan();
  // Starts writing this rank's files. `plan` must be this rank's entry of
  // create_global_plan(): another rank's plan (or one not from it) is
  // refused, and the checkpoint is not harmed.
  WriteHandle save_on_this_process(const SavePlan& plan);
  // Collective: waits until every rank's files are durable and rank 0 has
  // committed; returns the committed directory. Any rank's error aborts the
  // checkpoint on every rank and comes back here.
  Result<std::string> barrier();
  // The same, waiting at most `timeout`: Status::timeout while the
  // checkpoint is not over (handle().done() is false); call again to wait on.
  Result<std::string> barrier(std::chrono::milliseconds timeout);

  uint64_t step() const;
  // The save underneath (progress, metrics, warnings).
  SaveHandle handle() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace ferry
