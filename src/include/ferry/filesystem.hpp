// Every OS call of the storage path goes through Filesystem, so tests can
// wrap it (FilesystemWrapper) to inject faults. Implementations are
// thread-safe; a File may be used from several threads for pread/pwrite.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ferry/export_macro.hpp"
#include "ferry/status.hpp"

namespace ferry {

// Every open refuses a symbolic link as the last component (O_NOFOLLOW):
// whatever Ferry reads or writes inside a root or an export directory is
// its own regular file, never something a link points at outside it. Below
// a declared root (Filesystem::add_root) no component is followed at all.
struct OpenOptions {
  bool write = false;  // read-only otherwise
  bool create = false;
  bool exclusive = false;  // with create: fail if it exists
  bool truncate = false;
  bool direct = false;  // O_DIRECT; silently dropped where unsupported (tmpfs)
  // A hint that reads jump around or are large: no kernel readahead, whose
  // pages would arrive after the reader has dropped the ones it read.
  bool no_readahead = false;
};

class FERRY_EXPORT File {
 public:
  virtual ~File() = default;
  virtual const std::string& path() const = 0;
  // True when the file really is open with O_DIRECT: then buffers, offsets
  // and lengths must be 4096-aligned.
  virtual bool direct() const = 0;
  // Writes all `len` bytes (loops over short writes) or fails naming the path.
  virtual Status pwrite(const void* data, size_t len, uint64_t offset) = 0;
  // Reads up to `len` bytes; fewer only at end of file.
  virtual Result<size_t> pread(void* data, size_t len, uint64_t offset) = 0;
  virtual Status truncate(uint64_t size) = 0;
  // Allocates the file's first `size` bytes on disk, growing it to at least
  // `size` (reading as zeros). Later writes there neither extend the file nor
  // allocate, so concurrent writes to it run side by side (an extending or
  // allocating O_DIRECT write holds the file's lock to the end of its I/O),
  // and a full disk fails here, before any byte is written. Where the
  // filesystem cannot allocate ahead it does nothing and returns ok; only a
  // lack of space (or quota) or a failing device is an error.
  virtual Status reserve(uint64_t /*size*/) { return Status(); }
  virtual Status sync() = 0;   // fsync
  virtual Status close() = 0;  // idempotent; the destructor closes too
};

struct FileInfo {
  uint64_t size = 0;
  bool is_dir = false;
  bool is_regular = false;  // a plain file (not a FIFO, socket or device)
  bool is_symlink = false;  // only from lstat: stat follows links
  int64_t mtime_unix_ms = 0;
  uint64_t inode = 0;
};

// An advisory lock held until this object is destroyed. Not shared between
// threads: each holder has its own.
class FERRY_EXPORT FileLock {
 public:
  virtual ~FileLock() = default;
};

class FERRY_EXPORT Filesystem {
 public:
  virtual ~Filesystem() = default;
  virtual Result<std::unique_ptr<File>> open(const std::string& path, const OpenOptions& o) = 0;
  virtual Status mkdir(const std::string& path) = 0;   // fails if it exists
  virtual Status mkdirs(const std::string& path) = 0;  // mkdir -p
  virtual Status rename(const std::string& from, const std::string& to) = 0;
  // A rename that never replaces: already_exists when `to` exists. The
  // create-once commit of an object store (Store::put_if_absent) rests on it.
  virtual Status rename_noreplace(const std::string& from, const std::string& to) = 0;
  virtual Status unlink(const std::string& path) = 0;
  virtual Status rmdir(const std::string& path) = 0;
  virtual Status sync_dir(const std::string& path) = 0;  // open O_DIRECTORY + fsync
  virtual Result<std::vector<std::string>> list(const std::string& dir) = 0;  // names, no . ..
  virtual Result<FileInfo> stat(const std::string& path) = 0;                 // not_found if absent
  // stat of the link itself when `path` is a symbolic link (is_symlink).
  virtual Result<FileInfo> lstat(const std::string& path) = 0;
  // An exclusive advisory lock on the file at `path` (created if absent),
  // excluding other processes and other holders in this process alike.
  // Waits up to `wait_ms` for a holder to let go, then fails with
  // `busy` naming the path and the holder (who
  // wrote "pid ... host ..." into the file when it took the lock). A lock
  // file that is a symbolic link or has other hard links is refused: taking
  // the lock writes into it.
  virtual Result<std::unique_ptr<FileLock>> lock(const std::string& path, int64_t wait_ms) = 0;
  // Declares `root` a checkpoint root (or an export directory): from then on
  // every operation on a path strictly inside it resolves that path from a
  // descriptor of `root`, following no symbolic link in any component and
  // never leaving it (".."), so a directory swapped for a link after a check
  // cannot send a read or write outside. `root`'s own path may hold links.
  // Matching is lexical, on the path as callers spell it; the outermost
  // declared root containing a path wins. lock() declares its directory
  // while the lock is held. Each add_root is undone by one release_root of
  // the same root (RootHold pairs them): a root stays declared while any of
  // its declarations lasts, so the list does not grow with every runtime.
  virtual void add_root(const std::string& /*root*/) {}
  virtual void release_root(const std::string& /*root*/) {}
  // Ferry passed the named crash point of its protocol (`ferry kill-points`
  // lists them). A no-op: a crash drill or a test wraps the filesystem and
  // overrides it to observe the points, or to crash at one.
  virtual void crash_point(const char* point) { (void)point; }
};

// The default: POSIX calls, errors via Status::from_errno naming op and path.
FERRY_EXPORT std::shared_ptr<Filesystem> posix_filesystem();

namespace detail {
// A POSIX filesystem that resolves paths below a root one component at a
// time, as where the kernel lacks openat2 (before Linux 5.6): for tests.
std::shared_ptr<Filesystem> posix_filesystem_without_openat2();
// How many roots a POSIX filesystem has declared (0 for any other): for tests.
size_t declared_roots(Filesystem& fs);
}  // namespace detail

// `root` declared on `fs` (Filesystem::add_root) for this object's life.
class RootHold {
 public:
  RootHold() = default;
  RootHold(std::shared_ptr<Filesystem> fs, std::string root)
      : fs_(std::move(fs)), root_(std::move(root)) {
    if (fs_) fs_->add_root(root_);
  }
  RootHold(RootHold&& o) noexcept : fs_(std::move(o.fs_)), root_(std::move(o.root_)) {
    o.fs_.reset();
  }
  RootHold& operator=(RootHold&& o) noexcept {
    if (this != &o) {
      reset();
      fs_ = std::move(o.fs_);
      root_ = std::move(o.root_);
      o.fs_.reset();
    }
    return *this;
  }
  RootHold(const RootHold&) = delete;
  RootHold& operator=(const RootHold&) = delete;
  ~RootHold() { reset(); }
  void reset() {
    if (fs_) fs_->release_root(root_);
    fs_.reset();
  }

 private:
  std::shared_ptr<Filesystem> fs_;
  std::string root_;
};

// Forwards everything to `target`; subclasses override only what they break.
class FERRY_EXPORT FilesystemWrapper : public Filesystem {
 public:
  explicit FilesystemWrapper(std::shared_ptr<Filesystem> target) : target_(std::move(target)) {}
  Result<std::unique_ptr<File>> open(const std::string& p, const OpenOptions& o) override {
    return target_->open(p, o);
  }
  Status mkdir(const std::string& p) override { return target_->mkdir(p); }
  Status mkdirs(const std::string& p) override { return target_->mkdirs(p); }
  Status rename(const std::string& f, const std::string& t) override {
    return target_->rename(f, t);
  }
  Status rename_noreplace(const std::string& f, const std::string& t) override {
    return target_->rename_noreplace(f, t);
  }
  Status unlink(const std::string& p) override { return target_->unlink(p); }
  Status rmdir(const std::string& p) override { return target_->rmdir(p); }
  Status sync_dir(const std::string& p) override { return target_->sync_dir(p); }
  Result<std::vector<std::string>> list(const std::string& d) override { return target_->list(d); }
  Result<FileInfo> stat(const std::string& p) override { return target_->stat(p); }
  Result<FileInfo> lstat(const std::string& p) override { return target_->lstat(p); }
  Result<std::unique_ptr<FileLock>> lock(const std::string& p, int64_t wait_ms) override {
    return target_->lock(p, wait_ms);
  }
  void add_root(const std::string& root) override { target_->add_root(root); }
  void release_root(const std::string& root) override { target_->release_root(root); }
  void crash_point(const char* point) override { target_->crash_point(point); }

 protected:
  std::shared_ptr<Filesystem> target_;
};

// Helpers built on the interface (so they see injected faults too).
FERRY_EXPORT std::string join_path(const std::string& a, const std::string& b);
FERRY_EXPORT std::string parent_path(const std::string& p);
// Reads a whole regular file. Anything else (a FIFO, a device) is refused
// without blocking, and so is a file larger than `max_bytes`: the error
// names the path (and the size). The default cap is far above any manifest.
constexpr uint64_t kMaxReadFileBytes = 1ull << 30;
FERRY_EXPORT Result<std::string> read_file(Filesystem& fs, const std::string& path,
                                           uint64_t max_bytes = kMaxReadFileBytes);
// The same into `*out`, whose memory is reused: a caller reading many large
// files through one buffer spares the page faults of a fresh one each time.
FERRY_EXPORT Status read_file_into(Filesystem& fs, const std::string& path, std::string* out,
                                   uint64_t max_bytes = kMaxReadFileBytes);
// The first `max_bytes` bytes of a regular file (all of a shorter one),
// refusing what read_file refuses.
FERRY_EXPORT Result<std::string> read_file_head(Filesystem& fs, const std::string& path,
                                                uint64_t max_bytes);
// temp file in the same directory, write, fsync (if `sync`), rename over
// `path`, fsync the directory (if `sync`).
FERRY_EXPORT Status write_file_atomic(Filesystem& fs, const std::string& path,
                                      const std::string& bytes, bool sync);
// The first half of write_file_atomic: the temp file beside `path`
// ("<path>.tmp-<pid>-<n>"), written and fsynced (if `sync`); returns its
// path. The caller renames it over `path` when it chooses (and removes it
// if it does not), so that one directory fsync can cover several renames.
FERRY_EXPORT Result<std::string> write_temp_file(Filesystem& fs, const std::string& path,
                                                 const std::string& bytes, bool sync);
// Removes a file or a directory tree; not_found is not an error.
FERRY_EXPORT Status remove_all(Filesystem& fs, const std::string& path);

}  // namespace ferry
