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
#include "ferry/save_plan.hpp"
#include "ferry/status.hpp"
#include "ferry/tensor.hpp"

namespace ferry {

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
