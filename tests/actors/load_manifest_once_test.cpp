// A load decodes its checkpoint's manifest once per runtime: the manifest
// ferry_manifest_open decoded is the one the runtime's load plans
// against, and a manifest replaced or changed on disk since is decoded
// again (or refused), never served stale.

#include <catch2/catch.hpp>

#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "actors/c_api_internal.hpp"
#include "ferry/ferry.h"
#include "ferry/runtime.hpp"
#include "manifest.hpp"
#include "runtime_rig.hpp"
#include "test_util.hpp"

using ferry::testing::TempDir;

namespace {

constexpr int kTensors = 5;
constexpr int64_t kElems = 32;

struct CRuntime {
  ferry_runtime* rt;
  explicit CRuntime(const std::string& root)
      : rt(ferry::detail::adopt_c_runtime(ferry::testing::make_test_runtime(root))) {}
  ~CRuntime() { ferry_runtime_destroy(rt); }
  ferry::Runtime& cpp() { return *rt->rt; }
};

// kTensors f32 tensors whose values depend on `seed`, as ferry_tensors.
struct State {
  std::vector<std::string> keys;
  std::vector<std::vector<float>> data;
  std::vector<ferry_tensor> c;
  int64_t shape[1] = {kElems};
  explicit State(float seed) {
    for (int i = 0; i < kTensors; ++i) {
      keys.push_back("layer" + std::to_string(i) + ".w");
      data.emplace_back(kElems);
      for (int64_t j = 0; j < kElems; ++j)
        data[i][j] = seed * 1000 + static_cast<float>(i * 64 + j);
    }
    for (int i = 0; i < kTensors; ++i) {
      ferry_tensor t{};
      t.key = keys[i].c_str();
      t.data = data[i].data();
      t.dtype = FERRY_DTYPE_F32;
      t.ndim = 1;
      t.shape = shape;
      t.device_type = FERRY_DEVICE_HOST;
      c.push_back(t);
    }
  }
  ferry::StateDict sd() {
    ferry::StateDict out;
    for (int i = 0; i < kTensors; ++i)
      REQUIRE(
          out.add(keys[i], ferry::TensorView(data[i].data(), ferry::DType::f32, {kElems})).ok());
    return out;
  }
};

void save(ferry::Runtime& rt, float seed, bool overwrite) {
  State s(seed);
  ferry::SaveOptions o;
  o.overwrite = overwrite;
  auto h = rt.save_async(s.sd(), 1, o);
  REQUIRE(h.wait_committed().ok());
}

ferry_manifest* open_rt(ferry_runtime* rt, const std::string& path) {
  ferry_manifest* m = nullptr;
  INFO(ferry_last_error());
  REQUIRE(ferry_manifest_open(rt, path.c_str(), &m) == FERRY_OK);
  REQUIRE(m != nullptr);
  return m;
}

}  // namespace

TEST_CASE("a load decodes the manifest ferry_manifest_open decoded, not again",
          "[load][manifest]") {
  TempDir dir;
  CRuntime c(dir.path());
  save(c.cpp(), 1, false);
  const std::string step = dir.path() + "/step-00000001";

  const uint64_t before = ferry::manifest_decodes();
  ferry_manifest* m = open_rt(c.rt, step);
  CHECK(ferry_manifest_num_tensors(m) == static_cast<size_t>(kTensors));
  CHECK(std::string(ferry_manifest_path(m)) == step);
  ferry_tensor_info info{};
  REQUIRE(ferry_manifest_tensor(m, 0, &info) == FERRY_OK);
  CHECK(std::string(info.key) == "layer0.w");
  CHECK(info.bytes == kElems * sizeof(float));
  ferry_manifest_close(m);

  State target(0);
  INFO(ferry_last_error());
  REQUIRE(ferry_load(c.rt, target.c.data(), target.c.size(), step.c_str()) == FERRY_OK);
  CHECK(target.data == State(1).data);
  CHECK(ferry::manifest_decodes() - before == 1);

  // Loaded again (through the root this time): the same decode serves it.
  State again(0);
  REQUIRE(ferry_load(c.rt, again.c.data(), again.c.size(), dir.path().c_str()) == FERRY_OK);
  CHECK(again.data == State(1).data);
  CHECK(ferry::manifest_decodes() - before == 1);
}

TEST_CASE("a manifest replaced between ferry_manifest_open and the load is read again",
          "[load][manifest]") {
  TempDir dir;
  CRuntime c(dir.path());
  save(c.cpp(), 1, false);
  const std::string step = dir.path() + "/step-00000001";
  ferry_manifest* m = open_rt(c.rt, step);

  // Step 1 saved again with other values: new data files, a new MANIFEST.
  save(c.cpp(), 2, true);
  const uint64_t before = ferry::manifest_decodes();
  State target(0);
  INFO(ferry_last_error());
  REQUIRE(ferry_load(c.rt, target.c.data(), target.c.size(), step.c_str()) == FERRY_OK);
  CHECK(target.data == State(2).data);
  CHECK(ferry::manifest_decodes() - before == 1);
  ferry_manifest_close(m);
}

TEST_CASE("a manifest changed in place after ferry_manifest_open fails the load",
          "[load][manifest]") {
  TempDir dir;
  CRuntime c(dir.path());
  save(c.cpp(), 1, false);
  const std::string step = dir.path() + "/step-00000001";
  ferry_manifest* m = open_rt(c.rt, step);

  // Its last payload byte flipped: same length, same frame, other content.
  const std::string file = step + "/MANIFEST";
  std::string bytes;
  {
    std::ifstream in(file, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  REQUIRE(!bytes.empty());
  bytes.back() = static_cast<char>(bytes.back() ^ 0x5a);
  {
    std::ofstream out(file, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  State target(0);
  CHECK(ferry_load(c.rt, target.c.data(), target.c.size(), step.c_str()) == FERRY_CORRUPTION);
  CHECK_THAT(std::string(ferry_last_error()), Catch::Contains(file));
  ferry_manifest_close(m);
}
