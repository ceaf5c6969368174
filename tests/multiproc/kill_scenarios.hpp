// The crash matrix's scenario runner, shared by the kill-points tests of
// every root kind: a directory (tests/multiproc/kill_points_test.cpp) and an
// s3:// root on the suite's S3 server (tests/s3/kill_points_s3_test.cpp).
// Each kill point gets the scenario that reaches it, run once per role the
// table gives it (rank 0, or rank 0 and rank 1), and each run must kill
// exactly one process there; then the root must hold what a crash may leave:
// - a save on top of a committed checkpoint (most points): the latest is the
//   old step or the new one and loads bit-exact, nothing is lost, and gc
//   removes every leftover once its lease has expired; on a directory also
//   after a power cut (what was not fsynced is dropped, from the
//   FERRY_FAULTS journal);
// - an overwrite of the committed step (overwrite.aside): the old or the new
//   content of that step is the latest and loads;
// - a save whose gc removes an expired save's leftovers (gc.delete): the old
//   checkpoint stays the latest, and the next gc deletes what was out of
//   sight;
// - 1-rank and 2-rank loads (load.read, load.receive): the other rank fails
//   (never hangs) and the checkpoint loads again.
// A root kind may not reach some points at all (an object root has no
// directory to fsync, nothing to rename): it names them with the reason, and
// the runner checks that a save with the kill set there really completes.
// FERRY_CRASH_RUNS (default 1) runs each point and role that many times:
// `make crashtest` soaks with 100.
#pragma once

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "catalog.hpp"
#include "drills/fault_fs.hpp"
#include "drills/kill_point.hpp"
#include "manifest.hpp"
#include "multiproc/launch.hpp"
#include "test_util.hpp"

namespace ferry::testing {

// One fresh checkpoint root of some kind, as the ranks and the checks see it.
struct CrashRoot {
  std::string root;
  // What every rank's command line needs to reach the root (" --set ...").
  std::string worker_args;
  // Reads the root as a rank does.
  std::shared_ptr<Filesystem> fs;
  // The power-cut model applies (a directory; an object is durable once put).
  bool power_cut = false;
  // gc's grace for leftovers without a lease (directories, unfinished uploads).
  int64_t gc_grace_ms = 60'000;
  // After gc past every lease: nothing but committed checkpoints is left.
  std::function<void()> check_clean;
  // The directory's or bucket's owner, kept alive with the root.
  std::shared_ptr<void> keep;
};

struct CrashRootKind {
  std::string name;  // "directory", "s3"
  std::function<CrashRoot()> make;
  // Kill points a save or load on this kind never passes, and why.
  std::map<std::string, std::string> unreached;
};

namespace kill_scenarios {

enum class Scenario { save, overwrite, gc, load };

// The scenario that reaches `point`; none for a point nobody wrote one for.
inline std::optional<Scenario> scenario_of(const std::string& point) {
  static const char* const kInSave[] = {
      "plan.sent",       "plan.received",    "pending.created", "writer.open",    "writer.write",
      "writer.fsync",    "writer.close",     "writer.report",   "manifest.write", "manifest.fsync",
      "manifest.rename", "manifest.dirsync", "latest.write",    "latest.fsync",   "commit.rename",
      "latest.rename",   "root.fsync",       "retention.delete"};
  for (const char* p : kInSave)
    if (point == p) return Scenario::save;
  if (point == "overwrite.aside") return Scenario::overwrite;
  if (point == "gc.delete") return Scenario::gc;
  if (point == "load.read" || point == "load.receive") return Scenario::load;
  return std::nullopt;
}

// Saves use a short lease: gc is asked about a moment past its expiry
// instead of the test sleeping until then. Not shorter: a save whose lease
// lapsed fails, and under ASan on a loaded machine a refresh timer can run
// late.
constexpr int64_t kLeaseMs = 3000;
inline const std::string kOpts =
    " --set keep-last=1 --set lease-seconds=" + std::to_string(kLeaseMs) + "ms";

inline std::string save_args(const CrashRoot& r, int step, int seed) {
  return "--mode save --root " + r.root + " --step " + std::to_string(step) + " --seed " +
         std::to_string(seed) + kOpts + r.worker_args;
}

inline std::string kill_env(const std::string& point, int role) {
  return "FERRY_KILL_AT=" + point + "@" + std::to_string(role) + " ";
}

// Exactly one process died, the one of `role`, and nobody hung.
inline void check_one_kill(const LaunchRun& r, int role) {
  CHECK(count(r.out, "killed by signal") == 1);
  CHECK(count(r.out, "rank " + std::to_string(role) + " killed by signal 9") == 1);
  CHECK(r.seconds < 30);
}

// What the next reader must find after a crash of a save whose previous
// checkpoint was saved with seed 11: a latest checkpoint, and it loads with
// `seed_of` its manifest (0: a checkpoint that must not be there). Then gc,
// past every lease, leaves nothing but checkpoints.
template <typename SeedOf>
void check_after_save_crash(const CrashRoot& r, SeedOf seed_of) {
  auto latest = find_latest(*r.fs, r.root);
  INFO("latest: " << (latest.ok() ? latest->path : latest.status().to_string()));
  REQUIRE(latest.ok());  // a committed checkpoint is never lost
  auto m = read_manifest(*r.fs, latest->path);
  REQUIRE(m.ok());
  const int seed = seed_of(*m);
  INFO("step " << m->step << " commit " << m->commit_seq);
  REQUIRE(seed != 0);  // the old checkpoint or the new one, nothing else
  check_loads(2, "--seed " + std::to_string(seed) + r.worker_args, r.root);
  // Every checkpoint listed loads: a step without its MANIFEST is invisible.
  auto all = list_checkpoints(*r.fs, r.root);
  REQUIRE(all.ok());
  for (const auto& c : *all) {
    INFO("listed: " << c.path);
    CHECK(c.status.ok());
  }
  auto gc = collect_garbage(*r.fs, r.root, now_unix_ms() + 2 * kLeaseMs, r.gc_grace_ms);
  INFO("gc: " << (gc.ok() ? "" : gc.status().to_string()));
  REQUIRE(gc.ok());
  CHECK(gc->failed.empty());
  r.check_clean();
}

// A 2-rank save of step 2 (or an overwrite of step 1) on top of step 1,
// killed at `point` on `role`; plain restart, then (where the kind has one)
// a power cut.
inline void save_killed(const CrashRootKind& kind, const std::string& point, int role,
                        bool overwrite) {
  std::vector<bool> cuts = {false, true};
  for (bool cut : cuts) {
    CrashRoot r = kind.make();
    if (cut && !r.power_cut) continue;
    INFO((overwrite ? "overwrite" : "save") << " on a " << kind.name << " root killed at " << point
                                            << " on rank " << role << (cut ? " + power cut" : ""));
    TempDir side;
    const std::string journal = side.sub("journal");
    const std::string faults = cut ? "FERRY_FAULTS=journal=" + journal + " " : "";
    auto first = launch(2, save_args(r, 1, 11), faults);
    INFO("the first save:\n" << first.out);
    REQUIRE(first.code == 0);
    const std::string args =
        overwrite ? save_args(r, 1, 12) + " --overwrite 1" : save_args(r, 2, 12);
    auto killed = launch(2, args, faults + kill_env(point, role));
    INFO(killed.out);
    check_one_kill(killed, role);
    if (cut) REQUIRE(FaultFilesystem::apply_power_cut_from_journal(*r.fs, journal).ok());
    check_after_save_crash(r, [&](const Manifest& m) {
      if (overwrite) return m.step != 1 ? 0 : m.commit_seq == 1 ? 11 : 12;
      return m.step == 1 ? 11 : m.step == 2 ? 12 : 0;
    });
  }
}

// The pending directory a save killed after creating it left in `root`.
inline std::string only_pending(const std::string& root) {
  std::vector<std::string> found;
  for (auto& e : std::filesystem::directory_iterator(root))
    if (is_pending_dir_name(e.path().filename().string())) found.push_back(e.path());
  REQUIRE(found.size() == 1);
  return found[0];
}

// A save's gc takes an expired save's directory out of sight and is killed
// before deleting it: the previous checkpoint stays the latest, and the next
// gc deletes the leftover. (Directories only: a save does not gc an object root.)
inline void gc_killed(const CrashRootKind& kind, const std::string& point, int role) {
  CrashRoot r = kind.make();
  auto first = launch(2, save_args(r, 1, 11));
  INFO("the first save:\n" << first.out);
  REQUIRE(first.code == 0);
  // A save that died right after creating its pending directory...
  auto dead = launch(2, save_args(r, 2, 12), kill_env("pending.created", 0));
  INFO("the save left behind:\n" << dead.out);
  REQUIRE(count(dead.out, "killed by signal 9") == 1);
  const std::string expired = only_pending(r.root);
  // ...and whose lease has run out since.
  auto lease = read_lease(*r.fs, expired);
  REQUIRE(lease.ok());
  REQUIRE(write_lease(*r.fs, expired, now_unix_ms() - 1, lease->owner).ok());
  auto killed = launch(2, save_args(r, 2, 12), kill_env(point, role));
  INFO(killed.out);
  check_one_kill(killed, role);
  CHECK_FALSE(std::filesystem::exists(expired));  // out of sight before the kill
  bool trash = false;
  for (auto& e : std::filesystem::directory_iterator(r.root))
    trash = trash || is_trash_dir_name(e.path().filename().string());
  CHECK(trash);  // not deleted yet: the kill came first
  check_after_save_crash(r, [](const Manifest& m) { return m.step == 1 ? 11 : 0; });
}

// 1-rank and 2-rank loads of a committed checkpoint, killed at `point` on
// `role`: the other rank fails at once, and the checkpoint loads again.
inline void load_killed(const CrashRootKind& kind, const std::string& point, int role) {
  CrashRoot r = kind.make();
  auto first = launch(2, save_args(r, 1, 11));
  INFO("the save:\n" << first.out);
  REQUIRE(first.code == 0);
  // Shared bytes travel in frames only without share rings; every tensor
  // whole on every rank, so that each rank reads some for the other.
  const bool receive = point == "load.receive";
  const std::string flags = std::string("--seed 11") +
                            (receive ? " --layout full --set share-memory=false" : "") +
                            r.worker_args;
  std::vector<int> worlds = {2};
  if (!receive && role == 0) worlds.push_back(1);  // a lone rank receives nothing
  for (int n : worlds) {
    INFO("a " << n << "-rank load from a " << kind.name << " root killed at " << point
              << " on rank " << role);
    auto killed = launch(n, "--mode load --root " + r.root + " " + flags, kill_env(point, role));
    INFO(killed.out);
    check_one_kill(killed, role);
    if (n > 1) CHECK(count(killed.out, "ERROR load") == 1);  // the other rank, failed
    check_loads(n, flags, r.root);
  }
}

// A point the kind says it never reaches: a save with the kill set there
// completes, nobody is killed, and the new step is the latest and loads.
inline void not_reached(const CrashRootKind& kind, const std::string& point,
                        const std::string& why) {
  INFO(point << " is not reached on a " << kind.name << " root: " << why);
  CrashRoot r = kind.make();
  auto first = launch(2, save_args(r, 1, 11));
  INFO("the first save:\n" << first.out);
  REQUIRE(first.code == 0);
  const bool overwrite = scenario_of(point) == Scenario::overwrite;
  const std::string args = overwrite ? save_args(r, 1, 12) + " --overwrite 1" : save_args(r, 2, 12);
  auto run = launch(2, args, kill_env(point, 0));
  INFO(run.out);
  CHECK(run.code == 0);
  CHECK(count(run.out, "killed by signal") == 0);
  check_after_save_crash(r, [&](const Manifest& m) {
    if (overwrite) return m.step == 1 && m.commit_seq != 1 ? 12 : 0;
    return m.step == 2 ? 12 : 0;
  });
}

inline void crash_at_kill_point(const CrashRootKind& kind, const KillPointInfo& kp) {
  const std::string point = kp.name;
  const auto scenario = scenario_of(point);
  if (!scenario) FAIL("kill point " << point << " has no scenario that reaches it");
  const char* runs_env = std::getenv("FERRY_CRASH_RUNS");
  const int runs = runs_env ? std::max(1, std::atoi(runs_env)) : 1;
  if (auto it = kind.unreached.find(point); it != kind.unreached.end()) {
    not_reached(kind, point, it->second);
    std::printf("crash soak (%s): %-18s not reached: %s\n", kind.name.c_str(), point.c_str(),
                it->second.c_str());
    return;
  }
  std::vector<int> roles = {0};
  if (kp.roles == KillPointRoles::every_rank) roles.push_back(1);
  for (int role : roles) {
    for (int run = 0; run < runs; ++run) {
      switch (*scenario) {
        case Scenario::save:
          save_killed(kind, point, role, false);
          break;
        case Scenario::overwrite:
          save_killed(kind, point, role, true);
          break;
        case Scenario::gc:
          gc_killed(kind, point, role);
          break;
        case Scenario::load:
          load_killed(kind, point, role);
          break;
      }
    }
    std::printf("crash soak (%s): %-18s rank %d: %d run(s)\n", kind.name.c_str(), point.c_str(),
                role, runs);
  }
}

struct KillPointCase : Catch::ITestInvoker {
  KillPointCase(std::function<void(const KillPointInfo&)> run, KillPointInfo p)
      : run(std::move(run)), kp(p) {}
  void invoke() const override { run(kp); }
  std::function<void(const KillPointInfo&)> run;
  KillPointInfo kp;
};

// One test case per kill point (ctest runs them in parallel), registered
// from kill_points(): "<prefix>a crash at kill point P leaves ...". `run`
// makes the root kind (or skips, where an S3 server is missing) and calls
// crash_at_kill_point.
inline bool register_kill_point_cases(const std::string& prefix, const std::string& tags,
                                      std::function<void(const KillPointInfo&)> run) {
  for (const auto& kp : kill_points()) {
    const std::string name =
        prefix + "a crash at kill point " + kp.name + " leaves the old or the new checkpoint whole";
    Catch::AutoReg reg(new KillPointCase(run, kp), CATCH_INTERNAL_LINEINFO, Catch::StringRef(),
                       Catch::NameAndTags(name, tags));
  }
  return true;
}

}  // namespace kill_scenarios
}  // namespace ferry::testing
