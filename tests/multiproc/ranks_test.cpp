// Many ranks for real: `ferry launch` starts N processes that meet over UCX,
// plan together and commit one checkpoint; other rank counts load it back.

#include <catch2/catch.hpp>

#include <sys/wait.h>
#include <unistd.h>
#include <array>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <thread>

#include "catalog.hpp"
#include "launch.hpp"
#include "manifest.hpp"
#include "test_util.hpp"

namespace fs = std::filesystem;
using ferry::testing::TempDir;

namespace {

using Run = ferry::testing::LaunchRun;
using ferry::testing::count;
using ferry::testing::launch;

ferry::Manifest manifest_of(const std::string& root) {
  auto fsys = ferry::posix_filesystem();
  auto latest = ferry::find_latest(*fsys, root);
  REQUIRE(latest.ok());
  auto m = ferry::read_manifest(*fsys, latest->path);
  REQUIRE(m.ok());
  return *m;
}

std::string save_args(const TempDir& d, int step = 1, int seed = 7) {
  return "--mode save --root " + d.path() + " --step " + std::to_string(step) + " --seed " +
         std::to_string(seed);
}

}  // namespace

TEST_CASE("2 ranks save one checkpoint and load it back in other shardings", "[ranks]") {
  TempDir d;
  auto r = launch(2, save_args(d));
  INFO(r.out);
  REQUIRE(r.code == 0);
  CHECK(count(r.out, "SAVED") == 2);
  auto m = manifest_of(d.path());
  CHECK(m.world_size == 2);
  CHECK(m.files.size() == 2);  // one data file per rank
  // Replicated tensors are written once.
  for (const auto& t : m.tensors)
    if (t.key == "layers.0.bias" || t.key == "optimizer.step") CHECK(t.chunks.size() == 1);
  size_t dirs = 0;
  for (auto& e : fs::directory_iterator(d.path())) dirs += e.is_directory();
  CHECK(dirs == 1);  // one checkpoint directory, no pending leftovers

  for (int m_ranks : {2, 1, 3}) ferry::testing::check_loads(m_ranks, "--seed 7", d.path());
  auto full = launch(2, "--mode load --layout full --seed 7 --root " + d.path());
  INFO(full.out);
  CHECK(full.code == 0);
}

TEST_CASE("every rank's file headers are checksummed: a flipped header byte fails the load",
          "[ranks][corruption]") {
  TempDir d;
  auto r = launch(3, save_args(d, 1, 5));
  INFO(r.out);
  REQUIRE(r.code == 0);
  auto m = manifest_of(d.path());
  REQUIRE(m.files.size() == 3);
  const ferry::ManifestFile* of_rank2 = nullptr;
  for (const auto& f : m.files) {
    INFO(f.name << " of rank " << f.rank);
    CHECK(f.header_bytes > 0);
    CHECK(f.header_checksum != 0);
    if (f.rank == 2) of_rank2 = &f;
  }
  REQUIRE(of_rank2);
  // A byte inside the JSON header of rank 2's file, which no chunk checksum covers.
  const std::string path =
      ferry::find_latest(*ferry::posix_filesystem(), d.path())->path + "/" + of_rank2->name;
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(12);
    f.put('#');
  }
  auto l = launch(3, "--mode load --seed 5 --root " + d.path());
  INFO(l.out);
  CHECK(l.code != 0);
  CHECK_THAT(l.out, Catch::Contains(of_rank2->name) &&
                        Catch::Contains("does not match its checksum in the manifest"));
}

TEST_CASE("a rank that left the job fails the next save on the others at once, naming it",
          "[ranks]") {
  TempDir d;
  auto r = launch(3, save_args(d, 1, 5) + " --leave-rank 2 --set plan-timeout=30s");
  INFO(r.out);
  CHECK(r.code == 0);
  CHECK(count(r.out, "SAVED") == 3);
  CHECK(count(r.out, "LEAVING") == 1);
  CHECK(count(r.out, "FAILED as expected") == 2);
  CHECK(r.seconds < 15);  // not plan-timeout
  CHECK(manifest_of(d.path()).step == 1);
}

TEST_CASE("4 ranks save, 3 ranks load with a different sharding", "[ranks]") {
  TempDir d;
  auto r = launch(4, save_args(d));
  INFO(r.out);
  REQUIRE(r.code == 0);
  auto m = manifest_of(d.path());
  CHECK(m.world_size == 4);
  ferry::testing::check_loads(3, "--seed 7", d.path());
}

TEST_CASE("a 2,000-tensor state across 4 ranks", "[ranks]") {
  TempDir d;
  auto r = launch(4, save_args(d) + " --many 2000");
  INFO(r.out.substr(0, 4000));
  REQUIRE(r.code == 0);
  CHECK(manifest_of(d.path()).tensors.size() == 2000);
  auto l = launch(2, "--mode load --many 2000 --seed 7 --root " + d.path());
  INFO(l.out.substr(0, 4000));
  CHECK(l.code == 0);
}

TEST_CASE("mismatched state dicts fail on every rank, naming the key, with no files left",
          "[ranks]") {
  TempDir d;
  auto r = launch(3, "--mode mismatch --root " + d.path());
  INFO(r.out);
  CHECK(r.code == 0);  // every rank saw the error it expected
  CHECK(count(r.out, "FAILED as expected") == 3);
  CHECK(fs::is_empty(d.path()));
}

TEST_CASE("a rank killed during a save: the others fail fast, nothing is committed", "[ranks]") {
  TempDir d;
  auto first = launch(2, save_args(d, 1, 11));
  INFO(first.out);
  REQUIRE(first.code == 0);
  // Right after save_async returns, and inside the save once rank 1's data
  // file is durable and closed but before it reports (a kill from the
  // caller's thread after wait_snapshot could come after the report, when
  // committing without rank 1 would be right).
  for (const char* when : {"plan", "writer.close"}) {
    INFO("killed at " << when);
    const bool point = std::string(when) != "plan";
    auto r = launch(3,
                    "--mode kill --step 2 --seed 12 --kill-rank 1 --root " + d.path() +
                        " --kill-after " + (point ? "none" : when),
                    point ? std::string("FERRY_KILL_AT=") + when + "@1" : std::string());
    INFO(r.out);
    CHECK(r.code != 0);  // rank 1 died
    CHECK(count(r.out, "FAILED as expected") == 2);
    CHECK_THAT(r.out, Catch::Contains("rank 1"));
    CHECK(r.seconds < 15);  // heartbeat timeout 3 s + write timeout not reached
    // Nothing committed; the previous checkpoint is still the latest and loads.
    auto m = manifest_of(d.path());
    CHECK(m.step == 1);
    auto l = launch(2, "--mode load --seed 11 --root " + d.path());
    INFO(l.out);
    CHECK(l.code == 0);
  }
}

TEST_CASE("a hung (SIGSTOPped) rank: the others fail within the heartbeat timeout", "[ranks]") {
  TempDir d;
  auto first = launch(2, save_args(d, 1, 11));
  REQUIRE(first.code == 0);
  for (const char* point : {"plan.sent", "writer.report"}) {
    INFO("stopped at " << point);
    // heartbeat-timeout is 3 s in the worker; launch reaps the stopped rank
    // 2 s after the others exit. Rank 1 stops itself inside the save (from
    // the caller's thread, the whole save could be over first).
    auto r = launch(
        3, "--mode kill --step 2 --seed 12 --kill-rank 1 --kill-after none --root " + d.path(),
        std::string("FERRY_KILL_AT='") + point + "@1!stop'", 2);
    INFO(r.out);
    CHECK(count(r.out, "FAILED as expected") == 2);
    CHECK_THAT(r.out, Catch::Contains("rank 1"));
    CHECK(r.seconds < 15);
    CHECK(manifest_of(d.path()).step == 1);
  }
}

TEST_CASE("a process with the wrong job token is refused", "[ranks]") {
  TempDir d;
  // Rank 0 and rank 1 started by hand with different tokens, inside a
  // one-rank `ferry launch` for the free MASTER_PORT it picks and holds.
  const std::string common =
      "env -u LOCAL_RANK -u LOCAL_WORLD_SIZE WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 ";
  const std::string w = std::string(FERRY_RANK_WORKER_PATH) + " --mode save --root " + d.path() +
                        " --set connect-timeout=4s";
  const std::string inner = common + "RANK=0 FERRY_JOB_TOKEN=aaaa " + w + " > " + d.sub("r0") +
                            " 2>&1 & r0=$!; " + common + "RANK=1 FERRY_JOB_TOKEN=bbbb " + w +
                            " > " + d.sub("r1") + " 2>&1; wait $r0; true";
  const std::string cmd = std::string(FERRY_CLI_PATH) + " launch -n 1 -- sh -c '" + inner + "'";
  REQUIRE(std::system(cmd.c_str()) == 0);
  auto slurp = [](const std::string& p) {
    std::ifstream f(p);
    return std::string(std::istreambuf_iterator<char>(f), {});
  };
  const std::string r0 = slurp(d.sub("r0")), r1 = slurp(d.sub("r1"));
  INFO("rank 0: " << r0 << "\nrank 1: " << r1);
  CHECK_THAT(r1, Catch::Contains("ERROR start"));
  CHECK_THAT(r1, Catch::Contains("token"));
  CHECK_THAT(r0, Catch::Contains("refused"));
  CHECK_THAT(r0, Catch::Contains("ERROR start"));  // rank 0 never got its peer
}

TEST_CASE("malformed messages are logged and answered, never a crash", "[ranks]") {
  TempDir d;
  auto r = launch(2, "--mode garbage --root " + d.path() + " --set plan-timeout=3s");
  INFO(r.out);
  CHECK(r.code == 0);
  CHECK_THAT(r.out, Catch::Contains("malformed message from rank 1"));
  CHECK_THAT(r.out, Catch::Contains("error reports back"));
  CHECK_THAT(r.out, Catch::Contains("FAILED as expected"));  // rank 0 lived to report
}

TEST_CASE("an overwrite killed with its old step aside: the resumed job finds and keeps it",
          "[ranks][overwrite]") {
  TempDir d;
  const std::string keep1 = " --set keep-last=1";
  auto first = launch(2, save_args(d, 1, 11) + keep1);
  INFO(first.out);
  REQUIRE(first.code == 0);
  // Rank 0 (the coordinator) dies between moving step 1 aside and putting
  // the new step 1 in its place.
  auto r =
      launch(2, save_args(d, 1, 12) + keep1 + " --overwrite 1", "FERRY_KILL_AT=overwrite.aside@0");
  INFO(r.out);
  CHECK_THAT(r.out, Catch::Contains("killed by signal 9"));
  auto fsys = ferry::posix_filesystem();
  REQUIRE_FALSE(fs::exists(d.sub("step-00000001")));
  // What a resuming job asks first: the old step 1, whole.
  auto latest = ferry::find_latest(*fsys, d.path());
  INFO(latest.status().to_string());
  REQUIRE(latest.ok());
  CHECK(latest->step == 1);
  auto l = launch(2, "--mode load --seed 11 --root " + d.path());
  INFO(l.out);
  CHECK(l.code == 0);
  // Its next save, keeping one checkpoint, leaves a loadable one.
  auto next = launch(2, save_args(d, 2, 13) + keep1);
  INFO(next.out);
  REQUIRE(next.code == 0);
  latest = ferry::find_latest(*fsys, d.path());
  REQUIRE(latest.ok());
  CHECK(latest->step == 2);
  l = launch(2, "--mode load --seed 13 --root " + d.path());
  INFO(l.out);
  CHECK(l.code == 0);
}
