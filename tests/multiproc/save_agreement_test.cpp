// Saves are collective: ranks that ask for different checkpoints are refused
// at once on every rank, and a job restarted with the same token never meets
// the pending directories of its predecessor.

#include <catch2/catch.hpp>

#include <filesystem>
#include <set>

#include "catalog.hpp"
#include "launch.hpp"
#include "test_util.hpp"

namespace fs = std::filesystem;
using ferry::testing::TempDir;

namespace {

// Every rank's output and the launcher's verdict (launch.hpp).
ferry::testing::LaunchRun launch_ranks(int n, const std::string& worker_args,
                                       const std::string& env = "") {
  return ferry::testing::launch(n, worker_args, env);
}

using ferry::testing::count;

std::set<std::string> pending_dirs(const std::string& root) {
  std::set<std::string> out;
  for (auto& e : fs::directory_iterator(root))
    if (ferry::is_pending_dir_name(e.path().filename().string()))
      out.insert(e.path().filename().string());
  return out;
}

}  // namespace

TEST_CASE("ranks that pass different steps are refused at once, naming step and ranks",
          "[ranks][agreement]") {
  TempDir d;
  auto r = launch_ranks(2, "--mode disagree --root " + d.path() +
                               " --step 5 --step-for-rank 1=6 --set plan-timeout=20s");
  INFO(r.out);
  CHECK(r.code == 0);
  CHECK(count(r.out, "FAILED as expected") == 2);
  CHECK(count(r.out, "disagree on the step") >= 2);  // both ranks say so
  CHECK_THAT(r.out, Catch::Contains("has 5") && Catch::Contains("has 6"));
  CHECK_THAT(r.out, Catch::Contains("rank 0 has") || Catch::Contains("rank 1 has"));
  CHECK(r.seconds < 10);  // not the 20 s plan timeout
  ferry::testing::check_nothing_saved(d.path());
}

TEST_CASE("ranks that pass different roots are refused at once, naming root and ranks",
          "[ranks][agreement]") {
  TempDir d, other;
  auto r = launch_ranks(2, "--mode disagree --root " + d.path() +
                               " --root-for-rank 1=" + other.path() + " --set plan-timeout=20s");
  INFO(r.out);
  CHECK(r.code == 0);
  CHECK(count(r.out, "FAILED as expected") == 2);
  CHECK(count(r.out, "disagree on the root") >= 2);
  CHECK_THAT(r.out, Catch::Contains(d.path()) && Catch::Contains(other.path()));
  CHECK(r.seconds < 10);
  for (const auto& root : {d.path(), other.path()}) ferry::testing::check_nothing_saved(root);
}

TEST_CASE("a job restarted with the same token leaves its predecessor's pending directory alone",
          "[ranks][agreement]") {
  TempDir d;
  const std::string token = "FERRY_JOB_TOKEN=restart-" + std::to_string(::getpid());
  // The first run dies after its files are durable, leaving its pending
  // directory behind with a lease that has not expired yet.
  auto first = launch_ranks(2, "--mode save --step 1 --seed 3 --root " + d.path(),
                            token + " FERRY_KILL_AT=writer.report@0");
  INFO(first.out);
  REQUIRE(first.code != 0);
  const auto left = pending_dirs(d.path());
  REQUIRE(left.size() == 1);
  // The restart has the same checkpoint ids; its save must still work, in a
  // directory of its own.
  auto second = launch_ranks(2, "--mode save --step 1 --seed 3 --root " + d.path(), token);
  INFO(second.out);
  CHECK(second.code == 0);
  CHECK(count(second.out, "SAVED") == 2);
  const auto after = pending_dirs(d.path());
  CHECK(after == left);  // untouched: its lease is still live
  for (const auto& name : left) CHECK(fs::exists(fs::path(d.path()) / name / "LEASE"));
}
