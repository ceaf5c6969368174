#include "commit.hpp"

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <map>

#include "catalog.hpp"
#include "codec.hpp"
#include "crash_points.hpp"
#include "object_fs.hpp"

namespace ferry {

namespace {

const std::vector<uint64_t> kNoSums;  // a repeat report's chunks without checksums

// The one place a chunk as a rank reported it (protocol) becomes a chunk of
// the manifest; `file_base` turns the rank's file index into the manifest's.
// Assigned field by field, so a kept chunk reuses its vectors' memory.
void fill_chunk(ManifestChunk& m, const WrittenChunk& c, uint32_t file_base) {
  m.offsets = c.box.offsets;
  m.sizes = c.box.sizes;
  m.file = file_base + c.file;
  m.byte_offset = c.byte_offset;
  m.byte_length = c.byte_length;
  m.entry = c.entry;
  m.checksums = c.checksums;
  m.codec = c.codec;
  m.raw_length = c.raw_length;
  m.frame_bytes = c.frame_bytes;
  m.frame_ends = c.frame_ends;
}

ManifestChunk manifest_chunk(const WrittenChunk& c, uint32_t file_base) {
  ManifestChunk m;
  fill_chunk(m, c, file_base);
  return m;
}

// A repeat report's chunk that its layout says is compressed: the skeleton
// holds raw chunks only (the planner never reports such a layout as a repeat).
Status compressed_repeat(const WriteResult& wr) {
  return Status::internal(
      "rank " + std::to_string(wr.rank) + "'s repeated report does not match its layout " +
      std::to_string(wr.layout) + " (checksums of other files or chunks, or a compressed chunk)");
}

// Refills the skeleton's manifest from `results`; false (the manifest then
// half refilled, its keys, boxes and entries intact) when their shape is not
// the one it holds. A repeat report (checked against the skeleton already)
// brings only sizes and checksums; one that names a compressed chunk is an
// error (the skeleton is then dropped). Clears sk.checked when what
// check_manifest_before_commit looks at changed. Where the skeleton's
// encoder holds its message, each chunk's values go there in the same walk
// (ManifestEncoder::put_chunk), a repeat report's there only: the manifest's
// own vectors are not touched (sync_chunks brings them up to date).
Result<bool> refill(ManifestSkeleton& sk, const Manifest& header,
                    const std::vector<WriteResult>& results) {
  Manifest& m = sk.manifest;
  if (!sk.valid || !header.files.empty() || !header.tensors.empty() ||
      header.required_features != m.required_features || results.size() != sk.parts.size() ||
      sk.places.size() != sk.slots.size())
    return false;
  for (size_t r = 0; r < results.size(); ++r)
    if (results[r].rank != static_cast<int32_t>(r) ||
        results[r].files.size() != sk.parts[r].files ||
        results[r].chunk_count() != sk.parts[r].chunks)
      return false;
  ManifestEncoder& enc = sk.encoder;
  const std::vector<ManifestSkeleton::Place>& places = sk.places;
  bool put = enc.holds(sk.body);
  // Where the message cannot take a chunk's values (another checksum
  // count), the manifest takes them all from here on, after the newest
  // ones so far, the message's (it holds the body, so the shape fits).
  auto stop_putting = [&] {
    (void)enc.take_chunks(&m);
    enc.chunks_put(0);
    put = false;
  };
  bool same =
      header.checksum_block_bytes == m.checksum_block_bytes && header.world_size == m.world_size;
  size_t k = 0;
  uint32_t file_base = 0;
  uint64_t total = 0;
  for (const WriteResult& wr : results) {
    for (size_t i = 0; i < wr.files.size(); ++i) {
      const WrittenFile& f = wr.files[i];
      ManifestFile& mf = m.files[file_base + i];
      if (mf.name != f.name || mf.rank != wr.rank) return false;
      same = same && mf.size == f.size && mf.header_bytes == f.header_bytes;
      mf.size = f.size;
      mf.header_bytes = f.header_bytes;
      mf.header_checksum = f.header_checksum;
    }
    if (wr.repeat) {
      const std::vector<FileLayout>& files = *wr.laid_out;
      for (size_t f = 0; f < files.size(); ++f)
        for (size_t i = 0; i < files[f].chunks.size(); ++i, ++k) {
          // The layouts, the checksums and the message's chunks lie all
          // over memory: asked for ahead (far enough for a guest's memory,
          // reached through two levels of page tables), the walk is not one
          // cache miss after another (at 100,000 tensors it is bound by them).
          if (i + 16 < files[f].chunks.size()) {
            const char* ahead = reinterpret_cast<const char*>(&files[f].chunks[i + 16]);
            __builtin_prefetch(ahead + offsetof(LaidOutChunk, chunk.compressed));
            __builtin_prefetch(ahead + offsetof(LaidOutChunk, length));
            if (!wr.sums.empty()) __builtin_prefetch(wr.sums[f][i + 16].data());
          }
          const LaidOutChunk& lc = files[f].chunks[i];
          if (lc.chunk.compressed) {
            sk.valid = false;
            sk.body = 0;
            sk.checked = false;
            enc.chunks_put(0);
            return compressed_repeat(wr);
          }
          const std::vector<uint64_t>& sums = wr.sums.empty() ? kNoSums : wr.sums[f][i];
          total += lc.length;
          if (put) {
            if (k + 16 < places.size())
              enc.prefetch_chunk(places[k + 16].index,
                                 k + 32 < places.size() ? places[k + 32].index : SIZE_MAX);
            if (enc.put_chunk(places[k].index, lc.offset, lc.length, sums.data(), sums.size(),
                              &same))
              continue;
            stop_putting();
            same = false;
          }
          ManifestChunk& mc = *places[k].chunk;
          same = same && mc.byte_offset == lc.offset && mc.byte_length == lc.length &&
                 mc.checksums.size() == sums.size();
          mc.byte_offset = lc.offset;
          mc.byte_length = lc.length;
          mc.checksums = sums;  // assigned: the kept vector's memory is reused
        }
      file_base += static_cast<uint32_t>(wr.files.size());
      continue;
    }
    for (const WrittenChunk& c : wr.chunks) {
      const auto [ti, ci] = sk.slots[k];
      ManifestTensor& t = m.tensors[ti];
      ManifestChunk& mc = t.chunks[ci];
      if (!c.codec.empty()) return false;
      if (c.file >= wr.files.size() || mc.file != file_base + c.file || t.key != c.key ||
          t.dtype != c.dtype || t.global_shape != c.global_shape || mc.offsets != c.box.offsets ||
          mc.sizes != c.box.sizes || mc.entry != c.entry)
        return false;
      if (put && !enc.put_chunk(places[k].index, c.byte_offset, c.byte_length, c.checksums.data(),
                                c.checksums.size(), &same)) {
        stop_putting();
        same = false;
      }
      if (!put)
        same = same && mc.byte_offset == c.byte_offset && mc.byte_length == c.byte_length &&
               mc.checksums.size() == c.checksums.size();
      fill_chunk(mc, c, file_base);
      total += c.byte_length;
      ++k;
    }
    file_base += static_cast<uint32_t>(wr.files.size());
  }
  if (put) enc.chunks_put(sk.body);
  if (!same) sk.checked = false;
  sk.total_bytes = total;
  for (size_t r = 0; r < results.size(); ++r) sk.parts[r].layout = results[r].layout;
  // The header's fields, whatever they are; the body stays.
  std::vector<ManifestTensor> tensors = std::move(m.tensors);
  std::vector<ManifestFile> kept_files = std::move(m.files);
  m = header;
  m.tensors = std::move(tensors);
  m.files = std::move(kept_files);
  m.created_unix_ms = now_unix_ms();
  return true;
}

// A repeat report must be of the layout the skeleton holds for its rank
// (its chunks' codecs are checked as the refill meets them).
Status check_repeats(const ManifestSkeleton& sk, const std::vector<WriteResult>& results) {
  for (size_t r = 0; r < results.size(); ++r) {
    const WriteResult& wr = results[r];
    if (!wr.repeat) continue;
    if (!sk.valid || r >= sk.parts.size() || wr.layout == 0 || sk.parts[r].layout != wr.layout ||
        !wr.laid_out || sk.parts[r].files != wr.files.size() ||
        wr.laid_out->size() != wr.files.size() || sk.parts[r].chunks != wr.chunk_count())
      return Status::internal("rank " + std::to_string(wr.rank) +
                              " reported its files as laid out in its last save (layout " +
                              std::to_string(wr.layout) + "), which rank 0 does not hold");
    bool sums_fit = wr.sums.empty() || wr.sums.size() == wr.laid_out->size();
    for (size_t f = 0; sums_fit && !wr.sums.empty() && f < wr.sums.size(); ++f)
      sums_fit = wr.sums[f].size() == (*wr.laid_out)[f].chunks.size();
    if (!sums_fit) return compressed_repeat(wr);
  }
  return Status();
}

// Makes the repeat reports whole again from the skeleton (before it is
// built afresh for a save whose shape changed on another rank).
void expand_repeats(const ManifestSkeleton& sk, std::vector<WriteResult>& results) {
  const Manifest& m = sk.manifest;
  size_t k = 0;
  uint32_t file_base = 0;
  for (size_t r = 0; r < results.size() && r < sk.parts.size(); ++r) {
    WriteResult& wr = results[r];
    if (wr.repeat) {
      for (size_t i = 0; i < wr.files.size(); ++i) wr.files[i].name = m.files[file_base + i].name;
      wr.chunks.clear();
      wr.chunks.reserve(sk.parts[r].chunks);
      const std::vector<FileLayout>& files = *wr.laid_out;
      size_t i = 0;
      for (size_t f = 0; f < files.size(); ++f)
        for (size_t j = 0; j < files[f].chunks.size(); ++j, ++i) {
          const auto [ti, ci] = sk.slots[k + i];
          const ManifestTensor& t = m.tensors[ti];
          const ManifestChunk& mc = t.chunks[ci];
          WrittenChunk& c = wr.chunks.emplace_back();
          c.key = t.key;
          c.dtype = t.dtype;
          c.global_shape = t.global_shape;
          c.box.offsets = mc.offsets;
          c.box.sizes = mc.sizes;
          c.file = mc.file - file_base;
          c.byte_offset = files[f].chunks[j].offset;
          c.byte_length = files[f].chunks[j].length;
          c.entry = mc.entry;
          if (!wr.sums.empty()) c.checksums = std::move(wr.sums[f][j]);
        }
      wr.repeat = false;
      wr.laid_out.reset();
      wr.sums.clear();
    }
    k += sk.parts[r].chunks;
    file_base += static_cast<uint32_t>(sk.parts[r].files);
  }
}

// Where each reported chunk landed in `m` (as assemble_manifest sorted it).
bool find_slots(const Manifest& m, const std::vector<WriteResult>& results,
                std::vector<std::pair<uint32_t, uint32_t>>* slots) {
  slots->clear();
  for (const WriteResult& wr : results)
    for (const WrittenChunk& c : wr.chunks) {
      if (!c.codec.empty()) return false;
      const ManifestTensor* t = m.find(c.key);
      if (!t) return false;
      auto it = std::lower_bound(
          t->chunks.begin(), t->chunks.end(), c.box.offsets,
          [](const ManifestChunk& a, const std::vector<int64_t>& o) { return a.offsets < o; });
      if (it == t->chunks.end() || it->offsets != c.box.offsets) return false;
      slots->emplace_back(static_cast<uint32_t>(t - m.tensors.data()),
                          static_cast<uint32_t>(it - t->chunks.begin()));
    }
  return true;
}

}  // namespace

Result<Manifest> assemble_manifest(Manifest header, const std::vector<WriteResult>& results) {
  Manifest m = std::move(header);
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
      if (fresh) {
        m.tensors.push_back({c.key, c.dtype, c.global_shape, {}});
        // make_local_plan refuses other keys of this form: it is a per-rank value.
        if (auto pr = parse_per_rank_key(c.key)) m.tensors.back().per_rank = pr->second;
      }
      ManifestTensor& t = m.tensors[it->second];
      if (t.dtype != c.dtype || t.global_shape != c.global_shape)
        return Status::invalid_argument("tensor '" + c.key +
                                        "' reported with different dtype or "
                                        "global shape by rank " +
                                        std::to_string(wr.rank));
      t.chunks.push_back(manifest_chunk(c, file_base));
      // Readers that do not know the codec must refuse the checkpoint.
      if (!c.codec.empty() && std::find(m.required_features.begin(), m.required_features.end(),
                                        kCodecZstdFeature) == m.required_features.end())
        m.required_features.push_back(kCodecZstdFeature);
    }
  }
  std::sort(m.tensors.begin(), m.tensors.end(),
            [](const ManifestTensor& a, const ManifestTensor& b) { return a.key < b.key; });
  for (ManifestTensor& t : m.tensors)
    std::sort(t.chunks.begin(), t.chunks.end(),
              [](const ManifestChunk& a, const ManifestChunk& b) { return a.offsets < b.offsets; });
  return m;
}

Result<Manifest*> assemble_manifest_into(ManifestSkeleton& skeleton, const Manifest& header,
                                         std::vector<WriteResult>& results) {
  FERRY_RETURN_IF_ERROR(check_repeats(skeleton, results));
  FERRY_ASSIGN_OR_RETURN(const bool refilled, refill(skeleton, header, results));
  if (refilled) return &skeleton.manifest;

  expand_repeats(skeleton, results);
  skeleton.valid = false;
  skeleton.body = 0;
  skeleton.checked = false;
  skeleton.parts.clear();
  FERRY_ASSIGN_OR_RETURN(skeleton.manifest, assemble_manifest(header, results));
  skeleton.total_bytes = skeleton.manifest.total_bytes();
  skeleton.valid = find_slots(skeleton.manifest, results, &skeleton.slots);
  skeleton.places.clear();
  if (skeleton.valid) {
    std::vector<uint32_t> first;  // [tensor]: its first chunk's place among all chunks
    first.reserve(skeleton.manifest.tensors.size());
    uint32_t n = 0;
    for (const ManifestTensor& t : skeleton.manifest.tensors) {
      first.push_back(n);
      n += static_cast<uint32_t>(t.chunks.size());
    }
    skeleton.places.reserve(skeleton.slots.size());
    for (const auto& [t, c] : skeleton.slots)
      skeleton.places.push_back({&skeleton.manifest.tensors[t].chunks[c], first[t] + c});
  }
  // Unique across skeletons: an encoder is never told another's tensors are its own.
  static std::atomic<uint64_t> bodies{0};
  skeleton.body = skeleton.valid ? bodies.fetch_add(1, std::memory_order_relaxed) + 1 : 0;
  for (const WriteResult& wr : results)
    skeleton.parts.push_back({wr.layout, wr.files.size(), wr.chunks.size()});
  return &skeleton.manifest;
}

void sync_chunks(ManifestSkeleton& skeleton) {
  if (skeleton.encoder.chunks_newest(skeleton.body))
    (void)skeleton.encoder.take_chunks(&skeleton.manifest);
}

size_t WriteResult::chunk_count() const {
  if (!repeat || !laid_out) return chunks.size();
  size_t n = 0;
  for (const FileLayout& l : *laid_out) n += l.chunks.size();
  return n;
}

namespace {

// Creates `dir` and its missing parents, each made durable in its parent
// when `fsync` is set (a power cut must not take a level, and with it every
// checkpoint below). *created lists what this call made, outermost first.
Status make_dirs_durable(Filesystem& fs, const std::string& dir, bool fsync,
                         std::vector<std::string>* created) {
  std::vector<std::string> missing;
  for (std::string p = dir;; p = parent_path(p)) {
    Result<FileInfo> st = fs.stat(p);
    if (st.ok()) {
      if (!st->is_dir) return Status::invalid_argument(p + " exists and is not a directory");
      break;
    }
    if (st.status().code() != StatusCode::not_found) return st.status();
    missing.push_back(p);
    if (parent_path(p) == p) break;
  }
  for (auto it = missing.rbegin(); it != missing.rend(); ++it) {
    Status st = fs.mkdir(*it);
    if (st.ok()) {
      created->push_back(*it);
    } else if (st.code() != StatusCode::already_exists) {
      return st;  // made by someone else meanwhile is fine; it is theirs
    }
    if (fsync) FERRY_RETURN_IF_ERROR(fs.sync_dir(parent_path(*it)));
  }
  return Status::ok_status();
}

// Empty directories this call made; never one with something in it, which
// another process may have put there meanwhile. A root this call made holds
// the lock file its own gc created: that goes too.
void remove_created(Filesystem& fs, const std::string& root,
                    const std::vector<std::string>& created) {
  if (std::find(created.begin(), created.end(), root) != created.end())
    (void)fs.unlink(join_path(root, kRootLockFileName));
  for (auto it = created.rbegin(); it != created.rend(); ++it) (void)fs.rmdir(*it);
}

int64_t now_of(const CommitOptions& opts) {
  return opts.clock ? opts.clock() : now_unix_ms();
}

// The save still owns `pending_dir`: its lease reads, is this save's and has
// not lapsed. Returns the lease.
Result<PendingLease> check_lease(Filesystem& fs, const std::string& pending_dir,
                                 const CommitOptions& opts) {
  Result<PendingLease> lease = read_lease(fs, pending_dir);
  if (!lease.ok())
    return Status::aborted("commit refused: the lease of " + pending_dir +
                           " is unreadable (gc may have taken it): " + lease.status().to_string());
  if (!opts.lease_owner.empty() && lease->owner != opts.lease_owner)
    return Status::aborted("commit refused: " + pending_dir + " is leased by '" + lease->owner +
                           "', not by this save ('" + opts.lease_owner + "')");
  const int64_t now = now_of(opts);
  if (lease->expires_unix_ms < now)
    return Status::aborted("commit refused: the lease of " + pending_dir + " expired " +
                           std::to_string(now - lease->expires_unix_ms) +
                           " ms ago (the save could not keep it fresh; gc may take its files)");
  return lease;
}

// What must hold just before the commit rename: the files the manifest names
// (relative to `files_dir`) are all there, whole, and the save still owns
// its directory.
Status check_pending(Filesystem& fs, const std::string& files_dir, const std::string& pending_dir,
                     const Manifest& m, const CommitOptions& opts) {
  for (const ManifestFile& f : m.files) {
    const std::string path = join_path(files_dir, f.name);
    Result<FileInfo> st = fs.lstat(path);
    if (!st.ok())
      return Status::aborted("commit refused: data file " + path + " is missing (" +
                             st.status().to_string() + ")");
    if (!st->is_regular)  // a symbolic link too: loads never follow one
      return Status::aborted("commit refused: data file " + path + " is not a regular file");
    if (st->size != f.size)
      return Status::aborted("commit refused: data file " + path + " holds " +
                             std::to_string(st->size) + " bytes, the manifest says " +
                             std::to_string(f.size));
  }
  return check_lease(fs, pending_dir, opts).status();
}

// Retention once `step_dir` is committed: what it retires goes into `out`;
// its failure is a warning of the commit, never its error.
void retire_after(Filesystem& fs, const std::string& root, const std::string& step_dir,
                  const CommitOptions& opts, const std::vector<std::string>& spared,
                  CommitOutcome& out) {
  Result<Retired> retired =
      retire_checkpoints(fs, root, opts.keep_last, step_dir, spared, opts.manifests);
  if (retired.ok()) {
    out.retired = std::move(retired->checkpoints);
    out.trash.insert(out.trash.end(), retired->trash.begin(), retired->trash.end());
  } else {
    out.warnings.push_back(
        retired.status().with_context("committed " + step_dir + ", but retention: "));
  }
}

// The commit on an object root, from the checks on: the MANIFEST, created
// only if absent (replaced with overwrite), is the commit point; LATEST and
// retention follow as on a directory. An overwritten step's old files (the
// other saves' prefixes its MANIFEST named) go to the trash.
Result<CommitOutcome> commit_to_object_root(Filesystem& fs, const std::string& root,
                                            const std::string& pending_dir,
                                            const Manifest& manifest, const std::string& encoded,
                                            const CommitOptions& opts) {
  const std::string name = step_dir_name(manifest.step);
  const std::string step_dir = join_path(root, name);
  FERRY_RETURN_IF_ERROR(check_pending(fs, step_dir, pending_dir, manifest, opts));
  std::vector<std::string> old_prefixes;
  if (opts.overwrite) {
    Result<Manifest> old = read_manifest(fs, step_dir);
    const std::string ours = pending_dir.substr(pending_dir.find_last_of('/') + 1);
    for (const ManifestFile& f : old.ok() ? old->files : std::vector<ManifestFile>{}) {
      const std::string prefix = f.name.substr(0, f.name.find('/'));
      if (f.name.find('/') != std::string::npos && prefix != ours &&
          std::find(old_prefixes.begin(), old_prefixes.end(), prefix) == old_prefixes.end())
        old_prefixes.push_back(prefix);
    }
  }
  const std::string manifest_path = join_path(step_dir, kManifestFileName);
  FERRY_ASSIGN_OR_RETURN(
      std::string tmp, write_temp_file_passing(fs, manifest_path, encoded, opts.fsync, "manifest"));
  Status committed = opts.overwrite ? fs.rename(tmp, manifest_path)
                                    : fs.rename_noreplace(tmp, manifest_path);  // the commit point
  if (!committed.ok()) {
    (void)fs.unlink(tmp);
    if (committed.code() == StatusCode::already_exists)
      return Status::already_exists("checkpoint " + step_dir +
                                    " was committed by another save (its MANIFEST exists)");
    return committed.with_context("the commit of " + step_dir + ": ");
  }
  fs.crash_point("commit.rename");
  CommitOutcome out{step_dir, manifest.commit_seq, {}, {}, {}, {}};
  remember_committed(fs, step_dir, manifest, encoded, encoded.size(), opts.manifests,
                     opts.total_bytes);
  for (const std::string& p : old_prefixes) out.trash.push_back(join_path(step_dir, p));
  (void)fs.unlink(join_path(pending_dir, kLeaseFileName));
  Status latest = write_file_atomic_passing(fs, join_path(root, kLatestFileName), name + "\n",
                                            /*sync=*/false, "latest");
  if (!latest.ok())
    out.warnings.push_back(latest.with_context("committed " + step_dir + ", but LATEST: "));
  retire_after(fs, root, step_dir, opts, {}, out);
  return out;
}

}  // namespace

std::string pending_path(const std::string& root, uint64_t step, const std::string& job,
                         const std::string& unique) {
  if (is_object_root(root))
    return join_path(join_path(root, step_dir_name(step)), "save-" + job + "-" + unique);
  return join_path(root, pending_dir_name(step, job, unique));
}

Status prepare_pending(Filesystem& fs, const std::string& root, const std::string& pending_dir,
                       uint64_t step, bool overwrite, int64_t lease_ms, const std::string& owner,
                       bool fsync, std::vector<GcReport::Failed>* undeleted) {
  std::vector<std::string> created;
  Status st = make_dirs_durable(fs, root, fsync, &created);
  if (!st.ok()) {
    remove_created(fs, root, created);
    return st;
  }
  // Crashed saves leave pending directories: each save tidies its root
  // rather than waiting for `ferry gc`. Best effort, and without waiting:
  // another job holding the lock is committing. A step an overwrite left
  // aside stays aside: this save's commit puts it back and knows to spare it
  // from its retention. What gc could not delete still takes space: the
  // caller hears of it.
  const bool object = is_object_root(root);
  if (!object) {  // an object root's gc is `ferry gc`: listing it costs a request per 1,000 objects
    Result<GcReport> gc = collect_garbage(fs, root, now_unix_ms(), 60'000, /*lock_wait_ms=*/0,
                                          /*restore_displaced=*/false);
    if (gc.ok() && undeleted != nullptr)
      undeleted->insert(undeleted->end(), gc->failed.begin(), gc->failed.end());
  }
  const std::string step_dir = join_path(root, step_dir_name(step));
  if (!overwrite) {
    Result<bool> aside = overwrite_pending_for(fs, root, step);
    // On an object root a step prefix is committed only once its MANIFEST is there.
    if (fs.stat(object ? join_path(step_dir, kManifestFileName) : step_dir).ok() ||
        (aside.ok() && *aside))
      return Status::already_exists("checkpoint " + step_dir +
                                    " already exists (save with overwrite to replace it)");
  }
  // A directory already there is someone else's (a restarted job with the
  // same token): fail without touching it.
  st = fs.mkdir(pending_dir);
  if (!st.ok()) {
    remove_created(fs, root, created);
    return st;
  }
  st = write_lease(fs, pending_dir, now_unix_ms() + lease_ms, owner);
  if (!st.ok()) {
    (void)remove_all(fs, pending_dir);  // made just above, by this call
    remove_created(fs, root, created);
    return st;
  }
  fs.crash_point("pending.created");
  return Status();
}

Result<CommitOutcome> commit_checkpoint(Filesystem& fs, const std::string& root,
                                        const std::string& pending_dir, Manifest manifest,
                                        const CommitOptions& opts) {
  return commit_checkpoint_in_place(fs, root, pending_dir, &manifest, opts);
}

Result<CommitOutcome> commit_checkpoint_in_place(Filesystem& fs, const std::string& root,
                                                 const std::string& pending_dir, Manifest* filled,
                                                 const CommitOptions& opts) {
  Manifest& manifest = *filled;
  // Everything up to retention under ROOT's lock: another job committing
  // into this root would otherwise pick the same sequence number, and its
  // retention could remove this commit.
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<FileLock> lock, lock_root(fs, root, opts.lock_wait_ms));
  // A step an earlier overwrite left aside when it died belongs back in
  // place before anything looks at what is committed; this save's retention
  // spares it (the job may not have known of it).
  std::vector<std::string> restored;
  const bool object = is_object_root(root);
  if (!object) FERRY_RETURN_IF_ERROR(recover_displaced(fs, root, &restored, nullptr));

  // The sequence must exceed every committed one, so "latest" is well defined
  // even when steps go backwards (a job restarted from an older checkpoint).
  FERRY_ASSIGN_OR_RETURN(const uint64_t seq, highest_commit_seq(fs, root, opts.manifests));
  manifest.commit_seq = seq + 1;
  manifest.fsynced = opts.fsync;

  // A lease that held when the commit began must not lapse during it: the
  // manifest's write and fsync can take seconds on a loaded machine, longer
  // than a short lease has left since its last refresh.
  if (opts.renew_lease_ms > 0) {
    FERRY_ASSIGN_OR_RETURN(PendingLease lease, check_lease(fs, pending_dir, opts));
    FERRY_RETURN_IF_ERROR(
        write_lease(fs, pending_dir, now_of(opts) + opts.renew_lease_ms, lease.owner));
  }
  if (object) {
    // The files stay under the save's own prefix: the manifest names them through it.
    const std::string save = pending_dir.substr(pending_dir.find_last_of('/') + 1);
    // A manifest kept from the last commit (ManifestSkeleton) holds that
    // save's prefix: only the file's own name is the rank's.
    for (ManifestFile& f : manifest.files)
      f.name = save + "/" + f.name.substr(f.name.find_last_of('/') + 1);
  }
  // Kept between commits: a fresh buffer of megabytes is paged in anew each
  // time. With an encoder it holds the frame only, and `rest`, the message
  // the encoder keeps, follows it in the file without being copied.
  static thread_local std::string encoded;
  std::string_view rest;
  if (opts.encoder != nullptr)
    rest = opts.encoder->encode_parts(manifest, &encoded, opts.body);
  else
    encode_manifest_into(manifest, &encoded);
  struct Trim {
    ManifestEncoder* encoder;
    ~Trim() {
      if (encoded.capacity() > kKeptManifestBufferBytes) std::string().swap(encoded);
      if (encoder != nullptr) encoder->release_oversized();
    }
  } trim{opts.encoder};
  const uint64_t file_bytes = encoded.size() + rest.size();
  // Readers refuse a larger one: committing it would make the step unreadable.
  if (file_bytes > kMaxManifestBytes)
    return Status::invalid_argument(
        "the manifest of " + pending_dir + " would be " + std::to_string(file_bytes) +
        " bytes, more than the " + std::to_string(kMaxManifestBytes) +
        " a reader accepts (fewer, larger chunks or checksum blocks make it smaller)");
  if (object) {
    std::string whole = encoded;
    whole.append(rest);
    return commit_to_object_root(fs, root, pending_dir, manifest, whole, opts);
  }
  FERRY_RETURN_IF_ERROR(write_pieces_atomic_passing(fs, join_path(pending_dir, kManifestFileName),
                                                    {encoded, rest}, opts.fsync, "manifest"));
  FERRY_RETURN_IF_ERROR(check_pending(fs, pending_dir, pending_dir, manifest, opts));

  const std::string name = step_dir_name(manifest.step);
  const std::string step_dir = join_path(root, name);
  // LATEST's new content is written (and fsynced) before the commit point,
  // so after it one rename and one fsync of ROOT make both the commit and
  // LATEST durable. LATEST is a hint (load trusts the manifests' sequence
  // numbers), so failing to write it is only a warning.
  const std::string latest_path = join_path(root, kLatestFileName);
  Result<std::string> latest_tmp =
      write_temp_file_passing(fs, latest_path, name + "\n", opts.fsync, "latest");
  // Whatever way this returns, the temp file goes unless it became LATEST.
  struct Unlinked {
    Filesystem& fs;
    std::string path;
    ~Unlinked() {
      if (!path.empty()) (void)fs.unlink(path);
    }
  } leftover{fs, latest_tmp.ok() ? *latest_tmp : std::string()};
  std::string displaced;
  if (fs.stat(step_dir).ok()) {
    if (!opts.overwrite)
      return Status::already_exists("checkpoint " + step_dir + " was committed by another save");
    // rename(2) cannot replace a non-empty directory: move the old one
    // aside first, under a name that says what it is, so that whoever finds
    // it without a step in its place (a crash right here) puts it back.
    displaced = join_path(root, displaced_dir_name(manifest.step, std::to_string(seq + 1)));
    FERRY_RETURN_IF_ERROR(fs.rename(step_dir, displaced));
    fs.crash_point("overwrite.aside");
  }
  Status committed = fs.rename(pending_dir, step_dir);  // the commit point
  if (!committed.ok()) {
    if (!displaced.empty()) {
      Status back = fs.rename(displaced, step_dir);
      if (!back.ok())
        committed = committed.with_context(
            "(the old " + step_dir + " is kept as " + displaced +
            "; the next save or gc puts it back: " + back.to_string() + ") ");
    }
    return committed;
  }
  fs.crash_point("commit.rename");
  // From here the checkpoint is committed and is what load picks: whatever
  // fails now is a warning, never a failed save (a retry would only meet
  // already_exists).
  CommitOutcome out{step_dir, manifest.commit_seq, {}, {}, {}, restored};
  remember_committed(fs, step_dir, manifest, encoded, file_bytes, opts.manifests, opts.total_bytes);
  // The lease protected the save while it was pending (a crash before the
  // rename leaves a directory gc may take once it expires); a committed
  // directory needs none. Not in the manifest, so a leftover is harmless.
  (void)fs.unlink(join_path(step_dir, kLeaseFileName));
  Status latest = latest_tmp.status();
  if (latest.ok()) latest = fs.rename(*latest_tmp, latest_path);
  if (latest.ok()) {
    leftover.path.clear();
    fs.crash_point("latest.rename");
  }
  if (!latest.ok())
    out.warnings.push_back(latest.with_context("committed " + step_dir + ", but LATEST: "));
  bool durable = true;
  if (opts.fsync) {
    Status st = fs.sync_dir(root);
    if (!st.ok()) {
      durable = false;
      out.warnings.push_back(st.with_context("committed " + step_dir + ", but fsync of ROOT: "));
    }
  }
  fs.crash_point("root.fsync");
  // Until ROOT is durable a power cut may undo the commit rename; the old
  // step must then still be there to come back.
  if (!displaced.empty() && durable) {
    std::string trash = join_path(root, trash_dir_name());
    Status st = fs.rename(displaced, trash);
    if (st.ok())
      out.trash.push_back(std::move(trash));
    else
      out.warnings.push_back(
          st.with_context("committed " + step_dir + ", but removing the old one: "));
  }
  if (durable) {
    retire_after(fs, root, step_dir, opts, restored, out);
  }
  return out;
}

}  // namespace ferry
