// A save's data files: the options that shape them, resolved once where the
// save enters Ferry, and the one function that turns a rank's part of the
// global plan into its files. The plan a caller sees (SavePlan::files) and
// the files the rank's writers create both come from data_files(), so the
// preview is what lands on disk. Pure: no actors, threads or I/O.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "box.hpp"
#include "ferry/options.hpp"
#include "ferry/save_options.hpp"
#include "ferry/status.hpp"
#include "plan.hpp"

namespace ferry {

// Resolved: nothing here is "unset". Travels in the rank's PlanRequest.
struct DataFileOptions {
  std::string prefix = "rank";    // files are <prefix>-<rank>-<k>.<extension()>
  uint64_t max_bytes = 0;         // most data bytes per file; 0 = no cap
  std::string compress = "none";  // normalized: "none" or "zstd:<level>"

  int level() const;              // zstd level, 0 = stored raw
  std::string extension() const;  // "safetensors", or the compressed files' one
  bool operator==(const DataFileOptions& o) const {
    return prefix == o.prefix && max_bytes == o.max_bytes && compress == o.compress;
  }
  bool operator!=(const DataFileOptions& o) const { return !(*this == o); }
};

// A save's options over the configured ones (`cfg` fills what `o` leaves
// unset). `custom_writer`: a checkpoint_fn writes the files, as plain
// safetensors, so nothing is compressed whatever was asked. Errors name the
// SaveOptions field.
Result<DataFileOptions> resolve_data_files(const Options& cfg, const SaveOptions& o,
                                           bool custom_writer);

// Checks options that came from elsewhere (another rank's message).
Status check_data_files(const DataFileOptions& o, const std::string& who);

// One piece of one of a rank's items in a data file: its region `box` (the
// item's, or a dim-0 slice of it), starting `skip` bytes into the item's
// row-major bytes.
struct FileSlice {
  uint32_t item = 0;  // index into the rank's LocalPlan::items
  Box box;
  uint64_t skip = 0;
};

struct PlannedFile {
  std::string name;
  std::vector<FileSlice> slices;  // in the order the file holds them
};

// The files `plan.rank` writes, in order: the plan's chunks in plan order
// (by plan file, then chunk), packed into files of at most o.max_bytes data
// bytes (counting the codec's worst case when compressed; a chunk that does
// not fit is split along dim 0, see pack_into_files), or without a cap one
// file per plan file. A rank with nothing to write has no files. Errors:
// a chunk naming an item or file the rank does not have.
Result<std::vector<PlannedFile>> data_files(const LocalPlan& local, const RankPlan& plan,
                                            const DataFileOptions& o);

}  // namespace ferry
