// What writers report, how the coordinator turns reports into a manifest, and
// the commit protocol itself (DESIGN.md "On disk"), as plain functions over
// the Filesystem interface so that faults can be injected under them.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "ferry/box.hpp"
#include "ferry/filesystem.hpp"
#include "ferry/manifest.hpp"
#include "ferry/status.hpp"
#include "ferry/tensor.hpp"

namespace ferry {

struct WrittenChunk {
  std::string key;
  DType dtype = DType::f32;
  std::vector<int64_t> global_shape;
  Box box;
  uint32_t file = 0;  // index into WriteResult::files
  uint64_t byte_offset = 0;
  uint64_t byte_length = 0;
  std::string entry;
  std::vector<uint64_t> checksums;
};

struct WrittenFile {
  std::string name;
  uint64_t size = 0;
  uint64_t header_bytes = 0;
  uint64_t header_checksum = 0;
};

// One rank's report after its files and the pending directory are durable.
struct WriteResult {
  int32_t rank = 0;
  std::vector<WrittenFile> files;
  std::vector<WrittenChunk> chunks;
  double snapshot_ms = 0;
  double write_ms = 0;
  uint64_t bytes = 0;
  double ready_ms = 0;  // save_async -> files and directory durable
};

struct ManifestHeader {
  uint64_t step = 0;
  int32_t world_size = 1;
  std::string job_id;
  std::string checkpoint_id;
  bool fsynced = true;
  uint64_t checksum_block_bytes = 1ull << 20;
  std::vector<std::pair<std::string, std::string>> metadata;
};

// Merges the ranks' reports (results[r].rank == r) into a manifest: files
// renumbered globally, tensors sorted by key, chunks sorted by offsets.
// commit_seq is filled in by commit_checkpoint.
Result<Manifest> assemble_manifest(const ManifestHeader& header,
                                   const std::vector<WriteResult>& results);

struct CommitOptions {
  bool fsync = true;
  bool overwrite = false;
  uint32_t keep_last = 0;
};

struct CommitOutcome {
  std::string path;  // ROOT/step-...
  uint64_t commit_seq = 0;
  std::vector<std::string> retired;  // removed by retention
};

// REQUIRES: every rank's data files in `pending_dir` are durable.
// Writes MANIFEST (temp, fsync, rename, fsync dir), renames the pending
// directory to its step directory (the commit point), fsyncs ROOT, replaces
// LATEST, then applies retention. An error before the commit point leaves
// nothing visible; the caller removes the pending directory.
Result<CommitOutcome> commit_checkpoint(Filesystem& fs, const std::string& root,
                                        const std::string& pending_dir, Manifest manifest,
                                        const CommitOptions& opts);

// Creates ROOT (if needed) and the pending directory with its lease. Fails
// with already_exists naming the step directory when the step exists and
// `overwrite` is false.
// A ROOT created here is made durable in its parent when `fsync` is set.
Status prepare_pending(Filesystem& fs, const std::string& root, const std::string& pending_dir,
                       uint64_t step, bool overwrite, int64_t lease_ms, const std::string& owner,
                       bool fsync = true);

}  // namespace ferry
