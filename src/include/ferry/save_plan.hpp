// The plan of a save as values: what each rank holds, who writes what into
// which file, and the pure planning functions over them. The core (src/)
// uses these without the runtime; ferry/planner.hpp includes this.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "ferry/export_macro.hpp"
#include "ferry/save_options.hpp"
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

}  // namespace ferry
