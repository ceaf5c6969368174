// The fault-injecting Filesystem: fault rules applied to each call, and the
// bookkeeping that feeds the power-cut model (cut_model.hpp) and its journal
// (fault_journal.hpp). The FERRY_FAULTS spec is parsed in fault_spec.cpp.
#include "drills/fault_fs.hpp"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <thread>

#include "drills/cut_model.hpp"
#include "drills/fault_journal.hpp"

namespace ferry {

using drills::CutModel;
using drills::Journal;
using drills::Node;
using drills::normalize_path;
using drills::PendingOp;
using drills::Saved;

namespace {

// A rename that replaces a bigger file does not save it (see the header).
constexpr uint64_t kMaxSavedBytes = 64ull << 20;

bool path_matches(const std::string& filter, const std::string& path) {
  if (filter.empty()) return true;
  if (filter.back() == '$') {
    const size_t n = filter.size() - 1;
    return path.size() >= n && path.compare(path.size() - n, n, filter, 0, n) == 0;
  }
  return path.find(filter) != std::string::npos;
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
    bool stall = false;
    int error = 0;
    std::chrono::microseconds delay{0};
  };

  // Counts the call against every rule that matches it; the first rule that
  // fires decides the error. Latency rules add up.
  Decision decide(FaultOp op, const std::string& p1, const std::string& p2, uint64_t bytes) {
    std::lock_guard<std::mutex> lock(rules_mu);
    ++calls[static_cast<size_t>(op)];
    Decision d;
    for (RuleState& rs : rules) {
      const FaultRule& r = rs.rule;
      if (!r.any_op && r.op != op) continue;
      if (!path_matches(r.path_contains, p1) && (p2.empty() || !path_matches(r.path_contains, p2)))
        continue;
      if (r.action == FaultRule::Action::latency) {
        // per_bytes: in proportion to the bytes moved (a rate, whatever the call's size).
        d.delay += r.per_bytes == 0
                       ? r.latency
                       : std::chrono::microseconds(static_cast<int64_t>(
                             static_cast<double>(r.latency.count()) * bytes / r.per_bytes));
        continue;
      }
      ++rs.seen;
      bool fire;
      if (r.nth > 0)
        fire = r.sticky ? rs.seen >= r.nth : rs.seen == r.nth;
      else
        fire = r.rate_den > 0 && splitmix64(rs.rng) % r.rate_den < r.rate_num;
      if (fire && r.action == FaultRule::Action::stall) {
        d.stall = true;
        continue;
      }
      if (fire && !d.fire) {
        d.fire = true;
        d.error = r.error;
        d.short_write = r.action == FaultRule::Action::short_write && op == FaultOp::write;
      }
    }
    if (d.fire) ++injected;
    if (d.delay.count() > 0) ++delayed;
    return d;
  }

  // Sleeps for any latency, then returns the injected error if one fires.
  // `label` and `shown` are what the POSIX filesystem would name in its
  // message; the paths are the normalised ones filters match.
  Status check(FaultOp op, const char* label, const std::string& shown, const std::string& p1,
               const std::string& p2 = std::string(), bool* short_write = nullptr,
               uint64_t bytes = 0) {
    Decision d = decide(op, p1, p2, bytes);
    if (d.delay.count() > 0) std::this_thread::sleep_for(d.delay);
    if (d.stall) {
      // Said at once, so that a driver in another process knows the call is held.
      std::fprintf(stderr, "ferry: fault injected: %s %s stalled until released\n", label,
                   shown.c_str());
      stall();
    }
    if (!d.fire) return Status::ok_status();
    if (short_write) *short_write = d.short_write;
    return injected_status(d.error, label, shown);
  }

  // Blocks until release_stalls() (at once if it was called already).
  void stall() {
    std::unique_lock<std::mutex> lock(stall_mu);
    if (stalls_released) return;
    ++stalled_now;
    ++stalled_total;
    stall_cv.notify_all();
    stall_cv.wait(lock, [this] { return stalls_released; });
    --stalled_now;
  }

  void release_stalls() {
    std::lock_guard<std::mutex> lock(stall_mu);
    stalls_released = true;
    stall_cv.notify_all();
  }

  // REQUIRES: mu held.
  Status journal(const std::string& event) { return journal_file.append(event); }

  // REQUIRES: mu held.
  void forget_side_files(const std::vector<PendingOp>& ops) {
    for (const PendingOp& op : ops)
      if (!op.saved.side_file.empty()) ::unlink(op.saved.side_file.c_str());
  }

  // unlink or rmdir (`op`, done by the target's `how`): both are durable at
  // once in the model.
  Status remove(FaultOp op, const char* label, const std::string& path,
                Status (Filesystem::*how)(const std::string&)) {
    const std::string np = normalize_path(path);
    FERRY_RETURN_IF_ERROR(check(op, label, path, np));
    std::lock_guard<std::mutex> lock(mu);
    FERRY_RETURN_IF_ERROR(((*target).*how)(path));
    forget_side_files(model.removed(np));
    return journal(drills::journal_removed(np));
  }

  Status open_journal(const std::string& path) {
    std::lock_guard<std::mutex> lock(mu);
    return journal_file.open(path, model);
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
  uint64_t delayed = 0;

  mutable std::mutex stall_mu;  // guards the fields below
  mutable std::condition_variable stall_cv;
  bool stalls_released = false;
  uint64_t stalled_now = 0;
  uint64_t stalled_total = 0;

  // Guards the model and the journal. Held across namespace operations
  // (not across pwrite or fsync of files), so that the journal's order is
  // the order in which they really happened.
  std::mutex mu;
  CutModel model;
  Journal journal_file;
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
    Status injected = impl_->check(FaultOp::write, "pwrite", path(), norm_path_, std::string(),
                                   &short_write, len);
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
    FERRY_RETURN_IF_ERROR(
        impl_->check(FaultOp::read, "pread", path(), norm_path_, std::string(), nullptr, len));
    return base_->pread(data, len, offset);
  }

  Status truncate(uint64_t size) override {
    FERRY_RETURN_IF_ERROR(impl_->check(FaultOp::truncate, "truncate", path(), norm_path_));
    FERRY_RETURN_IF_ERROR(base_->truncate(size));
    return note(size, &CutModel::truncated, drills::journal_truncated);
  }

  // A size change, faulted as truncate is; like a write, it grows the file
  // without making anything durable.
  Status reserve(uint64_t size) override {
    FERRY_RETURN_IF_ERROR(impl_->check(FaultOp::truncate, "fallocate", path(), norm_path_));
    Status st = base_->reserve(size);
    note_write(st.ok(), size);
    return st;
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
    return note(size, &CutModel::synced, drills::journal_synced);
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
  // Tells the model and the journal what a truncate or sync of this file
  // did, unless it was opened read-only or has left the model (unlinked or
  // replaced) meanwhile.
  Status note(uint64_t size, void (CutModel::*apply)(const std::string&, uint64_t),
              std::string (*event)(const std::string&, uint64_t)) {
    if (!node_) return Status::ok_status();
    std::lock_guard<std::mutex> lock(impl_->mu);
    if (node_->removed) return Status::ok_status();
    (impl_->model.*apply)(node_->path, size);
    return impl_->journal(event(node_->path, size));
  }

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

// ---- FaultFilesystem ------------------------------------------------------------------

FaultFilesystem::FaultFilesystem(std::shared_ptr<Filesystem> target)
    : FilesystemWrapper(target), impl_(std::make_shared<Impl>(target)) {}

FaultFilesystem::~FaultFilesystem() {
  impl_->release_stalls();
}

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

uint64_t FaultFilesystem::delayed() const {
  std::lock_guard<std::mutex> lock(impl_->rules_mu);
  return impl_->delayed;
}

uint64_t FaultFilesystem::stalled_now() const {
  std::lock_guard<std::mutex> lock(impl_->stall_mu);
  return impl_->stalled_now;
}

uint64_t FaultFilesystem::stalled_total() const {
  std::lock_guard<std::mutex> lock(impl_->stall_mu);
  return impl_->stalled_total;
}

bool FaultFilesystem::wait_stalled(uint64_t n, std::chrono::milliseconds timeout) const {
  std::unique_lock<std::mutex> lock(impl_->stall_mu);
  return impl_->stall_cv.wait_for(lock, timeout, [&] { return impl_->stalled_total >= n; });
}

void FaultFilesystem::release_stalls() {
  impl_->release_stalls();
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
    journaled = impl_->journal(drills::journal_created(np, false));
  } else {
    uint64_t size = before.ok() ? before->size : 0;
    node = impl_->model.opened(np, o.truncate, size);
    journaled = impl_->journal(drills::journal_opened(np, o.truncate, size));
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
  return impl_->journal(drills::journal_created(np, true));
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
    FERRY_RETURN_IF_ERROR(impl_->journal(drills::journal_created(prefix, true)));
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
        if (impl_->journal_file.enabled()) {
          FERRY_ASSIGN_OR_RETURN(saved.side_file, impl_->journal_file.save_side_file(*saved.data));
        }
      }
    }
  }
  Status st = target_->rename(from, to);
  if (!st.ok()) {
    if (!saved.side_file.empty()) ::unlink(saved.side_file.c_str());
    return st;
  }
  std::string event = drills::journal_renamed(nf, nt, saved);
  impl_->model.renamed(nf, nt, saved);
  return impl_->journal(event);
}

Status FaultFilesystem::rename_noreplace(const std::string& from, const std::string& to) {
  const std::string nf = normalize_path(from);
  const std::string nt = normalize_path(to);
  FERRY_RETURN_IF_ERROR(impl_->check(FaultOp::rename, "rename", from + " -> " + to, nf, nt));
  std::lock_guard<std::mutex> lock(impl_->mu);
  FERRY_RETURN_IF_ERROR(target_->rename_noreplace(from, to));
  Saved none;  // it replaced nothing
  std::string event = drills::journal_renamed(nf, nt, none);
  impl_->model.renamed(nf, nt, none);
  return impl_->journal(event);
}

Status FaultFilesystem::unlink(const std::string& path) {
  return impl_->remove(FaultOp::unlink, "unlink", path, &Filesystem::unlink);
}

Status FaultFilesystem::rmdir(const std::string& path) {
  return impl_->remove(FaultOp::rmdir, "rmdir", path, &Filesystem::rmdir);
}

Status FaultFilesystem::sync_dir(const std::string& path) {
  const std::string np = normalize_path(path);
  FERRY_RETURN_IF_ERROR(impl_->check(FaultOp::sync, "fsync directory", path, np));
  std::lock_guard<std::mutex> lock(impl_->mu);
  FERRY_RETURN_IF_ERROR(target_->sync_dir(path));
  std::vector<PendingOp> durable = impl_->model.dir_synced(np);
  Status st = impl_->journal(drills::journal_dir_synced(np));
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
    return drills::read_local_file(s.side_file);
  });
  // Marks the cut as applied, so that a replay of this journal (or a later
  // process continuing it) does not undo the same things again.
  Status journaled = impl_->journal(drills::journal_cut());
  for (const std::string& f : side) ::unlink(f.c_str());
  return st.ok() ? journaled : st;
}

Status FaultFilesystem::apply_power_cut_from_journal(Filesystem& fs,
                                                     const std::string& journal_path) {
  return drills::apply_journal(fs, journal_path);
}

}  // namespace ferry
