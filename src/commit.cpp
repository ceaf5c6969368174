#include "ferry/commit.hpp"

#include <algorithm>
#include <map>

#include "ferry/catalog.hpp"
#include "ferry/kill_point.hpp"

namespace ferry {

Result<Manifest> assemble_manifest(const ManifestHeader& header,
                                   const std::vector<WriteResult>& results) {
  Manifest m;
  m.step = header.step;
  m.world_size = header.world_size;
  m.job_id = header.job_id;
  m.checkpoint_id = header.checkpoint_id;
  m.fsynced = header.fsynced;
  m.checksum_block_bytes = header.checksum_block_bytes;
  m.metadata = header.metadata;
  m.created_unix_ms = now_unix_ms();

  std::map<std::string, size_t> tensor_index;
  for (size_t r = 0; r < results.size(); ++r) {
    const WriteResult& wr = results[r];
    if (wr.rank != static_cast<int32_t>(r))
      return Status::internal("write result " + std::to_string(r) + " is from rank " +
                              std::to_string(wr.rank));
    const uint32_t file_base = static_cast<uint32_t>(m.files.size());
    for (const WrittenFile& f : wr.files)
      m.files.push_back({f.name, f.size, wr.rank, f.header_bytes, f.header_checksum});
    for (const WrittenChunk& c : wr.chunks) {
      if (c.file >= wr.files.size())
        return Status::internal("rank " + std::to_string(wr.rank) + " reported chunk of '" + c.key +
                                "' in unknown file " + std::to_string(c.file));
      auto [it, fresh] = tensor_index.emplace(c.key, m.tensors.size());
      if (fresh) m.tensors.push_back({c.key, c.dtype, c.global_shape, {}});
      ManifestTensor& t = m.tensors[it->second];
      if (t.dtype != c.dtype || t.global_shape != c.global_shape)
        return Status::invalid_argument("tensor '" + c.key +
                                        "' reported with different dtype or "
                                        "global shape by rank " +
                                        std::to_string(wr.rank));
      t.chunks.push_back({c.box.offsets, c.box.sizes, file_base + c.file, c.byte_offset,
                          c.byte_length, c.entry, c.checksums});
    }
  }
  std::sort(m.tensors.begin(), m.tensors.end(),
            [](const ManifestTensor& a, const ManifestTensor& b) { return a.key < b.key; });
  for (ManifestTensor& t : m.tensors)
    std::sort(t.chunks.begin(), t.chunks.end(),
              [](const ManifestChunk& a, const ManifestChunk& b) { return a.offsets < b.offsets; });
  return m;
}

Status prepare_pending(Filesystem& fs, const std::string& root, const std::string& pending_dir,
                       uint64_t step, bool overwrite, int64_t lease_ms, const std::string& owner,
                       bool fsync) {
  if (!fs.stat(root).ok()) {
    FERRY_RETURN_IF_ERROR(fs.mkdirs(root));
    // Without this a power cut can take the new ROOT, and with it the first
    // checkpoint committed into it.
    if (fsync) FERRY_RETURN_IF_ERROR(fs.sync_dir(parent_path(root)));
  }
  const std::string step_dir = join_path(root, step_dir_name(step));
  if (!overwrite && fs.stat(step_dir).ok())
    return Status::already_exists("checkpoint " + step_dir +
                                  " already exists (save with overwrite to replace it)");
  FERRY_RETURN_IF_ERROR(fs.mkdir(pending_dir));
  FERRY_RETURN_IF_ERROR(write_lease(fs, pending_dir, now_unix_ms() + lease_ms, owner));
  kill_point("pending.created");
  return Status();
}

Result<CommitOutcome> commit_checkpoint(Filesystem& fs, const std::string& root,
                                        const std::string& pending_dir, Manifest manifest,
                                        const CommitOptions& opts) {
  // The sequence must exceed every committed one, so "latest" is well defined
  // even when steps go backwards (a job restarted from an older checkpoint).
  uint64_t seq = 0;
  FERRY_ASSIGN_OR_RETURN(auto existing, list_checkpoints(fs, root));
  for (const auto& c : existing) seq = std::max(seq, c.commit_seq);
  manifest.commit_seq = seq + 1;
  manifest.fsynced = opts.fsync;

  FERRY_RETURN_IF_ERROR(write_file_atomic(fs, join_path(pending_dir, kManifestFileName),
                                          encode_manifest(manifest), opts.fsync, "manifest"));

  const std::string name = step_dir_name(manifest.step);
  const std::string step_dir = join_path(root, name);
  std::string displaced;
  if (fs.stat(step_dir).ok()) {
    if (!opts.overwrite)
      return Status::already_exists("checkpoint " + step_dir + " was committed by another save");
    // rename(2) cannot replace a non-empty directory: move the old one aside
    // first; it stays a pending-style name so it is never listed or loaded.
    displaced =
        join_path(root, pending_dir_name(manifest.step, "replaced", manifest.checkpoint_id));
    FERRY_RETURN_IF_ERROR(fs.rename(step_dir, displaced));
  }
  FERRY_RETURN_IF_ERROR(fs.rename(pending_dir, step_dir));  // the commit point
  kill_point("commit.rename");
  // The lease protected the save while it was pending (a crash before the
  // rename leaves a directory gc may take once it expires); a committed
  // directory needs none. Not in the manifest, so a leftover is harmless.
  (void)fs.unlink(join_path(step_dir, kLeaseFileName));
  CommitOutcome out{step_dir, manifest.commit_seq, {}};
  if (opts.fsync) FERRY_RETURN_IF_ERROR(fs.sync_dir(root));
  kill_point("root.fsync");
  FERRY_RETURN_IF_ERROR(
      write_file_atomic(fs, join_path(root, kLatestFileName), name + "\n", opts.fsync, "latest"));
  if (!displaced.empty()) FERRY_RETURN_IF_ERROR(remove_all(fs, displaced));
  FERRY_ASSIGN_OR_RETURN(out.retired, apply_retention(fs, root, opts.keep_last));
  return out;
}

}  // namespace ferry
