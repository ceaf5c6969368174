#include "drills/cut_model.hpp"

#include <unistd.h>

#include <algorithm>
#include <climits>

namespace ferry::drills {

std::string normalize_path(const std::string& p) {
  std::string in = p;
  if (in.empty() || in[0] != '/') {
    char buf[PATH_MAX];
    std::string cwd = ::getcwd(buf, sizeof(buf)) ? buf : "";
    in = cwd + "/" + in;
  }
  std::string out;
  size_t i = 0;
  while (i < in.size()) {
    size_t j = in.find('/', i);
    if (j == std::string::npos) j = in.size();
    std::string part = in.substr(i, j - i);
    if (!part.empty() && part != ".") out += "/" + part;
    i = j + 1;
  }
  return out.empty() ? "/" : out;
}

namespace {

bool is_at_or_under(const std::string& p, const std::string& dir) {
  if (dir == "/") return !p.empty() && p[0] == '/';
  if (p.compare(0, dir.size(), dir) != 0) return false;
  return p.size() == dir.size() || p[dir.size()] == '/';
}

// Moves `p` along with a rename of `from` to `to` when it lies at or under
// `from`.
bool rebase(std::string& p, const std::string& from, const std::string& to) {
  if (from == "/" || !is_at_or_under(p, from)) return false;
  p = to + p.substr(from.size());
  return true;
}

Status restore(Filesystem& fs, const std::string& path, const Saved& saved,
               const CutModel::Loader& load) {
  if (saved.kind == Saved::Kind::none) return Status::ok_status();
  if (saved.kind == Saved::Kind::dir) return fs.mkdir(path);
  FERRY_ASSIGN_OR_RETURN(std::string bytes, load(saved));
  // Not synced: the cut models what survived, it is not itself at risk.
  return write_file_atomic(fs, path, bytes, /*sync=*/false);
}

}  // namespace

std::shared_ptr<Node> CutModel::find(const std::string& path) const {
  auto it = nodes_.find(path);
  return it == nodes_.end() ? nullptr : it->second;
}

std::shared_ptr<Node> CutModel::created(const std::string& path, bool is_dir) {
  PendingOp op;
  op.kind = PendingOp::Kind::create;
  op.is_dir = is_dir;
  op.path = path;
  op.needs = {parent_path(path)};
  pending_.push_back(std::move(op));
  if (is_dir) return nullptr;
  return track(path, 0, 0);
}

std::shared_ptr<Node> CutModel::opened(const std::string& path, bool truncated, uint64_t size) {
  std::shared_ptr<Node> n = find(path);
  if (!n) return track(path, truncated ? 0 : size, truncated ? 0 : size);
  if (truncated)
    n->synced = n->size = 0;
  else
    n->size = size;
  return n;
}

void CutModel::synced(const std::string& path, uint64_t size) {
  std::shared_ptr<Node> n = find(path);
  if (!n) n = track(path, size, size);
  n->synced = size;
}

void CutModel::truncated(const std::string& path, uint64_t size) {
  std::shared_ptr<Node> n = find(path);
  if (!n) return;
  n->synced = std::min(n->synced, size);
  n->size = size;
}

void CutModel::renamed(const std::string& from, const std::string& to, Saved saved) {
  if (from == to) return;  // rename(2) of a path onto itself does nothing
  drop_nodes_under(to);    // what the rename replaced is gone
  move(from, to, pending_.size());
  PendingOp op;
  op.kind = PendingOp::Kind::rename;
  op.path = from;
  op.to = to;
  op.needs = {parent_path(to)};
  if (parent_path(from) != parent_path(to)) op.needs.push_back(parent_path(from));
  op.saved = std::move(saved);
  pending_.push_back(std::move(op));
}

std::vector<PendingOp> CutModel::dir_synced(const std::string& dir) {
  std::vector<PendingOp> done;
  std::vector<PendingOp> keep;
  for (PendingOp& op : pending_) {
    op.needs.erase(std::remove(op.needs.begin(), op.needs.end(), dir), op.needs.end());
    (op.needs.empty() ? done : keep).push_back(std::move(op));
  }
  pending_ = std::move(keep);
  return done;
}

std::vector<PendingOp> CutModel::removed(const std::string& path) {
  drop_nodes_under(path);
  std::vector<PendingOp> gone;
  std::vector<PendingOp> keep;
  for (PendingOp& op : pending_) {
    const std::string& where = op.kind == PendingOp::Kind::create ? op.path : op.to;
    (is_at_or_under(where, path) ? gone : keep).push_back(std::move(op));
  }
  pending_ = std::move(keep);
  return gone;
}

std::vector<std::string> CutModel::side_files() const {
  std::vector<std::string> out;
  for (const PendingOp& op : pending_)
    if (!op.saved.side_file.empty()) out.push_back(op.saved.side_file);
  return out;
}

void CutModel::reset() {
  for (auto& kv : nodes_) kv.second->removed = true;
  nodes_.clear();
  pending_.clear();
}

Status CutModel::cut(Filesystem& fs, const Loader& load) {
  Status first;
  auto keep_first = [&first](const Status& st) {
    if (!st.ok() && st.code() != StatusCode::not_found && first.ok()) first = st;
  };
  while (!pending_.empty()) {
    PendingOp op = std::move(pending_.back());
    pending_.pop_back();
    if (op.kind == PendingOp::Kind::create) {
      keep_first(remove_all(fs, op.path));
      drop_nodes_under(op.path);
      continue;
    }
    Status st = fs.rename(op.to, op.path);
    keep_first(st);
    if (!st.ok()) continue;  // the destination is gone: nothing to move back
    move(op.to, op.path, pending_.size());
    keep_first(restore(fs, op.to, op.saved, load));
  }
  for (auto& kv : nodes_) {
    const Node& n = *kv.second;
    Result<FileInfo> info = fs.stat(n.path);
    if (!info.ok()) {
      keep_first(info.status());
      continue;
    }
    if (info->is_dir || info->size <= n.synced) continue;
    OpenOptions o;
    o.write = true;
    Result<std::unique_ptr<File>> f = fs.open(n.path, o);
    if (!f.ok()) {
      keep_first(f.status());
      continue;
    }
    keep_first((*f)->truncate(n.synced));
    keep_first((*f)->close());
  }
  reset();
  return first;
}

std::shared_ptr<Node> CutModel::track(const std::string& path, uint64_t size, uint64_t synced) {
  drop_nodes_under(path);
  auto n = std::make_shared<Node>();
  n->path = path;
  n->size = size;
  n->synced = synced;
  nodes_[path] = n;
  return n;
}

std::vector<std::string> CutModel::keys_under(const std::string& dir) const {
  std::vector<std::string> keys;
  for (auto it = nodes_.lower_bound(dir); it != nodes_.end(); ++it) {
    if (it->first.compare(0, dir.size(), dir) != 0) break;  // past the prefix
    if (is_at_or_under(it->first, dir)) keys.push_back(it->first);
  }
  return keys;
}

void CutModel::drop_nodes_under(const std::string& path) {
  for (const std::string& k : keys_under(path)) {
    nodes_[k]->removed = true;
    nodes_.erase(k);
  }
}

void CutModel::move(const std::string& from, const std::string& to, size_t ops) {
  std::vector<std::shared_ptr<Node>> moved;
  for (const std::string& k : keys_under(from)) {
    moved.push_back(nodes_[k]);
    nodes_.erase(k);
  }
  for (auto& n : moved) {
    rebase(n->path, from, to);
    nodes_[n->path] = n;
  }
  for (size_t i = 0; i < ops; ++i) {
    PendingOp& op = pending_[i];
    rebase(op.path, from, to);
    if (op.kind == PendingOp::Kind::rename) rebase(op.to, from, to);
    for (std::string& d : op.needs) rebase(d, from, to);
  }
}

}  // namespace ferry::drills
