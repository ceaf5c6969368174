// A rank's data file written by the caller's checkpoint_fn instead of by
// Ferry's writers (SavePlannerOptions::checkpoint_fn): what the function is
// handed, and what Ferry records of the file it wrote.
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "ferry/device.hpp"
#include "ferry/filesystem.hpp"
#include "ferry/save_plan.hpp"
#include "layout.hpp"

namespace ferry {

// The tensors the rank's plan puts in one file, keyed by their safetensors
// entry names (entry_name): `sources[c]` is where chunk c of `planned`
// starts in the caller's memory (a byte offset into its row-major stream).
// Host, contiguous chunks are handed over as views of the caller's memory;
// the others (strided, or on a device) are copied by `device` into buffers
// appended to `*staged`, which must outlive the returned views. Blocks until
// those copies are done. Without a device, such a chunk is an error naming
// its key.
struct PlannedSource {
  TensorView view;
  uint64_t offset = 0;
};
Result<StateDict> planned_state_dict(const FileLayout& planned,
                                     const std::vector<PlannedSource>& sources,
                                     DeviceBackend* device,
                                     std::deque<std::vector<uint8_t>>* staged);

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
