// Full verification of a committed checkpoint: the manifest's own checksum,
// every data file's size and safetensors header against the manifest, and
// every checksum block of every chunk.
#pragma once

#include <string>
#include <vector>

#include "catalog.hpp"
#include "ferry/filesystem.hpp"
#include "ferry/status.hpp"
#include "manifest.hpp"

namespace ferry {

struct VerifyReport {
  uint64_t files = 0;
  uint64_t chunks = 0;
  uint64_t bytes_checked = 0;
  // Chunks saved without checksums (checksum = false): their bytes were
  // not, and cannot be, checked.
  uint64_t unchecked_chunks = 0;
  uint64_t unchecked_bytes = 0;
  // Each names the file (and tensor). io_error: a file could not be read
  // (permissions, a failing device), which says nothing of its bytes; any
  // other code: the checkpoint is damaged or malformed.
  std::vector<Status> problems;
  bool ok() const { return problems.empty(); }
  // "CORRUPT" (a problem other than an I/O error), "UNREADABLE" (only I/O
  // errors), "UNCHECKED" (no problem, but chunks without checksums), "OK".
  const char* verdict() const;
};

// Reads every byte. Returns an error only when the manifest itself cannot
// be read; problems in data files, and a malformed manifest
// (check_manifest_coverage), are collected in the report.
Result<VerifyReport> verify_checkpoint(Filesystem& fs, const std::string& dir);

// The newest committed checkpoint (by commit sequence) that verifies
// completely (chunks saved without checksums count: nothing can check
// them), walking back past corrupt ones; not_found when none does.
Result<CheckpointInfo> latest_valid(Filesystem& fs, const std::string& root);

// What decode_manifest leaves to its users: each tensor's global size in
// bytes fits in 64 bits, and its chunks cover every element. Corruption
// ("malformed manifest") names the tensor. export and verify refuse a
// manifest that fails here.
Status check_manifest_coverage(const Manifest& m);

// Checks one data file's safetensors header against what the manifest says
// it holds (names, dtypes, shapes, offsets) and its size. headers_only
// callers (ferry inspect) use this without reading the data.
Status check_data_file_header(Filesystem& fs, const std::string& dir, uint32_t file_index,
                              const Manifest& m);

}  // namespace ferry
