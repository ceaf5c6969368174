// The commit protocol and garbage collection under adversity: gc racing a
// save whose lease lapsed, an overwrite that fails or dies half-way, a nested
// root under a power cut, two jobs committing into one root, pending
// directories that are not ours, errors after the commit point, files that
// are FIFOs, and job ids that look like Ferry's own name parts.
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <algorithm>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "catalog.hpp"
#include "commit.hpp"
#include "drills/fault_fs.hpp"
#include "drills/kill_point.hpp"
#include "ferry/filesystem.hpp"
#include "test_util.hpp"

namespace ferry {
namespace {

using ferry::testing::TempDir;
constexpr int64_t kMinute = 60'000;

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

bool exists(const std::string& path) {
  return std::filesystem::exists(std::filesystem::symlink_status(path));
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<std::string> names_in(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

void put(Filesystem& fs, const std::string& path, const std::string& bytes) {
  OpenOptions o;
  o.write = true;
  o.create = true;
  o.truncate = true;
  auto f = fs.open(path, o);
  REQUIRE(f.ok());
  REQUIRE((*f)->pwrite(bytes.data(), bytes.size(), 0).ok());
  REQUIRE((*f)->sync().ok());
  REQUIRE((*f)->close().ok());
}

std::string data_of(uint64_t step, const std::string& tag) {
  return "tensor bytes of step " + std::to_string(step) + " " + tag;
}

// What the ranks do before the coordinator commits: the pending directory
// with its lease, a data file, everything durable. Returns the pending dir.
std::string stage(Filesystem& fs, const std::string& root, uint64_t step, Manifest* m,
                  const std::string& tag = "new", bool overwrite = false,
                  const std::string& owner = "job/ckpt") {
  static int counter = 0;
  const std::string id = "c" + std::to_string(++counter);
  const std::string pending = join_path(root, pending_dir_name(step, "job", id));
  Status st = prepare_pending(fs, root, pending, step, overwrite, kMinute, owner);
  INFO(st.to_string());
  REQUIRE(st.ok());
  const std::string data = data_of(step, tag);
  put(fs, join_path(pending, "rank-00000-0000.safetensors"), data);
  REQUIRE(fs.sync_dir(pending).ok());
  *m = Manifest();
  m->step = step;
  m->job_id = "job";
  m->checkpoint_id = id;
  m->files = {{"rank-00000-0000.safetensors", data.size(), 0}};
  return pending;
}

CommitOutcome commit_ok(Filesystem& fs, const std::string& root, uint64_t step,
                        const std::string& tag = "new", CommitOptions opts = {}) {
  Manifest m;
  std::string pending = stage(fs, root, step, &m, tag, opts.overwrite);
  auto out = commit_checkpoint(fs, root, pending, m, opts);
  INFO(out.status().to_string());
  REQUIRE(out.ok());
  return *out;
}

std::string data_file(const std::string& root, uint64_t step) {
  return join_path(join_path(root, step_dir_name(step)), "rank-00000-0000.safetensors");
}

// The latest checkpoint is `step` and holds the bytes saved with `tag`.
void require_latest(Filesystem& fs, const std::string& root, uint64_t step,
                    const std::string& tag) {
  auto latest = find_latest(fs, root);
  INFO(latest.status().to_string());
  REQUIRE(latest.ok());
  CHECK(latest->step == step);
  CHECK(slurp(data_file(root, step)) == data_of(step, tag));
}

// ---- 1. gc racing a save whose lease lapsed -----------------------------------------------

TEST_CASE("commit refuses a pending directory that is not whole or not ours", "[commit]") {
  TempDir tmp;
  auto fs = posix_filesystem();
  const std::string root = tmp.sub("root");
  CommitOptions opts;
  opts.keep_last = 1;
  commit_ok(*fs, root, 1, "old", opts);

  Manifest m;
  std::string pending = stage(*fs, root, 2, &m);
  const std::string file = join_path(pending, "rank-00000-0000.safetensors");
  std::string expect;
  SECTION("a data file was deleted (a gc that deleted file by file)") {
    REQUIRE(fs->unlink(file).ok());
    expect = "is missing";
  }
  SECTION("a data file is short") {
    REQUIRE(::truncate(file.c_str(), 3) == 0);
    expect = "holds 3 bytes";
  }
  SECTION("a data file is not a regular file") {
    REQUIRE(fs->unlink(file).ok());
    REQUIRE(::mkfifo(file.c_str(), 0644) == 0);
    expect = "not a regular file";
  }
  SECTION("the lease expired: the saver was paused past it") {
    opts.clock = [t = now_unix_ms() + 10 * kMinute] { return t; };
    expect = "expired";
  }
  SECTION("the lease is another owner's") {
    REQUIRE(write_lease(*fs, pending, now_unix_ms() + kMinute, "other/job").ok());
    opts.lease_owner = "job/ckpt";
    expect = "leased by 'other/job'";
  }
  SECTION("gc took the directory away") {
    auto gc = collect_garbage(*fs, root, now_unix_ms() + 10 * kMinute);
    REQUIRE(gc.ok());
    REQUIRE(gc->removed == std::vector<std::string>{pending});
    expect = pending;
  }
  auto out = commit_checkpoint(*fs, root, pending, m, opts);
  REQUIRE_FALSE(out.ok());
  CHECK(contains(out.status().message(), expect));
  // Nothing committed, and retention never ran: the old one is still latest.
  CHECK_FALSE(exists(join_path(root, step_dir_name(2))));
  require_latest(*fs, root, 1, "old");
  CHECK(slurp(join_path(root, kLatestFileName)) == "step-00000001\n");
}

// The coordinator refreshes a lease every third of its length, so a commit
// can begin with two thirds of it left; a slow manifest fsync (a loaded
// machine, a busy disk) then outlasts a short lease. Renewed as the commit
// begins, the lease covers the commit; without the renewal the same commit
// is refused, which is the window the renewal closes. The commit's clock
// stands 3 s later once the manifest is written, as after a 3 s fsync,
// against a lease with 2 s left.
TEST_CASE("a commit renews a lease that holds: a slow manifest sync cannot make it lapse",
          "[commit]") {
  TempDir tmp;
  auto fs = posix_filesystem();
  const std::string root = tmp.sub("root");
  Manifest m;
  std::string pending = stage(*fs, root, 1, &m);
  const int64_t start = now_unix_ms();
  REQUIRE(write_lease(*fs, pending, start + 2000, "job/ckpt").ok());
  CommitOptions opts;
  opts.lease_owner = "job/ckpt";
  const std::string manifest = join_path(pending, kManifestFileName);
  int64_t last_now = 0;
  opts.clock = [&] { return last_now = exists(manifest) ? start + 3000 : start; };
  SECTION("renewed as the commit begins: committed") {
    opts.renew_lease_ms = kMinute;
    auto out = commit_checkpoint(*fs, root, pending, m, opts);
    INFO(out.status().to_string());
    REQUIRE(out.ok());
    CHECK(last_now == start + 3000);  // checked again after the manifest
    require_latest(*fs, root, 1, "new");
  }
  SECTION("not renewed: the lease lapses during the commit, which is refused") {
    auto out = commit_checkpoint(*fs, root, pending, m, opts);
    REQUIRE_FALSE(out.ok());
    CHECK(contains(out.status().message(), "expired 1000 ms ago"));
    CHECK_FALSE(exists(join_path(root, step_dir_name(1))));
  }
  SECTION("a lease that lapsed before the commit began is not renewed") {
    REQUIRE(write_lease(*fs, pending, start - 1, "job/ckpt").ok());
    opts.renew_lease_ms = kMinute;
    auto out = commit_checkpoint(*fs, root, pending, m, opts);
    REQUIRE_FALSE(out.ok());
    CHECK(contains(out.status().message(), "expired 1 ms ago"));
    CHECK_FALSE(exists(join_path(root, step_dir_name(1))));
  }
}

TEST_CASE("commit checks the lease owner it is given and accepts its own", "[commit]") {
  TempDir tmp;
  auto fs = posix_filesystem();
  Manifest m;
  std::string pending = stage(*fs, tmp.path(), 3, &m, "new", false, "jobA/ck1");
  CommitOptions opts;
  opts.lease_owner = "jobA/ck1";
  auto out = commit_checkpoint(*fs, tmp.path(), pending, m, opts);
  INFO(out.status().to_string());
  REQUIRE(out.ok());
  CHECK(out->warnings.empty());
  CHECK_FALSE(exists(join_path(out->path, kLeaseFileName)));
}

TEST_CASE("gc takes a pending directory out of sight whole, never file by file", "[commit][gc]") {
  TempDir tmp;
  auto fs = std::make_shared<FaultFilesystem>(posix_filesystem());
  const std::string root = tmp.path();
  const std::string pending = join_path(root, pending_dir_name(4, "job", "x"));
  REQUIRE(fs->mkdir(pending).ok());
  for (int i = 0; i < 3; ++i)
    put(*fs, join_path(pending, "rank-0000" + std::to_string(i) + "-0000.safetensors"), "bytes");
  REQUIRE(write_lease(*fs, pending, 1000, "gone/save").ok());

  // Deletion fails half-way: whatever is left must not be a pending
  // directory with some of its files gone, which a late saver could commit.
  FaultRule r;
  r.op = FaultOp::unlink;
  r.nth = 2;
  r.error = EIO;
  fs->add_rule(r);
  auto gc = collect_garbage(*fs, root, now_unix_ms());
  REQUIRE(gc.ok());
  CHECK(gc->removed == std::vector<std::string>{pending});
  REQUIRE(gc->failed.size() == 1);
  CHECK(is_trash_dir_name(gc->failed[0].path.substr(root.size() + 1)));
  CHECK_THAT(gc->failed[0].status.to_string(), Catch::Contains(gc->failed[0].path));
  CHECK_THAT(gc->failed[0].status.to_string(), Catch::Contains("Input/output error"));
  CHECK_FALSE(exists(pending));
  fs->clear_rules();
  // The next gc finishes the job.
  auto again = collect_garbage(*fs, root, now_unix_ms());
  REQUIRE(again.ok());
  CHECK(again->discarded.size() == 1);
  CHECK(names_in(root) == std::vector<std::string>{kRootLockFileName});
}

TEST_CASE("gc deletes every leftover it can and names each one it cannot", "[commit][gc]") {
  TempDir tmp;
  auto fs = std::make_shared<FaultFilesystem>(posix_filesystem());
  const std::string root = tmp.path();
  std::vector<std::string> dirs;
  for (const char* name : {".trash-a", ".trash-b", ".trash-c"}) {
    dirs.push_back(join_path(root, name));
    REQUIRE(fs->mkdir(dirs.back()).ok());
    put(*fs, join_path(dirs.back(), "rank-00000-0000.safetensors"), "bytes");
  }
  // The middle one's file cannot be unlinked, ever: one bad directory must
  // not keep gc from the others, before or after it.
  FaultRule r;
  r.op = FaultOp::unlink;
  r.nth = 1;
  r.sticky = true;
  r.error = EIO;
  r.path_contains = "/.trash-b/";
  fs->add_rule(r);
  for (int round = 0; round < 2; ++round) {
    auto gc = collect_garbage(*fs, root, now_unix_ms());
    REQUIRE(gc.ok());
    REQUIRE(gc->failed.size() == 1);
    CHECK(gc->failed[0].path == dirs[1]);
    std::vector<std::string> discarded = gc->discarded;  // in listing order
    std::sort(discarded.begin(), discarded.end());
    CHECK(discarded ==
          (round == 0 ? std::vector<std::string>{dirs[0], dirs[2]} : std::vector<std::string>{}));
    CHECK_THAT(gc->failed[0].status.to_string(), Catch::Contains(dirs[1]));
    CHECK_THAT(gc->failed[0].status.to_string(), Catch::Contains("Input/output error"));
    CHECK_FALSE(exists(dirs[0]));
    CHECK(exists(dirs[1]));
    CHECK_FALSE(exists(dirs[2]));
  }
  fs->clear_rules();
  auto gc = collect_garbage(*fs, root, now_unix_ms());
  REQUIRE(gc.ok());
  CHECK(gc->failed.empty());
  CHECK(names_in(root) == std::vector<std::string>{kRootLockFileName});
}

TEST_CASE("retention never removes the new checkpoint nor the last loadable one",
          "[commit][retention]") {
  TempDir tmp;
  auto fs = posix_filesystem();
  const std::string root = tmp.path();
  commit_ok(*fs, root, 1, "good");
  commit_ok(*fs, root, 2, "broken");
  // Step 2 lost a data file after its commit: its manifest reads, but it
  // cannot be loaded, so it must not count as one of the kept.
  REQUIRE(fs->unlink(data_file(root, 2)).ok());
  CommitOptions opts;
  opts.keep_last = 2;
  CommitOutcome out = commit_ok(*fs, root, 3, "new", opts);
  CHECK(out.retired.empty());
  CHECK(exists(data_file(root, 1)));
  CHECK(exists(join_path(root, step_dir_name(2))));  // left for the user to see

  opts.keep_last = 1;
  out = commit_ok(*fs, root, 4, "new", opts);
  CHECK(out.retired == std::vector<std::string>{join_path(root, step_dir_name(1)),
                                                join_path(root, step_dir_name(3))});
  require_latest(*fs, root, 4, "new");
  // Retired durably out of sight, their bytes left for the caller to
  // delete once the save has reported (or for gc).
  REQUIRE(out.trash.size() == 2);
  CHECK_FALSE(exists(join_path(root, step_dir_name(1))));
  CHECK(slurp(join_path(out.trash[0], "rank-00000-0000.safetensors")) == data_of(1, "good"));
  auto listed = list_checkpoints(*fs, root);
  REQUIRE(listed.ok());
  CHECK(listed->size() == 2);  // 2 (not loadable, left to see) and 4
  auto gc = collect_garbage(*fs, root, now_unix_ms());
  REQUIRE(gc.ok());
  CHECK(gc->discarded.size() == 2);
  for (const std::string& t : out.trash) CHECK_FALSE(exists(t));

  // keep_path protects the new checkpoint even when a higher sequence
  // number (a commit of another job) would push it out.
  auto kept = apply_retention(*fs, root, 1, join_path(root, step_dir_name(4)));
  REQUIRE(kept.ok());
  CHECK(kept->empty());
}

// ---- 2. failed overwrite ------------------------------------------------------------------

TEST_CASE("an overwrite whose commit rename fails puts the old step back", "[commit][overwrite]") {
  TempDir tmp;
  auto fs = std::make_shared<FaultFilesystem>(posix_filesystem());
  const std::string root = tmp.path();
  commit_ok(*fs, root, 5, "old");
  CommitOptions opts;
  opts.overwrite = true;
  Manifest m;
  std::string pending = stage(*fs, root, 5, &m, "new", true);

  // Renames that touch step-5: moving it aside (1st), the commit (2nd),
  // putting it back (3rd).
  FaultRule r;
  r.op = FaultOp::rename;
  r.nth = 2;
  r.error = EIO;
  r.path_contains = "/step-00000005$";
  SECTION("the old step comes back at once") {
    fs->add_rule(r);
    auto out = commit_checkpoint(*fs, root, pending, m, opts);
    REQUIRE_FALSE(out.ok());
    CHECK(contains(out.status().message(), "(injected)"));
    require_latest(*fs, root, 5, "old");
  }
  SECTION("putting it back fails too: gc puts it back later, never deletes it") {
    r.sticky = true;
    fs->add_rule(r);
    auto out = commit_checkpoint(*fs, root, pending, m, opts);
    REQUIRE_FALSE(out.ok());
    CHECK(contains(out.status().message(), "the next save or gc puts it back"));
    CHECK_FALSE(exists(join_path(root, step_dir_name(5))));
    fs->clear_rules();
    auto gc = collect_garbage(*fs, root, now_unix_ms() + 10 * kMinute);
    REQUIRE(gc.ok());
    CHECK(gc->restored == std::vector<std::string>{join_path(root, step_dir_name(5))});
    require_latest(*fs, root, 5, "old");
  }
  SECTION("after a good overwrite, nothing of the old step is left once its trash goes") {
    auto out = commit_checkpoint(*fs, root, pending, m, opts);
    REQUIRE(out.ok());
    require_latest(*fs, root, 5, "new");
    // The old step is out of sight but not deleted: that is the caller's,
    // after the save has reported.
    REQUIRE(out->trash.size() == 1);
    CHECK(is_trash_dir_name(out->trash[0].substr(root.size() + 1)));
    CHECK(slurp(join_path(out->trash[0], "rank-00000-0000.safetensors")) == data_of(5, "old"));
    REQUIRE(remove_all(*fs, out->trash[0]).ok());
    CHECK(names_in(root) ==
          std::vector<std::string>{kRootLockFileName, kLatestFileName, step_dir_name(5)});
  }
}

// Runs `commit` in a child process, through `fs` wrapped to SIGKILL the
// process at `point` (the drills' observer of crash points).
template <typename Fn>
void run_killed_at(Filesystem& fs, const char* point, Fn commit) {
  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    auto killer = kill_point_filesystem(std::shared_ptr<Filesystem>(&fs, [](Filesystem*) {}), point,
                                        /*rank=*/0);
    if (!killer.ok()) ::_exit(3);
    commit(**killer);
    ::_exit(0);  // not killed: the point was never reached
  }
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  REQUIRE(WIFSIGNALED(status));
  CHECK(WTERMSIG(status) == SIGKILL);
}

// Stages a "new" step over a committed one and commits it with overwrite
// in a child killed at `point`.
void overwrite_killed_at(Filesystem& fs, const std::string& root, uint64_t step,
                         const char* point) {
  CommitOptions opts;
  opts.overwrite = true;
  Manifest m;
  std::string pending = stage(fs, root, step, &m, "new", true);
  run_killed_at(fs, point, [&](Filesystem& killing) {
    (void)commit_checkpoint(killing, root, pending, m, opts);
  });
}

TEST_CASE("an overwrite killed with the old step aside: the old step comes back",
          "[commit][overwrite]") {
  TempDir tmp;
  auto fs = posix_filesystem();
  const std::string root = tmp.path();
  commit_ok(*fs, root, 5, "old");
  commit_ok(*fs, root, 6, "later");
  overwrite_killed_at(*fs, root, 5, "overwrite.aside");
  // Killed between the two renames: no step-5 in place, the old one aside.
  CHECK_FALSE(exists(join_path(root, step_dir_name(5))));

  SECTION("gc puts it back") {
    auto gc = collect_garbage(*fs, root, now_unix_ms());
    REQUIRE(gc.ok());
    CHECK(gc->restored == std::vector<std::string>{join_path(root, step_dir_name(5))});
  }
  SECTION("the next save's prepare refuses to overwrite it by accident; a reader puts it back") {
    const std::string next = join_path(root, pending_dir_name(5, "job", "again"));
    Status st = prepare_pending(*fs, root, next, 5, false, kMinute, "job/again");
    CHECK(st.code() == StatusCode::already_exists);
    CHECK_FALSE(exists(next));
  }
  SECTION("the next save's commit puts it back") {
    commit_ok(*fs, root, 7, "newest");
  }
  auto list = list_checkpoints(*fs, root);
  CHECK(slurp(data_file(root, 5)) == data_of(5, "old"));
  REQUIRE(list.ok());
  std::set<uint64_t> steps;
  for (const auto& c : *list) steps.insert(c.step);
  CHECK(steps.count(5) == 1);
  CHECK(steps.count(6) == 1);
}

TEST_CASE("an overwrite killed with the old step aside: every reader finds the step at once",
          "[commit][overwrite]") {
  TempDir tmp;
  auto fs = posix_filesystem();
  const std::string root = tmp.path();
  commit_ok(*fs, root, 5, "old");
  overwrite_killed_at(*fs, root, 5, "overwrite.aside");
  REQUIRE_FALSE(exists(join_path(root, step_dir_name(5))));

  // Each reader alone, before any gc or save, finishes the overwrite's undo.
  SECTION("find_latest (load, `latest`, a resume's latest_step)") {
    require_latest(*fs, root, 5, "old");
  }
  SECTION("list_checkpoints (`ferry ls`)") {
    auto list = list_checkpoints(*fs, root);
    REQUIRE(list.ok());
    REQUIRE(list->size() == 1);
    CHECK(list->front().step == 5);
    CHECK(list->front().status.ok());
  }
  SECTION("resolve_checkpoint of the step itself (a load naming it)") {
    auto dir = resolve_checkpoint(*fs, join_path(root, step_dir_name(5)) + "/");
    INFO(dir.status().to_string());
    REQUIRE(dir.ok());
  }
  CHECK(slurp(data_file(root, 5)) == data_of(5, "old"));
  for (const std::string& name : names_in(root))
    CHECK(name.find(".displaced-") == std::string::npos);

  // The resumed job's next save, keeping one checkpoint, keeps a loadable one.
  CommitOptions keep1;
  keep1.keep_last = 1;
  CommitOutcome out = commit_ok(*fs, root, 6, "resumed", keep1);
  CHECK(out.restored.empty());
  for (const std::string& t : out.trash) REQUIRE(remove_all(*fs, t).ok());
  require_latest(*fs, root, 6, "resumed");
}

TEST_CASE("a save that puts back a step left aside spares it from its own retention",
          "[commit][overwrite]") {
  TempDir tmp;
  auto fs = posix_filesystem();
  const std::string root = tmp.path();
  commit_ok(*fs, root, 5, "old");
  overwrite_killed_at(*fs, root, 5, "overwrite.aside");
  // A job that never looked (it was told its step) saves step 1 with
  // keep_last = 1: its prepare leaves the step aside, its commit puts it
  // back and its retention must not delete what the job never saw.
  CommitOptions keep1;
  keep1.keep_last = 1;
  CommitOutcome out = commit_ok(*fs, root, 1, "scratch", keep1);
  CHECK(out.restored == std::vector<std::string>{join_path(root, step_dir_name(5))});
  CHECK(out.retired.empty());
  CHECK(slurp(data_file(root, 5)) == data_of(5, "old"));
  require_latest(*fs, root, 1, "scratch");
  // The next save's retention is an ordinary one.
  out = commit_ok(*fs, root, 2, "next", keep1);
  CHECK(out.retired.size() == 2);
  require_latest(*fs, root, 2, "next");
}

TEST_CASE("two processes finishing one interrupted overwrite put the step back once",
          "[commit][overwrite][lock]") {
  TempDir tmp;
  auto fs = posix_filesystem();
  const std::string root = tmp.path();
  commit_ok(*fs, root, 5, "old");
  commit_ok(*fs, root, 6, "later");
  overwrite_killed_at(*fs, root, 5, "overwrite.aside");
  // Each child waits at a pipe so that both look at the root at once.
  int go[2];
  REQUIRE(::pipe(go) == 0);
  std::vector<pid_t> kids;
  for (int i = 0; i < 2; ++i) {
    pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      ::close(go[1]);
      char c;
      if (::read(go[0], &c, 1) != 0) ::_exit(4);
      auto latest = find_latest(*posix_filesystem(), root);
      ::_exit(latest.ok() && latest->step == 6 ? 0 : 5);
    }
    kids.push_back(pid);
  }
  ::close(go[0]);
  ::close(go[1]);  // both start
  for (pid_t pid : kids) {
    int status = 0;
    REQUIRE(::waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 0);
  }
  CHECK(slurp(data_file(root, 5)) == data_of(5, "old"));
  CHECK(slurp(data_file(root, 6)) == data_of(6, "later"));
  for (const std::string& name : names_in(root))
    CHECK(name.find(".displaced-") == std::string::npos);
}

TEST_CASE("gc puts back only a directory holding that step's manifest", "[commit][gc][overwrite]") {
  TempDir tmp;
  TempDir elsewhere;
  auto fs = posix_filesystem();
  const std::string root = tmp.path();
  commit_ok(*fs, root, 5, "old");
  const std::string outside = join_path(elsewhere.path(), "kept");
  REQUIRE(fs->mkdir(outside).ok());
  put(*fs, join_path(outside, "precious"), "outside bytes");
  // None of these is step 9..12's checkpoint: a file, an empty directory,
  // another step's checkpoint, a link to a directory outside the root.
  const std::string file = join_path(root, displaced_dir_name(9, "a"));
  put(*fs, file, "not a directory");
  const std::string empty = join_path(root, displaced_dir_name(10, "b"));
  REQUIRE(fs->mkdir(empty).ok());
  const std::string other = join_path(root, displaced_dir_name(11, "c"));
  REQUIRE(fs->mkdir(other).ok());
  put(*fs, join_path(other, kManifestFileName),
      slurp(join_path(join_path(root, step_dir_name(5)), kManifestFileName)));
  const std::string link = join_path(root, displaced_dir_name(12, "d"));
  REQUIRE(::symlink(outside.c_str(), link.c_str()) == 0);

  // Readers see nothing to put back, so they neither wait nor write.
  require_latest(*fs, root, 5, "old");
  auto gc = collect_garbage(*fs, root, now_unix_ms());
  REQUIRE(gc.ok());
  CHECK(gc->restored.empty());
  std::set<std::string> discarded(gc->discarded.begin(), gc->discarded.end());
  CHECK(discarded == std::set<std::string>{file, empty, other, link});
  CHECK(names_in(root) ==
        std::vector<std::string>{kRootLockFileName, kLatestFileName, step_dir_name(5)});
  CHECK(slurp(join_path(outside, "precious")) == "outside bytes");
  require_latest(*fs, root, 5, "old");
}

TEST_CASE("an overwrite killed after its commit rename leaves the new step whole",
          "[commit][overwrite]") {
  TempDir tmp;
  auto fs = posix_filesystem();
  const std::string root = tmp.path();
  commit_ok(*fs, root, 5, "old");
  overwrite_killed_at(*fs, root, 5, "commit.rename");
  require_latest(*fs, root, 5, "new");
  // The replaced step is garbage, and so is LATEST's temp file (written
  // before the commit point, never renamed); gc removes both and leaves the
  // new step.
  auto gc = collect_garbage(*fs, root, now_unix_ms());
  REQUIRE(gc.ok());
  CHECK(gc->restored.empty());
  REQUIRE(gc->discarded.size() == 2);
  CHECK(std::count_if(gc->discarded.begin(), gc->discarded.end(), [](const std::string& p) {
          return p.find("/LATEST.tmp-") != std::string::npos;
        }) == 1);
  require_latest(*fs, root, 5, "new");
  for (const std::string& name : names_in(root)) CHECK(name.find(".tmp-") == std::string::npos);
}

// ---- 3. nested root -----------------------------------------------------------------------

TEST_CASE("the first checkpoint in a fresh nested root survives a power cut", "[commit][power]") {
  TempDir tmp;
  auto fs = std::make_shared<FaultFilesystem>(posix_filesystem());
  const std::string root = tmp.sub("a/b/c");
  commit_ok(*fs, root, 1, "first");
  REQUIRE(fs->power_cut().ok());
  require_latest(*posix_filesystem(), root, 1, "first");
}

// ---- 4. two jobs on one root --------------------------------------------------------------

TEST_CASE("two jobs committing into one root get unique sequence numbers", "[commit][lock]") {
  TempDir tmp;
  auto fs = posix_filesystem();
  const std::string root = tmp.path();
  REQUIRE(fs->mkdirs(root).ok());
  constexpr int kPerJob = 25;
  std::vector<uint64_t> seqs[2];
  std::vector<std::string> errors[2];
  auto job = [&](int j) {
    for (int i = 0; i < kPerJob; ++i) {
      const uint64_t step = static_cast<uint64_t>(j * 1000 + i);
      const std::string id = "j" + std::to_string(j) + "-" + std::to_string(i);
      const std::string pending =
          join_path(root, pending_dir_name(step, "job" + std::to_string(j), id));
      Status st = prepare_pending(*fs, root, pending, step, false, kMinute, id);
      if (!st.ok()) {
        errors[j].push_back(st.to_string());
        continue;
      }
      Manifest m;
      m.step = step;
      m.checkpoint_id = id;
      CommitOptions opts;
      opts.keep_last = 3;
      opts.lease_owner = id;
      auto out = commit_checkpoint(*fs, root, pending, m, opts);
      if (!out.ok()) {
        errors[j].push_back(out.status().to_string());
        continue;
      }
      for (const Status& w : out->warnings) errors[j].push_back(w.to_string());
      seqs[j].push_back(out->commit_seq);
    }
  };
  std::thread a(job, 0), b(job, 1);
  a.join();
  b.join();
  for (int j = 0; j < 2; ++j) {
    INFO("job " << j << ": " << (errors[j].empty() ? "" : errors[j][0]));
    CHECK(errors[j].empty());
  }
  std::set<uint64_t> all(seqs[0].begin(), seqs[0].end());
  all.insert(seqs[1].begin(), seqs[1].end());
  CHECK(all.size() == 2 * kPerJob);
  CHECK(*all.rbegin() == 2 * kPerJob);
  for (int j = 0; j < 2; ++j) CHECK(std::is_sorted(seqs[j].begin(), seqs[j].end()));
  auto list = list_checkpoints(*fs, root);
  REQUIRE(list.ok());
  CHECK(list->size() == 3);
  auto latest = find_latest(*fs, root);
  REQUIRE(latest.ok());
  CHECK(latest->commit_seq == 2 * kPerJob);
  CHECK(latest->latest_hint);  // LATEST and the listing agree
}

TEST_CASE("a commit waits a bounded time for the root lock, then names root and holder",
          "[commit][lock]") {
  TempDir tmp;
  auto fs = posix_filesystem();
  const std::string root = tmp.path();
  Manifest m;
  std::string pending = stage(*fs, root, 1, &m);
  auto held = lock_root(*fs, root);
  REQUIRE(held.ok());
  CommitOptions opts;
  opts.lock_wait_ms = 20;
  auto out = commit_checkpoint(*fs, root, pending, m, opts);
  REQUIRE_FALSE(out.ok());
  CHECK(out.status().code() == StatusCode::busy);
  CHECK(contains(out.status().message(), root));
  CHECK(contains(out.status().message(), "pid " + std::to_string(::getpid())));
  held->reset();
  REQUIRE(commit_checkpoint(*fs, root, pending, m, opts).ok());
}

// ---- 5. prepare_pending cleans up only what it created, and collects ------------------------

TEST_CASE("prepare_pending never removes a pending directory it did not create",
          "[commit][pending]") {
  TempDir tmp;
  auto fs = std::make_shared<FaultFilesystem>(posix_filesystem());
  const std::string root = tmp.path();
  Manifest m;
  std::string theirs = stage(*fs, root, 1, &m);
  // A restarted job with the same token picks the same name.
  Status st = prepare_pending(*fs, root, theirs, 1, false, kMinute, "job/restarted");
  CHECK_FALSE(st.ok());
  CHECK(slurp(join_path(theirs, "rank-00000-0000.safetensors")) == data_of(1, "new"));
  CHECK(read_lease(*fs, theirs)->owner == "job/ckpt");
}

TEST_CASE("prepare_pending removes what it created when it fails", "[commit][pending]") {
  TempDir tmp;
  auto fs = std::make_shared<FaultFilesystem>(posix_filesystem());
  const std::string root = tmp.sub("x/y");
  const std::string pending = join_path(root, pending_dir_name(1, "job", "a"));
  fs->add_rule([] {
    FaultRule r;
    r.op = FaultOp::rename;  // the lease's rename into place
    r.nth = 1;
    r.error = ENOSPC;
    return r;
  }());
  Status st = prepare_pending(*fs, root, pending, 1, false, kMinute, "job/a");
  REQUIRE_FALSE(st.ok());
  CHECK(contains(st.message(), "(injected)"));
  CHECK_FALSE(exists(pending));
  CHECK_FALSE(exists(tmp.sub("x")));  // the levels it made, and only those
  CHECK(exists(tmp.path()));
}

TEST_CASE("prepare_pending collects expired pending directories and LATEST temp files",
          "[commit][pending][gc]") {
  TempDir tmp;
  auto fs = posix_filesystem();
  const std::string root = tmp.path();
  const std::string crashed = join_path(root, pending_dir_name(1, "job", "crashed"));
  REQUIRE(fs->mkdir(crashed).ok());
  put(*fs, join_path(crashed, "rank-00000-0000.safetensors"), "bytes");
  REQUIRE(write_lease(*fs, crashed, 1000, "job/crashed").ok());
  const std::string live = join_path(root, pending_dir_name(2, "other", "live"));
  REQUIRE(fs->mkdir(live).ok());
  REQUIRE(write_lease(*fs, live, now_unix_ms() + 10 * kMinute, "other/live").ok());
  put(*fs, join_path(root, "LATEST.tmp-12345-0"), "step-00000001");

  const std::string mine = join_path(root, pending_dir_name(3, "job", "next"));
  REQUIRE(prepare_pending(*fs, root, mine, 3, false, kMinute, "job/next").ok());
  CHECK(names_in(root) == std::vector<std::string>{kRootLockFileName,
                                                   ".pending-00000002-other-live",
                                                   ".pending-00000003-job-next"});
}

// ---- 6. errors after the commit point -------------------------------------------------------

// LATEST's temp file is written before the commit point and renamed after
// it; either failing is only a warning (LATEST is a hint), and no temp file
// is left behind.
TEST_CASE("a failed LATEST write or rename is a warning, not a failed commit",
          "[commit][warnings]") {
  for (FaultOp op : {FaultOp::open, FaultOp::sync, FaultOp::rename}) {
    INFO("failing " << fault_op_name(op) << " of LATEST's temp file");
    TempDir tmp;
    auto fs = std::make_shared<FaultFilesystem>(posix_filesystem());
    const std::string root = tmp.path();
    commit_ok(*fs, root, 1, "old");
    FaultRule r;
    r.op = op;
    r.nth = 1;
    r.error = op == FaultOp::open ? ENOSPC : EIO;
    r.path_contains = "/LATEST.tmp-";
    fs->add_rule(r);
    CommitOptions opts;
    opts.keep_last = 1;
    CommitOutcome out = commit_ok(*fs, root, 2, "new", opts);
    REQUIRE(out.warnings.size() == 1);
    CHECK(contains(out.warnings[0].message(), "LATEST"));
    CHECK(contains(out.warnings[0].message(), "(injected)"));
    require_latest(*fs, root, 2, "new");
    CHECK(out.retired == std::vector<std::string>{join_path(root, step_dir_name(1))});
    CHECK(slurp(join_path(root, kLatestFileName)) == "step-00000001\n");  // only a hint
    for (const std::string& name : names_in(root)) CHECK(name.find(".tmp-") == std::string::npos);
  }
}

// ---- 7. no hangs ----------------------------------------------------------------------------

TEST_CASE("FIFOs named MANIFEST, LATEST or LEASE never block", "[commit][fifo]") {
  TempDir tmp;
  auto fs = posix_filesystem();
  const std::string root = tmp.path();
  commit_ok(*fs, root, 1, "good");
  const std::string bad = join_path(root, step_dir_name(2));
  REQUIRE(fs->mkdir(bad).ok());
  REQUIRE(::mkfifo(join_path(bad, kManifestFileName).c_str(), 0644) == 0);
  REQUIRE(fs->unlink(join_path(root, kLatestFileName)).ok());
  REQUIRE(::mkfifo(join_path(root, kLatestFileName).c_str(), 0644) == 0);
  const std::string pending = join_path(root, pending_dir_name(3, "job", "fifo"));
  REQUIRE(fs->mkdir(pending).ok());
  REQUIRE(::mkfifo(join_path(pending, kLeaseFileName).c_str(), 0644) == 0);

  auto m = read_manifest(*fs, bad);
  REQUIRE_FALSE(m.ok());
  CHECK(contains(m.status().message(), join_path(bad, kManifestFileName)));
  CHECK(contains(m.status().message(), "not a regular file"));
  auto list = list_checkpoints(*fs, root);
  REQUIRE(list.ok());
  REQUIRE(list->size() == 2);
  auto latest = find_latest(*fs, root);
  REQUIRE(latest.ok());
  CHECK(latest->step == 1);
  auto lease = read_lease(*fs, pending);
  CHECK_FALSE(lease.ok());
  auto pend = list_pending(*fs, root);
  REQUIRE(pend.ok());
  REQUIRE(pend->size() == 1);
  CHECK_FALSE((*pend)[0].has_lease);
  auto gc = collect_garbage(*fs, root, now_unix_ms() + 10 * kMinute);
  REQUIRE(gc.ok());
  CHECK(gc->removed == std::vector<std::string>{pending});
  // The next save lists the root during its commit.
  commit_ok(*fs, root, 4, "next");
  require_latest(*fs, root, 4, "next");

  auto data = fs->open(join_path(bad, kManifestFileName), OpenOptions{});
  REQUIRE_FALSE(data.ok());
  CHECK(contains(data.status().message(), "not a regular file"));
}

TEST_CASE("read_file refuses a file over its cap, naming path and size", "[commit][fifo]") {
  TempDir tmp;
  auto fs = posix_filesystem();
  const std::string path = tmp.sub("big");
  put(*fs, path, std::string(100, 'x'));
  auto r = read_file(*fs, path, 10);
  REQUIRE_FALSE(r.ok());
  CHECK(contains(r.status().message(), path));
  CHECK(contains(r.status().message(), "100 bytes"));
  CHECK(read_file(*fs, path, 100).ok());
}

// ---- 8. unambiguous names -------------------------------------------------------------------

TEST_CASE("job ids like 'retired' or 'replaced' never make gc remove a live save",
          "[commit][gc][names]") {
  TempDir tmp;
  auto fs = posix_filesystem();
  const std::string root = tmp.path();
  std::vector<std::string> live;
  for (const char* job : {"retired", "replaced", "a-replaced-b", "trash"}) {
    const std::string p = join_path(root, pending_dir_name(9, job, "x-1"));
    REQUIRE(fs->mkdir(p).ok());
    REQUIRE(write_lease(*fs, p, now_unix_ms() + 10 * kMinute, job).ok());
    live.push_back(p);
  }
  std::sort(live.begin(), live.end());
  auto gc = collect_garbage(*fs, root, now_unix_ms());
  REQUIRE(gc.ok());
  CHECK(gc->removed.empty());
  CHECK(gc->restored.empty());
  CHECK(gc->kept == live);
  for (const std::string& p : live) CHECK(exists(p));
}

TEST_CASE("a step moved aside by an older version is put back, or collected once replaced",
          "[commit][gc][names]") {
  TempDir tmp;
  auto fs = posix_filesystem();
  const std::string root = tmp.path();
  commit_ok(*fs, root, 7, "old");
  commit_ok(*fs, root, 8, "other");
  // What older versions left after a failed overwrite of step 7 (no LEASE:
  // it was committed) and a leftover of their retention.
  const std::string old_aside = join_path(root, ".pending-00000007-replaced-c1");
  REQUIRE(fs->rename(join_path(root, step_dir_name(7)), old_aside).ok());
  const std::string old_retired = join_path(root, ".pending-00000003-retired-2");
  REQUIRE(fs->mkdir(old_retired).ok());
  auto gc = collect_garbage(*fs, root, now_unix_ms() + 10 * kMinute);
  REQUIRE(gc.ok());
  CHECK(gc->restored == std::vector<std::string>{join_path(root, step_dir_name(7))});
  CHECK(gc->removed == std::vector<std::string>{old_retired});
  CHECK(slurp(data_file(root, 7)) == data_of(7, "old"));

  // Once a step-7 is in place, an aside copy is garbage.
  REQUIRE(fs->mkdir(old_aside).ok());
  put(*fs, join_path(old_aside, kManifestFileName), "m");
  gc = collect_garbage(*fs, root, now_unix_ms());
  REQUIRE(gc.ok());
  CHECK(gc->discarded == std::vector<std::string>{old_aside});
  CHECK_FALSE(exists(old_aside));
  CHECK(slurp(data_file(root, 7)) == data_of(7, "old"));
}

}  // namespace
}  // namespace ferry

TEST_CASE("kill point specs: a typo is an error naming it, !stop is the one signal",
          "[killpoints]") {
  using ferry::check_kill_spec;
  CHECK(check_kill_spec("writer.report").ok());
  CHECK(check_kill_spec("writer.report:2@1!stop").ok());
  ferry::Status bad_signal = check_kill_spec("writer.report@1!term");
  CHECK_THAT(bad_signal.message(), Catch::Contains("bad signal") && Catch::Contains("!term"));
  CHECK_THAT(check_kill_spec("writer.reprot").message(), Catch::Contains("'writer.reprot'"));
  CHECK_THAT(check_kill_spec("plan.sent@x").message(), Catch::Contains("bad rank"));
  CHECK_THAT(check_kill_spec("plan.sent:0").message(), Catch::Contains("bad count"));
}

namespace ferry {
namespace {

// Records the crash points passed through it: a test's observer.
class RecordingFilesystem : public FilesystemWrapper {
 public:
  using FilesystemWrapper::FilesystemWrapper;
  void crash_point(const char* point) override { passed.emplace_back(point); }
  std::vector<std::string> passed;
};

TEST_CASE("a commit announces its crash points, in order, to its filesystem's observer",
          "[killpoints]") {
  TempDir tmp;
  auto rec = std::make_shared<RecordingFilesystem>(posix_filesystem());
  Manifest m;
  const std::string pending = stage(*rec, tmp.path(), 3, &m);
  rec->passed.clear();
  REQUIRE(commit_checkpoint(*rec, tmp.path(), pending, m, CommitOptions{}).ok());
  const std::vector<std::string> want = {"manifest.write",   "manifest.fsync", "manifest.rename",
                                         "manifest.dirsync", "latest.write",   "latest.fsync",
                                         "commit.rename",    "latest.rename",  "root.fsync"};
  CHECK(rec->passed == want);
  // Every point announced is one the drills know.
  for (const auto& p : rec->passed) CHECK(check_kill_spec(p).ok());
}

TEST_CASE("kill points count per filesystem and per rank, never per process", "[killpoints]") {
  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    auto a = kill_point_filesystem(posix_filesystem(), "commit.rename:2", 0);
    auto b = kill_point_filesystem(posix_filesystem(), "commit.rename:2", 0);
    auto other_rank = kill_point_filesystem(posix_filesystem(), "commit.rename@1", 0);
    if (!a.ok() || !b.ok() || !other_rank.ok()) ::_exit(3);
    (*a)->crash_point("commit.rename");
    (*b)->crash_point("commit.rename");  // b's first: a's count is a's own
    (*other_rank)->crash_point("commit.rename");
    (*a)->crash_point("latest.rename");
    (*a)->crash_point("commit.rename");  // a's second: killed here
    ::_exit(0);
  }
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  REQUIRE(WIFSIGNALED(status));
  CHECK(WTERMSIG(status) == SIGKILL);
}

}  // namespace
}  // namespace ferry
