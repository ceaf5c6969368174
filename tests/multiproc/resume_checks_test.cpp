// A resume is exactly right or the save fails loudly: replicated tensors
// whose holders disagree, saves some ranks never call, and per-rank entries
// (issue 41, 1 and 5).

#include <catch2/catch.hpp>

#include <filesystem>

#include "catalog.hpp"
#include "launch.hpp"
#include "test_util.hpp"

namespace fs = std::filesystem;
using ferry::testing::count;
using ferry::testing::launch;
using ferry::testing::TempDir;

TEST_CASE("a replicated tensor whose holders differ fails the save, naming key and ranks",
          "[ranks][replica]") {
  TempDir d;
  // Rank 1 of 3 holds another value of layers.0.bias under the same key and box.
  auto r = launch(3, "--mode replica-differ --differ-rank 1 --root " + d.path());
  INFO(r.out);
  CHECK(r.code == 0);
  CHECK(count(r.out, "FAILED as expected") == 3);
  CHECK_THAT(r.out, Catch::Contains("tensor 'layers.0.bias'") &&
                        Catch::Contains("ranks 0, 2 hold one value, rank 1 another") &&
                        Catch::Contains("replica-check full"));
  ferry::testing::check_nothing_saved(d.path());
}

TEST_CASE("replica-check sampled catches a large replica that differs, and off saves one of them",
          "[ranks][replica]") {
  {
    TempDir d;
    // rep_big is 512 KiB: sampled hashes 64 windows of it, the first among them.
    auto r = launch(2,
                    "--mode replica-differ --differ-key rep_big --set replica-check=sampled "
                    "--root " +
                        d.path());
    INFO(r.out);
    CHECK(r.code == 0);
    CHECK_THAT(r.out,
               Catch::Contains("tensor 'rep_big'") && Catch::Contains("replica-check sampled"));
    ferry::testing::check_nothing_saved(d.path());
  }
  {
    TempDir d;
    auto r = launch(2, "--mode replica-differ --set replica-check=off --root " + d.path());
    INFO(r.out);
    CHECK(count(r.out, "SAVED despite differing replicas") == 2);
  }
}

TEST_CASE("a save only rank 0 calls fails at plan-timeout, saying who never called save",
          "[ranks][agreement]") {
  TempDir d;
  auto r = launch(2, "--mode rank0-only --step 7 --set plan-timeout=2s --root " + d.path());
  INFO(r.out);
  CHECK(r.code == 0);
  CHECK(count(r.out, "FAILED as expected") == 1);
  CHECK_THAT(r.out, Catch::Contains("rank 0 is saving step 7; rank 1 has not called save") &&
                        Catch::Contains("every rank calls save_async with its own shards, even "
                                        "for replicated state"));
  CHECK(r.seconds < 12);  // plan-timeout, not the 20 s of heartbeat and link waits
  ferry::testing::check_nothing_saved(d.path());
}

TEST_CASE("a per-rank entry comes back to each rank its own, and across sizes by on_resize",
          "[ranks][per_rank]") {
  TempDir d;
  auto saved = launch(2, "--mode save --per-rank 1 --root " + d.path());
  INFO(saved.out);
  REQUIRE(saved.code == 0);  // 2 ranks' own values under one key: no replica error
  {
    auto r = launch(2, "--mode load --layout save --per-rank 1 --root " + d.path());
    INFO(r.out);
    CHECK(r.code == 0);
    CHECK(count(r.out, "PERRANK rank 0 got rank 0's value") == 1);
    CHECK(count(r.out, "PERRANK rank 1 got rank 1's value") == 1);
  }
  {
    auto r = launch(3, "--mode load --per-rank 1 --saved-world 2 --root " + d.path());
    INFO(r.out);
    CHECK(r.code == 0);
    CHECK(count(r.out, "REFUSED as expected") == 3);
  }
  {
    auto r =
        launch(3, "--mode load --per-rank 1 --saved-world 2 --on-resize first --root " + d.path());
    INFO(r.out);
    CHECK(r.code == 0);
    CHECK(count(r.out, "got rank 0's value") == 3);
  }
}
