// Crash consistency at every kill point (src/drills/kill_point.cpp) on a
// directory root: the scenarios and what a crash may leave are in
// kill_scenarios.hpp, which the S3 variant (tests/s3/kill_points_s3_test.cpp)
// runs on an s3:// root. A point without a scenario fails its case and the
// table check below.

#include <catch2/catch.hpp>

#include <filesystem>

#include "multiproc/kill_scenarios.hpp"

namespace fs = std::filesystem;
using ferry::testing::CrashRoot;
using ferry::testing::CrashRootKind;
using ferry::testing::TempDir;

namespace {

// Every point is reached on a directory.
CrashRootKind directory_kind() {
  CrashRootKind kind;
  kind.name = "directory";
  kind.make = [] {
    auto dir = std::make_shared<TempDir>();
    CrashRoot r;
    r.root = dir->path();
    r.fs = ferry::posix_filesystem();
    r.power_cut = true;
    r.check_clean = [root = r.root] {
      for (auto& e : fs::directory_iterator(root)) {
        const std::string name = e.path().filename().string();
        CHECK_FALSE(ferry::is_pending_dir_name(name));
        CHECK_FALSE(ferry::is_trash_dir_name(name));
      }
    };
    r.keep = dir;
    return r;
  };
  return kind;
}

const bool kKillPointCasesRegistered = ferry::testing::kill_scenarios::register_kill_point_cases(
    "", "[ranks][killpoints]", [](const ferry::KillPointInfo& kp) {
      ferry::testing::kill_scenarios::crash_at_kill_point(directory_kind(), kp);
    });

}  // namespace

TEST_CASE("every kill point has a scenario that reaches it", "[killpoints]") {
  REQUIRE_FALSE(ferry::kill_points().empty());
  for (const auto& kp : ferry::kill_points()) {
    INFO(kp.name);
    CHECK(ferry::testing::kill_scenarios::scenario_of(kp.name).has_value());
  }
}
