// The catalog reads a checkpoint root only through the Filesystem interface,
// so fault-injection tests see every call it makes.
#include "catalog.hpp"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <limits>
#include <map>
#include <mutex>
#include <tuple>
#include <unordered_map>

#include "object_fs.hpp"
#include "s3/client.hpp"

namespace ferry {
namespace {

constexpr char kStepPrefix[] = "step-";
constexpr char kPendingPrefix[] = ".pending-";
constexpr char kDisplacedPrefix[] = ".displaced-";
constexpr char kTrashPrefix[] = ".trash-";
// What older versions named a step moved aside by an overwrite.
constexpr char kOldReplacedInfix[] = "-replaced-";
constexpr char kLatestTempInfix[] = ".tmp-";
constexpr size_t kStepDigits = 8;
// A lease or LATEST is a line of text: anything bigger is not one.
constexpr uint64_t kMaxSmallFileBytes = 4096;

bool starts_with(const std::string& s, const char* prefix) {
  return s.compare(0, std::char_traits<char>::length(prefix), prefix) == 0;
}

std::string padded_step(uint64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%08" PRIu64, step);
  return buf;
}

// Parses "<expires_unix_ms> <owner>\n"; false when the text is not a lease.
bool parse_lease(const std::string& text, PendingLease* lease) {
  size_t end = text.find_first_of(" \n");
  std::string number = text.substr(0, end);
  if (number.empty() || number.size() > 18) return false;
  for (char c : number) {
    if (c < '0' || c > '9') return false;
  }
  lease->expires_unix_ms = std::stoll(number);
  lease->owner.clear();
  if (end != std::string::npos && text[end] == ' ') {
    size_t nl = text.find('\n', end + 1);
    lease->owner = text.substr(end + 1, nl == std::string::npos ? std::string::npos : nl - end - 1);
  }
  return true;
}

// Parses the digits of a step that start at `pos` and end at '-'.
bool parse_step_digits(const std::string& name, size_t pos, uint64_t* step, size_t* end) {
  size_t dash = name.find('-', pos);
  if (dash == std::string::npos || dash - pos < kStepDigits) return false;
  uint64_t value = 0;
  for (size_t i = pos; i < dash; ++i) {
    char c = name[i];
    if (c < '0' || c > '9') return false;
    uint64_t d = static_cast<uint64_t>(c - '0');
    if (value > (std::numeric_limits<uint64_t>::max() - d) / 10) return false;
    value = value * 10 + d;
  }
  *step = value;
  *end = dash;
  return true;
}

// The name LATEST holds, without the trailing newline; empty when absent.
std::string read_latest_hint(Filesystem& fs, const std::string& root) {
  Result<std::string> text = read_file(fs, join_path(root, kLatestFileName), kMaxSmallFileBytes);
  if (!text.ok()) return "";
  std::string name = *text;
  while (!name.empty() && (name.back() == '\n' || name.back() == '\r' || name.back() == ' ')) {
    name.pop_back();
  }
  return name;
}

}  // namespace

std::string step_dir_name(uint64_t step) {
  return kStepPrefix + padded_step(step);
}

std::string pending_dir_name(uint64_t step, const std::string& job, const std::string& id) {
  return kPendingPrefix + padded_step(step) + "-" + job + "-" + id;
}

bool is_pending_dir_name(const std::string& name) {
  return starts_with(name, kPendingPrefix);
}

std::string displaced_dir_name(uint64_t step, const std::string& tag) {
  return kDisplacedPrefix + padded_step(step) + "-" + tag;
}

bool parse_displaced_dir_name(const std::string& name, uint64_t* step) {
  uint64_t value = 0;
  size_t end = 0;
  if (starts_with(name, kDisplacedPrefix)) {
    if (!parse_step_digits(name, std::char_traits<char>::length(kDisplacedPrefix), &value, &end))
      return false;
  } else if (starts_with(name, kPendingPrefix)) {
    if (!parse_step_digits(name, std::char_traits<char>::length(kPendingPrefix), &value, &end) ||
        name.compare(end, std::char_traits<char>::length(kOldReplacedInfix), kOldReplacedInfix) !=
            0)
      return false;
  } else {
    return false;
  }
  if (step != nullptr) *step = value;
  return true;
}

std::string trash_dir_name() {
  static std::atomic<uint64_t> counter{0};
  return kTrashPrefix + std::to_string(now_unix_ms()) + "-" + std::to_string(::getpid()) + "-" +
         std::to_string(counter.fetch_add(1, std::memory_order_relaxed));
}

bool is_trash_dir_name(const std::string& name) {
  return starts_with(name, kTrashPrefix);
}

Result<std::unique_ptr<FileLock>> lock_root(Filesystem& fs, const std::string& root,
                                            int64_t wait_ms) {
  Result<std::unique_ptr<FileLock>> lock = fs.lock(join_path(root, kRootLockFileName), wait_ms);
  if (!lock.ok())
    return lock.status().with_context("checkpoint root " + root +
                                      " (another job commits into it?): ");
  return lock;
}

bool parse_step_dir_name(const std::string& name, uint64_t* step) {
  if (!starts_with(name, kStepPrefix)) return false;
  std::string digits = name.substr(std::char_traits<char>::length(kStepPrefix));
  if (digits.size() < kStepDigits) return false;
  uint64_t value = 0;
  for (char c : digits) {
    if (c < '0' || c > '9') return false;
    uint64_t d = static_cast<uint64_t>(c - '0');
    if (value > (std::numeric_limits<uint64_t>::max() - d) / 10) return false;
    value = value * 10 + d;
  }
  if (step != nullptr) *step = value;
  return true;
}

namespace {

constexpr uint64_t kFrameHeadBytes = 4096;

using FailureKey = ManifestCache::FailureKey;

FailureKey failure_key(const std::string& path, const FileInfo& info) {
  return {path, info.size, info.inode, info.mtime_unix_ms};
}

// Only what the bytes say is remembered: an I/O error may pass.
void remember_failure(ManifestCache* cache, const FailureKey& key, const Status& st, bool frame) {
  if (st.code() != StatusCode::corruption && st.code() != StatusCode::unsupported) return;
  if (cache != nullptr) cache->remember_failure(key, st, frame);
}

// The MANIFEST at `path` as far as its first 4 KiB tell: a regular file
// (never a link), not known to have failed before (`frame_only`: by its
// frame), whose frame's length is the file's and at most kMaxManifestBytes.
// Nothing beyond the head (*head) is read here, so a sparse or hostile file
// costs 4 KiB. Sets *info for the caller's own remember_failure.
Status check_manifest_file(Filesystem& fs, ManifestCache* cache, const std::string& path,
                           bool frame_only, FileInfo* info, std::string* head) {
  FERRY_ASSIGN_OR_RETURN(*info, fs.lstat(path));
  if (info->is_symlink)
    return Status::invalid_argument(path + ": is a symbolic link, which Ferry never follows there");
  if (!info->is_regular) return Status::invalid_argument(path + ": not a regular file");
  const FailureKey key = failure_key(path, *info);
  if (cache != nullptr) {
    if (std::optional<Status> failed = cache->failure(key, frame_only)) return *failed;
  }
  // Opened without read_file_head's own lstat: the one above told a regular
  // file, and the open refuses anything else (a link put there meanwhile too).
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<File> f, fs.open(path, OpenOptions{}));
  head->resize(static_cast<size_t>(std::min<uint64_t>(info->size, kFrameHeadBytes)));
  FERRY_ASSIGN_OR_RETURN(const size_t n, f->pread(head->data(), head->size(), 0));
  head->resize(n);
  FERRY_RETURN_IF_ERROR(f->close());
  Result<uint64_t> total = manifest_file_bytes(*head);
  Status bad;
  if (!total.ok()) {
    bad = total.status().with_context(path + ": ");
  } else if (*total > kMaxManifestBytes) {
    bad = Status::corruption(path + ": MANIFEST frame says " + std::to_string(*total) +
                             " bytes, more than the " + std::to_string(kMaxManifestBytes) +
                             " a manifest may hold");
  } else if (*total != info->size) {
    bad = Status::corruption(path + ": MANIFEST frame says " + std::to_string(*total) +
                             " bytes, the file holds " + std::to_string(info->size));
  }
  if (!bad.ok()) remember_failure(cache, key, bad, /*frame=*/true);
  return bad;
}

}  // namespace

namespace {

// The manifest at `path` whose file check_manifest_file passed (`info`,
// `head`), read and decoded whole.
Result<Manifest> decode_checked(Filesystem& fs, ManifestCache* cache, const std::string& path,
                                const FileInfo& info, std::string& head) {
  // A small manifest is all in its head already.
  std::string bytes;
  if (head.size() == info.size)
    bytes = std::move(head);
  else
    FERRY_RETURN_IF_ERROR(read_file_into(fs, path, &bytes, kMaxManifestBytes));
  Result<Manifest> m = decode_manifest(bytes);
  if (!m.ok()) {
    Status st = m.status().with_context(path + ": ");
    // Whether the commit numbering may still use it (only its tensors failed).
    remember_failure(cache, failure_key(path, info), st, !summarize_manifest(bytes).ok());
    return st;
  }
  return m;
}

// decode_checked through decode_manifest_shared (`dir`: the checkpoint's).
Result<std::shared_ptr<const Manifest>> decode_checked_shared(Filesystem& fs, ManifestCache* cache,
                                                              const std::string& dir,
                                                              const std::string& path,
                                                              const FileInfo& info,
                                                              std::string& head) {
  std::string bytes;
  if (head.size() == info.size)
    bytes = std::move(head);
  else
    FERRY_RETURN_IF_ERROR(read_file_into(fs, path, &bytes, kMaxManifestBytes));
  Result<std::shared_ptr<const Manifest>> m = decode_manifest_shared(bytes, dir, cache);
  if (!m.ok()) {
    Status st = m.status().with_context(path + ": ");
    remember_failure(cache, failure_key(path, info), st, !summarize_manifest(bytes).ok());
    return st;
  }
  return m;
}

}  // namespace

Result<Manifest> read_manifest(Filesystem& fs, const std::string& checkpoint_dir,
                               ManifestCache* cache) {
  std::string path = join_path(checkpoint_dir, kManifestFileName);
  FileInfo info;
  std::string head;
  FERRY_RETURN_IF_ERROR(check_manifest_file(fs, cache, path, /*frame_only=*/false, &info, &head));
  return decode_checked(fs, cache, path, info, head);
}

Result<std::shared_ptr<const Manifest>> decode_manifest_shared(std::string_view bytes,
                                                               const std::string& dir,
                                                               ManifestCache* cache) {
  uint64_t sum = 0;
  if (cache != nullptr) {
    // Checks the frame and the payload against its checksum: what is served
    // is a decode of these very bytes.
    Result<ManifestSummary> s = summarize_manifest(bytes);
    if (s.ok()) {
      sum = s->payload_sum;
      if (auto known = cache->manifest(dir, bytes.size(), sum)) return known;
    }
  }
  FERRY_ASSIGN_OR_RETURN(Manifest m, decode_manifest(bytes));
  auto out = std::make_shared<const Manifest>(std::move(m));
  if (cache != nullptr) cache->remember_manifest(dir, bytes.size(), sum, out);
  return out;
}

Result<std::shared_ptr<const Manifest>> read_manifest_shared(Filesystem& fs,
                                                             const std::string& checkpoint_dir,
                                                             ManifestCache* cache) {
  std::string path = join_path(checkpoint_dir, kManifestFileName);
  FileInfo info;
  std::string head;
  FERRY_RETURN_IF_ERROR(check_manifest_file(fs, cache, path, /*frame_only=*/false, &info, &head));
  return decode_checked_shared(fs, cache, checkpoint_dir, path, info, head);
}

void remember_committed(Filesystem& fs, const std::string& checkpoint_dir, const Manifest& m,
                        std::string_view head, uint64_t file_bytes, ManifestCache* cache,
                        uint64_t total_bytes) {
  if (cache == nullptr) return;
  Result<uint64_t> sum = manifest_payload_sum(head);
  Result<FileInfo> info = fs.lstat(join_path(checkpoint_dir, kManifestFileName));
  if (!sum.ok() || !info.ok() || !info->is_regular || info->size != file_bytes) return;
  auto d = std::make_shared<ManifestCache::Decoded>();
  d->step = m.step;
  d->commit_seq = m.commit_seq;
  d->total_bytes = total_bytes != 0 ? total_bytes : m.total_bytes();
  d->tensors = m.tensors.size();
  d->files = m.files;
  cache->remember_decoded(failure_key(join_path(checkpoint_dir, kManifestFileName), *info), *sum,
                          std::move(d));
  cache->remember_summary({m.step, m.commit_seq, *sum});
}

namespace {

// A step directory as found in a root: a real directory, never a link (whose
// files would be read from wherever it points).
Status check_step_dir(Filesystem& fs, const std::string& path) {
  FERRY_ASSIGN_OR_RETURN(FileInfo st, fs.lstat(path));
  if (st.is_symlink)
    return Status::invalid_argument(path + " is a symbolic link, which Ferry never follows");
  if (!st.is_dir) return Status::invalid_argument(path + " is not a directory");
  return Status();
}

Result<std::vector<CheckpointInfo>> list_checkpoints_here(Filesystem& fs, const std::string& root,
                                                          ManifestCache* cache) {
  FERRY_ASSIGN_OR_RETURN(std::vector<std::string> names, fs.list(root));
  std::string hint = read_latest_hint(fs, root);
  std::vector<CheckpointInfo> out;
  for (const std::string& name : names) {
    uint64_t step = 0;
    if (!parse_step_dir_name(name, &step)) continue;
    CheckpointInfo info;
    info.path = join_path(root, name);
    info.step = step;
    info.latest_hint = (name == hint);
    Result<FileInfo> st = fs.lstat(info.path);
    if (st.ok() && !st->is_dir && !st->is_symlink) continue;  // a stray file with a step-like name
    Status dir = check_step_dir(fs, info.path);
    Result<Manifest> m = dir.ok() ? read_manifest(fs, info.path, cache) : Result<Manifest>(dir);
    // A step prefix without its MANIFEST is a save in flight or one that failed.
    if (!m.ok() && m.status().code() == StatusCode::not_found && is_object_root(root)) continue;
    if (m.ok()) {
      info.commit_seq = m->commit_seq;
      info.bytes = m->total_bytes();
      info.tensors = m->tensors.size();
    } else {
      info.state = CheckpointState::corrupt;
      info.status = m.status();
    }
    out.push_back(std::move(info));
  }
  std::stable_sort(out.begin(), out.end(), [](const CheckpointInfo& a, const CheckpointInfo& b) {
    if (a.commit_seq != b.commit_seq) return a.commit_seq < b.commit_seq;
    return a.step < b.step;
  });
  return out;
}

// A committed checkpoint's summary, from its manifest's 4 KiB frame once the
// manifest was read whole by `cache`'s owner (none: read whole each time):
// decoding every kept manifest on every commit and load grows with the tensors.
Result<ManifestSummary> read_summary(Filesystem& fs, const std::string& dir,
                                     ManifestCache* cache = nullptr) {
  const std::string path = join_path(dir, kManifestFileName);
  // Fails for a stray file with a step-like name: it has no MANIFEST.
  FileInfo info;
  std::string head;
  FERRY_RETURN_IF_ERROR(check_manifest_file(fs, cache, path, /*frame_only=*/true, &info, &head));
  Result<uint64_t> sum = manifest_payload_sum(head);
  if (sum.ok() && cache != nullptr) {
    if (std::optional<ManifestSummary> known = cache->summary(*sum)) return *known;
  }
  // One buffer for every manifest this thread reads (see read_file_into).
  static thread_local std::string bytes;
  FERRY_RETURN_IF_ERROR(read_file_into(fs, path, &bytes, kMaxManifestBytes));
  Result<ManifestSummary> s = summarize_manifest(bytes);
  if (bytes.capacity() > kKeptManifestBufferBytes) std::string().swap(bytes);
  if (!s.ok()) {
    Status st = s.status().with_context(path + ": ");
    remember_failure(cache, failure_key(path, info), st, /*frame=*/true);
    return st;
  }
  if (cache != nullptr) cache->remember_summary(*s);
  return s;
}

struct Candidate {
  std::string name;
  ManifestSummary summary;
};

// Step directories whose manifests summarize, highest (commit_seq, step) first.
Result<std::vector<Candidate>> committed_by_seq(Filesystem& fs, const std::string& root,
                                                ManifestCache* cache) {
  FERRY_ASSIGN_OR_RETURN(std::vector<std::string> names, fs.list(root));
  std::vector<Candidate> out;
  for (const std::string& name : names) {
    if (!parse_step_dir_name(name, nullptr)) continue;
    if (!check_step_dir(fs, join_path(root, name)).ok()) continue;
    Result<ManifestSummary> s = read_summary(fs, join_path(root, name), cache);
    if (s.ok()) out.push_back({name, *s});
  }
  std::sort(out.begin(), out.end(), [](const Candidate& a, const Candidate& b) {
    if (a.summary.commit_seq != b.summary.commit_seq)
      return a.summary.commit_seq > b.summary.commit_seq;
    return a.summary.step > b.summary.step;
  });
  return out;
}

// What retention and find_latest need of the manifest in `dir`: decoded whole once per
// `cache` owner (none: each time), then known from its 4 KiB head.
Result<std::shared_ptr<const ManifestCache::Decoded>> decoded_manifest(Filesystem& fs,
                                                                       const std::string& dir,
                                                                       ManifestCache* cache) {
  const std::string path = join_path(dir, kManifestFileName);
  FileInfo info;
  std::string head;
  FERRY_RETURN_IF_ERROR(check_manifest_file(fs, cache, path, /*frame_only=*/false, &info, &head));
  Result<uint64_t> sum = manifest_payload_sum(head);
  if (cache != nullptr && sum.ok()) {
    if (auto known = cache->decoded(failure_key(path, info), *sum)) return known;
  }
  // Decoded as a load decodes it: a load of the root plans against this decode.
  FERRY_ASSIGN_OR_RETURN(std::shared_ptr<const Manifest> m,
                         decode_checked_shared(fs, cache, dir, path, info, head));
  auto d = std::make_shared<ManifestCache::Decoded>();
  d->step = m->step;
  d->commit_seq = m->commit_seq;
  d->total_bytes = m->total_bytes();
  d->tensors = m->tensors.size();
  d->files = m->files;
  if (cache != nullptr && sum.ok()) cache->remember_decoded(failure_key(path, info), *sum, d);
  return std::shared_ptr<const ManifestCache::Decoded>(std::move(d));
}

}  // namespace

Result<uint64_t> highest_commit_seq(Filesystem& fs, const std::string& root, ManifestCache* cache) {
  FERRY_ASSIGN_OR_RETURN(std::vector<Candidate> all, committed_by_seq(fs, root, cache));
  return all.empty() ? 0 : all.front().summary.commit_seq;
}

Result<std::vector<CheckpointInfo>> list_checkpoints(Filesystem& fs, const std::string& root,
                                                     ManifestCache* cache) {
  FERRY_RETURN_IF_ERROR(finish_interrupted_overwrites(fs, root).status());
  return list_checkpoints_here(fs, root, cache);
}

Result<CheckpointInfo> find_latest(Filesystem& fs, const std::string& root, ManifestCache* cache) {
  FERRY_RETURN_IF_ERROR(finish_interrupted_overwrites(fs, root).status());
  FERRY_ASSIGN_OR_RETURN(std::vector<Candidate> all, committed_by_seq(fs, root, cache));
  const std::string hint = read_latest_hint(fs, root);
  // Only the choice is decoded whole; one that fails gives way to the next.
  for (const Candidate& c : all) {
    CheckpointInfo info;
    info.path = join_path(root, c.name);
    Result<std::shared_ptr<const ManifestCache::Decoded>> m =
        decoded_manifest(fs, info.path, cache);
    if (!m.ok()) continue;
    parse_step_dir_name(c.name, &info.step);
    info.commit_seq = (*m)->commit_seq;
    info.bytes = (*m)->total_bytes;
    info.tensors = (*m)->tensors;
    info.latest_hint = (c.name == hint);
    return info;
  }
  return Status::not_found("no committed checkpoint with a readable manifest in " + root);
}

Status write_lease(Filesystem& fs, const std::string& pending_dir, int64_t expires_unix_ms,
                   const std::string& owner) {
  // No fsync: a lease is advisory, and losing it in a crash only makes the
  // directory collectable sooner, which is right for a crashed save.
  return write_file_atomic(fs, join_path(pending_dir, kLeaseFileName),
                           std::to_string(expires_unix_ms) + " " + owner + "\n",
                           /*sync=*/false);
}

Result<PendingLease> read_lease(Filesystem& fs, const std::string& pending_dir) {
  const std::string path = join_path(pending_dir, kLeaseFileName);
  FERRY_ASSIGN_OR_RETURN(std::string text, read_file(fs, path, kMaxSmallFileBytes));
  PendingLease lease;
  if (!parse_lease(text, &lease)) return Status::corruption(path + ": not a lease");
  return lease;
}

Result<std::vector<PendingInfo>> list_pending(Filesystem& fs, const std::string& root) {
  FERRY_ASSIGN_OR_RETURN(std::vector<std::string> names, fs.list(root));
  std::vector<PendingInfo> out;
  for (const std::string& name : names) {
    if (!is_pending_dir_name(name)) continue;
    PendingInfo info;
    info.path = join_path(root, name);
    Result<FileInfo> st = fs.lstat(info.path);
    if (!st.ok() || !st->is_dir) continue;  // a link too: never read through
    info.mtime_unix_ms = st->mtime_unix_ms;
    Result<PendingLease> lease = read_lease(fs, info.path);
    if (lease.ok()) {
      info.has_lease = true;
      info.lease = *lease;
    }
    out.push_back(std::move(info));
  }
  return out;
}

namespace {

enum class Aside { live, restorable, garbage, leave };

// What a displaced entry `name` (step `step`) is now. restorable: a real
// directory whose MANIFEST is a committed step `step`'s, with no step
// directory in its place; garbage: replaced (a step directory is there), or
// not a checkpoint of that step at all (a file, an empty directory, a link);
// live: the old form's name on a pending save; leave: neither.
Aside classify_aside(Filesystem& fs, const std::string& root, const std::string& name,
                     uint64_t step) {
  const std::string path = join_path(root, name);
  const bool old_form = is_pending_dir_name(name);
  // The old form ".pending-<step>-replaced-<id>" is also what a live save of
  // a job named "replaced" is called. A moved-aside step was committed, so
  // it holds a MANIFEST and no LEASE (removed at the commit); a pending save
  // has a LEASE from its first moment, and what has neither is the pending
  // gc's.
  if (old_form && fs.lstat(join_path(path, kLeaseFileName)).ok()) return Aside::live;
  if (old_form && !fs.lstat(join_path(path, kManifestFileName)).ok()) return Aside::leave;
  Result<FileInfo> in_place = fs.lstat(join_path(root, step_dir_name(step)));
  if (in_place.ok())
    return in_place->is_dir && !in_place->is_symlink ? Aside::garbage : Aside::leave;
  if (in_place.status().code() != StatusCode::not_found) return Aside::leave;
  Result<FileInfo> st = fs.lstat(path);
  bool valid = st.ok() && st->is_dir && !st->is_symlink;
  if (valid) {
    Result<ManifestSummary> s = read_summary(fs, path);
    valid = s.ok() && s->step == step;
  }
  if (valid) return Aside::restorable;
  return old_form ? Aside::leave : Aside::garbage;
}

// Restorable displaced steps of `root` (lock-free: a reader's first look).
Result<std::vector<std::string>> restorable_asides(Filesystem& fs, const std::string& root,
                                                   const uint64_t* only_step) {
  std::vector<std::string> out;
  Result<std::vector<std::string>> names = fs.list(root);
  if (!names.ok()) {
    if (names.status().code() == StatusCode::not_found) return out;
    return names.status();
  }
  for (const std::string& name : *names) {
    uint64_t step = 0;
    if (!parse_displaced_dir_name(name, &step)) continue;
    if (only_step != nullptr && step != *only_step) continue;
    if (classify_aside(fs, root, name, step) == Aside::restorable)
      out.push_back(join_path(root, name));
  }
  return out;
}

}  // namespace

Status recover_displaced(Filesystem& fs, const std::string& root,
                         std::vector<std::string>* restored, std::vector<std::string>* garbage,
                         bool restore) {
  FERRY_ASSIGN_OR_RETURN(std::vector<std::string> names, fs.list(root));
  bool renamed = false;
  for (const std::string& name : names) {
    uint64_t step = 0;
    if (!parse_displaced_dir_name(name, &step)) continue;
    const std::string path = join_path(root, name);
    switch (classify_aside(fs, root, name, step)) {
      case Aside::garbage:
        if (garbage) garbage->push_back(path);
        continue;
      case Aside::live:
      case Aside::leave:
        continue;
      case Aside::restorable:
        break;
    }
    if (!restore) continue;
    // The overwrite that moved it aside never put a new step in its place
    // (its rename failed, or the process died in between): it is still the
    // checkpoint of that step.
    const std::string step_dir = join_path(root, step_dir_name(step));
    FERRY_RETURN_IF_ERROR(fs.rename(path, step_dir));
    renamed = true;
    if (restored) restored->push_back(step_dir);
  }
  if (renamed) FERRY_RETURN_IF_ERROR(fs.sync_dir(root));
  return Status::ok_status();
}

Result<std::vector<std::string>> finish_interrupted_overwrites(Filesystem& fs,
                                                               const std::string& root,
                                                               int64_t lock_wait_ms) {
  std::vector<std::string> restored;
  if (is_object_root(root)) return restored;  // no overwrite moves a step aside there
  FERRY_ASSIGN_OR_RETURN(std::vector<std::string> aside, restorable_asides(fs, root, nullptr));
  if (aside.empty()) return restored;  // the common case: no lock, nothing written
  // An overwrite in flight holds the lock with its old step aside on purpose:
  // once it is ours, whatever is still aside was left by one that died.
  Result<std::unique_ptr<FileLock>> lock = lock_root(fs, root, lock_wait_ms);
  if (!lock.ok())
    return lock.status().with_context(aside.front() +
                                      " was moved aside by an overwrite that did not finish, and "
                                      "putting it back needs the root's lock: ");
  FERRY_RETURN_IF_ERROR(recover_displaced(fs, root, &restored, nullptr));
  return restored;
}

Result<bool> overwrite_pending_for(Filesystem& fs, const std::string& root, uint64_t step) {
  if (is_object_root(root)) return false;
  FERRY_ASSIGN_OR_RETURN(std::vector<std::string> aside, restorable_asides(fs, root, &step));
  return !aside.empty();
}

namespace {

// An object root's garbage (no rename there, so no pending, displaced or
// trash names): under each step prefix, the save prefixes its MANIFEST does
// not name whose LEASE expired or is missing, and the uploads a crashed
// writer left unfinished there, once older than the grace. The leases are
// listed before the MANIFEST is read: a save puts its MANIFEST before it
// drops its LEASE, so a prefix seen without a lease that no MANIFEST read
// afterwards names is no save's. Nothing outside the root is looked at.
Result<GcReport> collect_object_garbage(Filesystem& fs, const std::string& root,
                                        int64_t now_unix_ms, int64_t grace_ms) {
  GcReport report;
  std::vector<std::string> kept_prefixes;  // "step-N/save-..." still leased
  FERRY_ASSIGN_OR_RETURN(std::vector<std::string> names, fs.list(root));
  for (const std::string& name : names) {
    if (!parse_step_dir_name(name, nullptr)) continue;
    const std::string step_dir = join_path(root, name);
    Result<std::vector<std::string>> saves = fs.list(step_dir);
    if (!saves.ok()) continue;  // gone meanwhile, or not a prefix
    struct Save {
      std::string prefix;
      bool lapsed;  // its lease lapsed, or it has none
      bool leased;  // a LEASE object is there
    };
    std::vector<Save> expired;
    for (const std::string& s : *saves) {
      if (!starts_with(s, "save-")) continue;
      Result<PendingLease> lease = read_lease(fs, join_path(step_dir, s));
      expired.push_back({s, !lease.ok() || lease->expires_unix_ms < now_unix_ms,
                         lease.status().code() != StatusCode::not_found});
    }
    Result<Manifest> m = read_manifest(fs, step_dir);
    if (!m.ok() && m.status().code() != StatusCode::not_found) continue;  // cannot tell: leave it
    for (const auto& [s, lapsed, leased] : expired) {
      const std::string path = join_path(step_dir, s);
      bool named = false;
      for (const ManifestFile& f : m.ok() ? m->files : std::vector<ManifestFile>{})
        named |= f.name.compare(0, s.size() + 1, s + "/") == 0;
      if (named) {
        // A save that died between its commit and dropping its lease left it.
        if (lapsed && leased) {
          Status st = fs.unlink(join_path(path, kLeaseFileName));
          if (st.ok())
            report.discarded.push_back(join_path(path, kLeaseFileName));
          else
            report.failed.push_back({path, st});
        }
        continue;
      }
      if (!lapsed) {
        report.kept.push_back(path);
        kept_prefixes.push_back(name + "/" + s + "/");
        continue;
      }
      Status st = remove_all(fs, path);
      if (st.ok())
        report.removed.push_back(path);
      else
        report.failed.push_back({path, st});
    }
  }
  FERRY_ASSIGN_OR_RETURN(std::vector<PendingUpload> uploads, unfinished_uploads(fs, root));
  FERRY_ASSIGN_OR_RETURN(s3::Url url, s3::parse_url(root));
  const std::string base = url.prefix.empty() ? "" : url.prefix + "/";
  for (const PendingUpload& u : uploads) {
    const std::string rel = u.key.substr(base.size());  // listed under the root's prefix
    bool leased = false;
    for (const std::string& k : kept_prefixes) leased |= rel.compare(0, k.size(), k) == 0;
    if (leased || u.started_unix_ms >= now_unix_ms - grace_ms) continue;
    const std::string path = join_path(root, rel) + " (upload " + u.id + ")";
    Status st = abort_unfinished_upload(fs, root, u);
    if (st.ok())
      report.discarded.push_back(path);
    else
      report.failed.push_back({path, st});
  }
  return report;
}

}  // namespace

Result<GcReport> collect_garbage(Filesystem& fs, const std::string& root, int64_t now_unix_ms,
                                 int64_t grace_ms, int64_t lock_wait_ms, bool restore_displaced) {
  if (is_object_root(root)) return collect_object_garbage(fs, root, now_unix_ms, grace_ms);
  GcReport report;
  std::vector<std::string> trash;  // out of sight, to delete once unlocked
  {
    // Under the lock no commit is between moving a step aside and putting
    // the new one in place, and none is writing LATEST: what looks
    // abandoned here is.
    FERRY_ASSIGN_OR_RETURN(std::unique_ptr<FileLock> lock, lock_root(fs, root, lock_wait_ms));
    std::vector<std::string> replaced;
    FERRY_RETURN_IF_ERROR(
        recover_displaced(fs, root, &report.restored, &replaced, restore_displaced));
    FERRY_ASSIGN_OR_RETURN(std::vector<std::string> names, fs.list(root));
    bool moved = false;
    auto take_out_of_sight = [&](const std::string& path) -> Status {
      const std::string to = join_path(root, trash_dir_name());
      FERRY_RETURN_IF_ERROR(fs.rename(path, to));
      moved = true;
      trash.push_back(to);
      return Status::ok_status();
    };
    for (const std::string& path : replaced) {
      FERRY_RETURN_IF_ERROR(take_out_of_sight(path));
      report.discarded.push_back(path);
    }
    for (const std::string& name : names) {
      const std::string path = join_path(root, name);
      if (is_trash_dir_name(name)) {
        trash.push_back(path);  // a gc or retention that died before deleting
        report.discarded.push_back(path);
        continue;
      }
      if (starts_with(name, kLatestFileName) &&
          name.compare(std::char_traits<char>::length(kLatestFileName),
                       std::char_traits<char>::length(kLatestTempInfix), kLatestTempInfix) == 0) {
        // Every LATEST write happens under the lock: this one's writer died.
        Status st = fs.unlink(path);
        if (!st.ok() && st.code() != StatusCode::not_found) return st;
        report.discarded.push_back(path);
        continue;
      }
      if (!is_pending_dir_name(name)) continue;
      if (std::find(replaced.begin(), replaced.end(), path) != replaced.end()) continue;
      Result<FileInfo> st = fs.lstat(path);
      if (!st.ok()) {
        if (st.status().code() == StatusCode::not_found) continue;  // restored or gone
        return st.status();
      }
      if (st->is_symlink) {
        // No save's directory is a link: never read a lease through it.
        FERRY_RETURN_IF_ERROR(take_out_of_sight(path));
        report.discarded.push_back(path);
        continue;
      }
      bool expired;
      Result<PendingLease> lease = read_lease(fs, path);
      if (lease.ok()) {
        expired = lease->expires_unix_ms < now_unix_ms;
      } else {
        // No lease yet (a save that just made its directory), a torn one,
        // or a directory older versions moved aside: only the directory's
        // age says whether anyone still owns it.
        expired = st->mtime_unix_ms < now_unix_ms - grace_ms;
      }
      if (expired) {
        // One rename takes it out of sight whole: a saver that wakes up
        // after its lease lapsed finds no directory, never a half-deleted
        // one that it could still commit.
        FERRY_RETURN_IF_ERROR(take_out_of_sight(path));
        report.removed.push_back(path);
      } else {
        report.kept.push_back(path);
      }
    }
    if (moved) FERRY_RETURN_IF_ERROR(fs.sync_dir(root));
  }
  for (const std::string& path : trash) {
    fs.crash_point("gc.delete");
    Status st = remove_all(fs, path);
    if (st.ok()) continue;
    report.failed.push_back({path, st.with_context("deleting " + path + ": ")});
    // Still there: not discarded after all.
    report.discarded.erase(std::remove(report.discarded.begin(), report.discarded.end(), path),
                           report.discarded.end());
  }
  return report;
}

namespace {

struct Loadable {
  std::string path;
  uint64_t step = 0;
  uint64_t commit_seq = 0;
};

// The committed checkpoints of ROOT that can be loaded (the manifest reads
// and every file it names is a regular file of its size), oldest (by
// commit_seq, then step) first.
Result<std::vector<Loadable>> loadable_checkpoints(Filesystem& fs, const std::string& root,
                                                   ManifestCache* cache) {
  FERRY_ASSIGN_OR_RETURN(std::vector<std::string> names, fs.list(root));
  std::vector<Loadable> out;
  for (const std::string& name : names) {
    uint64_t step = 0;
    if (!parse_step_dir_name(name, &step)) continue;
    const std::string path = join_path(root, name);
    if (!check_step_dir(fs, path).ok()) continue;
    Result<std::shared_ptr<const ManifestCache::Decoded>> m = decoded_manifest(fs, path, cache);
    if (!m.ok()) continue;
    bool whole = true;
    for (const ManifestFile& f : (*m)->files) {
      Result<FileInfo> st = fs.lstat(join_path(path, f.name));
      if (!st.ok() || !st->is_regular || st->size != f.size) {
        whole = false;
        break;
      }
    }
    if (whole) out.push_back({path, step, (*m)->commit_seq});
  }
  std::stable_sort(out.begin(), out.end(), [](const Loadable& a, const Loadable& b) {
    if (a.commit_seq != b.commit_seq) return a.commit_seq < b.commit_seq;
    return a.step < b.step;
  });
  return out;
}

}  // namespace

Result<Retired> retire_checkpoints(Filesystem& fs, const std::string& root, uint32_t keep_last,
                                   const std::string& keep_path,
                                   const std::vector<std::string>& spare, ManifestCache* cache) {
  Retired out;
  if (keep_last == 0) return out;
  // Under the lock: a displaced step is either the caller's to put back
  // (spare) or already back. Only loadable checkpoints count toward
  // keep_last: one whose files are gone must not push out the last one that
  // can still be loaded.
  FERRY_ASSIGN_OR_RETURN(std::vector<Loadable> committed, loadable_checkpoints(fs, root, cache));
  if (committed.size() <= keep_last) return out;
  const size_t drop = committed.size() - keep_last;
  for (size_t i = 0; i < drop; ++i) {
    const Loadable& c = committed[i];
    if (!keep_path.empty() && c.path == keep_path) continue;
    if (std::find(spare.begin(), spare.end(), c.path) != spare.end()) continue;
    // Out of sight before any byte goes: a crash halfway through deleting
    // must not leave a step-* directory whose manifest names missing files.
    // The trash name makes a leftover collectable by collect_garbage.
    std::string trash = join_path(root, trash_dir_name());
    if (is_object_root(root)) {
      // No rename there: without its MANIFEST the step is no checkpoint.
      FERRY_RETURN_IF_ERROR(fs.unlink(join_path(c.path, kManifestFileName)));
      trash = c.path;
    } else {
      FERRY_RETURN_IF_ERROR(fs.rename(c.path, trash));
    }
    out.checkpoints.push_back(c.path);
    out.trash.push_back(std::move(trash));
  }
  if (out.trash.empty()) return out;
  FERRY_RETURN_IF_ERROR(fs.sync_dir(root));
  fs.crash_point("retention.delete");
  return out;
}

Result<std::vector<std::string>> apply_retention(Filesystem& fs, const std::string& root,
                                                 uint32_t keep_last, const std::string& keep_path,
                                                 int64_t lock_wait_ms) {
  Result<Retired> retired = Retired{};
  {
    FERRY_ASSIGN_OR_RETURN(std::unique_ptr<FileLock> lock, lock_root(fs, root, lock_wait_ms));
    retired = retire_checkpoints(fs, root, keep_last, keep_path);
  }
  FERRY_ASSIGN_OR_RETURN(Retired r, std::move(retired));
  for (const std::string& t : r.trash) FERRY_RETURN_IF_ERROR(remove_all(fs, t));
  return std::move(r.checkpoints);
}

int64_t now_unix_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

Result<std::string> resolve_checkpoint(Filesystem& fs, const std::string& path,
                                       ManifestCache* cache) {
  if (path.empty()) return Status::not_found("no checkpoint to load (empty path)");
  std::string base = path;
  while (base.size() > 1 && base.back() == '/') base.pop_back();
  base = base.substr(base.find_last_of('/') + 1);
  // A crash after the manifest write but before the rename leaves a
  // complete-looking pending directory: never load one.
  if (is_pending_dir_name(base))
    return Status::invalid_argument(path + " is a pending (uncommitted) checkpoint");
  if (is_trash_dir_name(base) || parse_displaced_dir_name(base, nullptr))
    return Status::invalid_argument(path + " is a checkpoint on its way to deletion");
  if (parse_step_dir_name(base, nullptr)) {
    // A step of a root: an overwrite that died may have left it aside.
    std::string dir = path;
    while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
    FERRY_RETURN_IF_ERROR(finish_interrupted_overwrites(fs, parent_path(dir)).status());
    Result<FileInfo> st = fs.lstat(dir);
    if (st.ok() && st->is_symlink)
      return Status::invalid_argument(path + " is a symbolic link, which Ferry never follows");
  }
  if (fs.stat(join_path(path, kManifestFileName)).ok()) return path;
  auto latest = find_latest(fs, path, cache);
  if (!latest.ok()) return Status::not_found("no committed checkpoint at " + path);
  return latest->path;
}

}  // namespace ferry
