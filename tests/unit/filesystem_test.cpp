// One conformance suite for every Filesystem: the POSIX one, a forwarding
// wrapper and the fault-injecting one (with no faults) must behave the same.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "drills/fault_fs.hpp"
#include "ferry/filesystem.hpp"
#include "pool.hpp"
#include "process.hpp"
#include "test_util.hpp"

namespace ferry {
namespace {

using ferry::testing::TempDir;

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

OpenOptions writable(bool create = true, bool exclusive = false) {
  OpenOptions o;
  o.write = true;
  o.create = create;
  o.exclusive = exclusive;
  return o;
}

// Exercises every operation of `fs` inside `dir`. Called once per
// implementation; SECTIONs rerun the setup for each branch.
void filesystem_conformance(Filesystem& fs, const std::string& dir) {
  SECTION("write, read back, truncate, sync, close twice") {
    std::string path = join_path(dir, "a.bin");
    auto f = fs.open(path, writable());
    REQUIRE(f.ok());
    CHECK((*f)->path() == path);
    std::string text = "hello, ferry";
    REQUIRE((*f)->pwrite(text.data(), text.size(), 0).ok());
    REQUIRE((*f)->pwrite("!!", 2, 100).ok());  // leaves a hole
    REQUIRE((*f)->sync().ok());

    char buf[200] = {};
    auto n = (*f)->pread(buf, sizeof(buf), 0);
    REQUIRE(n.ok());
    CHECK(*n == 102);  // short only because of end of file
    CHECK(std::string(buf, text.size()) == text);
    CHECK(buf[50] == '\0');
    CHECK(std::string(buf + 100, 2) == "!!");

    auto past = (*f)->pread(buf, 10, 1000);
    REQUIRE(past.ok());
    CHECK(*past == 0);

    REQUIRE((*f)->truncate(5).ok());
    REQUIRE((*f)->sync().ok());
    auto info = fs.stat(path);
    REQUIRE(info.ok());
    CHECK(info->size == 5);
    CHECK_FALSE(info->is_dir);
    CHECK(info->mtime_unix_ms > 0);

    CHECK((*f)->close().ok());
    CHECK((*f)->close().ok());  // idempotent
    auto contents = read_file(fs, path);
    REQUIRE(contents.ok());
    CHECK(*contents == "hello");
  }

  SECTION("reserve: the file grows to the size, reading as zeros, and never shrinks") {
    std::string path = join_path(dir, "r.bin");
    auto f = fs.open(path, writable());
    REQUIRE(f.ok());
    REQUIRE((*f)->pwrite("head", 4, 0).ok());
    const uint64_t size = (1 << 20) + 5;
    REQUIRE((*f)->reserve(size).ok());
    auto info = fs.stat(path);
    REQUIRE(info.ok());
    // A filesystem without fallocate reserves nothing, and says ok.
    if (info->size == 4) return;
    CHECK(info->size == size);
    std::vector<char> buf(size + 10, 'x');
    auto n = (*f)->pread(buf.data(), buf.size(), 0);
    REQUIRE(n.ok());
    CHECK(*n == size);
    CHECK(std::string(buf.data(), 4) == "head");  // what was written stays
    CHECK(std::all_of(buf.begin() + 4, buf.begin() + size, [](char c) { return c == 0; }));
    REQUIRE((*f)->reserve(100).ok());  // smaller: nothing changes
    CHECK(fs.stat(path)->size == size);
    // Written into and cut to its length, as a save's data file is.
    REQUIRE((*f)->pwrite("tail", 4, 4096).ok());
    REQUIRE((*f)->truncate(4100).ok());
    REQUIRE((*f)->close().ok());
    auto contents = read_file(fs, path);
    REQUIRE(contents.ok());
    CHECK(contents->size() == 4100);
    CHECK(contents->substr(4096) == "tail");
  }

  SECTION("open options: exclusive, truncate, read-only") {
    std::string path = join_path(dir, "b.bin");
    REQUIRE(write_file_atomic(fs, path, "0123456789", false).ok());

    auto excl = fs.open(path, writable(true, true));
    REQUIRE_FALSE(excl.ok());
    CHECK(excl.status().code() == StatusCode::already_exists);
    CHECK(contains(excl.status().message(), path));

    OpenOptions trunc = writable(false);
    trunc.truncate = true;
    auto t = fs.open(path, trunc);
    REQUIRE(t.ok());
    REQUIRE((*t)->close().ok());
    CHECK(fs.stat(path)->size == 0);

    auto ro = fs.open(path, OpenOptions{});
    REQUIRE(ro.ok());
    Status w = (*ro)->pwrite("x", 1, 0);
    CHECK_FALSE(w.ok());
    CHECK(contains(w.message(), "pwrite"));
    CHECK(contains(w.message(), path));
  }

  SECTION("errors name the operation and the path") {
    std::string missing = join_path(dir, "no-such-file");
    auto f = fs.open(missing, OpenOptions{});
    REQUIRE_FALSE(f.ok());
    CHECK(f.status().code() == StatusCode::not_found);
    CHECK(contains(f.status().message(), "open"));
    CHECK(contains(f.status().message(), missing));

    auto st = fs.stat(missing);
    REQUIRE_FALSE(st.ok());
    CHECK(st.status().code() == StatusCode::not_found);
    CHECK(contains(st.status().message(), missing));

    auto rf = read_file(fs, missing);
    REQUIRE_FALSE(rf.ok());
    CHECK(rf.status().code() == StatusCode::not_found);

    std::string orphan = join_path(dir, "missing-parent/child");
    Status m = fs.mkdir(orphan);
    CHECK(m.code() == StatusCode::not_found);
    CHECK(contains(m.message(), "mkdir"));
    CHECK(contains(m.message(), orphan));

    // A regular file as the parent fails for root too (unlike a read-only
    // directory, which root may write into anyway).
    std::string file = join_path(dir, "plain");
    REQUIRE(write_file_atomic(fs, file, "x", false).ok());
    Status under_file = fs.mkdir(join_path(file, "sub"));
    CHECK_FALSE(under_file.ok());
    CHECK(contains(under_file.message(), file));
    Status mkdirs_under_file = fs.mkdirs(join_path(file, "sub/deeper"));
    CHECK_FALSE(mkdirs_under_file.ok());
    CHECK(contains(mkdirs_under_file.message(), file));

    Status un = fs.unlink(missing);
    CHECK(un.code() == StatusCode::not_found);
    CHECK(contains(un.message(), "unlink"));
    Status rn = fs.rename(missing, join_path(dir, "elsewhere"));
    CHECK(rn.code() == StatusCode::not_found);
    CHECK(contains(rn.message(), missing));
    CHECK(fs.rmdir(missing).code() == StatusCode::not_found);
    CHECK(fs.sync_dir(missing).code() == StatusCode::not_found);
    auto ls = fs.list(missing);
    REQUIRE_FALSE(ls.ok());
    CHECK(ls.status().code() == StatusCode::not_found);
    CHECK(contains(ls.status().message(), missing));
  }

  SECTION("read-only parent directory") {
    std::string ro = join_path(dir, "ro");
    REQUIRE(fs.mkdir(ro).ok());
    REQUIRE(::chmod(ro.c_str(), 0555) == 0);
    // root bypasses directory permissions, so the check runs as nobody, who
    // must be able to reach `ro`.
    REQUIRE(::chmod(dir.c_str(), 0755) == 0);
    const std::optional<int> refused = ferry::testing::run_unprivileged([&fs, &ro] {
      Status s = fs.mkdir(join_path(ro, "sub"));
      if (s.code() != StatusCode::io_error) return 1;
      if (!contains(s.message(), join_path(ro, "sub"))) return 2;
      if (fs.open(join_path(ro, "f"), writable()).ok()) return 3;
      return 0;
    });
    REQUIRE(::chmod(ro.c_str(), 0755) == 0);
    if (!refused) FERRY_SKIP("running as root and cannot switch to an unprivileged user");
    // 1: not io_error, 2: message without the path, 3: a file was created.
    CHECK(*refused == 0);
  }

  SECTION("mkdir, mkdirs, list, stat, rename, rmdir") {
    std::string d = join_path(dir, "d");
    REQUIRE(fs.mkdir(d).ok());
    Status again = fs.mkdir(d);
    CHECK(again.code() == StatusCode::already_exists);
    CHECK(contains(again.message(), d));

    std::string deep = join_path(dir, "x/y/z");
    REQUIRE(fs.mkdirs(deep).ok());
    REQUIRE(fs.mkdirs(deep).ok());  // existing directories are fine
    REQUIRE(fs.mkdirs(deep + "/").ok());
    auto info = fs.stat(deep);
    REQUIRE(info.ok());
    CHECK(info->is_dir);

    REQUIRE(write_file_atomic(fs, join_path(d, "c"), "c", false).ok());
    REQUIRE(write_file_atomic(fs, join_path(d, "a"), "a", false).ok());
    REQUIRE(fs.mkdir(join_path(d, "b")).ok());
    auto names = fs.list(d);
    REQUIRE(names.ok());
    CHECK(*names == std::vector<std::string>{"a", "b", "c"});

    REQUIRE(fs.rename(join_path(d, "a"), join_path(d, "c")).ok());  // replaces c
    CHECK(*read_file(fs, join_path(d, "c")) == "a");
    CHECK(fs.stat(join_path(d, "a")).status().code() == StatusCode::not_found);
    REQUIRE(fs.sync_dir(d).ok());

    Status not_empty = fs.rmdir(d);
    CHECK_FALSE(not_empty.ok());
    CHECK(contains(not_empty.message(), "rmdir"));
    REQUIRE(fs.rmdir(join_path(d, "b")).ok());
    REQUIRE(fs.unlink(join_path(d, "c")).ok());
    REQUIRE(fs.rmdir(d).ok());
    CHECK(fs.stat(d).status().code() == StatusCode::not_found);
  }

  SECTION("write_file_atomic replaces and leaves no temp files") {
    std::string path = join_path(dir, "LATEST");
    REQUIRE(write_file_atomic(fs, path, "step-00000001\n", true).ok());
    REQUIRE(write_file_atomic(fs, path, "step-00000002\n", true).ok());
    CHECK(*read_file(fs, path) == "step-00000002\n");
    CHECK(*fs.list(dir) == std::vector<std::string>{"LATEST"});

    std::string empty = join_path(dir, "empty");
    REQUIRE(write_file_atomic(fs, empty, "", false).ok());
    CHECK(*read_file(fs, empty) == "");

    std::string big(3 * 1024 * 1024 + 17, '\0');
    for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 31 + 7);
    std::string big_path = join_path(dir, "big");
    REQUIRE(write_file_atomic(fs, big_path, big, false).ok());
    CHECK(*read_file(fs, big_path) == big);

    // Renaming over a directory fails: the temp file must be cleaned up.
    std::string blocker = join_path(dir, "blocker");
    REQUIRE(fs.mkdir(blocker).ok());
    REQUIRE(write_file_atomic(fs, join_path(blocker, "inner"), "x", false).ok());
    Status s = write_file_atomic(fs, blocker, "data", false);
    CHECK_FALSE(s.ok());
    CHECK(contains(s.message(), blocker));
    CHECK(*fs.list(dir) == std::vector<std::string>{"LATEST", "big", "blocker", "empty"});

    Status missing_dir = write_file_atomic(fs, join_path(dir, "nope/file"), "x", true);
    CHECK(missing_dir.code() == StatusCode::not_found);
    CHECK(contains(missing_dir.message(), join_path(dir, "nope/file")));
  }

  SECTION("remove_all") {
    std::string tree = join_path(dir, "tree");
    REQUIRE(fs.mkdirs(join_path(tree, "a/b/c")).ok());
    REQUIRE(write_file_atomic(fs, join_path(tree, "f1"), "1", false).ok());
    REQUIRE(write_file_atomic(fs, join_path(tree, "a/f2"), "2", false).ok());
    REQUIRE(write_file_atomic(fs, join_path(tree, "a/b/c/f3"), "3", false).ok());
    REQUIRE(remove_all(fs, tree).ok());
    CHECK(fs.stat(tree).status().code() == StatusCode::not_found);
    CHECK(remove_all(fs, tree).ok());  // already gone is fine

    std::string file = join_path(dir, "single");
    REQUIRE(write_file_atomic(fs, file, "s", false).ok());
    REQUIRE(remove_all(fs, file).ok());
    CHECK(fs.stat(file).status().code() == StatusCode::not_found);
    CHECK(*fs.list(dir) == std::vector<std::string>{});
  }

  SECTION("remove_all removes a link to a directory, not what it points at") {
    std::string target = join_path(dir, "target");
    REQUIRE(fs.mkdir(target).ok());
    REQUIRE(write_file_atomic(fs, join_path(target, "keep"), "k", false).ok());
    std::string link = join_path(dir, "link");
    REQUIRE(::symlink(target.c_str(), link.c_str()) == 0);
    REQUIRE(remove_all(fs, link).ok());
    CHECK(fs.stat(link).status().code() == StatusCode::not_found);
    CHECK(*read_file(fs, join_path(target, "keep")) == "k");
  }

  SECTION("a symbolic link is never opened, read, written or locked through") {
    std::string outside = join_path(dir, "outside");
    REQUIRE(fs.mkdir(outside).ok());
    const std::string target = join_path(outside, "target");
    REQUIRE(write_file_atomic(fs, target, "outside bytes", false).ok());
    const std::string inside = join_path(dir, "inside");
    REQUIRE(fs.mkdir(inside).ok());
    for (const char* name : {"MANIFEST", "LATEST", "rank-00000-0000.safetensors", ".ferry-lock"}) {
      const std::string link = join_path(inside, name);
      REQUIRE(::symlink(target.c_str(), link.c_str()) == 0);
      INFO(link);
      auto lst = fs.lstat(link);
      REQUIRE(lst.ok());
      CHECK(lst->is_symlink);
      CHECK_FALSE(lst->is_regular);
      CHECK(fs.stat(link)->is_regular);  // stat follows, as documented
      auto r = fs.open(link, OpenOptions{});
      REQUIRE_FALSE(r.ok());
      CHECK(contains(r.status().message(), link));
      CHECK(contains(r.status().message(), "symbolic link"));
      auto w = fs.open(link, writable(true, false));
      REQUIRE_FALSE(w.ok());
      w = fs.open(link, writable(true, true));
      REQUIRE_FALSE(w.ok());
      auto text = read_file(fs, link);
      REQUIRE_FALSE(text.ok());
      CHECK(contains(text.status().message(), "symbolic link"));
      auto lock = fs.lock(link, 0);
      REQUIRE_FALSE(lock.ok());
      CHECK(contains(lock.status().message(), link));
    }
    // A second name for a file (a hard link from elsewhere) is no lock file:
    // taking the lock would write into the other name's file.
    const std::string hard = join_path(inside, "hard-lock");
    REQUIRE(::link(target.c_str(), hard.c_str()) == 0);
    auto lock = fs.lock(hard, 0);
    REQUIRE_FALSE(lock.ok());
    CHECK(contains(lock.status().message(), "hard links"));
    CHECK(*read_file(fs, target) == "outside bytes");
  }

  SECTION("concurrent pwrite and pread on one file") {
    std::string path = join_path(dir, "shared.bin");
    auto f = fs.open(path, writable());
    REQUIRE(f.ok());
    File* file = f->get();
    constexpr size_t kPiece = 64 * 1024;
    std::vector<std::thread> threads;
    std::vector<Status> results(4);
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([file, t, &results]() {
        std::string piece(kPiece, static_cast<char>('a' + t));
        results[t] = file->pwrite(piece.data(), piece.size(), t * kPiece);
      });
    }
    for (auto& th : threads) th.join();
    for (const Status& s : results) CHECK(s.ok());
    std::string back(4 * kPiece, '\0');
    auto n = file->pread(&back[0], back.size(), 0);
    REQUIRE(n.ok());
    REQUIRE(*n == back.size());
    for (int t = 0; t < 4; ++t) CHECK(back[t * kPiece + kPiece - 1] == 'a' + t);
    REQUIRE(file->close().ok());
  }

  SECTION("lock: exclusive, bounded wait, names path and holder, released on destruction") {
    const std::string path = join_path(dir, ".lock");
    auto a = fs.lock(path, 0);
    REQUIRE(a.ok());
    // A second holder in the same process is excluded too (one per open).
    auto b = fs.lock(path, 10);
    REQUIRE_FALSE(b.ok());
    CHECK(b.status().code() == StatusCode::busy);
    CHECK(contains(b.status().message(), path));
    CHECK(contains(b.status().message(), "pid " + std::to_string(::getpid())));
    a->reset();
    auto c = fs.lock(path, 0);
    CHECK(c.ok());
  }

  SECTION("a FIFO is never opened for reading, and stat tells it apart") {
    const std::string fifo = join_path(dir, "fifo");
    REQUIRE(::mkfifo(fifo.c_str(), 0644) == 0);
    auto st = fs.stat(fifo);
    REQUIRE(st.ok());
    CHECK_FALSE(st->is_regular);
    CHECK_FALSE(st->is_dir);
    auto f = fs.open(fifo, OpenOptions{});
    REQUIRE_FALSE(f.ok());
    CHECK(contains(f.status().message(), fifo));
    CHECK(contains(f.status().message(), "not a regular file"));
    auto r = read_file(fs, fifo);
    REQUIRE_FALSE(r.ok());
    CHECK(contains(r.status().message(), fifo));
    REQUIRE(write_file_atomic(fs, join_path(dir, "plain"), "x", false).ok());
    CHECK(fs.stat(join_path(dir, "plain"))->is_regular);
  }

  SECTION("O_DIRECT writes of aligned blocks from pool memory") {
    auto pool = StagingPool::create(3 * 4096, 4096);
    REQUIRE(pool.ok());
    auto w1 = (*pool)->try_acquire();
    auto w2 = (*pool)->try_acquire();
    auto r = (*pool)->try_acquire();
    REQUIRE((w1 && w2 && r));
    uint8_t* b1 = *(*pool)->data(*w1);
    uint8_t* b2 = *(*pool)->data(*w2);
    uint8_t* rb = *(*pool)->data(*r);
    std::memset(b1, 0x11, 4096);
    std::memset(b2, 0x22, 4096);

    std::string path = join_path(dir, "direct.bin");
    OpenOptions o = writable();
    o.direct = true;
    auto f = fs.open(path, o);
    REQUIRE(f.ok());  // where O_DIRECT is refused (tmpfs) open still succeeds
    INFO("direct() = " << (*f)->direct());
    REQUIRE((*f)->pwrite(b1, 4096, 0).ok());
    REQUIRE((*f)->pwrite(b2, 4096, 4096).ok());
    auto n = (*f)->pread(rb, 4096, 4096);
    REQUIRE(n.ok());
    CHECK(*n == 4096);
    CHECK(std::memcmp(rb, b2, 4096) == 0);
    // The writer pads the last block and cuts the file to its real size.
    REQUIRE((*f)->truncate(4096 + 100).ok());
    REQUIRE((*f)->sync().ok());
    REQUIRE((*f)->close().ok());

    auto back = read_file(fs, path);
    REQUIRE(back.ok());
    REQUIRE(back->size() == 4096 + 100);
    CHECK(static_cast<uint8_t>((*back)[0]) == 0x11);
    CHECK(static_cast<uint8_t>((*back)[4095]) == 0x11);
    CHECK(static_cast<uint8_t>((*back)[4096 + 99]) == 0x22);
  }
}

// Forwards everything: the smallest subclass, as a fault injector starts.
class PassThroughFilesystem : public FilesystemWrapper {
 public:
  using FilesystemWrapper::FilesystemWrapper;
};

// Registers the whole suite for one implementation; `make` returns a fresh
// std::shared_ptr<Filesystem>.
#define FERRY_FILESYSTEM_CONFORMANCE(name, make)              \
  TEST_CASE(name " filesystem conformance", "[filesystem]") { \
    TempDir tmp;                                              \
    REQUIRE(!tmp.path().empty());                             \
    std::shared_ptr<Filesystem> fs = (make)();                \
    filesystem_conformance(*fs, tmp.path());                  \
  }

FERRY_FILESYSTEM_CONFORMANCE("posix", [] { return posix_filesystem(); })
FERRY_FILESYSTEM_CONFORMANCE("wrapped", [] {
  return std::make_shared<PassThroughFilesystem>(posix_filesystem());
})
// With no faults set the fault-injecting filesystem must be invisible; its
// power-cut bookkeeping runs on every call all the same.
FERRY_FILESYSTEM_CONFORMANCE("fault-injecting",
                             [] { return std::make_shared<FaultFilesystem>(posix_filesystem()); })

// The same suite below a declared root, resolved by openat2 and by the
// component walk kept for kernels without it.
#define FERRY_FILESYSTEM_CONFORMANCE_ROOTED(name, make)                    \
  TEST_CASE(name " filesystem conformance below a root", "[filesystem]") { \
    TempDir tmp;                                                           \
    std::shared_ptr<Filesystem> fs = (make)();                             \
    fs->add_root(tmp.path());                                              \
    filesystem_conformance(*fs, tmp.path() + "/.");                        \
  }

FERRY_FILESYSTEM_CONFORMANCE_ROOTED("openat2", [] {
  return std::shared_ptr<Filesystem>(std::make_shared<PassThroughFilesystem>(posix_filesystem()));
})
FERRY_FILESYSTEM_CONFORMANCE_ROOTED("walking", detail::posix_filesystem_without_openat2)

std::vector<std::string> names_in(Filesystem& fs, const std::string& dir) {
  auto names = fs.list(dir);
  REQUIRE(names.ok());
  return *names;
}

// A directory inside the root swapped for a link to one outside (as a
// neighbour could between Ferry's check and its open): no operation below
// the root reaches through it, and each error names the path.
void no_component_followed(std::shared_ptr<Filesystem> fs) {
  TempDir tmp;
  const std::string root = join_path(tmp.path(), "root");
  const std::string outside = join_path(tmp.path(), "outside");
  REQUIRE(fs->mkdir(root).ok());
  REQUIRE(fs->mkdir(outside).ok());
  {
    auto f = fs->open(join_path(outside, "secret"), writable());
    REQUIRE(f.ok());
    REQUIRE((*f)->pwrite("outside", 7, 0).ok());
    REQUIRE((*f)->close().ok());
  }
  REQUIRE(fs->mkdir(join_path(root, "step-2")).ok());
  const std::string link = join_path(root, "step-1");
  REQUIRE(::symlink(outside.c_str(), link.c_str()) == 0);
  // A link deeper down, below a real directory, is refused as well.
  REQUIRE(fs->mkdir(join_path(root, "step-2/sub")).ok());
  const std::string deep = join_path(root, "step-2/sub/inner");
  REQUIRE(::symlink(outside.c_str(), deep.c_str()) == 0);
  fs->add_root(root);

  for (const std::string& via : {link, deep, join_path(root, "step-2/../../outside")}) {
    INFO(via);
    const std::string secret = join_path(via, "secret");
    const std::string fresh = join_path(via, "fresh");
    auto names = [&](const Status& st, const std::string& path) {
      INFO(st.to_string());
      CHECK(!st.ok());
      CHECK(contains(st.message(), path));
    };
    names(fs->open(secret, OpenOptions{}).status(), secret);
    names(fs->open(fresh, writable()).status(), fresh);
    names(fs->open(secret, writable(false)).status(), secret);
    names(read_file(*fs, secret).status(), secret);
    names(fs->stat(secret).status(), secret);
    names(fs->lstat(secret).status(), secret);
    names(fs->list(join_path(via, "")).status(), join_path(via, ""));
    names(fs->mkdir(fresh), fresh);
    // mkdirs names the first of the path's prefixes it could not make.
    names(fs->mkdirs(join_path(fresh, "a/b")), root + "/step-");
    names(fs->unlink(secret), secret);
    names(fs->rename(join_path(root, "step-2/sub"), fresh), fresh);
    names(fs->rename(secret, join_path(root, "taken")), secret);
    names(fs->sync_dir(join_path(via, "")), via);
    names(fs->lock(join_path(via, ".ferry-lock"), 0).status(), via);
  }
  // The link itself, the last component of a path, is refused as before.
  CHECK(!fs->open(link, OpenOptions{}).ok());
  CHECK(!fs->list(link).ok());
  // Nothing outside was written, removed, moved or created.
  CHECK(names_in(*fs, outside) == std::vector<std::string>{"secret"});
  auto bytes = read_file(*fs, join_path(outside, "secret"));
  REQUIRE(bytes.ok());
  CHECK(*bytes == "outside");
  CHECK(names_in(*fs, join_path(root, "step-2")) == std::vector<std::string>{"sub"});
  // Ferry's own entries below the root still work, links themselves included.
  REQUIRE(fs->mkdirs(join_path(root, "step-2/a/b")).ok());
  REQUIRE(fs->rename(join_path(root, "step-2/a"), join_path(root, "step-3")).ok());
  CHECK(fs->stat(join_path(root, "step-3/b"))->is_dir);
  CHECK(fs->lstat(link)->is_symlink);
  REQUIRE(fs->unlink(link).ok());
  REQUIRE(remove_all(*fs, join_path(root, "step-2")).ok());
  CHECK(names_in(*fs, outside) == std::vector<std::string>{"secret"});
  CHECK(names_in(*fs, root) == std::vector<std::string>{"step-3"});
}

TEST_CASE("below a root no component is a followed link (openat2)", "[filesystem][symlink]") {
  no_component_followed(posix_filesystem());
}

TEST_CASE("below a root no component is a followed link (component walk)",
          "[filesystem][symlink]") {
  no_component_followed(detail::posix_filesystem_without_openat2());
}

TEST_CASE("a root's own path may go through links", "[filesystem][symlink]") {
  TempDir tmp;
  auto fs = detail::posix_filesystem_without_openat2();
  const std::string real = join_path(tmp.path(), "real");
  const std::string alias = join_path(tmp.path(), "alias");
  REQUIRE(fs->mkdir(real).ok());
  REQUIRE(::symlink(real.c_str(), alias.c_str()) == 0);
  fs->add_root(alias + "/");
  REQUIRE(fs->mkdirs(join_path(alias, "step-1")).ok());
  REQUIRE(write_file_atomic(*fs, join_path(alias, "step-1/MANIFEST"), "m", true).ok());
  auto back = read_file(*fs, join_path(real, "step-1/MANIFEST"));
  REQUIRE(back.ok());
  CHECK(*back == "m");
  CHECK(names_in(*fs, alias) == std::vector<std::string>{"step-1"});
  auto lock = fs->lock(join_path(alias, ".ferry-lock"), 0);
  CHECK(lock.ok());
}

TEST_CASE("a root stays declared while any declaration of it lasts, then is released",
          "[filesystem][symlink][root]") {
  TempDir tmp;
  auto fs = detail::posix_filesystem_without_openat2();
  const std::string root = join_path(tmp.path(), "root");
  const std::string outside = join_path(tmp.path(), "outside");
  REQUIRE(fs->mkdir(root).ok());
  REQUIRE(fs->mkdir(outside).ok());
  REQUIRE(write_file_atomic(*fs, join_path(outside, "secret"), "s", true).ok());
  REQUIRE(::symlink(outside.c_str(), join_path(root, "step-1").c_str()) == 0);
  const std::string via = join_path(root, "step-1/secret");
  {
    RootHold first(fs, root);
    {
      RootHold second(fs, root + "/");  // the same root, spelled otherwise
      CHECK(detail::declared_roots(*fs) == 1);
    }
    // One declaration left: still no link below the root is followed.
    CHECK(detail::declared_roots(*fs) == 1);
    CHECK_FALSE(read_file(*fs, via).ok());
  }
  CHECK(detail::declared_roots(*fs) == 0);
  // Undeclared, the path is an ordinary one again (only its last component
  // is never a link).
  auto back = read_file(*fs, via);
  REQUIRE(back.ok());
  CHECK(*back == "s");

  // Many declarations and locks come and go: the list ends where it began.
  for (int i = 0; i < 1000; ++i) {
    const std::string r = join_path(tmp.path(), "r" + std::to_string(i));
    RootHold hold(fs, r);
    CHECK(detail::declared_roots(*fs) == 1);
  }
  for (int i = 0; i < 20; ++i) {
    const std::string d = join_path(tmp.path(), "d" + std::to_string(i));
    REQUIRE(fs->mkdir(d).ok());
    auto lock = fs->lock(join_path(d, ".ferry-lock"), 0);
    REQUIRE(lock.ok());
    CHECK(detail::declared_roots(*fs) == 1);
  }
  CHECK(detail::declared_roots(*fs) == 0);
}

TEST_CASE("O_DIRECT falls back where the filesystem refuses it", "[filesystem]") {
  // /dev/shm is tmpfs, which refused O_DIRECT (EINVAL) before Linux 6.6;
  // newer kernels accept it, so both outcomes are valid here.
  struct stat st;
  if (::stat("/dev/shm", &st) != 0 || !S_ISDIR(st.st_mode)) {
    FERRY_SKIP("no /dev/shm (tmpfs) to try O_DIRECT on");
  }
  auto fs = posix_filesystem();
  std::string path = "/dev/shm/ferry-direct-" + std::to_string(::getpid());
  OpenOptions o = writable();
  o.direct = true;
  auto f = fs->open(path, o);
  REQUIRE(f.ok());
  std::string data = "not aligned at all";
  // Unaligned I/O is only legal when the fallback really happened.
  if (!(*f)->direct()) REQUIRE((*f)->pwrite(data.data(), data.size(), 0).ok());
  REQUIRE((*f)->close().ok());
  REQUIRE(fs->unlink(path).ok());
}

TEST_CASE("join_path and parent_path", "[filesystem]") {
  CHECK(join_path("a", "b") == "a/b");
  CHECK(join_path("a/", "b") == "a/b");
  CHECK(join_path("", "b") == "b");
  CHECK(join_path("/", "b") == "/b");
  CHECK(parent_path("/x/y/z") == "/x/y");
  CHECK(parent_path("/x/y/z/") == "/x/y");
  CHECK(parent_path("/x") == "/");
  CHECK(parent_path("/") == "/");
  CHECK(parent_path("x") == ".");
  CHECK(parent_path("x/y") == "x");
  CHECK(parent_path("//x//y") == "//x");
  CHECK(parent_path("") == ".");
}

}  // namespace
}  // namespace ferry
