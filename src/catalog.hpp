// What is in a checkpoint root: committed checkpoints, the latest one,
// pending directories and their leases, retention and garbage collection.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/catalog.hpp"
#include "ferry/filesystem.hpp"
#include "ferry/status.hpp"
#include "manifest.hpp"
#include "manifest_cache.hpp"

namespace ferry {

constexpr char kLatestFileName[] = "LATEST";
constexpr char kLeaseFileName[] = "LEASE";
// ROOT/.ferry-lock: the advisory lock that serializes commits, retention
// and gc of one root across jobs (docs/format.md).
constexpr char kRootLockFileName[] = ".ferry-lock";
// How long a commit waits for another job's commit before it fails.
constexpr int64_t kDefaultLockWaitMs = 30'000;

std::string step_dir_name(uint64_t step);  // "step-00001000"
// The pending directory of a save: ".pending-00001000-<job>-<id>"
std::string pending_dir_name(uint64_t step, const std::string& job, const std::string& id);
bool is_pending_dir_name(const std::string& name);
// Parses "step-<digits>"; false for anything else.
bool parse_step_dir_name(const std::string& name, uint64_t* step);
// A step moved aside by an overwrite: ".displaced-00001000-<tag>". Each of
// Ferry's own kinds of directory has its own prefix, so no job id (which
// only ever appears after ".pending-") can make one look like another.
std::string displaced_dir_name(uint64_t step, const std::string& tag);
// True for ".displaced-<digits>-..." (setting *step) and for the names of
// older versions (".pending-<digits>-replaced-..."); see collect_garbage for
// how the old form is told apart from a job named "replaced".
bool parse_displaced_dir_name(const std::string& name, uint64_t* step);
// Directories on their way to deletion: ".trash-<unique>". Never read.
std::string trash_dir_name();
bool is_trash_dir_name(const std::string& name);

// Takes ROOT's lock (kRootLockFileName), waiting up to wait_ms; busy names
// the root and the holder. Released when the returned object is destroyed.
Result<std::unique_ptr<FileLock>> lock_root(Filesystem& fs, const std::string& root,
                                            int64_t wait_ms = kDefaultLockWaitMs);

// CheckpointInfo, PendingLease and GcReport are the public catalog's
// (ferry/catalog.hpp); these functions fill them. Those that take a
// ManifestCache remember in it what they learned of manifests (a runtime
// passes its own); without one they read every manifest they need.

// Committed checkpoints (step-* directories), sorted by commit sequence.
// Pending directories are never listed. Unreadable manifests (and step
// directories that are symbolic links, never followed) are listed with
// their status set and state corrupt (so `ferry ls` can show them) and never chosen as latest.
// Like find_latest and resolve_checkpoint, it first finishes what an
// interrupted overwrite left (finish_interrupted_overwrites).
Result<std::vector<CheckpointInfo>> list_checkpoints(Filesystem& fs, const std::string& root,
                                                     ManifestCache* cache = nullptr);

// The highest commit sequence of the committed checkpoints in `root` (0 if
// none), for the next commit to exceed. Unreadable manifests count for
// nothing, as in list_checkpoints. With a cache, neither this nor find_latest
// decodes every manifest: each is summarized (ManifestSummary) once per cache,
// and after that known by the first 4 KiB of its file, so commits and loads
// do not slow down as checkpoints accumulate.
Result<uint64_t> highest_commit_seq(Filesystem& fs, const std::string& root,
                                    ManifestCache* cache = nullptr);

// The committed checkpoint with the highest commit sequence whose manifest
// decodes, or not_found.
Result<CheckpointInfo> find_latest(Filesystem& fs, const std::string& root,
                                   ManifestCache* cache = nullptr);

// What a caller means by `path`: a checkpoint directory (it holds a
// MANIFEST), or a root (then its latest checkpoint). A pending directory is
// refused even when it holds a manifest: it was never committed.
Result<std::string> resolve_checkpoint(Filesystem& fs, const std::string& path,
                                       ManifestCache* cache = nullptr);

// Reads and decodes ROOT/.../MANIFEST (corruption names the path).
Result<Manifest> read_manifest(Filesystem& fs, const std::string& checkpoint_dir,
                               ManifestCache* cache = nullptr);

// The manifest of checkpoint DIR whose MANIFEST file holds `bytes`, decoded
// once per `cache` owner (ManifestCache::manifest) for ferry_manifest_open
// on a runtime and its loads: the bytes' frame and payload checksum are
// checked each time (summarize_manifest), so a manifest replaced or changed
// on disk is decoded again, never served stale. Null cache: decoded here.
Result<std::shared_ptr<const Manifest>> decode_manifest_shared(std::string_view bytes,
                                                               const std::string& dir,
                                                               ManifestCache* cache);
// read_manifest through decode_manifest_shared.
Result<std::shared_ptr<const Manifest>> read_manifest_shared(Filesystem& fs,
                                                             const std::string& checkpoint_dir,
                                                             ManifestCache* cache);

// Tells `cache` (null: nothing) of the manifest a commit just wrote to
// CHECKPOINT_DIR, `file_bytes` long, whose first bytes (its frame at least)
// are `head`: the next commits number themselves and retire checkpoints
// without decoding it.
// `total_bytes`: m.total_bytes() where the caller knows it (0: counted here,
// a walk over every chunk).
void remember_committed(Filesystem& fs, const std::string& checkpoint_dir, const Manifest& m,
                        std::string_view head, uint64_t file_bytes, ManifestCache* cache,
                        uint64_t total_bytes = 0);

// Lease: a text file holding the expiry time (unix ms) and the owner.
Status write_lease(Filesystem& fs, const std::string& pending_dir, int64_t expires_unix_ms,
                   const std::string& owner);

// not_found when there is no LEASE; corruption when it is not a lease.
Result<PendingLease> read_lease(Filesystem& fs, const std::string& pending_dir);

// A pending directory as `ferry ls` shows it.
struct PendingInfo {
  std::string path;
  bool has_lease = false;  // a readable LEASE
  PendingLease lease;
  int64_t mtime_unix_ms = 0;
};
Result<std::vector<PendingInfo>> list_pending(Filesystem& fs, const std::string& root);

// Under ROOT's lock (waiting up to lock_wait_ms): puts back every displaced
// step that nothing replaced (recover_displaced), and takes out of sight (renamed to a trash
// name, then ROOT fsynced) every pending directory whose lease expired
// before now_unix_ms (one without a readable lease counts as expired only
// when its mtime is older than grace_ms), every replaced displaced step and
// LATEST temp file. The lock released, deletes the trash: a directory that
// cannot be deleted is reported in `failed` and the others still go.
// With !restore_displaced (a save's own gc) displaced steps are left for
// the commit to put back, which then spares them from its retention.
Result<GcReport> collect_garbage(Filesystem& fs, const std::string& root, int64_t now_unix_ms,
                                 int64_t grace_ms = 60'000,
                                 int64_t lock_wait_ms = kDefaultLockWaitMs,
                                 bool restore_displaced = true);

// Renames each displaced step whose step directory is absent back into
// place (fsyncing ROOT after; none when !restore), and reports garbage in
// *garbage: displaced entries that were replaced, and those that are no
// checkpoint of their step (a file, a link, a directory without a MANIFEST
// of that step), which are never put back. REQUIRES: ROOT's lock is held (an
// overwrite in flight has its old step aside on purpose).
Status recover_displaced(Filesystem& fs, const std::string& root,
                         std::vector<std::string>* restored, std::vector<std::string>* garbage,
                         bool restore = true);

// What every reader of a root calls first: when a step that an overwrite
// moved aside has no step directory in its place (the overwrite died between
// its two renames), takes ROOT's lock (waiting up to lock_wait_ms for an
// overwrite in flight to finish) and puts it back; returns the steps put
// back. Without such a step it neither locks nor writes. Safe to run in
// several processes at once: each puts back only what is still aside under
// the lock. An error (the lock could not be taken) names the step aside.
// REQUIRES: ROOT's lock is not held by this thread.
Result<std::vector<std::string>> finish_interrupted_overwrites(
    Filesystem& fs, const std::string& root, int64_t lock_wait_ms = kDefaultLockWaitMs);

// True when an overwrite of `step` died with the old step aside (so the step
// exists, though not in place). Lock-free.
Result<bool> overwrite_pending_for(Filesystem& fs, const std::string& root, uint64_t step);

// What retention took out of sight: the committed checkpoints it retired
// (their step paths) and the trash directories they now are, still to be
// deleted (remove_all; gc deletes leftovers).
struct Retired {
  std::vector<std::string> checkpoints;
  std::vector<std::string> trash;
};

// Keeps the `keep_last` newest loadable committed checkpoints (by commit
// sequence; loadable: the manifest reads and every file it names is there
// with its size) and renames older loadable ones to trash names, then
// fsyncs ROOT once: they are durably out of sight, but their bytes are
// still on disk. 0 keeps all. `keep_path` (the checkpoint just committed)
// is never retired, nor any path in `spare` (steps the caller's commit put
// back: a job that did not know of them must not lose them to its own
// save). Checkpoints that are not loadable are left for the user to see.
// REQUIRES: ROOT's lock is held when other jobs may commit into ROOT.
// `cache` (its owner's): each manifest is decoded once, then known by its head.
Result<Retired> retire_checkpoints(Filesystem& fs, const std::string& root, uint32_t keep_last,
                                   const std::string& keep_path = "",
                                   const std::vector<std::string>& spare = {},
                                   ManifestCache* cache = nullptr);

// retire_checkpoints under ROOT's lock (waiting up to lock_wait_ms, as a
// commit does: a commit running meanwhile must not see checkpoints vanish
// while it numbers its own); the lock released, deletes the trash. Returns
// the retired paths.
Result<std::vector<std::string>> apply_retention(Filesystem& fs, const std::string& root,
                                                 uint32_t keep_last,
                                                 const std::string& keep_path = "",
                                                 int64_t lock_wait_ms = kDefaultLockWaitMs);

int64_t now_unix_ms();

}  // namespace ferry
