// Crash consistency at every kill point (src/drills/kill_point.cpp): each
// point gets the scenario that reaches it, run once per role the table gives
// it (rank 0, or rank 0 and rank 1), and each run must kill exactly one
// process there; then the root must hold what a crash may leave:
// - a save on top of a committed checkpoint (most points): the latest is the
//   old step or the new one and loads bit-exact, nothing is lost, and gc
//   removes every leftover once its lease has expired; also after a power
//   cut (what was not fsynced is dropped, from the FERRY_FAULTS journal);
// - an overwrite of the committed step (overwrite.aside): the old or the new
//   content of that step is the latest and loads;
// - a save whose gc removes an expired save's leftovers (gc.delete): the old
//   checkpoint stays the latest, and the next gc deletes what was out of
//   sight;
// - 1-rank and 2-rank loads (load.read, load.receive): the other rank fails
//   (never hangs) and the checkpoint loads again.
// One test case per kill point (ctest runs them in parallel), registered from
// ferry::kill_points(); a point without a scenario fails its case and the
// table check below. FERRY_CRASH_RUNS (default 1) runs each point and role
// that many times: `make crashtest` soaks with 100.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "catalog.hpp"
#include "drills/fault_fs.hpp"
#include "drills/kill_point.hpp"
#include "launch.hpp"
#include "manifest.hpp"
#include "test_util.hpp"

namespace fs = std::filesystem;
using ferry::testing::count;
using ferry::testing::launch;
using ferry::testing::TempDir;

namespace {

enum class Scenario { save, overwrite, gc, load };

// The scenario that reaches `point`; none for a point nobody wrote one for.
std::optional<Scenario> scenario_of(const std::string& point) {
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
const std::string kOpts =
    " --set keep-last=1 --set lease-seconds=" + std::to_string(kLeaseMs) + "ms";

std::string save_args(const TempDir& d, int step, int seed) {
  return "--mode save --root " + d.path() + " --step " + std::to_string(step) + " --seed " +
         std::to_string(seed) + kOpts;
}

std::string kill_env(const std::string& point, int role) {
  return "FERRY_KILL_AT=" + point + "@" + std::to_string(role) + " ";
}

// Exactly one process died, the one of `role`, and nobody hung.
void check_one_kill(const ferry::testing::LaunchRun& r, int role) {
  CHECK(count(r.out, "killed by signal") == 1);
  CHECK(count(r.out, "rank " + std::to_string(role) + " killed by signal 9") == 1);
  CHECK(r.seconds < 30);
}

// What the next reader must find after a crash of a save whose previous
// checkpoint was saved with seed 11: a latest checkpoint, and it loads with
// `seed_of` its manifest (0: a checkpoint that must not be there). Then gc,
// past every lease, leaves neither pending nor trash directories.
template <typename SeedOf>
void check_after_save_crash(const TempDir& d, SeedOf seed_of) {
  auto fsys = ferry::posix_filesystem();
  auto latest = ferry::find_latest(*fsys, d.path());
  INFO("latest: " << (latest.ok() ? latest->path : latest.status().to_string()));
  REQUIRE(latest.ok());  // a committed checkpoint is never lost
  auto m = ferry::read_manifest(*fsys, latest->path);
  REQUIRE(m.ok());
  const int seed = seed_of(*m);
  INFO("step " << m->step << " commit " << m->commit_seq);
  REQUIRE(seed != 0);  // the old checkpoint or the new one, nothing else
  ferry::testing::check_loads(2, "--seed " + std::to_string(seed), d.path());
  auto gc = ferry::collect_garbage(*fsys, d.path(), ferry::now_unix_ms() + 2 * kLeaseMs);
  REQUIRE(gc.ok());
  for (auto& e : fs::directory_iterator(d.path())) {
    const std::string name = e.path().filename().string();
    CHECK_FALSE(ferry::is_pending_dir_name(name));
    CHECK_FALSE(ferry::is_trash_dir_name(name));
  }
}

// A 2-rank save of step 2 (or an overwrite of step 1) on top of step 1,
// killed at `point` on `role`; plain restart, then a power cut.
void save_killed(const std::string& point, int role, bool overwrite) {
  for (bool cut : {false, true}) {
    INFO((overwrite ? "overwrite" : "save")
         << " killed at " << point << " on rank " << role << (cut ? " + power cut" : ""));
    TempDir d, side;
    const std::string journal = side.sub("journal");
    const std::string faults = cut ? "FERRY_FAULTS=journal=" + journal + " " : "";
    auto first = launch(2, save_args(d, 1, 11), faults);
    INFO("the first save:\n" << first.out);
    REQUIRE(first.code == 0);
    const std::string args =
        overwrite ? save_args(d, 1, 12) + " --overwrite 1" : save_args(d, 2, 12);
    auto r = launch(2, args, faults + kill_env(point, role));
    INFO(r.out);
    check_one_kill(r, role);
    auto fsys = ferry::posix_filesystem();
    if (cut) REQUIRE(ferry::FaultFilesystem::apply_power_cut_from_journal(*fsys, journal).ok());
    check_after_save_crash(d, [&](const ferry::Manifest& m) {
      if (overwrite) return m.step != 1 ? 0 : m.commit_seq == 1 ? 11 : 12;
      return m.step == 1 ? 11 : m.step == 2 ? 12 : 0;
    });
  }
}

// The pending directory a save killed after creating it left in `root`.
std::string only_pending(const TempDir& d) {
  std::vector<std::string> found;
  for (auto& e : fs::directory_iterator(d.path()))
    if (ferry::is_pending_dir_name(e.path().filename().string())) found.push_back(e.path());
  REQUIRE(found.size() == 1);
  return found[0];
}

// A save's gc takes an expired save's directory out of sight and is killed
// before deleting it: the previous checkpoint stays the latest, and the next
// gc deletes the leftover.
void gc_killed(const std::string& point, int role) {
  TempDir d;
  auto first = launch(2, save_args(d, 1, 11));
  INFO("the first save:\n" << first.out);
  REQUIRE(first.code == 0);
  // A save that died right after creating its pending directory...
  auto dead = launch(2, save_args(d, 2, 12), kill_env("pending.created", 0));
  INFO("the save left behind:\n" << dead.out);
  REQUIRE(count(dead.out, "killed by signal 9") == 1);
  const std::string expired = only_pending(d);
  // ...and whose lease has run out since.
  auto fsys = ferry::posix_filesystem();
  auto lease = ferry::read_lease(*fsys, expired);
  REQUIRE(lease.ok());
  REQUIRE(ferry::write_lease(*fsys, expired, ferry::now_unix_ms() - 1, lease->owner).ok());
  auto r = launch(2, save_args(d, 2, 12), kill_env(point, role));
  INFO(r.out);
  check_one_kill(r, role);
  CHECK_FALSE(fs::exists(expired));  // out of sight before the kill
  bool trash = false;
  for (auto& e : fs::directory_iterator(d.path()))
    trash = trash || ferry::is_trash_dir_name(e.path().filename().string());
  CHECK(trash);  // not deleted yet: the kill came first
  check_after_save_crash(d, [](const ferry::Manifest& m) { return m.step == 1 ? 11 : 0; });
}

// 1-rank and 2-rank loads of a committed checkpoint, killed at `point` on
// `role`: the other rank fails at once, and the checkpoint loads again.
void load_killed(const std::string& point, int role) {
  TempDir d;
  auto first = launch(2, save_args(d, 1, 11));
  INFO("the save:\n" << first.out);
  REQUIRE(first.code == 0);
  // Shared bytes travel in frames only without share rings; every tensor
  // whole on every rank, so that each rank reads some for the other.
  const bool receive = point == "load.receive";
  const std::string flags =
      std::string("--seed 11") + (receive ? " --layout full --set share-memory=false" : "");
  std::vector<int> worlds = {2};
  if (!receive && role == 0) worlds.push_back(1);  // a lone rank receives nothing
  for (int n : worlds) {
    INFO("a " << n << "-rank load killed at " << point << " on rank " << role);
    auto r = launch(n, "--mode load --root " + d.path() + " " + flags, kill_env(point, role));
    INFO(r.out);
    check_one_kill(r, role);
    if (n > 1) CHECK(count(r.out, "ERROR load") == 1);  // the other rank, failed
    ferry::testing::check_loads(n, flags, d.path());
  }
}

void crash_at_kill_point(const ferry::KillPointInfo& kp) {
  const std::string point = kp.name;
  const auto scenario = scenario_of(point);
  if (!scenario) FAIL("kill point " << point << " has no scenario that reaches it");
  const char* runs_env = std::getenv("FERRY_CRASH_RUNS");
  const int runs = runs_env ? std::max(1, std::atoi(runs_env)) : 1;
  std::vector<int> roles = {0};
  if (kp.roles == ferry::KillPointRoles::every_rank) roles.push_back(1);
  for (int role : roles) {
    for (int run = 0; run < runs; ++run) {
      switch (*scenario) {
        case Scenario::save:
          save_killed(point, role, false);
          break;
        case Scenario::overwrite:
          save_killed(point, role, true);
          break;
        case Scenario::gc:
          gc_killed(point, role);
          break;
        case Scenario::load:
          load_killed(point, role);
          break;
      }
    }
    std::printf("crash soak: %-18s rank %d: %d run(s)\n", point.c_str(), role, runs);
  }
}

struct KillPointCase : Catch::ITestInvoker {
  explicit KillPointCase(ferry::KillPointInfo p) : kp(p) {}
  void invoke() const override { crash_at_kill_point(kp); }
  ferry::KillPointInfo kp;
};

const bool kKillPointCasesRegistered = [] {
  for (const auto& kp : ferry::kill_points()) {
    const std::string name = std::string("a crash at kill point ") + kp.name +
                             " leaves the old or the new checkpoint whole";
    Catch::AutoReg reg(new KillPointCase(kp), CATCH_INTERNAL_LINEINFO, Catch::StringRef(),
                       Catch::NameAndTags(name, "[ranks][killpoints]"));
  }
  return true;
}();

}  // namespace

TEST_CASE("every kill point has a scenario that reaches it", "[killpoints]") {
  REQUIRE_FALSE(ferry::kill_points().empty());
  for (const auto& kp : ferry::kill_points()) {
    INFO(kp.name);
    CHECK(scenario_of(kp.name).has_value());
  }
}
