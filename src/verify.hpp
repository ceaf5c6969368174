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

// VerifyReport is the public catalog's (ferry/catalog.hpp).

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
