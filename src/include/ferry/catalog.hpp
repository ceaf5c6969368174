// What is in a checkpoint root, for users and tools alike: its checkpoints
// with their state, the latest and the latest valid one, full verification,
// garbage collection, retention, and a checkpoint's tensor list. The `ferry`
// CLI (ls, inspect, verify, gc) and the C ABI's catalog calls are built on it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ferry/export_macro.hpp"
#include "ferry/filesystem.hpp"
#include "ferry/status.hpp"
#include "ferry/tensor.hpp"

namespace ferry {

// What an entry of a root is (docs/format.md names each kind of directory).
enum class CheckpointState {
  committed,  // step-N with a readable MANIFEST: loadable by name
  pending,    // .pending-N-...: a save not (yet) committed; gc takes it once its lease expires
  displaced,  // .displaced-N-...: a step an overwrite moved aside; gc puts back or removes it
  corrupt,    // step-N whose MANIFEST cannot be read (status says why): never chosen as latest
};
// "committed", "pending", "displaced", "corrupt".
FERRY_EXPORT const char* checkpoint_state_name(CheckpointState s);

// The lease a pending save keeps on its directory.
struct PendingLease {
  int64_t expires_unix_ms = 0;
  std::string owner;
};

struct CheckpointInfo {
  std::string path;  // ROOT/step-..., ROOT/.pending-..., ROOT/.displaced-...
  CheckpointState state = CheckpointState::committed;
  uint64_t step = 0;
  uint64_t commit_seq = 0;   // committed only
  uint64_t bytes = 0;        // data bytes (manifest), committed only
  uint64_t tensors = 0;      // committed only
  bool latest_hint = false;  // LATEST names it
  Status status;             // corrupt: why its manifest could not be read
  // Pending only: its lease (has_lease false when none is readable) and the
  // directory's mtime, which gc goes by when there is no lease.
  bool has_lease = false;
  PendingLease lease;
  int64_t mtime_unix_ms = 0;
};

// Full verification of one checkpoint (Catalog::verify).
struct FERRY_EXPORT VerifyReport {
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

// What garbage collection did (Catalog::gc).
struct GcReport {
  std::vector<std::string> removed;   // pending dirs whose lease expired
  std::vector<std::string> kept;      // pending dirs still leased
  std::vector<std::string> restored;  // displaced steps put back (nothing replaced them)
  // Leftovers nobody owns: trash, displaced entries that were replaced or
  // are no checkpoint of their step, and LATEST temp files of a killed write.
  std::vector<std::string> discarded;
  // Out of sight but not deleted (a file that cannot be unlinked), and so
  // not in `discarded`: each error names its directory, which the next gc
  // tries again.
  struct Failed {
    std::string path;
    Status status;
  };
  std::vector<Failed> failed;
};

// A checkpoint's index as Catalog::manifest reads it.
struct ManifestChunkInfo {
  std::vector<int64_t> offsets;  // in the global tensor
  std::vector<int64_t> sizes;
  uint32_t file = 0;  // index into CheckpointManifest::files
  uint64_t byte_offset = 0;
  uint64_t byte_length = 0;  // stored bytes
  uint64_t raw_bytes = 0;    // bytes once decoded (numel x dtype size)
  std::string codec;         // "" = raw
  uint64_t frame_bytes = 0;  // compressed: raw bytes per frame
  uint64_t frames = 0;
  std::vector<uint64_t> checksums;  // xxh3-64 per checksum block; empty: saved without
};

struct ManifestTensorInfo {
  std::string key;
  DType dtype = DType::f32;
  std::vector<int64_t> global_shape;
  std::vector<ManifestChunkInfo> chunks;
  uint64_t bytes = 0;      // stored bytes of all its chunks
  uint64_t raw_bytes = 0;  // decoded bytes of all its chunks
};

struct ManifestFileInfo {
  std::string name;
  uint64_t size = 0;
  int32_t rank = 0;
  // With ManifestOptions::check_headers: the data file's safetensors header
  // and size against the manifest (the error names the file).
  Status header;
};

struct CheckpointManifest {
  std::string path;  // the checkpoint directory
  uint64_t step = 0;
  uint64_t commit_seq = 0;
  int32_t world_size = 1;
  std::string job_id;
  std::string checkpoint_id;
  bool fsynced = true;
  uint64_t checksum_block_bytes = 0;
  int64_t created_unix_ms = 0;
  uint64_t bytes = 0;  // stored data bytes
  std::vector<ManifestFileInfo> files;
  std::vector<ManifestTensorInfo> tensors;                    // sorted by key
  std::vector<std::pair<std::string, std::string>> metadata;  // user key/values
  // Whether every tensor's chunks cover it (export and verify refuse one
  // that does not; the error names the tensor).
  Status coverage;
};

struct ManifestOptions {
  bool check_headers = false;  // read each data file's header (ManifestFileInfo::header)
};

struct ListOptions {
  // Also list pending and displaced entries (after the committed and
  // corrupt ones, each group in name order).
  bool include_uncommitted = true;
};

struct GcOptions {
  int64_t now_unix_ms = 0;  // 0: the clock's now
  int64_t grace_ms =
      60'000;  // a pending dir without a readable lease waits this long after its mtime
  int64_t lock_wait_ms = 30'000;
};

// Every call takes a root (or a checkpoint path) and goes through the
// filesystem given at construction, so a fault-injecting one sees every call.
// Readers first finish what an interrupted overwrite left (a step moved aside
// whose replacement never came), as loads do. Thread-safe: it holds no state
// but the filesystem.
class FERRY_EXPORT Catalog {
 public:
  Catalog();  // the POSIX filesystem
  explicit Catalog(std::shared_ptr<Filesystem> fs);

  // Step directories sorted by commit sequence (corrupt ones included, with
  // their status), then, with include_uncommitted, pending and displaced
  // entries. Symbolic links are never followed.
  Result<std::vector<CheckpointInfo>> list(const std::string& root,
                                           const ListOptions& o = {}) const;
  // The committed checkpoint with the highest commit sequence whose manifest
  // decodes; not_found when there is none.
  Result<CheckpointInfo> latest(const std::string& root) const;
  // The newest committed checkpoint that verifies completely (walking back
  // past damaged ones); not_found when none does.
  Result<CheckpointInfo> latest_valid(const std::string& root) const;
  // What `path` means: a checkpoint directory, or a root (its latest). A
  // pending or displaced directory is refused: it is not committed.
  Result<std::string> resolve(const std::string& path) const;
  // Reads every byte of the checkpoint at `path` (resolve) against its
  // manifest. An error only when the manifest cannot be read; damage is in
  // the report's problems, each naming the file.
  Result<VerifyReport> verify(const std::string& path) const;
  // The manifest of the checkpoint at `path` (resolve).
  Result<CheckpointManifest> manifest(const std::string& path, const ManifestOptions& o = {}) const;
  // Under the root's lock: puts back displaced steps nothing replaced and
  // removes expired pending directories and leftovers (docs/format.md).
  Result<GcReport> gc(const std::string& root, const GcOptions& o = {}) const;
  // Keeps the keep_last newest loadable committed checkpoints and deletes
  // older loadable ones (0 keeps all); returns the removed paths.
  Result<std::vector<std::string>> apply_retention(const std::string& root,
                                                   uint32_t keep_last) const;

  // True for the names Ferry gives entries of a root: step, pending,
  // displaced and trash directories, LATEST and its temp files.
  static bool is_ferry_entry_name(const std::string& name);

 private:
  std::shared_ptr<Filesystem> fs_;
};

}  // namespace ferry
