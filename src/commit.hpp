// What writers report, how the coordinator turns reports into a manifest, and
// the commit protocol itself (docs/format.md), as plain functions over
// the Filesystem interface so that faults can be injected under them.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "box.hpp"
#include "catalog.hpp"
#include "ferry/filesystem.hpp"
#include "ferry/status.hpp"
#include "ferry/tensor.hpp"
#include "layout.hpp"
#include "manifest.hpp"

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
  // A compressed chunk (see ManifestChunk): codec "" means raw.
  std::string codec;
  uint64_t raw_length = 0;
  uint64_t frame_bytes = 0;
  std::vector<uint64_t> frame_ends;
};

struct WrittenFile {
  std::string name;
  uint64_t size = 0;
  uint64_t header_bytes = 0;
  uint64_t header_checksum = 0;
};

// A rank's hash of one replicated item's bytes (replica_check.hpp).
struct ReplicaDigest {
  std::string key;
  std::vector<int64_t> offsets;  // the item's box origin: with the key, its replica group
  uint64_t digest = 0;
  bool sampled = false;  // covers a sample of the bytes, not all of them
};

// One rank's report after its files and the pending directory are durable.
struct WriteResult {
  int32_t rank = 0;
  std::vector<WrittenFile> files;
  std::vector<WrittenChunk> chunks;
  double snapshot_ms = 0;
  double write_ms = 0;
  uint64_t bytes = 0;
  double ready_ms = 0;                         // save_async -> files and directory durable
  std::vector<ReplicaDigest> replica_digests;  // its replicated items, unless replica-check = off
  // Names the rank's files and chunks as laid out (keys, boxes, entries,
  // file names); 0: unnamed. With `repeat`, the report is the one rank 0
  // kept for this layout (ManifestSkeleton::parts) with new sizes: `chunks`
  // stays empty, each chunk's byte range is in `laid_out` (the planner's
  // layouts, shared) and its checksums in `sums` (the serializer's, moved),
  // so a repeated save builds nothing per chunk for its report. Only sent in
  // process (rank 0's own report): the wire carries whole reports.
  uint64_t layout = 0;
  bool repeat = false;
  std::shared_ptr<const std::vector<FileLayout>> laid_out;  // [file], with `repeat`
  std::vector<std::vector<std::vector<uint64_t>>> sums;     // [file][chunk][block]; empty: none

  // The chunks it reports, in either form.
  size_t chunk_count() const;
};

// Merges the ranks' reports (results[r].rank == r) into `header`, a manifest
// whose header fields the caller set (step, world size, ids, fsynced,
// checksum block, metadata): files renumbered globally, tensors sorted by
// key, chunks sorted by offsets, the codec's required feature, the creation
// time. commit_seq is filled in by commit_checkpoint.
// REQUIRES: header has no files and no tensors.
Result<Manifest> assemble_manifest(Manifest header, const std::vector<WriteResult>& results);

// The manifest of the last commit, kept to be refilled in place by the next
// one of the same shape (same ranks, files, tensors, boxes and entries, no
// codec): saves that repeat then allocate nothing per chunk here.
struct ManifestSkeleton {
  bool valid = false;
  Manifest manifest;
  std::vector<std::pair<uint32_t, uint32_t>> slots;  // [chunk, ranks in order]: tensor, chunk
  // [chunk, ranks in order]: the manifest's chunk, and its place among the
  // manifest's chunks tensor by tensor (the encoder's chunk index:
  // ManifestEncoder::put_chunk). A refill walks these in order, asking for
  // what lies ahead without a walk through the tensors.
  struct Place {
    ManifestChunk* chunk = nullptr;
    size_t index = 0;
  };
  std::vector<Place> places;
  struct Part {
    uint64_t layout = 0;  // WriteResult::layout of the rank's report it holds
    size_t files = 0, chunks = 0;
  };
  std::vector<Part> parts;  // [rank]
  // The manifest passed check_manifest_before_commit and its last refill
  // changed no byte range, file size or checksum count: the check would pass
  // again (the caller sets it once checked).
  bool checked = false;
  // The last commit's encoded manifest, rewritten in place by the next one
  // of the same shape (CommitOptions::encoder).
  ManifestEncoder encoder;
  // Names the manifest's tensors as assembled (ManifestEncoder's `body`): a
  // refill changes only their chunks' byte ranges and checksums, so it
  // keeps the value; a manifest assembled afresh gets a new one. 0 while
  // not valid.
  uint64_t body = 0;
  // manifest.total_bytes(), counted as the manifest is (re)filled.
  uint64_t total_bytes = 0;
};

// assemble_manifest(header, results), built in `skeleton` (refilled when the
// shape is the one it holds, else built afresh and kept). The manifest is
// the skeleton's, valid until its next use. A `repeat` report is read
// against the skeleton: an error when it does not hold that rank's layout.
// Its chunks' byte ranges and checksums may be in the skeleton's encoder
// only (a refill writes them into the kept message): encoded through that
// encoder with the skeleton's body they are there; whoever reads them from
// the manifest itself calls sync_chunks first.
Result<Manifest*> assemble_manifest_into(ManifestSkeleton& skeleton, const Manifest& header,
                                         std::vector<WriteResult>& results);
// Brings the skeleton's manifest's chunk values up to date from its encoder.
void sync_chunks(ManifestSkeleton& skeleton);

struct CommitOptions {
  bool fsync = true;
  bool overwrite = false;
  uint32_t keep_last = 0;
  // The owner written into the pending directory's lease by prepare_pending
  // and the lease refreshes. The commit refuses a directory whose lease is
  // another owner's or has expired: a save that could not keep its lease
  // fresh may have lost its files to gc and must fail, not commit.
  std::string lease_owner;
  // The clock (unix ms) the lease is checked and renewed against; empty
  // reads the system clock.
  std::function<int64_t()> clock = nullptr;
  // When > 0, a lease that holds when the commit begins is renewed for this
  // long before the manifest is written, so the commit's own time cannot
  // make it lapse; the check before the commit rename still applies.
  int64_t renew_lease_ms = 0;
  // How long to wait for another job's commit in the same root (ROOT's
  // lock) before failing with busy.
  int64_t lock_wait_ms = 30'000;
  // What the committer knows of the root's manifests (its runtime's); null:
  // each commit reads every committed manifest to number itself.
  ManifestCache* manifests = nullptr;
  // Encodes the manifest, keeping its message for the next commit (a
  // repeated save's manifest is rewritten in place); null: encoded afresh.
  ManifestEncoder* encoder = nullptr;
  // With `encoder`: names the manifest's tensors for it (ManifestSkeleton::body).
  uint64_t body = 0;
  // The manifest's total_bytes() where the caller knows it (a
  // ManifestSkeleton's); 0: counted, a walk over every chunk.
  uint64_t total_bytes = 0;
};

struct CommitOutcome {
  std::string path;  // ROOT/step-...
  uint64_t commit_seq = 0;
  std::vector<std::string> retired;  // taken out of sight by retention
  // Directories already out of sight (retired checkpoints, an overwritten
  // step) whose bytes the caller deletes (remove_all) once the save has
  // reported, so that deleting never delays a commit; gc deletes whatever
  // a crash leaves of them.
  std::vector<std::string> trash;
  // Failures after the commit point (ROOT fsync, LATEST, retention): the
  // checkpoint is committed and is what load picks; these are reported to
  // the caller as warnings, never as a failed save.
  std::vector<Status> warnings;
  // Steps an overwrite that died had left aside, put back by this commit
  // and spared by its retention.
  std::vector<std::string> restored;
};

// REQUIRES: every rank's data files in `pending_dir` are durable.
// Under ROOT's lock (kRootLockFileName; so the sequence number is unique and
// increasing across jobs): puts back a step a crashed overwrite left aside,
// picks the sequence number, writes MANIFEST (temp, fsync, rename, fsync
// dir), checks that every file the manifest names is a regular file of its
// recorded size and that the LEASE is opts.lease_owner's (when set) and
// unexpired, moves an overwritten step aside, renames the pending directory
// to its step directory (the commit point; on failure the old step is put
// back), fsyncs ROOT, replaces LATEST, moves the old step to trash, then
// retires checkpoints past keep_last (never the new one, nor a step put back
// at its start) to trash: see
// CommitOutcome::trash. On an object root the MANIFEST goes straight to
// ROOT/step-N/MANIFEST, created only if absent (replaced with overwrite),
// after the files and the lease are checked: that is the commit point, and
// its file names carry the save's prefix. An error (returned) means nothing became
// visible and the commit point was not passed; the caller removes the
// pending directory. After the commit point the result is always ok, with
// later failures in CommitOutcome::warnings.
Result<CommitOutcome> commit_checkpoint(Filesystem& fs, const std::string& root,
                                        const std::string& pending_dir, Manifest manifest,
                                        const CommitOptions& opts);
// The same, filling in the caller's manifest (commit_seq, fsynced) in place.
Result<CommitOutcome> commit_checkpoint_in_place(Filesystem& fs, const std::string& root,
                                                 const std::string& pending_dir, Manifest* manifest,
                                                 const CommitOptions& opts);

// Where a save writes its data files until the commit: ROOT/.pending-...
// (renamed to its step directory by the commit), or on an object root
// (s3://) ROOT/step-N/save-<job>-<unique>, a prefix of the save's own under
// the step: S3 has no rename, so the files stay where they were written and
// the MANIFEST names them through that prefix. A racing or overwriting save
// never writes over another's files.
std::string pending_path(const std::string& root, uint64_t step, const std::string& job,
                         const std::string& unique);

// Creates ROOT (if needed) and the pending directory with its lease. Fails
// with already_exists naming the step directory when the step exists and
// `overwrite` is false.
// Every directory created here (ROOT and any missing parents) is made durable
// in its parent when `fsync` is set. On failure it removes only what it
// created itself: never a directory that existed before the call.
// First it collects the root's garbage, best effort and without waiting for
// its lock, leaving displaced steps for the commit to put back; the
// leftovers that gc could not delete go to *undeleted.
Status prepare_pending(Filesystem& fs, const std::string& root, const std::string& pending_dir,
                       uint64_t step, bool overwrite, int64_t lease_ms, const std::string& owner,
                       bool fsync = true, std::vector<GcReport::Failed>* undeleted = nullptr);

}  // namespace ferry
