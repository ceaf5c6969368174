// The fault-injecting Filesystem: fault rules, the power-cut model, its
// journal, and the FERRY_FAULTS spec parser.
#include "ferry/fault_fs.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

namespace ferry {
namespace {

constexpr char kJournalHeader[] = "ferry-fault-journal 1";
// A rename that replaces a bigger file does not save it (see the header).
constexpr uint64_t kMaxSavedBytes = 64ull << 20;

constexpr std::array<const char*, kFaultOpCount> kOpNames = {
    "open", "write", "read", "sync", "rename", "mkdir", "unlink", "rmdir", "truncate", "close"};

// ---- paths ------------------------------------------------------------------

// The model compares paths as strings, so every spelling of one path must
// become the same string: absolute (a journal is replayed by another process,
// maybe in another directory), no empty or "." components. ".." is kept as
// written: resolving it lexically is wrong through symlinks.
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

bool path_matches(const std::string& filter, const std::string& path) {
  if (filter.empty()) return true;
  if (filter.back() == '$') {
    const size_t n = filter.size() - 1;
    return path.size() >= n && path.compare(path.size() - n, n, filter, 0, n) == 0;
  }
  return path.find(filter) != std::string::npos;
}

// ---- journal encoding ---------------------------------------------------------

// Journal fields are separated by spaces, one event a line, so paths are
// percent-encoded where they hold a space, a control byte or '%'.
std::string encode_field(const std::string& s) {
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  for (unsigned char c : s) {
    if (c <= 0x20 || c == '%' || c == 0x7f) {
      out += '%';
      out += kHex[c >> 4];
      out += kHex[c & 15];
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

bool decode_field(const std::string& s, std::string* out) {
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  out->clear();
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '%') {
      *out += s[i];
      continue;
    }
    if (i + 2 >= s.size()) return false;
    int hi = hex(s[i + 1]), lo = hex(s[i + 2]);
    if (hi < 0 || lo < 0) return false;
    *out += static_cast<char>(hi * 16 + lo);
    i += 2;
  }
  return true;
}

bool parse_u64(const std::string& s, uint64_t* out) {
  if (s.empty() || s.size() > 20) return false;
  uint64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    uint64_t d = static_cast<uint64_t>(c - '0');
    if (v > (UINT64_MAX - d) / 10) return false;
    v = v * 10 + d;
  }
  *out = v;
  return true;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t i = 0;
  while (true) {
    size_t j = s.find(sep, i);
    out.push_back(s.substr(i, j == std::string::npos ? std::string::npos : j - i));
    if (j == std::string::npos) break;
    i = j + 1;
  }
  return out;
}

// ---- local side files (journal, saved replaced files) ---------------------------

// The journal and the files it refers to are local files written with plain
// POSIX calls, never through the wrapped filesystem: faults and the power
// cut must not touch them.
Result<std::string> read_local_file(const std::string& path) {
  int fd;
  do {
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) return Status::from_errno(errno, "open", path);
  std::string out;
  char buf[65536];
  while (true) {
    ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      ::close(fd);
      return Status::from_errno(err, "read", path);
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return out;
}

Status write_all(int fd, const std::string& bytes, const std::string& path) {
  const char* p = bytes.data();
  size_t left = bytes.size();
  while (left > 0) {
    ssize_t n = ::write(fd, p, left);
    if (n < 0) {
      if (errno == EINTR) continue;
      return Status::from_errno(errno, "write", path);
    }
    if (n == 0) return Status::from_errno(ENOSPC, "write", path);
    p += n;
    left -= static_cast<size_t>(n);
  }
  return Status::ok_status();
}

Status write_local_file(const std::string& path, const std::string& bytes) {
  int fd;
  do {
    fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) return Status::from_errno(errno, "open", path);
  Status st = write_all(fd, bytes, path);
  if (::close(fd) != 0 && st.ok()) st = Status::from_errno(errno, "close", path);
  return st;
}

Status append_local_line(const std::string& path, const std::string& line) {
  int fd;
  do {
    fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) return Status::from_errno(errno, "open", path);
  Status st = write_all(fd, line, path);
  ::close(fd);
  return st;
}

// ---- the power-cut model ---------------------------------------------------------

// A file written through the wrapper, followed across renames.
struct Node {
  std::string path;      // where it is now (normalised)
  uint64_t size = 0;     // its length as the live process knows it (unused in replay)
  uint64_t synced = 0;   // durable length
  bool removed = false;  // unlinked or replaced: no longer in the model
};

// What a rename replaced, to put back when the rename is undone.
struct Saved {
  enum class Kind : uint8_t { none, file, dir };
  Kind kind = Kind::none;
  std::shared_ptr<const std::string> data;  // in memory (live process)
  std::string side_file;                    // or in a journal side file
};

// A namespace change that a power cut would lose, and the directories
// whose sync_dir would make it durable.
struct PendingOp {
  enum class Kind : uint8_t { create, rename };
  Kind kind = Kind::create;
  bool is_dir = false;  // create: a directory
  std::string path;     // create: the new entry; rename: the source
  std::string to;       // rename: the destination
  std::vector<std::string> needs;
  Saved saved;
};

// The model is a function of the event sequence alone, so the live
// filesystem and a journal replay build the same state by calling the same
// methods. Not thread-safe: the owner locks.
class CutModel {
 public:
  using Loader = std::function<Result<std::string>(const Saved&)>;

  std::shared_ptr<Node> find(const std::string& path) const {
    auto it = nodes_.find(path);
    return it == nodes_.end() ? nullptr : it->second;
  }

  std::shared_ptr<Node> created(const std::string& path, bool is_dir) {
    PendingOp op;
    op.kind = PendingOp::Kind::create;
    op.is_dir = is_dir;
    op.path = path;
    op.needs = {parent_path(path)};
    pending_.push_back(std::move(op));
    if (is_dir) return nullptr;
    return track(path, 0, 0);
  }

  // A write-open of a file that existed: what it held then counts as durable,
  // unless the open truncated it.
  std::shared_ptr<Node> opened(const std::string& path, bool truncated, uint64_t size) {
    std::shared_ptr<Node> n = find(path);
    if (!n) return track(path, truncated ? 0 : size, truncated ? 0 : size);
    if (truncated)
      n->synced = n->size = 0;
    else
      n->size = size;
    return n;
  }

  void synced(const std::string& path, uint64_t size) {
    std::shared_ptr<Node> n = find(path);
    if (!n) n = track(path, size, size);
    n->synced = size;
  }

  void truncated(const std::string& path, uint64_t size) {
    std::shared_ptr<Node> n = find(path);
    if (!n) return;
    n->synced = std::min(n->synced, size);
    n->size = size;
  }

  void renamed(const std::string& from, const std::string& to, Saved saved) {
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

  // Returns the ops this made durable (their saved files are not needed).
  std::vector<PendingOp> dir_synced(const std::string& dir) {
    std::vector<PendingOp> done;
    std::vector<PendingOp> keep;
    for (PendingOp& op : pending_) {
      op.needs.erase(std::remove(op.needs.begin(), op.needs.end(), dir), op.needs.end());
      (op.needs.empty() ? done : keep).push_back(std::move(op));
    }
    pending_ = std::move(keep);
    return done;
  }

  // unlink and rmdir are taken as durable at once (see the header): what
  // was at `path` leaves the model, and so do the pending ops that would
  // have to undo something there.
  std::vector<PendingOp> removed(const std::string& path) {
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

  std::vector<std::string> side_files() const {
    std::vector<std::string> out;
    for (const PendingOp& op : pending_)
      if (!op.saved.side_file.empty()) out.push_back(op.saved.side_file);
    return out;
  }

  void reset() {
    for (auto& kv : nodes_) kv.second->removed = true;
    nodes_.clear();
    pending_.clear();
  }

  // Undoes the pending namespace ops newest first, then truncates files.
  // Newest first because each op's paths are those of the state right after
  // it: walking back one op at a time, each undo finds its paths where it
  // recorded them (an undone rename moves the paths of older ops back with
  // it). Renames and creations are interleaved in that one walk rather than
  // all renames first: a file created and then renamed must be renamed back
  // before its creation can be undone at its first name. Truncation comes
  // last, when every surviving file is at its final path.
  Status cut(Filesystem& fs, const Loader& load) {
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

 private:
  std::shared_ptr<Node> track(const std::string& path, uint64_t size, uint64_t synced) {
    drop_nodes_under(path);
    auto n = std::make_shared<Node>();
    n->path = path;
    n->size = size;
    n->synced = synced;
    nodes_[path] = n;
    return n;
  }

  std::vector<std::string> keys_under(const std::string& dir) const {
    std::vector<std::string> keys;
    for (auto it = nodes_.lower_bound(dir); it != nodes_.end(); ++it) {
      if (it->first.compare(0, dir.size(), dir) != 0) break;  // past the prefix
      if (is_at_or_under(it->first, dir)) keys.push_back(it->first);
    }
    return keys;
  }

  void drop_nodes_under(const std::string& path) {
    for (const std::string& k : keys_under(path)) {
      nodes_[k]->removed = true;
      nodes_.erase(k);
    }
  }

  // Carries the files under `from` and the paths of the first `ops` pending
  // ops along with a rename.
  void move(const std::string& from, const std::string& to, size_t ops) {
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

  static Status restore(Filesystem& fs, const std::string& path, const Saved& saved,
                        const Loader& load) {
    if (saved.kind == Saved::Kind::none) return Status::ok_status();
    if (saved.kind == Saved::Kind::dir) return fs.mkdir(path);
    FERRY_ASSIGN_OR_RETURN(std::string bytes, load(saved));
    OpenOptions o;
    o.write = true;
    o.create = true;
    o.truncate = true;
    FERRY_ASSIGN_OR_RETURN(std::unique_ptr<File> f, fs.open(path, o));
    Status st = f->pwrite(bytes.data(), bytes.size(), 0);
    Status closed = f->close();
    return st.ok() ? closed : st;
  }

  std::map<std::string, std::shared_ptr<Node>> nodes_;
  std::vector<PendingOp> pending_;  // oldest first
};

// The journal: a header line, then one event a line, fields separated by
// spaces, paths normalised and percent-encoded, each written after the
// operation succeeded:
//   C f|d PATH         created a file / a directory
//   O 0|1 SIZE PATH    opened an existing file for writing (1: truncated)
//   S SIZE PATH        File::sync made SIZE bytes durable
//   T SIZE PATH        File::truncate
//   R SAVED FROM TO    rename; SAVED is '-', 'd' (replaced an empty directory)
//                      or 'f:SIDEFILE' (replaced a file, saved there)
//   D PATH             sync_dir
//   U PATH             unlink or rmdir
//   X                  a power cut was applied: forget everything before
// Feeds one journal line to the model. False if it is not a valid event.
bool replay_line(CutModel& model, const std::string& line) {
  std::vector<std::string> f = split(line, ' ');
  std::string a, b;
  uint64_t n = 0, t = 0;
  if (f[0] == "C" && f.size() == 3 && (f[1] == "f" || f[1] == "d") && decode_field(f[2], &a)) {
    model.created(a, f[1] == "d");
  } else if (f[0] == "O" && f.size() == 4 && parse_u64(f[1], &t) && parse_u64(f[2], &n) &&
             decode_field(f[3], &a)) {
    model.opened(a, t != 0, n);
  } else if (f[0] == "S" && f.size() == 3 && parse_u64(f[1], &n) && decode_field(f[2], &a)) {
    model.synced(a, n);
  } else if (f[0] == "T" && f.size() == 3 && parse_u64(f[1], &n) && decode_field(f[2], &a)) {
    model.truncated(a, n);
  } else if (f[0] == "R" && f.size() == 4 && decode_field(f[2], &a) && decode_field(f[3], &b)) {
    Saved saved;
    if (f[1] == "d") {
      saved.kind = Saved::Kind::dir;
    } else if (f[1].compare(0, 2, "f:") == 0) {
      saved.kind = Saved::Kind::file;
      if (!decode_field(f[1].substr(2), &saved.side_file)) return false;
    } else if (f[1] != "-") {
      return false;
    }
    model.renamed(a, b, std::move(saved));
  } else if (f[0] == "D" && f.size() == 2 && decode_field(f[1], &a)) {
    model.dir_synced(a);
  } else if (f[0] == "U" && f.size() == 2 && decode_field(f[1], &a)) {
    model.removed(a);
  } else if (f[0] == "X" && f.size() == 1) {
    model.reset();
  } else {
    return false;
  }
  return true;
}

// Replays a whole journal. A last line without its newline is a write the
// writer did not finish (it died): ignored.
Status replay_journal(CutModel& model, const std::string& text, const std::string& path) {
  std::vector<std::string> lines = split(text, '\n');
  lines.pop_back();  // after the last '\n': empty or torn
  if (lines.empty() || lines[0] != kJournalHeader)
    return Status::corruption("fault journal " + path + ": does not start with '" + kJournalHeader +
                              "'");
  for (size_t i = 1; i < lines.size(); ++i) {
    // Every rank of a job may share one journal: each process that found it
    // empty wrote the header, so a repeated header is not an event.
    if (lines[i] == kJournalHeader) continue;
    if (!replay_line(model, lines[i]))
      return Status::corruption("fault journal " + path + " line " + std::to_string(i + 1) +
                                ": bad event '" + lines[i] + "'");
  }
  return Status::ok_status();
}

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

Status injected_status(int err, const std::string& op, const std::string& shown) {
  Status st = Status::from_errno(err, op, shown);
  return Status(st.code(), st.message() + " (injected)");
}

}  // namespace

// ---- shared state -------------------------------------------------------------------

struct FaultFilesystem::Impl {
  explicit Impl(std::shared_ptr<Filesystem> t) : target(std::move(t)) {}

  struct Decision {
    bool fire = false;
    bool short_write = false;
    int error = 0;
    std::chrono::microseconds delay{0};
  };

  // Counts the call against every rule that matches it; the first rule that
  // fires decides the error. Latency rules add up.
  Decision decide(FaultOp op, const std::string& p1, const std::string& p2) {
    std::lock_guard<std::mutex> lock(rules_mu);
    ++calls[static_cast<size_t>(op)];
    Decision d;
    for (RuleState& rs : rules) {
      const FaultRule& r = rs.rule;
      if (!r.any_op && r.op != op) continue;
      if (!path_matches(r.path_contains, p1) && (p2.empty() || !path_matches(r.path_contains, p2)))
        continue;
      if (r.action == FaultRule::Action::latency) {
        d.delay += r.latency;
        continue;
      }
      ++rs.seen;
      bool fire;
      if (r.nth > 0)
        fire = r.sticky ? rs.seen >= r.nth : rs.seen == r.nth;
      else
        fire = r.rate_den > 0 && splitmix64(rs.rng) % r.rate_den < r.rate_num;
      if (fire && !d.fire) {
        d.fire = true;
        d.error = r.error;
        d.short_write = r.action == FaultRule::Action::short_write && op == FaultOp::write;
      }
    }
    if (d.fire) ++injected;
    return d;
  }

  // Sleeps for any latency, then returns the injected error if one fires.
  // `label` and `shown` are what the POSIX filesystem would name in its
  // message; the paths are the normalised ones filters match.
  Status check(FaultOp op, const char* label, const std::string& shown, const std::string& p1,
               const std::string& p2 = std::string(), bool* short_write = nullptr) {
    Decision d = decide(op, p1, p2);
    if (d.delay.count() > 0) std::this_thread::sleep_for(d.delay);
    if (!d.fire) return Status::ok_status();
    if (short_write) *short_write = d.short_write;
    return injected_status(d.error, label, shown);
  }

  // REQUIRES: mu held. Appends one event; the line is written by one
  // write(2) so it is whole or absent when the process is killed.
  Status journal(const std::string& line) {
    if (journal_path.empty()) return Status::ok_status();
    return append_local_line(journal_path, line + "\n")
        .with_context("fault journal (the operation itself succeeded): ");
  }

  // REQUIRES: mu held.
  void forget_side_files(const std::vector<PendingOp>& ops) {
    for (const PendingOp& op : ops)
      if (!op.saved.side_file.empty()) ::unlink(op.saved.side_file.c_str());
  }

  Status open_journal(const std::string& path) {
    std::lock_guard<std::mutex> lock(mu);
    int fd;
    do {
      fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) return Status::from_errno(errno, "open fault journal", path);
    ::close(fd);
    FERRY_ASSIGN_OR_RETURN(std::string text, read_local_file(path));
    if (text.empty()) {
      FERRY_RETURN_IF_ERROR(append_local_line(path, std::string(kJournalHeader) + "\n"));
    } else {
      // A journal left by an earlier process: what it did not make durable
      // is still at risk, so this process's cut must undo it too.
      FERRY_RETURN_IF_ERROR(replay_journal(model, text, path));
    }
    journal_path = path;
    return Status::ok_status();
  }

  std::shared_ptr<Filesystem> target;

  mutable std::mutex rules_mu;  // guards the fields below, up to mu
  struct RuleState {
    FaultRule rule;
    uint64_t seen = 0;
    uint64_t rng = 0;
  };
  std::vector<RuleState> rules;
  std::array<uint64_t, kFaultOpCount> calls{};
  uint64_t injected = 0;

  // Guards the model and the journal. Held across namespace operations
  // (not across pwrite or fsync of files), so that the journal's order is
  // the order in which they really happened.
  std::mutex mu;
  CutModel model;
  std::string journal_path;
  uint64_t side_counter = 0;
};

namespace {

// A file whose operations pass through the fault rules, and which reports
// its writes, syncs and truncations to the model when open for writing.
class FaultFile : public File {
 public:
  FaultFile(std::shared_ptr<FaultFilesystem::Impl> impl, std::unique_ptr<File> base,
            std::string norm_path, std::shared_ptr<Node> node)
      : impl_(std::move(impl)),
        base_(std::move(base)),
        norm_path_(std::move(norm_path)),
        node_(std::move(node)) {}

  const std::string& path() const override { return base_->path(); }
  bool direct() const override { return base_->direct(); }

  Status pwrite(const void* data, size_t len, uint64_t offset) override {
    bool short_write = false;
    Status injected =
        impl_->check(FaultOp::write, "pwrite", path(), norm_path_, std::string(), &short_write);
    if (!injected.ok() && !short_write) return injected;
    size_t n = len;
    if (short_write) {
      // A disk filling mid-write: part of the buffer lands, then ENOSPC.
      // O_DIRECT needs whole blocks, so the prefix is cut to 4096 multiples.
      n = len / 2;
      if (direct()) n -= n % 4096;
    }
    Status st = n > 0 ? base_->pwrite(data, n, offset) : Status::ok_status();
    note_write(st.ok(), offset + n);
    return short_write && st.ok() ? injected : st;
  }

  Result<size_t> pread(void* data, size_t len, uint64_t offset) override {
    FERRY_RETURN_IF_ERROR(impl_->check(FaultOp::read, "pread", path(), norm_path_));
    return base_->pread(data, len, offset);
  }

  Status truncate(uint64_t size) override {
    FERRY_RETURN_IF_ERROR(impl_->check(FaultOp::truncate, "truncate", path(), norm_path_));
    FERRY_RETURN_IF_ERROR(base_->truncate(size));
    if (!node_) return Status::ok_status();
    std::lock_guard<std::mutex> lock(impl_->mu);
    if (node_->removed) return Status::ok_status();
    impl_->model.truncated(node_->path, size);
    return impl_->journal("T " + std::to_string(size) + " " + encode_field(node_->path));
  }

  Status sync() override {
    FERRY_RETURN_IF_ERROR(impl_->check(FaultOp::sync, "fsync", path(), norm_path_));
    uint64_t size = 0;
    if (node_) {
      // Only what was written before fsync started is covered by it.
      std::lock_guard<std::mutex> lock(impl_->mu);
      size = node_->size;
    }
    FERRY_RETURN_IF_ERROR(base_->sync());
    if (!node_) return Status::ok_status();
    std::lock_guard<std::mutex> lock(impl_->mu);
    if (node_->removed) return Status::ok_status();
    impl_->model.synced(node_->path, size);
    return impl_->journal("S " + std::to_string(size) + " " + encode_field(node_->path));
  }

  Status close() override {
    if (closed_) return Status::ok_status();  // idempotent, and never faulted twice
    closed_ = true;
    Status injected = impl_->check(FaultOp::close, "close", path(), norm_path_);
    // As on Linux, a failing close still releases the descriptor.
    Status st = base_->close();
    return injected.ok() ? st : injected;
  }

 private:
  void note_write(bool ok, uint64_t end) {
    if (!node_) return;
    uint64_t size = end;
    if (!ok) {
      // A real failure may have written part of the buffer: ask the disk.
      Result<FileInfo> info = impl_->target->stat(path());
      size = info.ok() ? info->size : 0;
    }
    std::lock_guard<std::mutex> lock(impl_->mu);
    node_->size = std::max(node_->size, size);
  }

  std::shared_ptr<FaultFilesystem::Impl> impl_;
  std::unique_ptr<File> base_;
  std::string norm_path_;
  std::shared_ptr<Node> node_;  // null when open read-only
  std::atomic<bool> closed_{false};
};

}  // namespace

const char* fault_op_name(FaultOp op) {
  return kOpNames[static_cast<size_t>(op)];
}

std::string FaultRule::to_string() const {
  std::string s;
  switch (action) {
    case Action::error:
      s = error == EIO ? "eio" : error == ENOSPC ? "enospc" : "errno" + std::to_string(error);
      break;
    case Action::short_write:
      s = "short";
      break;
    case Action::latency:
      s = "latency";
      break;
  }
  s += ":";
  s += any_op ? "any" : fault_op_name(op);
  if (action == Action::latency) {
    s += ":" + std::to_string(latency.count()) + "us";
  } else if (nth > 0) {
    s += ":" + std::to_string(nth) + (sticky ? "+" : "");
  } else {
    s += ":rate=" + std::to_string(rate_num) + "/" + std::to_string(rate_den) +
         ":seed=" + std::to_string(seed);
  }
  if (!path_contains.empty()) s += ":path=" + path_contains;
  return s;
}

// ---- FaultFilesystem ------------------------------------------------------------------

FaultFilesystem::FaultFilesystem(std::shared_ptr<Filesystem> target)
    : FilesystemWrapper(target), impl_(std::make_shared<Impl>(target)) {}

FaultFilesystem::~FaultFilesystem() = default;

Result<std::shared_ptr<FaultFilesystem>> FaultFilesystem::create(std::shared_ptr<Filesystem> target,
                                                                 FaultOptions options) {
  auto fs = std::make_shared<FaultFilesystem>(std::move(target));
  for (const FaultRule& r : options.rules) fs->add_rule(r);
  if (!options.journal_path.empty())
    FERRY_RETURN_IF_ERROR(fs->impl_->open_journal(normalize_path(options.journal_path)));
  return fs;
}

void FaultFilesystem::add_rule(const FaultRule& rule) {
  std::lock_guard<std::mutex> lock(impl_->rules_mu);
  Impl::RuleState rs;
  rs.rule = rule;
  rs.rng = rule.seed;
  impl_->rules.push_back(rs);
}

void FaultFilesystem::clear_rules() {
  std::lock_guard<std::mutex> lock(impl_->rules_mu);
  impl_->rules.clear();
}

uint64_t FaultFilesystem::calls(FaultOp op) const {
  std::lock_guard<std::mutex> lock(impl_->rules_mu);
  return impl_->calls[static_cast<size_t>(op)];
}

uint64_t FaultFilesystem::injected() const {
  std::lock_guard<std::mutex> lock(impl_->rules_mu);
  return impl_->injected;
}

Result<std::unique_ptr<File>> FaultFilesystem::open(const std::string& path, const OpenOptions& o) {
  const std::string np = normalize_path(path);
  FERRY_RETURN_IF_ERROR(impl_->check(FaultOp::open, "open", path, np));
  if (!o.write) {
    FERRY_ASSIGN_OR_RETURN(std::unique_ptr<File> f, target_->open(path, o));
    return std::unique_ptr<File>(new FaultFile(impl_, std::move(f), np, nullptr));
  }
  std::lock_guard<std::mutex> lock(impl_->mu);
  Result<FileInfo> before = target_->stat(path);
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<File> f, target_->open(path, o));
  std::shared_ptr<Node> node;
  Status journaled;
  if (o.create && !before.ok() && before.status().code() == StatusCode::not_found) {
    node = impl_->model.created(np, false);
    journaled = impl_->journal("C f " + encode_field(np));
  } else {
    uint64_t size = before.ok() ? before->size : 0;
    node = impl_->model.opened(np, o.truncate, size);
    journaled = impl_->journal("O " + std::string(o.truncate ? "1 " : "0 ") + std::to_string(size) +
                               " " + encode_field(np));
  }
  FERRY_RETURN_IF_ERROR(journaled);
  return std::unique_ptr<File>(new FaultFile(impl_, std::move(f), np, std::move(node)));
}

Status FaultFilesystem::mkdir(const std::string& path) {
  const std::string np = normalize_path(path);
  FERRY_RETURN_IF_ERROR(impl_->check(FaultOp::mkdir, "mkdir", path, np));
  std::lock_guard<std::mutex> lock(impl_->mu);
  FERRY_RETURN_IF_ERROR(target_->mkdir(path));
  impl_->model.created(np, true);
  return impl_->journal("C d " + encode_field(np));
}

Status FaultFilesystem::mkdirs(const std::string& path) {
  if (path.empty()) return Status::invalid_argument("mkdirs: empty path");
  const std::string np = normalize_path(path);
  FERRY_RETURN_IF_ERROR(impl_->check(FaultOp::mkdir, "mkdir", path, np));
  std::lock_guard<std::mutex> lock(impl_->mu);
  // Made one directory at a time (not by the target's mkdirs) so that each
  // directory this call creates is known to the model.
  size_t pos = 0;
  while (pos != std::string::npos) {
    pos = np.find('/', pos + 1);
    const std::string prefix = np.substr(0, pos);
    Result<FileInfo> info = target_->stat(prefix);
    if (info.ok()) {
      if (!info->is_dir) return Status::from_errno(ENOTDIR, "mkdir", prefix);
      continue;
    }
    if (info.status().code() != StatusCode::not_found) return info.status();
    Status st = target_->mkdir(prefix);
    if (st.code() == StatusCode::already_exists) continue;  // made by someone else meanwhile
    FERRY_RETURN_IF_ERROR(st);
    impl_->model.created(prefix, true);
    FERRY_RETURN_IF_ERROR(impl_->journal("C d " + encode_field(prefix)));
  }
  return Status::ok_status();
}

Status FaultFilesystem::rename(const std::string& from, const std::string& to) {
  const std::string nf = normalize_path(from);
  const std::string nt = normalize_path(to);
  FERRY_RETURN_IF_ERROR(impl_->check(FaultOp::rename, "rename", from + " -> " + to, nf, nt));
  std::lock_guard<std::mutex> lock(impl_->mu);
  // Keep what the rename replaces, so undoing it can put that back.
  Saved saved;
  Result<FileInfo> old = target_->stat(to);
  if (old.ok() && nf != nt) {
    if (old->is_dir) {
      saved.kind = Saved::Kind::dir;  // rename(2) only replaces an empty one
    } else if (old->size <= kMaxSavedBytes) {
      Result<std::string> bytes = read_file(*target_, to);
      if (bytes.ok()) {
        saved.kind = Saved::Kind::file;
        saved.data = std::make_shared<const std::string>(std::move(*bytes));
        if (!impl_->journal_path.empty()) {
          saved.side_file = impl_->journal_path + ".saved-" + std::to_string(::getpid()) + "-" +
                            std::to_string(impl_->side_counter++);
          FERRY_RETURN_IF_ERROR(write_local_file(saved.side_file, *saved.data));
        }
      }
    }
  }
  Status st = target_->rename(from, to);
  if (!st.ok()) {
    if (!saved.side_file.empty()) ::unlink(saved.side_file.c_str());
    return st;
  }
  std::string kind = "-";
  if (saved.kind == Saved::Kind::dir) kind = "d";
  if (saved.kind == Saved::Kind::file)
    kind = saved.side_file.empty() ? "-" : "f:" + encode_field(saved.side_file);
  impl_->model.renamed(nf, nt, saved);
  return impl_->journal("R " + kind + " " + encode_field(nf) + " " + encode_field(nt));
}

Status FaultFilesystem::unlink(const std::string& path) {
  const std::string np = normalize_path(path);
  FERRY_RETURN_IF_ERROR(impl_->check(FaultOp::unlink, "unlink", path, np));
  std::lock_guard<std::mutex> lock(impl_->mu);
  FERRY_RETURN_IF_ERROR(target_->unlink(path));
  impl_->forget_side_files(impl_->model.removed(np));
  return impl_->journal("U " + encode_field(np));
}

Status FaultFilesystem::rmdir(const std::string& path) {
  const std::string np = normalize_path(path);
  FERRY_RETURN_IF_ERROR(impl_->check(FaultOp::rmdir, "rmdir", path, np));
  std::lock_guard<std::mutex> lock(impl_->mu);
  FERRY_RETURN_IF_ERROR(target_->rmdir(path));
  impl_->forget_side_files(impl_->model.removed(np));
  return impl_->journal("U " + encode_field(np));
}

Status FaultFilesystem::sync_dir(const std::string& path) {
  const std::string np = normalize_path(path);
  FERRY_RETURN_IF_ERROR(impl_->check(FaultOp::sync, "fsync directory", path, np));
  std::lock_guard<std::mutex> lock(impl_->mu);
  FERRY_RETURN_IF_ERROR(target_->sync_dir(path));
  std::vector<PendingOp> durable = impl_->model.dir_synced(np);
  Status st = impl_->journal("D " + encode_field(np));
  // After the line: a kill in between leaves a stray side file, never a
  // journal that points at a deleted one.
  impl_->forget_side_files(durable);
  return st;
}

Status FaultFilesystem::power_cut() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  std::vector<std::string> side = impl_->model.side_files();
  Status st = impl_->model.cut(*target_, [](const Saved& s) -> Result<std::string> {
    if (s.data) return *s.data;
    return read_local_file(s.side_file);
  });
  // Marks the cut as applied, so that a replay of this journal (or a later
  // process continuing it) does not undo the same things again.
  Status journaled = impl_->journal("X");
  for (const std::string& f : side) ::unlink(f.c_str());
  return st.ok() ? journaled : st;
}

Status FaultFilesystem::apply_power_cut_from_journal(Filesystem& fs,
                                                     const std::string& journal_path) {
  FERRY_ASSIGN_OR_RETURN(std::string text, read_local_file(journal_path));
  CutModel model;
  FERRY_RETURN_IF_ERROR(replay_journal(model, text, journal_path));
  std::vector<std::string> side = model.side_files();
  Status st = model.cut(fs, [](const Saved& s) -> Result<std::string> {
    if (s.side_file.empty())
      return Status::not_found("a replaced file was not saved (no side file)");
    return read_local_file(s.side_file);
  });
  // A torn last line would glue onto the marker: start it on its own line.
  std::string marker = (!text.empty() && text.back() != '\n') ? "\nX\n" : "X\n";
  Status journaled = append_local_line(journal_path, marker);
  for (const std::string& f : side) ::unlink(f.c_str());
  return st.ok() ? journaled : st;
}

// ---- spec ----------------------------------------------------------------------------------

namespace {

Status bad_spec(const std::string& part, const std::string& why) {
  return Status::invalid_argument("fault spec: '" + part + "': " + why);
}

std::string trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  size_t e = s.find_last_not_of(" \t");
  return s.substr(b, e - b + 1);
}

bool parse_rate(const std::string& v, uint64_t* num, uint64_t* den) {
  size_t slash = v.find('/');
  if (slash == std::string::npos) return false;
  return parse_u64(v.substr(0, slash), num) && parse_u64(v.substr(slash + 1), den) && *den > 0 &&
         *num <= *den;
}

bool parse_duration(const std::string& v, std::chrono::microseconds* out) {
  size_t digits = 0;
  while (digits < v.size() && v[digits] >= '0' && v[digits] <= '9') ++digits;
  uint64_t n = 0;
  if (digits == 0 || !parse_u64(v.substr(0, digits), &n)) return false;
  const std::string unit = v.substr(digits);
  uint64_t scale;
  if (unit == "us")
    scale = 1;
  else if (unit == "ms")
    scale = 1000;
  else if (unit == "s")
    scale = 1000 * 1000;
  else
    return false;
  if (n > UINT64_MAX / scale / 2) return false;
  *out = std::chrono::microseconds(static_cast<int64_t>(n * scale));
  return true;
}

// A rule as written, and which defaults it leaves to the spec's global
// path= and seed= items.
struct ParsedFault {
  FaultRule rule;
  bool own_seed = false;
  bool own_path = false;
};

Result<ParsedFault> parse_fault(const std::string& item) {
  std::vector<std::string> parts = split(item, ':');
  ParsedFault parsed;
  FaultRule& r = parsed.rule;
  const std::string& action = parts[0];
  if (action == "enospc") {
    r.action = FaultRule::Action::error;
    r.error = ENOSPC;
  } else if (action == "eio") {
    r.action = FaultRule::Action::error;
    r.error = EIO;
  } else if (action == "short") {
    r.action = FaultRule::Action::short_write;
    r.error = ENOSPC;
  } else if (action == "latency") {
    r.action = FaultRule::Action::latency;
  } else {
    return bad_spec(item, "unknown fault '" + action +
                              "' (expected enospc, eio, short or latency, or journal=, path=, "
                              "seed=)");
  }
  if (parts.size() < 2 || parts[1].empty())
    return bad_spec(item, "missing the operation after '" + action + ":'");
  if (parts[1] == "any") {
    r.any_op = true;
  } else {
    auto it = std::find(kOpNames.begin(), kOpNames.end(), parts[1]);
    if (it == kOpNames.end())
      return bad_spec(item, "unknown operation '" + parts[1] +
                                "' (expected open, write, read, sync, rename, mkdir, unlink, "
                                "rmdir, truncate, close or any)");
    r.op = static_cast<FaultOp>(it - kOpNames.begin());
  }
  if (r.action == FaultRule::Action::short_write && (r.any_op || r.op != FaultOp::write))
    return bad_spec(item, "a short write only applies to the operation 'write'");

  bool have_trigger = false;
  for (size_t i = 2; i < parts.size(); ++i) {
    const std::string& p = parts[i];
    size_t eq = p.find('=');
    if (eq != std::string::npos) {
      const std::string key = p.substr(0, eq), value = p.substr(eq + 1);
      if (key == "rate" && r.action != FaultRule::Action::latency) {
        if (have_trigger) return bad_spec(item, "more than one trigger ('" + p + "')");
        if (!parse_rate(value, &r.rate_num, &r.rate_den))
          return bad_spec(item, "bad rate '" + value + "' (expected A/B with 0 <= A <= B, B > 0)");
        have_trigger = true;
      } else if (key == "seed" && r.action != FaultRule::Action::latency) {
        if (!parse_u64(value, &r.seed)) return bad_spec(item, "bad seed '" + value + "'");
        parsed.own_seed = true;
      } else if (key == "path") {
        if (value.empty()) return bad_spec(item, "empty path filter");
        r.path_contains = value;
        parsed.own_path = true;
      } else {
        return bad_spec(item, "unknown option '" + p + "'");
      }
      continue;
    }
    if (have_trigger) return bad_spec(item, "more than one trigger ('" + p + "')");
    have_trigger = true;
    if (r.action == FaultRule::Action::latency) {
      if (!parse_duration(p, &r.latency))
        return bad_spec(item, "bad duration '" + p + "' (expected e.g. 250us, 5ms, 1s)");
      continue;
    }
    std::string count = p;
    if (!count.empty() && count.back() == '+') {
      r.sticky = true;
      count.pop_back();
    }
    if (!parse_u64(count, &r.nth) || r.nth == 0)
      return bad_spec(item, "bad trigger '" + p + "' (expected N >= 1, N+ or rate=A/B)");
  }
  if (!have_trigger)
    return bad_spec(item, r.action == FaultRule::Action::latency
                              ? "missing the duration (e.g. latency:write:5ms)"
                              : "missing the trigger (N, N+ or rate=A/B)");
  if (parsed.own_seed && r.nth > 0) return bad_spec(item, "seed= only goes with rate=");
  return parsed;
}

}  // namespace

Result<FaultOptions> parse_fault_spec(const std::string& spec) {
  FaultOptions out;
  std::string default_path;
  uint64_t default_seed = 1;
  std::vector<ParsedFault> faults;
  for (const std::string& raw : split(spec, ',')) {
    const std::string item = trim(raw);
    if (item.empty()) {
      if (trim(spec).empty()) break;
      return Status::invalid_argument("fault spec '" + spec + "': empty item");
    }
    if (item.compare(0, 8, "journal=") == 0) {
      if (item.size() == 8) return bad_spec(item, "empty journal path");
      out.journal_path = item.substr(8);
    } else if (item.compare(0, 5, "path=") == 0) {
      if (item.size() == 5) return bad_spec(item, "empty path filter");
      default_path = item.substr(5);
    } else if (item.compare(0, 5, "seed=") == 0) {
      if (!parse_u64(item.substr(5), &default_seed))
        return bad_spec(item, "bad seed '" + item.substr(5) + "'");
    } else {
      FERRY_ASSIGN_OR_RETURN(ParsedFault f, parse_fault(item));
      faults.push_back(std::move(f));
    }
  }
  // Global items apply wherever they stand in the spec.
  for (ParsedFault& f : faults) {
    if (!f.own_path) f.rule.path_contains = default_path;
    if (!f.own_seed) f.rule.seed = default_seed;
    out.rules.push_back(std::move(f.rule));
  }
  return out;
}

Result<std::shared_ptr<Filesystem>> filesystem_from_spec(std::shared_ptr<Filesystem> base,
                                                         const std::string& spec) {
  FERRY_ASSIGN_OR_RETURN(FaultOptions options, parse_fault_spec(spec));
  if (options.rules.empty() && options.journal_path.empty()) return base;
  FERRY_ASSIGN_OR_RETURN(std::shared_ptr<FaultFilesystem> fs,
                         FaultFilesystem::create(std::move(base), std::move(options)));
  return std::shared_ptr<Filesystem>(std::move(fs));
}

Result<std::shared_ptr<Filesystem>> filesystem_from_env(std::shared_ptr<Filesystem> base,
                                                        const char* var) {
  const char* spec = std::getenv(var);
  if (spec == nullptr || *spec == '\0') return base;
  Result<std::shared_ptr<Filesystem>> fs = filesystem_from_spec(std::move(base), spec);
  if (!fs.ok()) return fs.status().with_context(std::string(var) + ": ");
  return fs;
}

}  // namespace ferry
