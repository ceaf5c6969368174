// What is in a checkpoint root: committed checkpoints, the latest one,
// pending directories and their leases, retention and garbage collection.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ferry/filesystem.hpp"
#include "ferry/manifest.hpp"
#include "ferry/status.hpp"

namespace ferry {

constexpr char kLatestFileName[] = "LATEST";
constexpr char kLeaseFileName[] = "LEASE";

std::string step_dir_name(uint64_t step);  // "step-00001000"
// The pending directory of a save: ".pending-00001000-<job>-<id>"
std::string pending_dir_name(uint64_t step, const std::string& job, const std::string& id);
bool is_pending_dir_name(const std::string& name);
// Parses "step-<digits>"; false for anything else.
bool parse_step_dir_name(const std::string& name, uint64_t* step);

struct CheckpointInfo {
  std::string path;  // ROOT/step-...
  uint64_t step = 0;
  uint64_t commit_seq = 0;
  uint64_t bytes = 0;  // data bytes (manifest)
  uint64_t tensors = 0;
  bool latest_hint = false;  // LATEST names it
  Status status;             // ok, or why its manifest could not be read
};

// Committed checkpoints (step-* directories), sorted by commit sequence.
// Pending directories are never listed. Unreadable manifests are listed with
// their status set (so `ferry ls` can show them) and never chosen as latest.
Result<std::vector<CheckpointInfo>> list_checkpoints(Filesystem& fs, const std::string& root);

// The committed checkpoint with the highest commit sequence whose manifest
// decodes, or not_found.
Result<CheckpointInfo> find_latest(Filesystem& fs, const std::string& root);

// What a caller means by `path`: a checkpoint directory (it holds a
// MANIFEST), or a root (then its latest checkpoint). A pending directory is
// refused even when it holds a manifest: it was never committed.
Result<std::string> resolve_checkpoint(Filesystem& fs, const std::string& path);

// Reads and decodes ROOT/.../MANIFEST (corruption names the path).
Result<Manifest> read_manifest(Filesystem& fs, const std::string& checkpoint_dir);

// Lease: a text file holding the expiry time (unix ms) and the owner.
Status write_lease(Filesystem& fs, const std::string& pending_dir, int64_t expires_unix_ms,
                   const std::string& owner);

struct GcReport {
  std::vector<std::string> removed;  // pending dirs whose lease expired
  std::vector<std::string> kept;     // pending dirs still leased
};
// Removes pending directories whose lease expired before now_unix_ms (a
// pending directory without a readable lease counts as expired only when its
// mtime is older than grace_ms).
Result<GcReport> collect_garbage(Filesystem& fs, const std::string& root, int64_t now_unix_ms,
                                 int64_t grace_ms = 60'000);

// Keeps the `keep_last` newest committed checkpoints (by commit sequence),
// deleting older ones; 0 keeps all. Returns the removed paths.
Result<std::vector<std::string>> apply_retention(Filesystem& fs, const std::string& root,
                                                 uint32_t keep_last);

int64_t now_unix_ms();

}  // namespace ferry
