// A consolidated copy of a checkpoint for tools outside Ferry: one entry per
// tensor with its full global shape, in safetensors files with a Hugging
// Face style model.safetensors.index.json beside them.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "ferry/export_macro.hpp"
#include "ferry/status.hpp"

namespace ferry {

class Runtime;

struct ExportOptions {
  // Files hold at most this many bytes of tensors; a larger tensor gets a
  // file of its own.
  uint64_t max_shard_bytes = 5ull << 30;
  // Memory bound: tensors are loaded in batches of about this many bytes, a
  // larger one a block of rows at a time (a row is never split).
  uint64_t block_bytes = 256ull << 20;
  // Extra "__metadata__" key/values for every file, after "format": "pt",
  // "ferry.step" and the checkpoint's user metadata.
  std::vector<std::pair<std::string, std::string>> metadata;
};

// Writes `checkpoint` (a step directory, or a root: its latest) into
// `out_dir` as model-0000i-of-0000N.safetensors and
// model.safetensors.index.json, each written aside, fsynced and renamed into
// place, and returns the index's path. Reads through `rt`'s loader (checksums
// verified); `rt` must be a single-process runtime.
FERRY_EXPORT Result<std::string> export_checkpoint(Runtime& rt, const std::string& checkpoint,
                                                   const std::string& out_dir,
                                                   const ExportOptions& opts = {});

}  // namespace ferry
