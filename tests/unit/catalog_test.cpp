#include "catalog.hpp"

#include <unistd.h>

#include <catch2/catch.hpp>
#include <map>
#include <string>
#include <vector>

#include "ferry/catalog.hpp"
#include "ferry/filesystem.hpp"
#include "manifest.hpp"
#include "test_util.hpp"

namespace ferry {
namespace {

using ferry::testing::TempDir;

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// A committed checkpoint as the coordinator leaves it: a step directory with
// a MANIFEST (no data files: the catalog never opens them).
std::string make_checkpoint(Filesystem& fs, const std::string& root, uint64_t step,
                            uint64_t commit_seq) {
  std::string dir = join_path(root, step_dir_name(step));
  REQUIRE(fs.mkdirs(dir).ok());
  Manifest m;
  m.step = step;
  m.commit_seq = commit_seq;
  m.job_id = "job";
  m.checkpoint_id = "ckpt-" + std::to_string(step);
  REQUIRE(write_file_atomic(fs, join_path(dir, kManifestFileName), encode_manifest(m), false).ok());
  return dir;
}

std::vector<uint64_t> steps_of(const std::vector<CheckpointInfo>& v) {
  std::vector<uint64_t> out;
  for (const auto& c : v) out.push_back(c.step);
  return out;
}

TEST_CASE("catalog directory names", "[catalog]") {
  CHECK(step_dir_name(1000) == "step-00001000");
  CHECK(step_dir_name(0) == "step-00000000");
  CHECK(step_dir_name(123456789012ull) == "step-123456789012");
  CHECK(pending_dir_name(1200, "jobA", "x1") == ".pending-00001200-jobA-x1");
  CHECK(is_pending_dir_name(".pending-00001200-jobA-x1"));
  CHECK_FALSE(is_pending_dir_name("step-00001200"));
  CHECK_FALSE(is_pending_dir_name("pending-00001200"));

  uint64_t step = 7;
  CHECK(parse_step_dir_name("step-00001000", &step));
  CHECK(step == 1000);
  CHECK(parse_step_dir_name("step-123456789012", &step));
  CHECK(step == 123456789012ull);
  CHECK(parse_step_dir_name(step_dir_name(UINT64_MAX), &step));
  CHECK(step == UINT64_MAX);
  step = 7;
  CHECK_FALSE(parse_step_dir_name("step-1000", &step));  // too few digits
  CHECK_FALSE(parse_step_dir_name("step-0000100x", &step));
  CHECK_FALSE(parse_step_dir_name("step-00001000.tmp", &step));
  CHECK_FALSE(parse_step_dir_name("step--0001000", &step));
  CHECK_FALSE(parse_step_dir_name("Step-00001000", &step));
  CHECK_FALSE(parse_step_dir_name("step-", &step));
  CHECK_FALSE(parse_step_dir_name("step-99999999999999999999", &step));  // overflows
  CHECK_FALSE(parse_step_dir_name(".pending-00001000-j-i", &step));
  CHECK(step == 7);
}

TEST_CASE("catalog lists committed checkpoints by commit sequence", "[catalog]") {
  TempDir tmp;
  auto fs = posix_filesystem();
  const std::string& root = tmp.path();
  // Commit order differs from step order (e.g. a job rolled back and resaved).
  make_checkpoint(*fs, root, 300, 1);
  make_checkpoint(*fs, root, 100, 3);
  make_checkpoint(*fs, root, 200, 2);
  // A pending directory with a perfectly good manifest is still invisible.
  std::string pending = join_path(root, pending_dir_name(900, "job", "p"));
  REQUIRE(fs->mkdir(pending).ok());
  Manifest pm;
  pm.step = 900;
  pm.commit_seq = 99;
  REQUIRE(write_file_atomic(*fs, join_path(pending, kManifestFileName), encode_manifest(pm), false)
              .ok());
  // Noise that must be ignored.
  REQUIRE(fs->mkdir(join_path(root, "step-12")).ok());
  REQUIRE(write_file_atomic(*fs, join_path(root, "step-00000500"), "a file", false).ok());
  REQUIRE(write_file_atomic(*fs, join_path(root, kLatestFileName), "step-00000200\n", false).ok());

  auto list = list_checkpoints(*fs, root);
  REQUIRE(list.ok());
  CHECK(steps_of(*list) == std::vector<uint64_t>{300, 200, 100});
  for (const auto& c : *list) {
    CHECK(c.status.ok());
    CHECK(c.path == join_path(root, step_dir_name(c.step)));
    CHECK(c.latest_hint == (c.step == 200));
  }
  CHECK((*list)[2].commit_seq == 3);

  auto latest = find_latest(*fs, root);
  REQUIRE(latest.ok());
  CHECK(latest->step == 100);  // highest commit seq, not highest step
  CHECK(latest->commit_seq == 3);

  auto m = read_manifest(*fs, latest->path);
  REQUIRE(m.ok());
  CHECK(m->checkpoint_id == "ckpt-100");
}

TEST_CASE("catalog lists a corrupt manifest and never picks it", "[catalog]") {
  TempDir tmp;
  auto fs = posix_filesystem();
  const std::string& root = tmp.path();
  make_checkpoint(*fs, root, 10, 1);
  std::string bad = make_checkpoint(*fs, root, 20, 2);
  std::string bad_manifest = join_path(bad, kManifestFileName);
  auto bytes = read_file(*fs, bad_manifest);
  REQUIRE(bytes.ok());
  std::string broken = *bytes;
  broken[broken.size() / 2] ^= 0x5a;
  REQUIRE(write_file_atomic(*fs, bad_manifest, broken, false).ok());
  std::string missing = join_path(root, step_dir_name(30));  // no MANIFEST at all
  REQUIRE(fs->mkdir(missing).ok());

  auto list = list_checkpoints(*fs, root);
  REQUIRE(list.ok());
  REQUIRE(list->size() == 3);
  int unreadable = 0;
  for (const auto& c : *list) {
    if (c.step == 10) {
      CHECK(c.status.ok());
      continue;
    }
    ++unreadable;
    CHECK_FALSE(c.status.ok());
    CHECK(c.commit_seq == 0);
    CHECK(contains(c.status.message(), c.path));
  }
  CHECK(unreadable == 2);

  auto m = read_manifest(*fs, bad);
  REQUIRE_FALSE(m.ok());
  CHECK(contains(m.status().message(), bad_manifest));

  auto latest = find_latest(*fs, root);
  REQUIRE(latest.ok());
  CHECK(latest->step == 10);
}

TEST_CASE("catalog find_latest on an empty root", "[catalog]") {
  TempDir tmp;
  auto fs = posix_filesystem();
  REQUIRE(fs->mkdir(join_path(tmp.path(), pending_dir_name(1, "j", "i"))).ok());
  auto latest = find_latest(*fs, tmp.path());
  REQUIRE_FALSE(latest.ok());
  CHECK(latest.status().code() == StatusCode::not_found);
  CHECK(contains(latest.status().message(), tmp.path()));

  auto missing = list_checkpoints(*fs, join_path(tmp.path(), "nope"));
  REQUIRE_FALSE(missing.ok());
  CHECK(missing.status().code() == StatusCode::not_found);
}

TEST_CASE("catalog gc removes expired pending directories only", "[catalog]") {
  TempDir tmp;
  auto fs = posix_filesystem();
  const std::string& root = tmp.path();
  int64_t now = now_unix_ms();
  make_checkpoint(*fs, root, 1, 1);

  std::string expired = join_path(root, pending_dir_name(2, "job", "old"));
  REQUIRE(fs->mkdirs(join_path(expired, "sub")).ok());
  REQUIRE(
      write_file_atomic(*fs, join_path(expired, "sub/rank-00000-0000.safetensors"), "data", false)
          .ok());
  REQUIRE(write_lease(*fs, expired, now - 1000, "host:1234").ok());

  std::string live = join_path(root, pending_dir_name(3, "job", "live"));
  REQUIRE(fs->mkdir(live).ok());
  REQUIRE(write_lease(*fs, live, now + 60'000, "host:5678").ok());
  auto lease = read_file(*fs, join_path(live, kLeaseFileName));
  REQUIRE(lease.ok());
  CHECK(*lease == std::to_string(now + 60'000) + " host:5678\n");

  // Just created, lease not written yet: young, so kept within the grace.
  std::string fresh = join_path(root, pending_dir_name(4, "job", "fresh"));
  REQUIRE(fs->mkdir(fresh).ok());
  // A torn lease counts as no lease.
  std::string torn = join_path(root, pending_dir_name(5, "job", "torn"));
  REQUIRE(fs->mkdir(torn).ok());
  REQUIRE(write_file_atomic(*fs, join_path(torn, kLeaseFileName), "12ab", false).ok());

  auto report = collect_garbage(*fs, root, now, 60'000);
  REQUIRE(report.ok());
  CHECK(report->removed == std::vector<std::string>{expired});
  CHECK(report->kept == std::vector<std::string>{live, fresh, torn});
  CHECK(fs->stat(expired).status().code() == StatusCode::not_found);
  CHECK(fs->stat(live).ok());
  CHECK(find_latest(*fs, root).ok());  // committed checkpoints are untouched

  // Later, past both the grace period and the live lease.
  auto later = collect_garbage(*fs, root, now + 10 * 60'000, 60'000);
  REQUIRE(later.ok());
  CHECK(later->removed == std::vector<std::string>{live, fresh, torn});
  CHECK(later->kept.empty());
  CHECK(*fs->list(root) == std::vector<std::string>{kRootLockFileName, step_dir_name(1)});
}

TEST_CASE("catalog retention takes ROOT's lock, as a commit does", "[catalog]") {
  TempDir tmp;
  auto fs = posix_filesystem();
  const std::string& root = tmp.path();
  make_checkpoint(*fs, root, 10, 1);
  make_checkpoint(*fs, root, 20, 2);
  {
    auto held = lock_root(*fs, root, 0);  // a commit in progress
    REQUIRE(held.ok());
    auto r = apply_retention(*fs, root, 1, "", /*lock_wait_ms=*/0);
    REQUIRE_FALSE(r.ok());
    CHECK_THAT(r.status().message(), Catch::Contains(root));
    CHECK(list_checkpoints(*fs, root)->size() == 2);  // nothing retired
  }
  auto r = apply_retention(*fs, root, 1, "", 0);
  REQUIRE(r.ok());
  CHECK(*r == std::vector<std::string>{join_path(root, step_dir_name(10))});
}

TEST_CASE("catalog retention keeps the newest N by commit sequence", "[catalog]") {
  TempDir tmp;
  auto fs = posix_filesystem();
  const std::string& root = tmp.path();
  // Steps out of commit order; 50 was committed last.
  make_checkpoint(*fs, root, 10, 1);
  make_checkpoint(*fs, root, 40, 2);
  make_checkpoint(*fs, root, 20, 3);
  make_checkpoint(*fs, root, 30, 4);
  make_checkpoint(*fs, root, 50, 5);
  std::string pending = join_path(root, pending_dir_name(60, "job", "p"));
  REQUIRE(fs->mkdir(pending).ok());
  REQUIRE(write_lease(*fs, pending, now_unix_ms() + 60'000, "me").ok());

  auto none = apply_retention(*fs, root, 0);
  REQUIRE(none.ok());
  CHECK(none->empty());
  CHECK(list_checkpoints(*fs, root)->size() == 5);

  auto removed = apply_retention(*fs, root, 2);
  REQUIRE(removed.ok());
  CHECK(*removed == std::vector<std::string>{join_path(root, step_dir_name(10)),
                                             join_path(root, step_dir_name(40)),
                                             join_path(root, step_dir_name(20))});
  auto left = list_checkpoints(*fs, root);
  REQUIRE(left.ok());
  CHECK(steps_of(*left) == std::vector<uint64_t>{30, 50});
  CHECK(fs->stat(pending).ok());  // pending saves are not retention's business
  // Nothing half-deleted is left behind; retention took ROOT's lock.
  CHECK(*fs->list(root) == std::vector<std::string>{kRootLockFileName,
                                                    pending_dir_name(60, "job", "p"),
                                                    step_dir_name(30), step_dir_name(50)});

  auto again = apply_retention(*fs, root, 2);
  REQUIRE(again.ok());
  CHECK(again->empty());

  auto keep_one = apply_retention(*fs, root, 1);
  REQUIRE(keep_one.ok());
  CHECK(*keep_one == std::vector<std::string>{join_path(root, step_dir_name(30))});
  auto latest = find_latest(*fs, root);
  REQUIRE(latest.ok());
  CHECK(latest->step == 50);
}

TEST_CASE("catalog works through a wrapped filesystem", "[catalog]") {
  // Only the interface is used: a wrapper that sees every call still works.
  struct CountingFilesystem : FilesystemWrapper {
    using FilesystemWrapper::FilesystemWrapper;
    int lists = 0;
    Result<std::vector<std::string>> list(const std::string& d) override {
      ++lists;
      return FilesystemWrapper::list(d);
    }
  };
  TempDir tmp;
  CountingFilesystem fs(posix_filesystem());
  make_checkpoint(fs, tmp.path(), 5, 1);
  make_checkpoint(fs, tmp.path(), 6, 2);
  auto latest = find_latest(fs, tmp.path());
  REQUIRE(latest.ok());
  CHECK(latest->step == 6);
  CHECK(fs.lists >= 1);
}

// Counts the bytes read from MANIFEST files.
struct CountingFile : File {
  std::unique_ptr<File> f;
  uint64_t* bytes;
  CountingFile(std::unique_ptr<File> file, uint64_t* n) : f(std::move(file)), bytes(n) {}
  const std::string& path() const override { return f->path(); }
  bool direct() const override { return f->direct(); }
  Status pwrite(const void* d, size_t n, uint64_t o) override { return f->pwrite(d, n, o); }
  Result<size_t> pread(void* d, size_t n, uint64_t o) override {
    Result<size_t> r = f->pread(d, n, o);
    if (r.ok()) *bytes += *r;
    return r;
  }
  Status truncate(uint64_t n) override { return f->truncate(n); }
  Status sync() override { return f->sync(); }
  Status close() override { return f->close(); }
};
struct CountingFilesystem : FilesystemWrapper {
  using FilesystemWrapper::FilesystemWrapper;
  uint64_t manifest_bytes = 0;
  std::map<std::string, int> manifest_opens;  // by path
  Result<std::unique_ptr<File>> open(const std::string& p, const OpenOptions& o) override {
    FERRY_ASSIGN_OR_RETURN(std::unique_ptr<File> f, FilesystemWrapper::open(p, o));
    if (p.size() >= 8 && p.compare(p.size() - 8, 8, "MANIFEST") == 0) {
      ++manifest_opens[p];
      return std::unique_ptr<File>(new CountingFile(std::move(f), &manifest_bytes));
    }
    return f;
  }
};

TEST_CASE("commit sequences: each manifest is read whole once, then only its frame", "[catalog]") {
  TempDir tmp;
  CountingFilesystem fs(posix_filesystem());
  ManifestCache cache;  // what one runtime knows of the root
  const std::string& root = tmp.path();
  CHECK(*highest_commit_seq(fs, root, &cache) == 0);
  // Manifests of 64 KiB (metadata makes them big), the highest not the last
  // step; a stray file with a step-like name is no checkpoint.
  const int n = 6;
  for (int i = 1; i <= n; ++i) {
    Manifest m;
    m.step = 100 * i;
    m.commit_seq = i == 2 ? 40 : i;
    m.metadata.push_back({"blob", std::string(64 * 1024, static_cast<char>('a' + i))});
    const std::string dir = join_path(root, step_dir_name(m.step));
    REQUIRE(fs.mkdirs(dir).ok());
    REQUIRE(
        write_file_atomic(fs, join_path(dir, kManifestFileName), encode_manifest(m), false).ok());
  }
  REQUIRE(write_file_atomic(fs, join_path(root, step_dir_name(999)), "not a dir", false).ok());

  fs.manifest_bytes = 0;
  CHECK(*highest_commit_seq(fs, root, &cache) == 40);
  CHECK(fs.manifest_bytes > n * 64 * 1024);  // the first time: whole
  for (int again = 0; again < 2; ++again) {
    fs.manifest_bytes = 0;
    CHECK(*highest_commit_seq(fs, root, &cache) == 40);
    CHECK(fs.manifest_bytes <= n * 4096);  // then: each frame only
  }
  // Another owner (another runtime in this process) learned nothing of them.
  ManifestCache other;
  fs.manifest_bytes = 0;
  CHECK(*highest_commit_seq(fs, root, &other) == 40);
  CHECK(fs.manifest_bytes > n * 64 * 1024);

  // A checkpoint replaced by one with a higher number (a new manifest, so a
  // new payload checksum) is read again; a manifest corrupt before it was
  // ever read counts for nothing.
  Manifest m;
  m.step = 300;
  m.commit_seq = 41;
  REQUIRE(write_file_atomic(fs, join_path(root, join_path(step_dir_name(300), kManifestFileName)),
                            encode_manifest(m), false)
              .ok());
  m.step = 700;
  m.commit_seq = 99;
  std::string bad = encode_manifest(m);
  bad.back() = static_cast<char>(bad.back() ^ 0x5a);
  REQUIRE(fs.mkdirs(join_path(root, step_dir_name(700))).ok());
  REQUIRE(write_file_atomic(fs, join_path(root, join_path(step_dir_name(700), kManifestFileName)),
                            bad, false)
              .ok());
  CHECK(*highest_commit_seq(fs, root, &cache) == 41);
  CHECK(find_latest(fs, root, &cache)->step == 300);

  // Intact frame and checksum, contents that fail decode_manifest's checks:
  // its number counts for the next commit, but find_latest decodes its
  // choice whole and passes it over.
  m.step = 800;
  m.commit_seq = 50;
  m.checksum_block_bytes = 0;
  REQUIRE(fs.mkdirs(join_path(root, step_dir_name(800))).ok());
  REQUIRE(write_file_atomic(fs, join_path(root, join_path(step_dir_name(800), kManifestFileName)),
                            encode_manifest(m), false)
              .ok());
  CHECK(*highest_commit_seq(fs, root, &cache) == 50);
  auto latest = find_latest(fs, root, &cache);
  REQUIRE(latest.ok());
  CHECK(latest->step == 300);
  CHECK(latest->commit_seq == 41);
}

// Retention at every commit (keep-last) decoded each kept manifest twice
// (once to list, once to check its files): with an owner's cache each is
// read whole once, then known from its head; its files are still checked.
TEST_CASE("retention reads each kept manifest whole once, then only its frame", "[catalog]") {
  TempDir tmp;
  CountingFilesystem fs(posix_filesystem());
  ManifestCache cache;
  const std::string& root = tmp.path();
  constexpr uint64_t kBlob = 64 * 1024;
  auto add = [&](uint64_t step) {
    Manifest m;
    m.step = step;
    m.commit_seq = step;
    m.metadata.push_back({"blob", std::string(kBlob, static_cast<char>('a' + step))});
    m.files.push_back({"data.safetensors", 5, 0, 0, 0});
    const std::string dir = join_path(root, step_dir_name(step));
    REQUIRE(fs.mkdirs(dir).ok());
    REQUIRE(write_file_atomic(fs, join_path(dir, "data.safetensors"), "12345", false).ok());
    REQUIRE(
        write_file_atomic(fs, join_path(dir, kManifestFileName), encode_manifest(m), false).ok());
    return dir;
  };
  for (uint64_t step = 1; step <= 3; ++step) add(step);
  fs.manifest_bytes = 0;
  auto r = retire_checkpoints(fs, root, 3, "", {}, &cache);
  REQUIRE(r.ok());
  CHECK(r->checkpoints.empty());
  CHECK(fs.manifest_bytes > 3 * kBlob);  // each whole, once
  CHECK(fs.manifest_bytes < 2 * 3 * kBlob);

  // The next commits: only the new manifest is read whole.
  for (uint64_t step = 4; step <= 5; ++step) {
    const std::string dir = add(step);
    fs.manifest_bytes = 0;
    r = retire_checkpoints(fs, root, 3, dir, {}, &cache);
    REQUIRE(r.ok());
    REQUIRE(r->checkpoints.size() == 1);
    CHECK(r->checkpoints[0] == join_path(root, step_dir_name(step - 3)));
    CHECK(fs.manifest_bytes > kBlob);
    CHECK(fs.manifest_bytes < 2 * kBlob);
  }
  // A known manifest whose data file lost bytes is not loadable: it does not
  // count toward keep_last, so the oldest loadable one stays.
  REQUIRE(write_file_atomic(fs, join_path(join_path(root, step_dir_name(5)), "data.safetensors"),
                            "123", false)
              .ok());
  const std::string six = add(6);
  fs.manifest_bytes = 0;
  r = retire_checkpoints(fs, root, 3, six, {}, &cache);
  REQUIRE(r.ok());
  CHECK(r->checkpoints.empty());
  CHECK(fs.manifest_bytes < 2 * kBlob);

  // A manifest rewritten in place (another inode) is decoded again.
  Manifest m;
  m.step = 6;
  m.commit_seq = 1;  // now the oldest
  m.files.push_back({"data.safetensors", 5, 0, 0, 0});
  REQUIRE(write_file_atomic(fs, join_path(six, kManifestFileName), encode_manifest(m), false).ok());
  r = retire_checkpoints(fs, root, 2, "", {}, &cache);
  REQUIRE(r.ok());
  REQUIRE(r->checkpoints.size() == 1);
  CHECK(r->checkpoints[0] == six);

  // A commit that tells the cache of its manifest costs the next retention no decode.
  ManifestCache told;
  TempDir other;
  Manifest c;
  c.step = 9;
  c.commit_seq = 9;
  c.metadata.push_back({"blob", std::string(kBlob, 'z')});
  const std::string dir = join_path(other.path(), step_dir_name(9));
  REQUIRE(fs.mkdirs(dir).ok());
  const std::string bytes = encode_manifest(c);
  REQUIRE(write_file_atomic(fs, join_path(dir, kManifestFileName), bytes, false).ok());
  remember_committed(fs, dir, c, bytes, bytes.size(), &told);
  fs.manifest_bytes = 0;
  r = retire_checkpoints(fs, other.path(), 1, dir, {}, &told);
  REQUIRE(r.ok());
  CHECK(fs.manifest_bytes <= 4096);
}

// A MANIFEST whose frame (no features) says `payload_len` bytes follow,
// with `payload_sum`, as the file's first bytes; the file is then cut (or
// extended, sparse) to `file_bytes`.
void write_frame_only(const std::string& path, uint64_t payload_len, uint64_t payload_sum,
                      uint64_t file_bytes) {
  std::string head = encode_manifest(Manifest());
  head.resize(8 + 4 + 4);  // magic, version, no required features
  for (uint64_t v : {payload_len, payload_sum})
    for (int i = 0; i < 8; ++i) head.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  OpenOptions o;
  o.write = o.create = o.exclusive = true;
  auto f = posix_filesystem()->open(path, o);
  REQUIRE(f.ok());
  REQUIRE((*f)->pwrite(head.data(), head.size(), 0).ok());
  REQUIRE((*f)->truncate(file_bytes).ok());
  REQUIRE((*f)->close().ok());
}

TEST_CASE("a huge sparse MANIFEST costs its first 4 KiB, a failed one is not read again",
          "[catalog][bounded]") {
  TempDir tmp;
  CountingFilesystem fs(posix_filesystem());
  ManifestCache cache;  // what one runtime knows of the root
  const std::string& root = tmp.path();
  make_checkpoint(fs, root, 1, 1);
  // 1 GiB, sparse, whose frame agrees with its size: only the frame's
  // claim against the largest manifest Ferry reads can refuse it unread.
  const std::string huge = join_path(root, step_dir_name(2));
  REQUIRE(fs.mkdir(huge).ok());
  const uint64_t gib = 1ull << 30;
  write_frame_only(join_path(huge, kManifestFileName), gib - 32, 0, gib);
  // 1 MiB whose frame is whole but whose payload checksum fails: read once.
  const std::string bad = join_path(root, step_dir_name(3));
  REQUIRE(fs.mkdir(bad).ok());
  write_frame_only(join_path(bad, kManifestFileName), 1 << 20, 12345, 32 + (1 << 20));
  // A frame that claims more than the file holds is refused from its head.
  const std::string shorter = join_path(root, step_dir_name(4));
  REQUIRE(fs.mkdir(shorter).ok());
  write_frame_only(join_path(shorter, kManifestFileName), 1 << 20, 0, 4096);

  fs.manifest_bytes = 0;
  auto list = list_checkpoints(fs, root, &cache);
  REQUIRE(list.ok());
  REQUIRE(list->size() == 4);
  std::map<uint64_t, Status> status;
  for (const auto& c : *list) status[c.step] = c.status;
  CHECK(status[1].ok());
  CHECK(contains(status[2].message(), join_path(huge, kManifestFileName)));
  CHECK(contains(status[2].message(), "more than the 268435456 a manifest may hold"));
  CHECK(contains(status[3].message(), "checksum"));
  CHECK(contains(status[4].message(), "the file holds 4096"));
  // The good manifest and the bad one whole, the others' heads only.
  CHECK(fs.manifest_bytes < (1u << 20) + 4 * 4096);
  CHECK(fs.manifest_bytes >= (1u << 20));

  // Every later look (a save's numbering, a load's choice, another `ls`)
  // knows the three failed by their size, inode and mtime: none is opened.
  for (int again = 0; again < 3; ++again) {
    fs.manifest_bytes = 0;
    fs.manifest_opens.clear();
    CHECK(*highest_commit_seq(fs, root, &cache) == 1);
    auto latest = find_latest(fs, root, &cache);
    REQUIRE(latest.ok());
    CHECK(latest->step == 1);
    auto again_list = list_checkpoints(fs, root, &cache);
    REQUIRE(again_list.ok());
    CHECK(again_list->size() == 4);
    CHECK(read_manifest(fs, bad, &cache).status().message() == status[3].message());
    CHECK(fs.manifest_bytes <= 8 * 4096);  // step 1's frame, and its decode by find_latest/ls
    for (const std::string& dir : {huge, bad, shorter})
      CHECK(fs.manifest_opens.count(join_path(dir, kManifestFileName)) == 0);
  }
  // Rewritten (a new file), it is read again.
  REQUIRE(fs.unlink(join_path(bad, kManifestFileName)).ok());
  Manifest m;
  m.step = 3;
  m.commit_seq = 7;
  REQUIRE(write_file_atomic(fs, join_path(bad, kManifestFileName), encode_manifest(m), false).ok());
  CHECK(*highest_commit_seq(fs, root, &cache) == 7);
}

TEST_CASE("a symbolic link in a root is never followed as a step or a MANIFEST", "[catalog]") {
  TempDir tmp;
  TempDir elsewhere;
  auto fs = posix_filesystem();
  const std::string& root = tmp.path();
  make_checkpoint(*fs, root, 1, 1);
  // A checkpoint outside the root with a higher number, linked in as a step
  // and as another step's MANIFEST.
  const std::string outside = make_checkpoint(*fs, elsewhere.path(), 9, 50);
  REQUIRE(::symlink(outside.c_str(), join_path(root, step_dir_name(9)).c_str()) == 0);
  const std::string two = join_path(root, step_dir_name(2));
  REQUIRE(fs->mkdir(two).ok());
  REQUIRE(::symlink(join_path(outside, kManifestFileName).c_str(),
                    join_path(two, kManifestFileName).c_str()) == 0);

  auto latest = find_latest(*fs, root);
  REQUIRE(latest.ok());
  CHECK(latest->step == 1);
  CHECK(*highest_commit_seq(*fs, root) == 1);
  auto list = list_checkpoints(*fs, root);
  REQUIRE(list.ok());
  REQUIRE(list->size() == 3);
  for (const auto& c : *list) {
    if (c.step == 1) continue;
    CHECK(contains(c.status.message(), "symbolic link"));
  }
  auto named = resolve_checkpoint(*fs, join_path(root, step_dir_name(9)));
  REQUIRE_FALSE(named.ok());
  CHECK(contains(named.status().message(), "symbolic link"));
  auto m = read_manifest(*fs, two);
  REQUIRE_FALSE(m.ok());
  CHECK(contains(m.status().message(), join_path(two, kManifestFileName)));
  CHECK(contains(m.status().message(), "symbolic link"));
}

}  // namespace
}  // namespace ferry

// The public catalog (ferry/catalog.hpp) over the same roots.
namespace ferry {
namespace {

const CheckpointInfo* entry_named(const std::vector<CheckpointInfo>& v, const std::string& path) {
  for (const auto& c : v)
    if (c.path == path) return &c;
  return nullptr;
}

TEST_CASE("public catalog lists committed, corrupt, pending and displaced entries",
          "[catalog][public]") {
  TempDir tmp;
  auto fs = posix_filesystem();
  const std::string& root = tmp.path();
  const std::string c10 = make_checkpoint(*fs, root, 10, 1);
  const std::string c20 = make_checkpoint(*fs, root, 20, 2);
  const std::string bad = join_path(root, step_dir_name(30));  // no MANIFEST
  REQUIRE(fs->mkdir(bad).ok());
  const std::string pending = join_path(root, pending_dir_name(40, "jobA", "x1"));
  REQUIRE(fs->mkdir(pending).ok());
  REQUIRE(write_lease(*fs, pending, 1234567, "jobA/x1").ok());
  // Step 10 moved aside and replaced since: a displaced entry gc collects.
  const std::string aside = join_path(root, displaced_dir_name(10, "t"));
  REQUIRE(fs->mkdir(aside).ok());

  const Catalog catalog(fs);
  auto all = catalog.list(root);
  REQUIRE(all.ok());
  REQUIRE(all->size() == 5);
  const CheckpointInfo* e = entry_named(*all, c10);
  REQUIRE(e);
  CHECK(e->state == CheckpointState::committed);
  CHECK(e->commit_seq == 1);
  e = entry_named(*all, c20);
  REQUIRE(e);
  CHECK(e->state == CheckpointState::committed);
  CHECK((e->step == 20 && e->commit_seq == 2));
  e = entry_named(*all, bad);
  REQUIRE(e);
  CHECK(e->state == CheckpointState::corrupt);
  CHECK(e->step == 30);
  CHECK(contains(e->status.message(), bad));
  e = entry_named(*all, pending);
  REQUIRE(e);
  CHECK(e->state == CheckpointState::pending);
  CHECK(e->step == 40);
  CHECK(e->has_lease);
  CHECK(e->lease.expires_unix_ms == 1234567);
  CHECK(e->lease.owner == "jobA/x1");
  e = entry_named(*all, aside);
  REQUIRE(e);
  CHECK(e->state == CheckpointState::displaced);
  CHECK(e->step == 10);
  CHECK(std::string(checkpoint_state_name(CheckpointState::displaced)) == "displaced");

  auto committed_only = catalog.list(root, ListOptions{/*include_uncommitted=*/false});
  REQUIRE(committed_only.ok());
  CHECK(committed_only->size() == 3);

  auto latest = catalog.latest(root);
  REQUIRE(latest.ok());
  CHECK(latest->path == c20);
  auto valid = catalog.latest_valid(root);
  REQUIRE(valid.ok());
  CHECK(valid->path == c20);
  // Neither a pending nor a displaced directory is a checkpoint to open.
  CHECK_FALSE(catalog.resolve(pending).ok());
  CHECK_FALSE(catalog.resolve(aside).ok());
  CHECK(*catalog.resolve(root) == c20);

  for (const char* name : {"step-00000010", ".pending-00000001-j-i", ".displaced-00000001-t",
                           ".trash-x", "LATEST", "LATEST.tmp-1"})
    CHECK(Catalog::is_ferry_entry_name(name));
  for (const char* name : {"notes.txt", "step-", ".ferry-demo"})
    CHECK_FALSE(Catalog::is_ferry_entry_name(name));
}

TEST_CASE("public catalog gc and retention", "[catalog][public]") {
  TempDir tmp;
  auto fs = posix_filesystem();
  const std::string& root = tmp.path();
  const std::string c10 = make_checkpoint(*fs, root, 10, 1);
  const std::string c20 = make_checkpoint(*fs, root, 20, 2);
  const std::string c30 = make_checkpoint(*fs, root, 30, 3);
  const std::string expired = join_path(root, pending_dir_name(40, "j", "old"));
  REQUIRE(fs->mkdir(expired).ok());
  REQUIRE(write_lease(*fs, expired, 1000, "j/old").ok());
  const Catalog catalog(fs);

  auto gc = catalog.gc(root, GcOptions{/*now_unix_ms=*/5000});
  REQUIRE(gc.ok());
  CHECK(gc->removed == std::vector<std::string>{expired});

  auto retired = catalog.apply_retention(root, 2);
  REQUIRE(retired.ok());
  CHECK(*retired == std::vector<std::string>{c10});
  auto left = catalog.list(root);
  REQUIRE(left.ok());
  CHECK(steps_of(*left) == std::vector<uint64_t>{20, 30});
  // 0 keeps all.
  REQUIRE(catalog.apply_retention(root, 0).ok());
  CHECK(catalog.list(root)->size() == 2);
}

}  // namespace
}  // namespace ferry
