// A rank's data file written by the caller's checkpoint_fn instead of by
// Ferry's writers (SavePlannerOptions::checkpoint_fn): what the function is
// handed, and what Ferry records of the file it wrote.
#pragma once

#include <string>
#include <vector>

#include "ferry/filesystem.hpp"
#include "ferry/planner.hpp"
#include "layout.hpp"

namespace ferry {

// The tensors the rank's plan puts in one file, keyed by their safetensors
// entry names (entry_name): `sources[c]` is where chunk c of `planned`
// starts in the caller's memory. Host, contiguous views only: the function
// reads them directly (the error names the key otherwise).
struct PlannedSource {
  TensorView view;
  uint64_t offset = 0;
};
Result<StateDict> planned_state_dict(const FileLayout& planned,
                                     const std::vector<PlannedSource>& sources);

// Reads back what the function wrote at `path`: a safetensors file holding
// exactly the planned entries (any order, any padding). Fsyncs it and returns
// its layout as written (offsets, header) and the xxh3-64 of every
// `checksum_block_bytes` block of every planned chunk (none when 0), in the
// planned chunk order. Errors name the file and the entry: missing, empty,
// not safetensors, an entry missing, extra, or with another dtype or shape.
Result<FileLayout> adopt_written_file(Filesystem& fs, const std::string& path,
                                      const FileLayout& planned, uint64_t checksum_block_bytes,
                                      std::vector<std::vector<uint64_t>>* sums, bool fsync);

// Runs the function; an exception it throws becomes an error.
Status run_checkpoint_fn(const CheckpointFn& fn, const StateDict& planned, const std::string& path);

}  // namespace ferry
