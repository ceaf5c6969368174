// The catalog reads a checkpoint root only through the Filesystem interface,
// so fault-injection tests see every call it makes.
#include "ferry/catalog.hpp"
#include "ferry/kill_point.hpp"

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <limits>

namespace ferry {
namespace {

constexpr char kStepPrefix[] = "step-";
constexpr char kPendingPrefix[] = ".pending-";
constexpr size_t kStepDigits = 8;

bool starts_with(const std::string& s, const char* prefix) {
  return s.compare(0, std::char_traits<char>::length(prefix), prefix) == 0;
}

std::string padded_step(uint64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%08" PRIu64, step);
  return buf;
}

// Parses "<expires_unix_ms> <owner>\n"; false when the text is not a lease.
bool parse_lease(const std::string& text, int64_t* expires) {
  size_t end = text.find_first_of(" \n");
  std::string number = text.substr(0, end);
  if (number.empty() || number.size() > 19) return false;
  for (char c : number) {
    if (c < '0' || c > '9') return false;
  }
  *expires = std::stoll(number);
  return true;
}

// The name LATEST holds, without the trailing newline; empty when absent.
std::string read_latest_hint(Filesystem& fs, const std::string& root) {
  Result<std::string> text = read_file(fs, join_path(root, kLatestFileName));
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

Result<Manifest> read_manifest(Filesystem& fs, const std::string& checkpoint_dir) {
  std::string path = join_path(checkpoint_dir, kManifestFileName);
  FERRY_ASSIGN_OR_RETURN(std::string bytes, read_file(fs, path));
  Result<Manifest> m = decode_manifest(bytes);
  if (!m.ok()) return m.status().with_context(path + ": ");
  return m;
}

Result<std::vector<CheckpointInfo>> list_checkpoints(Filesystem& fs, const std::string& root) {
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
    Result<FileInfo> st = fs.stat(info.path);
    if (st.ok() && !st->is_dir) continue;  // a stray file with a step-like name
    Result<Manifest> m = read_manifest(fs, info.path);
    if (m.ok()) {
      info.commit_seq = m->commit_seq;
      info.bytes = m->total_bytes();
      info.tensors = m->tensors.size();
    } else {
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

Result<CheckpointInfo> find_latest(Filesystem& fs, const std::string& root) {
  FERRY_ASSIGN_OR_RETURN(std::vector<CheckpointInfo> all, list_checkpoints(fs, root));
  // Sorted by (commit_seq, step): the last readable one wins.
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    if (it->status.ok()) return *it;
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

Result<GcReport> collect_garbage(Filesystem& fs, const std::string& root, int64_t now_unix_ms,
                                 int64_t grace_ms) {
  FERRY_ASSIGN_OR_RETURN(std::vector<std::string> names, fs.list(root));
  GcReport report;
  for (const std::string& name : names) {
    if (!is_pending_dir_name(name)) continue;
    std::string path = join_path(root, name);
    bool expired;
    int64_t expires = 0;
    Result<std::string> lease = read_file(fs, join_path(path, kLeaseFileName));
    // Checkpoints moved aside by retention or by an overwrite are garbage by
    // construction: no save owns them.
    if (name.find("-retired-") != std::string::npos ||
        name.find("-replaced-") != std::string::npos) {
      expired = true;
    } else if (lease.ok() && parse_lease(*lease, &expires)) {
      expired = expires < now_unix_ms;
    } else {
      // No lease yet (a save that just made its directory) or a torn one:
      // only the directory's age says whether anyone still owns it.
      Result<FileInfo> st = fs.stat(path);
      if (!st.ok()) {
        if (st.status().code() == StatusCode::not_found) continue;  // committed or gone
        return st.status();
      }
      expired = st->mtime_unix_ms < now_unix_ms - grace_ms;
    }
    if (expired) {
      kill_point("gc.delete");
      FERRY_RETURN_IF_ERROR(remove_all(fs, path));
      report.removed.push_back(path);
    } else {
      report.kept.push_back(path);
    }
  }
  return report;
}

Result<std::vector<std::string>> apply_retention(Filesystem& fs, const std::string& root,
                                                 uint32_t keep_last) {
  std::vector<std::string> removed;
  if (keep_last == 0) return removed;
  FERRY_ASSIGN_OR_RETURN(std::vector<CheckpointInfo> all, list_checkpoints(fs, root));
  std::vector<CheckpointInfo> committed;
  for (CheckpointInfo& c : all) {
    if (c.status.ok()) committed.push_back(std::move(c));
  }
  if (committed.size() <= keep_last) return removed;
  size_t drop = committed.size() - keep_last;
  for (size_t i = 0; i < drop; ++i) {
    const CheckpointInfo& c = committed[i];
    // Rename out of sight first, durably: a crash halfway through deleting
    // must not leave a step-* directory whose manifest names missing files.
    // The pending name makes a leftover collectable by collect_garbage.
    std::string trash =
        join_path(root, pending_dir_name(c.step, "retired", std::to_string(c.commit_seq)));
    FERRY_RETURN_IF_ERROR(remove_all(fs, trash));
    FERRY_RETURN_IF_ERROR(fs.rename(c.path, trash));
    FERRY_RETURN_IF_ERROR(fs.sync_dir(root));
    removed.push_back(c.path);
    kill_point("retention.delete");
    FERRY_RETURN_IF_ERROR(remove_all(fs, trash));
  }
  FERRY_RETURN_IF_ERROR(fs.sync_dir(root));
  return removed;
}

int64_t now_unix_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

Result<std::string> resolve_checkpoint(Filesystem& fs, const std::string& path) {
  if (path.empty()) return Status::not_found("no checkpoint to load (empty path)");
  std::string base = path;
  while (base.size() > 1 && base.back() == '/') base.pop_back();
  base = base.substr(base.find_last_of('/') + 1);
  // A crash after the manifest write but before the rename leaves a
  // complete-looking pending directory: never load one.
  if (is_pending_dir_name(base))
    return Status::invalid_argument(path + " is a pending (uncommitted) checkpoint");
  if (fs.stat(join_path(path, kManifestFileName)).ok()) return path;
  auto latest = find_latest(fs, path);
  if (!latest.ok()) return Status::not_found("no committed checkpoint at " + path);
  return latest->path;
}

}  // namespace ferry
