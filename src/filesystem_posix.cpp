// The POSIX Filesystem and the helpers built on the Filesystem interface.
#include <dirent.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <map>
#include <mutex>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "crash_points.hpp"
#include "ferry/filesystem.hpp"
#include "node.hpp"

namespace ferry {
namespace {

class PosixFile : public File {
 public:
  PosixFile(int fd, std::string path, bool direct)
      : fd_(fd), path_(std::move(path)), direct_(direct) {}
  // A destructor has nobody to report to; callers that care call close().
  ~PosixFile() override { (void)close(); }

  const std::string& path() const override { return path_; }
  bool direct() const override { return direct_; }

  Status pwrite(const void* data, size_t len, uint64_t offset) override {
    const char* p = static_cast<const char*>(data);
    while (len > 0) {
      ssize_t n = ::pwrite(fd_, p, len, static_cast<off_t>(offset));
      if (n < 0) {
        if (errno == EINTR) continue;
        return Status::from_errno(errno, "pwrite", path_);
      }
      if (n == 0) {
        // The kernel accepted nothing and reported no error: looping would
        // spin forever, so treat it as the device refusing more bytes.
        return Status::from_errno(ENOSPC, "pwrite", path_);
      }
      p += n;
      len -= static_cast<size_t>(n);
      offset += static_cast<uint64_t>(n);
    }
    return Status::ok_status();
  }

  Result<size_t> pread(void* data, size_t len, uint64_t offset) override {
    char* p = static_cast<char*>(data);
    size_t done = 0;
    while (done < len) {
      ssize_t n = ::pread(fd_, p + done, len - done, static_cast<off_t>(offset + done));
      if (n < 0) {
        if (errno == EINTR) continue;
        return Status::from_errno(errno, "pread", path_);
      }
      if (n == 0) break;  // end of file
      done += static_cast<size_t>(n);
    }
    return done;
  }

  Status truncate(uint64_t size) override {
    while (::ftruncate(fd_, static_cast<off_t>(size)) != 0) {
      if (errno != EINTR) return Status::from_errno(errno, "truncate", path_);
    }
    return Status::ok_status();
  }

  // fallocate(2), not posix_fallocate: where the filesystem has no fallocate
  // glibc would write every byte, which is the writers' job. Only a lack of
  // space or a failing device is an error; any other refusal (no support,
  // a mode this filesystem lacks) leaves the file to grow as it is written.
  Status reserve(uint64_t size) override {
    if (size == 0) return Status::ok_status();  // fallocate refuses an empty range
    while (::fallocate(fd_, 0, 0, static_cast<off_t>(size)) != 0) {
      const int err = errno;
      if (err == EINTR) continue;
      if (err != ENOSPC && err != EDQUOT && err != EFBIG && err != EIO) return Status::ok_status();
      return Status::from_errno(err, "fallocate (reserving " + std::to_string(size) + " bytes)",
                                path_);
    }
    return Status::ok_status();
  }

  // fsync, not fdatasync: a truncate changes the size, which is metadata
  // that fdatasync may leave behind on some filesystems.
  Status sync() override {
    while (::fsync(fd_) != 0) {
      if (errno != EINTR) return Status::from_errno(errno, "fsync", path_);
    }
    return Status::ok_status();
  }

  Status close() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (fd_ < 0) return Status::ok_status();
    int fd = fd_;
    fd_ = -1;
    // Linux frees the descriptor even when close fails (EINTR included), so
    // retrying could close a descriptor another thread has just opened.
    if (::close(fd) != 0) return Status::from_errno(errno, "close", path_);
    return Status::ok_status();
  }

 private:
  std::mutex mu_;  // guards close() against a concurrent close()
  int fd_;
  std::string path_;
  bool direct_;
};

class PosixLock : public FileLock {
 public:
  PosixLock(int fd, RootHold dir) : fd_(fd), dir_(std::move(dir)) {}
  // Closing the descriptor releases the flock.
  ~PosixLock() override { ::close(fd_); }

 private:
  int fd_;
  RootHold dir_;  // its directory stays a root while the lock is held
};

Status check_errno(int rc, const char* op, const std::string& path) {
  if (rc == 0) return Status::ok_status();
  return Status::from_errno(errno, op, path);
}

// The components of `p`, without empty and "." ones.
std::vector<std::string> components(const std::string& p) {
  std::vector<std::string> out;
  size_t i = 0;
  while (i <= p.size()) {
    size_t j = std::min(p.find('/', i), p.size());
    std::string c = p.substr(i, j - i);
    if (!c.empty() && c != ".") out.push_back(std::move(c));
    i = j + 1;
  }
  return out;
}

// Lexical normal form: "//", "." and a trailing "/" gone; ".." kept.
std::string normal_path(const std::string& p) {
  std::string out = !p.empty() && p[0] == '/' ? "/" : "";
  for (const std::string& c : components(p)) {
    if (!out.empty() && out.back() != '/') out += '/';
    out += c;
  }
  return out.empty() ? "." : out;
}

// A descriptor closed when it goes out of scope.
class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    std::swap(fd_, o.fd_);
    return *this;
  }
  Fd(const Fd&) = delete;
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

// Where an *at call acts for a path: below a root, a descriptor of its
// parent directory (reached without following any link) and its last
// component; elsewhere the whole path against the working directory.
struct At {
  Fd owned;
  int dir = AT_FDCWD;
  std::string name;
  bool beneath = false;  // then the last component is never followed either
};

class PosixFilesystem : public Filesystem, public std::enable_shared_from_this<PosixFilesystem> {
 public:
  explicit PosixFilesystem(bool openat2 = true) : openat2_(openat2) {}

  void add_root(const std::string& root) override {
    std::string n = normal_path(root);
    if (n == "/") return;  // everything would be below it
    std::lock_guard<std::mutex> lock(roots_mu_);
    ++roots_[n];
  }

  void release_root(const std::string& root) override {
    std::string n = normal_path(root);
    std::lock_guard<std::mutex> lock(roots_mu_);
    auto it = roots_.find(n);
    if (it != roots_.end() && --it->second == 0) roots_.erase(it);
  }

  size_t declared_roots() {
    std::lock_guard<std::mutex> lock(roots_mu_);
    return roots_.size();
  }

  Result<std::unique_ptr<File>> open(const std::string& path, const OpenOptions& o) override {
    int flags = O_CLOEXEC | O_NOFOLLOW | (o.write ? O_RDWR : O_RDONLY);
    if (o.create) flags |= O_CREAT;
    if (o.create && o.exclusive) flags |= O_EXCL;
    if (o.truncate) flags |= O_TRUNC;
    // A FIFO opened for reading blocks until a writer comes, forever if none
    // does: never block in open, and refuse anything but a regular file.
    if (!o.write) flags |= O_NONBLOCK;
    bool direct = o.direct;
    FERRY_ASSIGN_OR_RETURN(At a, at(path, "open"));
    int fd = open_retrying(a, flags | (direct ? O_DIRECT : 0));
    if (fd < 0 && direct && errno == EINVAL) {
      // tmpfs and some FUSE filesystems refuse O_DIRECT: fall back to the
      // page cache and tell the caller through direct().
      direct = false;
      fd = open_retrying(a, flags);
    }
    if (fd < 0) return open_error(errno, "open", path);
    struct stat st;
    if (::fstat(fd, &st) != 0) {
      int err = errno;
      ::close(fd);
      return Status::from_errno(err, "fstat", path);
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd);
      return Status::invalid_argument("open " + path + ": not a regular file");
    }
    if (o.no_readahead && !direct) ::posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM);
    return std::unique_ptr<File>(new PosixFile(fd, path, direct));
  }

  Status mkdir(const std::string& path) override {
    FERRY_ASSIGN_OR_RETURN(At a, at(path, "mkdir"));
    return check_errno(::mkdirat(a.dir, a.name.c_str(), 0755), "mkdir", path);
  }

  Status mkdirs(const std::string& path) override {
    if (path.empty()) return Status::invalid_argument("mkdirs: empty path");
    // Walk every prefix that ends at a separator, then the whole path.
    size_t pos = 0;
    while (true) {
      pos = path.find('/', pos + 1);
      std::string prefix = path.substr(0, pos);
      if (!prefix.empty() && prefix != "/") {
        Status made = mkdir(prefix);
        if (!made.ok()) {
          if (made.code() != StatusCode::already_exists) return made;
          FERRY_ASSIGN_OR_RETURN(FileInfo info, stat(prefix));
          if (!info.is_dir) return Status::from_errno(ENOTDIR, "mkdir", prefix);
        }
      }
      if (pos == std::string::npos) break;
    }
    return Status::ok_status();
  }

  Status rename(const std::string& from, const std::string& to) override {
    FERRY_ASSIGN_OR_RETURN(At f, at(from, "rename"));
    FERRY_ASSIGN_OR_RETURN(At t, at(to, "rename"));
    return check_errno(::renameat(f.dir, f.name.c_str(), t.dir, t.name.c_str()), "rename",
                       from + " -> " + to);
  }

  Status rename_noreplace(const std::string& from, const std::string& to) override {
    FERRY_ASSIGN_OR_RETURN(At f, at(from, "rename"));
    FERRY_ASSIGN_OR_RETURN(At t, at(to, "rename"));
    int rc = ::renameat2(f.dir, f.name.c_str(), t.dir, t.name.c_str(), RENAME_NOREPLACE);
    // Filesystems without the flag (some network ones) still refuse a link
    // over an existing name.
    if (rc != 0 && (errno == EINVAL || errno == ENOSYS)) {
      rc = ::linkat(f.dir, f.name.c_str(), t.dir, t.name.c_str(), 0);
      if (rc == 0) (void)::unlinkat(f.dir, f.name.c_str(), 0);
    }
    if (rc == 0) return Status::ok_status();
    if (errno == EEXIST) return Status::already_exists(to + " exists");
    return Status::from_errno(errno, "rename", from + " -> " + to);
  }

  Status unlink(const std::string& path) override {
    FERRY_ASSIGN_OR_RETURN(At a, at(path, "unlink"));
    return check_errno(::unlinkat(a.dir, a.name.c_str(), 0), "unlink", path);
  }

  Status rmdir(const std::string& path) override {
    FERRY_ASSIGN_OR_RETURN(At a, at(path, "rmdir"));
    return check_errno(::unlinkat(a.dir, a.name.c_str(), AT_REMOVEDIR), "rmdir", path);
  }

  Status sync_dir(const std::string& path) override {
    FERRY_ASSIGN_OR_RETURN(At a, at(path, "open directory"));
    int fd = open_retrying(a, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return Status::from_errno(errno, "open directory", path);
    Status st;
    while (::fsync(fd) != 0) {
      if (errno != EINTR) {
        st = Status::from_errno(errno, "fsync directory", path);
        break;
      }
    }
    if (::close(fd) != 0 && st.ok()) st = Status::from_errno(errno, "close directory", path);
    return st;
  }

  Result<std::vector<std::string>> list(const std::string& dir) override {
    FERRY_ASSIGN_OR_RETURN(At a, at(dir, "opendir"));
    int fd = open_retrying(a, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return open_error(errno, "opendir", dir);
    DIR* d = ::fdopendir(fd);
    if (d == nullptr) {
      int err = errno;
      ::close(fd);
      return Status::from_errno(err, "opendir", dir);
    }
    std::vector<std::string> names;
    while (true) {
      errno = 0;  // readdir signals an error only through errno
      struct dirent* e = ::readdir(d);
      if (e == nullptr) {
        int err = errno;
        ::closedir(d);
        if (err != 0) return Status::from_errno(err, "readdir", dir);
        break;
      }
      std::string name = e->d_name;
      if (name == "." || name == "..") continue;
      names.push_back(std::move(name));
    }
    std::sort(names.begin(), names.end());
    return names;
  }

  Result<std::unique_ptr<FileLock>> lock(const std::string& path, int64_t wait_ms) override {
    // The lock guards a root: whatever Ferry does in it stays below it.
    RootHold dir(shared_from_this(), parent_path(path));
    FERRY_ASSIGN_OR_RETURN(At a, at(path, "open lock file"));
    int fd = open_retrying(a, O_RDWR | O_CREAT | O_CLOEXEC | O_NONBLOCK | O_NOFOLLOW);
    if (fd < 0) return open_error(errno, "open lock file", path);
    struct stat st;
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      return Status::invalid_argument("lock " + path + ": not a regular file");
    }
    // Taking the lock truncates and writes the file: a second name for it
    // (a hard link from elsewhere) would make that write land outside.
    if (st.st_nlink > 1) {
      ::close(fd);
      return Status::invalid_argument("lock " + path + ": has " + std::to_string(st.st_nlink) +
                                      " hard links (a lock file has only its own name)");
    }
    // flock has no timed wait: poll, so that a stuck holder becomes an
    // error after wait_ms instead of a hang.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(wait_ms);
    while (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      int err = errno;
      if (err == EINTR) continue;
      if (err != EWOULDBLOCK || std::chrono::steady_clock::now() >= deadline) {
        std::string holder = read_holder(fd);
        ::close(fd);
        if (err != EWOULDBLOCK) return Status::from_errno(err, "flock", path);
        return Status::busy("lock " + path + " is held by another process (" +
                            (holder.empty() ? std::string("holder unknown") : holder) +
                            "); gave up after " + std::to_string(wait_ms) + " ms");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    // Who holds it, for the error another waiter reports. Advisory only: a
    // failure here does not make the lock less held.
    std::string who = "pid " + std::to_string(::getpid()) + " on " + host_name() + "\n";
    if (::ftruncate(fd, 0) == 0) (void)!::pwrite(fd, who.data(), who.size(), 0);
    return std::unique_ptr<FileLock>(new PosixLock(fd, std::move(dir)));
  }

  Result<FileInfo> stat(const std::string& path) override {
    FERRY_ASSIGN_OR_RETURN(At a, at(path, "stat"));
    struct stat st;
    if (::fstatat(a.dir, a.name.c_str(), &st, 0) != 0)
      return Status::from_errno(errno, "stat", path);
    return info_of(st);
  }

  Result<FileInfo> lstat(const std::string& path) override {
    FERRY_ASSIGN_OR_RETURN(At a, at(path, "lstat"));
    struct stat st;
    if (::fstatat(a.dir, a.name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0)
      return Status::from_errno(errno, "lstat", path);
    return info_of(st);
  }

 private:
  static FileInfo info_of(const struct stat& st) {
    FileInfo info;
    info.size = static_cast<uint64_t>(st.st_size);
    info.is_dir = S_ISDIR(st.st_mode);
    info.is_regular = S_ISREG(st.st_mode);
    info.is_symlink = S_ISLNK(st.st_mode);
    info.mtime_unix_ms =
        static_cast<int64_t>(st.st_mtim.tv_sec) * 1000 + st.st_mtim.tv_nsec / 1'000'000;
    info.inode = static_cast<uint64_t>(st.st_ino);
    return info;
  }

  // O_NOFOLLOW's refusal says what it is rather than "too many levels of
  // symbolic links".
  static Status open_error(int err, const char* op, const std::string& path) {
    if (err == ELOOP)
      return Status::invalid_argument(std::string(op) + " " + path +
                                      ": is a symbolic link, which Ferry never follows there");
    if (err == EXDEV)
      return Status::invalid_argument(std::string(op) + " " + path +
                                      ": leads out of its checkpoint root (\"..\")");
    return Status::from_errno(err, op, path);
  }

  // The outermost declared root that `path` lies strictly inside, and the
  // rest of the path below it: a root declared inside another (a lock file's
  // directory) cannot make a link below the outer one followed.
  bool find_root(const std::string& path, std::string* root, std::string* rel) {
    const std::string n = normal_path(path);
    std::lock_guard<std::mutex> lock(roots_mu_);
    bool found = false;
    for (const auto& held : roots_) {
      const std::string& r = held.first;
      if (found && r.size() >= root->size()) continue;
      if (r == ".") {
        if (n[0] == '/' || n == "." || n == ".." || n.compare(0, 3, "../") == 0) continue;
        *rel = n;
      } else if (n.size() > r.size() + 1 && n.compare(0, r.size(), r) == 0 && n[r.size()] == '/') {
        *rel = n.substr(r.size() + 1);
      } else {
        continue;
      }
      *root = r;
      found = true;
    }
    return found;
  }

  // Opens directory `rel` below the directory `root` without following a
  // link in any component or leaving `root`: openat2 where the kernel has
  // it, else one component at a time.
  int open_dir_beneath(int root, const std::string& rel) {
    if (openat2_.load(std::memory_order_relaxed)) {
      struct open_how how = {};
      how.flags = O_PATH | O_DIRECTORY | O_CLOEXEC;
      how.resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS;
      for (int tries = 0;; ++tries) {
        long fd = ::syscall(SYS_openat2, root, rel.c_str(), &how, sizeof(how));
        if (fd >= 0) return static_cast<int>(fd);
        // EAGAIN: a concurrent rename made the kernel unsure; it asks for a retry.
        if (errno == EINTR || (errno == EAGAIN && tries < 16)) continue;
        if (errno != ENOSYS) return -1;
        openat2_.store(false, std::memory_order_relaxed);
        break;
      }
    }
    Fd cur(::openat(root, ".", O_PATH | O_DIRECTORY | O_CLOEXEC));
    if (cur.get() < 0) return -1;
    for (const std::string& c : components(rel)) {
      if (c == "..") {
        errno = EXDEV;
        return -1;
      }
      // O_PATH | O_NOFOLLOW opens a link itself: fstat tells it apart.
      Fd next(::openat(cur.get(), c.c_str(), O_PATH | O_NOFOLLOW | O_CLOEXEC));
      if (next.get() < 0) return -1;
      struct stat st;
      if (::fstat(next.get(), &st) != 0) return -1;
      if (!S_ISDIR(st.st_mode)) {
        errno = S_ISLNK(st.st_mode) ? ELOOP : ENOTDIR;
        return -1;
      }
      cur = std::move(next);
    }
    return cur.release();
  }

  Result<At> at(const std::string& path, const char* op) {
    At a;
    std::string root, rel;
    if (!find_root(path, &root, &rel)) {
      a.name = path;
      return a;
    }
    a.beneath = true;
    int fd;
    do {
      fd = ::open(root.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) return Status::from_errno(errno, op, path);
    Fd root_fd(fd);
    const size_t slash = rel.rfind('/');
    a.name = slash == std::string::npos ? rel : rel.substr(slash + 1);
    if (a.name == "..") return open_error(EXDEV, op, path);
    if (slash == std::string::npos) {
      a.owned = std::move(root_fd);
    } else {
      a.owned = Fd(open_dir_beneath(root_fd.get(), rel.substr(0, slash)));
      if (a.owned.get() < 0) {
        const int err = errno;
        if (err == ELOOP)
          return Status::invalid_argument(std::string(op) + " " + path +
                                          ": a directory on its way below " + root +
                                          " is a symbolic link, which Ferry never follows there");
        return open_error(err, op, path);
      }
    }
    a.dir = a.owned.get();
    return a;
  }

  static std::string read_holder(int fd) {
    char buf[512];
    ssize_t n = ::pread(fd, buf, sizeof(buf) - 1, 0);
    if (n <= 0) return "";
    std::string s(buf, static_cast<size_t>(n));
    while (!s.empty() && (s.back() == '\n' || s.back() == '\0')) s.pop_back();
    return s;
  }

  // Below a root the last component is never followed either.
  static int open_retrying(const At& a, int flags) {
    if (a.beneath) flags |= O_NOFOLLOW;
    int fd;
    do {
      fd = ::openat(a.dir, a.name.c_str(), flags, 0644);
    } while (fd < 0 && errno == EINTR);
    return fd;
  }

  std::atomic<bool> openat2_;
  std::mutex roots_mu_;
  std::map<std::string, size_t> roots_;  // in normal form: how many declarations hold each
};

}  // namespace

std::shared_ptr<Filesystem> posix_filesystem() {
  // One instance, passed down explicitly rather than reached as a global; its
  // only state is the declared roots, each released by what declared it.
  static const std::shared_ptr<Filesystem> fs = std::make_shared<PosixFilesystem>();
  return fs;
}

std::shared_ptr<Filesystem> detail::posix_filesystem_without_openat2() {
  return std::make_shared<PosixFilesystem>(false);
}

size_t detail::declared_roots(Filesystem& fs) {
  auto* posix = dynamic_cast<PosixFilesystem*>(&fs);
  return posix != nullptr ? posix->declared_roots() : 0;
}

std::string join_path(const std::string& a, const std::string& b) {
  if (a.empty()) return b;
  if (b.empty()) return a;
  if (a.back() == '/') return a + b;
  return a + "/" + b;
}

std::string parent_path(const std::string& p) {
  size_t end = p.find_last_not_of('/');
  if (end == std::string::npos) return p.empty() ? "." : "/";
  size_t slash = p.rfind('/', end);
  if (slash == std::string::npos) return ".";
  size_t last = p.find_last_not_of('/', slash);
  if (last == std::string::npos) return "/";
  return p.substr(0, last + 1);
}

namespace {

// Opening a FIFO for reading would wait for a writer: only a regular file
// is opened.
// A symbolic link is refused here, naming it, as open would refuse it.
Result<FileInfo> regular_file(Filesystem& fs, const std::string& path) {
  FERRY_ASSIGN_OR_RETURN(FileInfo info, fs.lstat(path));
  if (info.is_symlink)
    return Status::invalid_argument("read_file " + path +
                                    ": is a symbolic link, which Ferry never follows there");
  if (info.is_dir) return Status::invalid_argument("read_file " + path + ": is a directory");
  if (!info.is_regular)
    return Status::invalid_argument("read_file " + path + ": not a regular file");
  return info;
}

}  // namespace

Result<std::string> read_file_head(Filesystem& fs, const std::string& path, uint64_t max_bytes) {
  FERRY_ASSIGN_OR_RETURN(FileInfo info, regular_file(fs, path));
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<File> f, fs.open(path, OpenOptions{}));
  std::string out(static_cast<size_t>(std::min(info.size, max_bytes)), '\0');
  FERRY_ASSIGN_OR_RETURN(size_t n, f->pread(out.data(), out.size(), 0));
  out.resize(n);
  FERRY_RETURN_IF_ERROR(f->close());
  return out;
}

Status read_file_into(Filesystem& fs, const std::string& path, std::string* out,
                      uint64_t max_bytes) {
  FERRY_ASSIGN_OR_RETURN(FileInfo info, regular_file(fs, path));
  if (info.size > max_bytes)
    return Status::invalid_argument("read_file " + path + ": " + std::to_string(info.size) +
                                    " bytes, more than the " + std::to_string(max_bytes) +
                                    " this file may hold");
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<File> f, fs.open(path, OpenOptions{}));
  // The size is a hint: the file may have grown since stat, so read to EOF
  // through a small probe instead of doubling a possibly large buffer.
  out->resize(static_cast<size_t>(info.size));
  size_t have = 0;
  while (true) {
    if (have < out->size()) {
      FERRY_ASSIGN_OR_RETURN(size_t n, f->pread(&(*out)[have], out->size() - have, have));
      have += n;
      if (have < out->size()) break;  // pread stops short only at end of file
    } else {
      char probe[4096];
      FERRY_ASSIGN_OR_RETURN(size_t n, f->pread(probe, sizeof(probe), have));
      if (n == 0) break;
      out->append(probe, n);
      have += n;
      if (have > max_bytes)
        return Status::invalid_argument("read_file " + path + ": grew past " +
                                        std::to_string(max_bytes) + " bytes while read");
    }
  }
  out->resize(have);
  return f->close();
}

Result<std::string> read_file(Filesystem& fs, const std::string& path, uint64_t max_bytes) {
  std::string out;
  FERRY_RETURN_IF_ERROR(read_file_into(fs, path, &out, max_bytes));
  return out;
}

namespace {

void crash_point_of(Filesystem& fs, const char* points, const char* step) {
  if (points) fs.crash_point((std::string(points) + "." + step).c_str());
}

}  // namespace

Result<std::string> write_temp_file(Filesystem& fs, const std::string& path,
                                    const std::string& bytes, bool sync) {
  return write_temp_file_passing(fs, path, bytes, sync, nullptr);
}

namespace {

Result<std::string> write_temp_pieces(Filesystem& fs, const std::string& path,
                                      const std::vector<std::string_view>& pieces, bool sync,
                                      const char* points) {
  static std::atomic<uint64_t> counter{0};
  std::string tmp = path + ".tmp-" + std::to_string(::getpid()) + "-" +
                    std::to_string(counter.fetch_add(1, std::memory_order_relaxed));
  OpenOptions o;
  o.write = true;
  o.create = true;
  o.exclusive = true;
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<File> f, fs.open(tmp, o));
  Status st;
  uint64_t at = 0;
  for (std::string_view piece : pieces) {
    st = f->pwrite(piece.data(), piece.size(), at);
    if (!st.ok()) break;
    at += piece.size();
  }
  if (st.ok()) crash_point_of(fs, points, "write");
  if (st.ok() && sync) {
    st = f->sync();
    if (st.ok()) crash_point_of(fs, points, "fsync");
  }
  Status closed = f->close();
  if (st.ok()) st = closed;
  if (!st.ok()) {
    (void)fs.unlink(tmp);  // best effort: the first error is the one to report
    return st;
  }
  return tmp;
}

}  // namespace

Result<std::string> write_temp_file_passing(Filesystem& fs, const std::string& path,
                                            const std::string& bytes, bool sync,
                                            const char* points) {
  return write_temp_pieces(fs, path, {bytes}, sync, points);
}

Status write_file_atomic(Filesystem& fs, const std::string& path, const std::string& bytes,
                         bool sync) {
  return write_file_atomic_passing(fs, path, bytes, sync, nullptr);
}

Status write_file_atomic_passing(Filesystem& fs, const std::string& path, const std::string& bytes,
                                 bool sync, const char* points) {
  return write_pieces_atomic_passing(fs, path, {bytes}, sync, points);
}

Status write_pieces_atomic_passing(Filesystem& fs, const std::string& path,
                                   const std::vector<std::string_view>& pieces, bool sync,
                                   const char* points) {
  FERRY_ASSIGN_OR_RETURN(std::string tmp, write_temp_pieces(fs, path, pieces, sync, points));
  Status st = fs.rename(tmp, path);
  if (!st.ok()) {
    (void)fs.unlink(tmp);
    return st;
  }
  crash_point_of(fs, points, "rename");
  if (sync) FERRY_RETURN_IF_ERROR(fs.sync_dir(parent_path(path)));
  crash_point_of(fs, points, "dirsync");
  return Status::ok_status();
}

Status remove_all(Filesystem& fs, const std::string& path) {
  Result<FileInfo> info = fs.lstat(path);
  if (!info.ok()) {
    return info.status().code() == StatusCode::not_found ? Status::ok_status() : info.status();
  }
  // A link (to a directory too) goes itself: walking it would delete what
  // it points at.
  if (!info->is_dir || info->is_symlink) {
    Status st = fs.unlink(path);
    return st.code() == StatusCode::not_found ? Status::ok_status() : st;
  }
  Result<std::vector<std::string>> names = fs.list(path);
  if (!names.ok()) {
    return names.status().code() == StatusCode::not_found ? Status::ok_status() : names.status();
  }
  for (const std::string& name : *names) {
    FERRY_RETURN_IF_ERROR(remove_all(fs, join_path(path, name)));
  }
  Status st = fs.rmdir(path);
  return st.code() == StatusCode::not_found ? Status::ok_status() : st;
}

}  // namespace ferry
