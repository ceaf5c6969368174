// Two runtimes in one process share no state: what one learned of a root's
// manifests (its ManifestCache) is not the other's, whatever their settings.

#include <catch2/catch.hpp>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ferry/filesystem.hpp"
#include "ferry/runtime.hpp"
#include "runtime_rig.hpp"
#include "test_util.hpp"

namespace {

// Counts the opens of MANIFEST files through it.
class ManifestOpens : public ferry::FilesystemWrapper {
 public:
  ManifestOpens() : FilesystemWrapper(ferry::posix_filesystem()) {}
  ferry::Result<std::unique_ptr<ferry::File>> open(const std::string& p,
                                                   const ferry::OpenOptions& o) override {
    const std::string name = "/MANIFEST";
    if (p.size() >= name.size() && p.compare(p.size() - name.size(), name.size(), name) == 0)
      ++opens;
    return target_->open(p, o);
  }
  std::atomic<int> opens{0};
};

}  // namespace

TEST_CASE("two runtimes in one process do not share what they know of manifests", "[runtime]") {
  ferry::testing::TempDir dir;
  const std::string root = dir.sub("root");
  auto fs_a = std::make_shared<ManifestOpens>();
  auto fs_b = std::make_shared<ManifestOpens>();
  auto a = ferry::testing::make_test_runtime(root, {{}, fs_a});
  auto b = ferry::testing::make_test_runtime(root, {{{"pool-bytes", "8MiB"}}, fs_b});

  std::vector<float> w(4096, 1.5f);
  ferry::StateDict sd;
  REQUIRE(sd.add("w", {w.data(), ferry::DType::f32, {4096}}).ok());
  REQUIRE(a->save_async(sd, 1).wait_committed().ok());

  // A committed step 1, so it knows the manifest's summary: its look reads
  // less than B's first, which learns it. B then reads as little as A.
  fs_a->opens = 0;
  REQUIRE(a->latest() == root + "/step-00000001");
  const int a_look = fs_a->opens;
  REQUIRE(b->latest() == root + "/step-00000001");
  const int b_first = fs_b->opens;
  CHECK(a_look < b_first);
  fs_b->opens = 0;
  REQUIRE(b->latest() == root + "/step-00000001");
  CHECK(fs_b->opens == a_look);
  // A's knowledge stays its own: B's looks left A's count alone.
  fs_a->opens = 0;
  REQUIRE(a->latest() == root + "/step-00000001");
  CHECK(fs_a->opens == a_look);
}
