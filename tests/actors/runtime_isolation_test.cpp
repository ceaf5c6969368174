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

  // A learns the manifest's summary on its first look, and reads less after.
  fs_a->opens = 0;
  REQUIRE(a->latest() == root + "/step-00000001");
  const int first_look = fs_a->opens;
  fs_a->opens = 0;
  REQUIRE(a->latest() == root + "/step-00000001");
  const int second_look = fs_a->opens;
  REQUIRE(second_look < first_look);

  // B's first look reads as much as A's did: A's knowledge is not B's.
  REQUIRE(b->latest() == root + "/step-00000001");
  CHECK(fs_b->opens == first_look);
  fs_b->opens = 0;
  REQUIRE(b->latest() == root + "/step-00000001");
  CHECK(fs_b->opens == second_look);
}
