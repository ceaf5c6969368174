// A directory inside the root swapped for a link to one outside it between
// Ferry's checks and its opens (a step directory while a load reads it, the
// pending directory while a save writes it): nothing outside is written or
// read, and the save or load fails naming the path.

#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <filesystem>
#include <stdexcept>
#include <vector>

#include "ferry/filesystem.hpp"
#include "ferry/runtime.hpp"
#include "test_util.hpp"

namespace fs = std::filesystem;
using ferry::testing::TempDir;

namespace {

struct Model {
  std::vector<float> a;
  ferry::StateDict sd;
  explicit Model(float seed) : a(64 * 1024) {
    for (size_t i = 0; i < a.size(); ++i) a[i] = seed + static_cast<float>(i);
    if (!sd.add("w", {a.data(), ferry::DType::f32, {256, 256}}).ok())
      throw std::logic_error("Model: the state dict refused its key");
  }
};

// On the first open of a data file, moves its directory aside and puts a
// link to `outside` in its place (with `copy`, a copy of what it held there,
// so that a load through the link would find the same files).
class SwappingFs : public ferry::FilesystemWrapper {
 public:
  SwappingFs(std::shared_ptr<ferry::Filesystem> target, std::string outside)
      : FilesystemWrapper(std::move(target)), outside_(std::move(outside)) {}
  bool armed = false;
  bool copy = false;
  std::string swapped;  // the directory that became a link
  ferry::Result<std::unique_ptr<ferry::File>> open(const std::string& p,
                                                   const ferry::OpenOptions& o) override {
    if (armed && p.find(".safetensors") != std::string::npos) {
      armed = false;
      const fs::path dir = fs::path(p).parent_path();
      if (copy) fs::copy(dir, outside_, fs::copy_options::recursive);
      fs::rename(dir, dir.string() + ".aside");
      fs::create_directory_symlink(outside_, dir);
      swapped = dir.string();
    }
    return target_->open(p, o);
  }

 private:
  std::string outside_;
};

std::vector<std::string> names_in(const std::string& dir) {
  std::vector<std::string> out;
  for (auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

TEST_CASE("a save whose pending directory becomes a link writes nothing outside the root",
          "[actors][symlink]") {
  TempDir dir, elsewhere;
  const std::string outside = elsewhere.sub("victim");
  fs::create_directory(outside);
  auto swapping = std::make_shared<SwappingFs>(ferry::posix_filesystem(), outside);
  ferry::RuntimeArgs args;
  args.set("root", dir.sub("root")).set("pool-bytes", "1MiB").set("chunk-bytes", "64KiB");
  args.fs = swapping;
  auto rt = ferry::Runtime::create(args);
  REQUIRE(rt.ok());

  swapping->armed = true;
  Model m(1);
  const ferry::Status st = (*rt)->save_async(m.sd, 1).wait_committed(std::chrono::seconds(60));
  INFO(st.to_string());
  REQUIRE(swapping->swapped.find(".pending-") != std::string::npos);
  CHECK_FALSE(st.ok());
  CHECK_THAT(st.message(), Catch::Contains(swapping->swapped) &&
                               Catch::Contains("symbolic link, which Ferry never follows"));
  CHECK(names_in(outside).empty());  // no data file, no manifest landed there
  CHECK((*rt)->latest().empty());
}

TEST_CASE("a load whose step directory becomes a link reads nothing outside the root",
          "[actors][symlink]") {
  TempDir dir, elsewhere;
  const std::string outside = elsewhere.sub("copy");
  auto swapping = std::make_shared<SwappingFs>(ferry::posix_filesystem(), outside);
  ferry::RuntimeArgs args;
  args.set("root", dir.sub("root")).set("pool-bytes", "1MiB").set("chunk-bytes", "64KiB");
  args.fs = swapping;
  auto rt = ferry::Runtime::create(args);
  REQUIRE(rt.ok());
  Model saved(1);
  auto h = (*rt)->save_async(saved.sd, 1);
  REQUIRE(h.wait_committed(std::chrono::seconds(60)).ok());

  // A load through the link would succeed, reading the copy.
  swapping->armed = true;
  swapping->copy = true;
  Model got(-1);
  const ferry::Status st = (*rt)->load(got.sd, h.path());
  INFO(st.to_string());
  REQUIRE(swapping->swapped == h.path());
  CHECK_FALSE(st.ok());
  CHECK_THAT(st.message(), Catch::Contains(h.path()) &&
                               Catch::Contains("symbolic link, which Ferry never follows"));
  CHECK(got.a == Model(-1).a);
}

TEST_CASE("runtimes give back the roots they declared on the shared POSIX filesystem",
          "[actors][root]") {
  TempDir dir;
  ferry::Filesystem& shared = *ferry::posix_filesystem();
  const size_t before = ferry::detail::declared_roots(shared);
  for (int i = 0; i < 8; ++i) {
    ferry::RuntimeArgs args;
    const std::string root = dir.sub("root" + std::to_string(i));
    args.set("root", root).set("pool-bytes", "1MiB").set("chunk-bytes", "64KiB");
    auto rt = ferry::Runtime::create(args);
    REQUIRE(rt.ok());
    Model m(static_cast<float>(i));
    REQUIRE((*rt)->save_async(m.sd, 1).wait_committed(std::chrono::seconds(60)).ok());
    CHECK((*rt)->latest(dir.sub("other")).empty());  // a second root, for a call
    CHECK(ferry::detail::declared_roots(shared) >= before + 1);
  }
  // Each runtime's roots went with it (its save's lock released its own).
  CHECK(ferry::detail::declared_roots(shared) == before);
}
