// The public catalog (ferry/catalog.hpp): the internal catalog, verifier and
// manifest reader behind one class.
#include <algorithm>
#include <cstdlib>

#include "catalog.hpp"
#include "ferry/catalog.hpp"
#include "manifest.hpp"
#include "object_fs.hpp"
#include "verify.hpp"

namespace ferry {
namespace {

// Pending and displaced entries, in name order, after the committed ones.
Status add_uncommitted(Filesystem& fs, const std::string& root, std::vector<CheckpointInfo>* out) {
  FERRY_ASSIGN_OR_RETURN(std::vector<PendingInfo> pending, list_pending(fs, root));
  std::sort(pending.begin(), pending.end(),
            [](const PendingInfo& a, const PendingInfo& b) { return a.path < b.path; });
  for (PendingInfo& p : pending) {
    CheckpointInfo info;
    info.path = std::move(p.path);
    info.state = CheckpointState::pending;
    // ".pending-<step>-...": pending_dir_name's form.
    const std::string name = info.path.substr(info.path.find_last_of('/') + 1);
    info.step = std::strtoull(name.c_str() + 9, nullptr, 10);
    info.has_lease = p.has_lease;
    info.lease = std::move(p.lease);
    info.mtime_unix_ms = p.mtime_unix_ms;
    out->push_back(std::move(info));
  }
  FERRY_ASSIGN_OR_RETURN(std::vector<std::string> names, fs.list(root));
  std::sort(names.begin(), names.end());
  for (const std::string& name : names) {
    uint64_t step = 0;
    // The old form of a displaced name is a pending one: listed above.
    if (is_pending_dir_name(name) || !parse_displaced_dir_name(name, &step)) continue;
    CheckpointInfo info;
    info.path = join_path(root, name);
    info.state = CheckpointState::displaced;
    info.step = step;
    Result<FileInfo> st = fs.lstat(info.path);
    if (st.ok()) info.mtime_unix_ms = st->mtime_unix_ms;
    out->push_back(std::move(info));
  }
  return Status();
}

ManifestChunkInfo chunk_info(const ManifestChunk& c) {
  ManifestChunkInfo out;
  out.offsets = c.offsets;
  out.sizes = c.sizes;
  out.file = c.file;
  out.byte_offset = c.byte_offset;
  out.byte_length = c.byte_length;
  out.raw_bytes = c.raw_bytes();
  out.codec = c.codec;
  out.frame_bytes = c.frame_bytes;
  out.frames = c.frame_ends.size();
  out.checksums = c.checksums;
  return out;
}

}  // namespace

const char* checkpoint_state_name(CheckpointState s) {
  switch (s) {
    case CheckpointState::committed:
      return "committed";
    case CheckpointState::pending:
      return "pending";
    case CheckpointState::displaced:
      return "displaced";
    case CheckpointState::corrupt:
      return "corrupt";
  }
  return "unknown";
}

namespace {

// The local filesystem, and s3:// roots with the S3 settings of the config
// file and FERRY_CONFIG.
std::shared_ptr<Filesystem> default_filesystem() {
  return with_object_roots(posix_filesystem(), [] {
    Result<Options> o = load_options({}, "");
    return s3_store_options(o.ok() ? *o : Options{});
  });
}

}  // namespace

Catalog::Catalog() : fs_(default_filesystem()) {}

Catalog::Catalog(std::shared_ptr<Filesystem> fs) : fs_(fs ? std::move(fs) : posix_filesystem()) {}

Result<std::vector<CheckpointInfo>> Catalog::list(const std::string& root,
                                                  const ListOptions& o) const {
  const RootHold hold(fs_, root);
  FERRY_ASSIGN_OR_RETURN(std::vector<CheckpointInfo> out, list_checkpoints(*fs_, root));
  if (o.include_uncommitted) FERRY_RETURN_IF_ERROR(add_uncommitted(*fs_, root, &out));
  return out;
}

Result<CheckpointInfo> Catalog::latest(const std::string& root) const {
  const RootHold hold(fs_, root);
  return find_latest(*fs_, root);
}

Result<CheckpointInfo> Catalog::latest_valid(const std::string& root) const {
  const RootHold hold(fs_, root);
  return ferry::latest_valid(*fs_, root);
}

Result<std::string> Catalog::resolve(const std::string& path) const {
  const RootHold hold(fs_, path);
  return resolve_checkpoint(*fs_, path);
}

Result<VerifyReport> Catalog::verify(const std::string& path) const {
  const RootHold hold(fs_, path);
  FERRY_ASSIGN_OR_RETURN(std::string dir, resolve_checkpoint(*fs_, path));
  return verify_checkpoint(*fs_, dir);
}

Result<CheckpointManifest> Catalog::manifest(const std::string& path,
                                             const ManifestOptions& o) const {
  const RootHold hold(fs_, path);
  FERRY_ASSIGN_OR_RETURN(std::string dir, resolve_checkpoint(*fs_, path));
  FERRY_ASSIGN_OR_RETURN(Manifest m, read_manifest(*fs_, dir));
  CheckpointManifest out;
  out.step = m.step;
  out.commit_seq = m.commit_seq;
  out.world_size = m.world_size;
  out.job_id = m.job_id;
  out.checkpoint_id = m.checkpoint_id;
  out.fsynced = m.fsynced;
  out.checksum_block_bytes = m.checksum_block_bytes;
  out.created_unix_ms = m.created_unix_ms;
  out.bytes = m.total_bytes();
  out.metadata = m.metadata;
  out.coverage = check_manifest_coverage(m);
  out.files.reserve(m.files.size());
  for (uint32_t i = 0; i < m.files.size(); ++i) {
    ManifestFileInfo f;
    f.name = m.files[i].name;
    f.size = m.files[i].size;
    f.rank = m.files[i].rank;
    if (o.check_headers) f.header = check_data_file_header(*fs_, dir, i, m);
    out.files.push_back(std::move(f));
  }
  out.tensors.reserve(m.tensors.size());
  for (const ManifestTensor& t : m.tensors) {
    ManifestTensorInfo ti;
    ti.key = t.key;
    ti.dtype = t.dtype;
    ti.global_shape = t.global_shape;
    ti.chunks.reserve(t.chunks.size());
    for (const ManifestChunk& c : t.chunks) {
      ti.chunks.push_back(chunk_info(c));
      ti.bytes += c.byte_length;
      ti.raw_bytes += c.raw_bytes();
    }
    out.tensors.push_back(std::move(ti));
  }
  out.path = std::move(dir);
  return out;
}

Result<GcReport> Catalog::gc(const std::string& root, const GcOptions& o) const {
  const RootHold hold(fs_, root);
  return collect_garbage(*fs_, root, o.now_unix_ms ? o.now_unix_ms : now_unix_ms(), o.grace_ms,
                         o.lock_wait_ms);
}

Result<std::vector<std::string>> Catalog::apply_retention(const std::string& root,
                                                          uint32_t keep_last) const {
  const RootHold hold(fs_, root);
  return ferry::apply_retention(*fs_, root, keep_last);
}

bool Catalog::is_ferry_entry_name(const std::string& name) {
  uint64_t step = 0;
  return parse_step_dir_name(name, &step) || is_pending_dir_name(name) || is_trash_dir_name(name) ||
         parse_displaced_dir_name(name, &step) || name == kLatestFileName ||
         name.rfind(std::string(kLatestFileName) + ".tmp-", 0) == 0;
}

}  // namespace ferry
