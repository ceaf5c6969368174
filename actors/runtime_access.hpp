// What SavePlanner (actors/save_planner.cpp) needs of a Runtime's insides:
// the one save path save_async takes, and the planner actor to step it.
#pragma once

#include <memory>
#include <optional>

#include "actors/context.hpp"
#include "actors/messages.hpp"
#include "ferry/runtime.hpp"

namespace ferry::detail {

struct RuntimeAccess {
  // save_async's body. `local`: the local plan to send instead of the state
  // dict's own; `staged`: stop after the plan and after the write. `opts`
  // moves into the save's job: a caller that has no use for them after
  // (the C API) hands its metadata over uncopied (megabytes at 100,000
  // tensors: the Python package's tree).
  static std::shared_ptr<SaveState> start_save(Runtime& rt, const StateDict& sd, uint64_t step,
                                               SaveOptions opts, std::optional<LocalPlan> local,
                                               bool staged, CheckpointFn checkpoint_fn = {},
                                               uint8_t owner_policy = 0);
  // A save this rank cannot take part in: it takes its place in the
  // sequence of checkpoints and aborts that one on every rank with `why`.
  static std::shared_ptr<SaveState> start_doomed_save(Runtime& rt, uint64_t step, Status why);
  // The file options (filename_prefix, shard_size, compress) as start_save
  // resolves them, the configured ones filling what is unset.
  static Result<DataFileOptions> resolve_file_options(const Runtime& rt, const SaveOptions& opts,
                                                      bool custom_writer);
  static void proceed(Runtime& rt, Proceed p);
  static const RankContext& context(const Runtime& rt);
};

}  // namespace ferry::detail
