// SavePlanner's steps in a real multi-process job (`ferry launch`): every
// rank sees every rank's plan, another rank's plan is refused, barrier()
// commits a checkpoint that loads into other shardings, and a rank that never
// reaches barrier() fails the checkpoint on every rank within write-timeout,
// and a bad argument on one rank fails it on every rank at once.

#include <catch2/catch.hpp>

#include "catalog.hpp"
#include "launch.hpp"
#include "test_util.hpp"

using ferry::testing::check_loads;
using ferry::testing::check_nothing_saved;
using ferry::testing::count;
using ferry::testing::launch;
using ferry::testing::TempDir;

TEST_CASE("SavePlanner's steps on 2 and 4 ranks commit a checkpoint that loads resharded",
          "[ranks][planner_api]") {
  for (int n : {2, 4}) {
    TempDir d;
    INFO(n << " ranks");
    auto r = launch(n, "--mode planner --seed 9 --root " + d.path());
    INFO(r.out);
    REQUIRE(r.code == 0);
    CHECK(count(r.out, "PLANNED step 0: " + std::to_string(n) + " plans") ==
          static_cast<size_t>(n));
    CHECK(count(r.out, "REFUSED") == static_cast<size_t>(n));
    CHECK(count(r.out, "'s plan: each rank saves only its own") == static_cast<size_t>(n));
    CHECK(count(r.out, "SAVED " + d.path() + "/step-") == static_cast<size_t>(n));
    // Rank 0 printed the last rank's plan: its items, owners and files.
    CHECK_THAT(r.out,
               Catch::Contains("plan of rank " + std::to_string(n - 1) + ": writes") &&
                   Catch::Contains("written by rank") &&
                   Catch::Contains("rank-0000" + std::to_string(n - 1) + "-0000.safetensors"));
    auto cps = ferry::list_checkpoints(*ferry::posix_filesystem(), d.path());
    REQUIRE(cps.ok());
    REQUIRE(cps->size() == 1);
    CHECK(cps->front().step == 0);
    // Another sharding (rows and columns swapped) on another rank count.
    check_loads(n == 2 ? 3 : 2, "--layout swap --seed 9", d.path());
  }
}

TEST_CASE("a rank that never calls barrier() fails the checkpoint on every rank in write-timeout",
          "[ranks][planner_api]") {
  TempDir d;
  auto r = launch(3, "--mode planner-skip --skip-rank 1 --set write-timeout=3s --root " + d.path());
  INFO(r.out);
  CHECK(r.code == 0);
  CHECK(count(r.out, "FAILED as expected") == 3);
  CHECK(count(r.out, "skipped barrier") == 1);
  CHECK(count(r.out, "timed out") >= 3);
  CHECK(r.seconds < 20);  // the default write-timeout would be 30 s
  check_nothing_saved(d.path());
}

TEST_CASE("checkpoint_fn on every rank: the files it writes commit and load resharded",
          "[ranks][planner_api][checkpoint_fn]") {
  TempDir d;
  auto r = launch(2, "--mode planner --fn write --seed 5 --root " + d.path());
  INFO(r.out);
  REQUIRE(r.code == 0);
  CHECK(count(r.out, "CHECKPOINT_FN got") == 2);
  CHECK(count(r.out, "SAVED") == 2);
  check_loads(3, "--layout swap --seed 5", d.path());
}

TEST_CASE(
    "on 2 ranks every combination of compress, shard_size, prefix and checkpoint_fn "
    "writes the files the plans name, and they load resharded",
    "[ranks][planner_api][checkpoint_fn][plan_files]") {
  for (const char* compress : {"none", "zstd"})
    for (const char* shard : {"", "64KiB"})
      for (const char* prefix : {"rank", "model_v3"})
        for (bool fn : {false, true}) {
          TempDir d;
          std::string args = std::string("--mode planner --seed 4 --compress ") + compress +
                             " --prefix " + prefix + " --root " + d.path();
          if (*shard) args += std::string(" --shard-size ") + shard;
          if (fn) args += " --fn write";
          INFO(args);
          auto r = launch(2, args);
          INFO(r.out);
          REQUIRE(r.code == 0);
          CHECK(count(r.out, "FILES as planned") == 2);
          check_loads(3, "--layout swap --seed 4", d.path());
        }
}

TEST_CASE("a checkpoint_fn that raises on one rank aborts the checkpoint on every rank",
          "[ranks][planner_api][checkpoint_fn]") {
  TempDir d;
  auto r = launch(3, "--mode planner --fn raise --skip-rank 2 --root " + d.path());
  INFO(r.out);
  CHECK(r.code == 0);
  CHECK(count(r.out, "FAILED as expected") == 3);
  CHECK(count(r.out, "user checkpoint_fn bug") >= 3);
  CHECK(r.seconds < 20);
  check_nothing_saved(d.path());
}

TEST_CASE("the owner policy is a planner option every rank must agree on", "[ranks][planner_api]") {
  TempDir d;
  auto r = launch(3, "--mode planner --owner lowest --root " + d.path());
  INFO(r.out);
  REQUIRE(r.code == 0);
  CHECK(count(r.out, "OWNERS lowest rank") == 3);
  CHECK(count(r.out, "SAVED") == 3);
  TempDir e;
  auto bad =
      launch(2, "--mode planner --owner balanced --owner-for-rank 1=lowest --root " + e.path());
  INFO(bad.out);
  CHECK(bad.code == 0);
  CHECK(count(bad.out, "FAILED as expected") == 2);
  CHECK(ferry::list_checkpoints(*ferry::posix_filesystem(), e.path())->empty());
}

TEST_CASE("a bad SavePlanner argument on one rank aborts the checkpoint on every rank at once",
          "[ranks][planner_api]") {
  for (const char* bad : {"prefix", "shard", "transform"}) {
    TempDir d;
    INFO(bad);
    // plan-timeout 30 s: the others must not wait for it.
    auto r = launch(3, std::string("--mode planner --bad-for-rank 1=") + bad +
                           " --set plan-timeout=30s --root " + d.path());
    INFO(r.out);
    CHECK(r.code == 0);
    CHECK(count(r.out, "FAILED as expected") == 3);
    CHECK(count(r.out, "ERROR") == 0);
    CHECK(r.seconds < 15);
    // The ranks stayed in step: the next save committed, and nothing else.
    CHECK(count(r.out, "SAVED " + d.path() + "/step-00000000") == 3);
    auto cps = ferry::list_checkpoints(*ferry::posix_filesystem(), d.path());
    REQUIRE(cps.ok());
    CHECK(cps->size() == 1);
  }
}

TEST_CASE("a bad save_async option on one rank fails the save on every rank at once",
          "[ranks][planner_api]") {
  TempDir d;
  auto r = launch(3, "--mode save --bad-for-rank 2 --set plan-timeout=30s --root " + d.path());
  INFO(r.out);
  CHECK(r.code == 0);
  CHECK(count(r.out, "FAILED as expected") == 3);
  CHECK(count(r.out, "shard_size") >= 3);
  CHECK(r.seconds < 15);
  // In step: the next save (the same step) committed on every rank.
  CHECK(count(r.out, "SAVED " + d.path() + "/step-") == 3);
  auto cps = ferry::list_checkpoints(*ferry::posix_filesystem(), d.path());
  REQUIRE(cps.ok());
  CHECK(cps->size() == 1);
}
