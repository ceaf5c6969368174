// Instant start: Runtime::create maps the staging pool and returns; the pool
// is faulted in the background, and a save right away still works.

#include <catch2/catch.hpp>

#include <chrono>
#include <numeric>
#include <vector>

#include "ferry/runtime.hpp"
#include "test_util.hpp"

using ferry::DType;
using ferry::TensorView;
using ferry::testing::TempDir;

TEST_CASE("runtime: create with a 2 GiB pool returns at once, a save right away works",
          "[actors][start]") {
  TempDir dir;
  ferry::RuntimeArgs args;
  args.set("root", dir.path()).set("pool-bytes", "2GiB").set("chunk-bytes", "8MiB");
  const auto t0 = std::chrono::steady_clock::now();
  auto rt = ferry::Runtime::create(args);
  const auto took = std::chrono::steady_clock::now() - t0;
  REQUIRE(rt.ok());
  // Faulting 2 GiB in first takes seconds here; mapping it does not.
  CHECK(took < std::chrono::seconds(1));

  std::vector<float> w(3 << 20);
  std::iota(w.begin(), w.end(), 0.5f);
  ferry::StateDict sd;
  REQUIRE(sd.add("w", TensorView(w.data(), DType::f32, {static_cast<int64_t>(w.size())})).ok());
  auto h = (*rt)->save_async(sd, 1);
  auto st = h.wait_committed();
  INFO(st.to_string());
  REQUIRE(st.ok());
  std::vector<float> back(w.size(), 0);
  ferry::StateDict out;
  REQUIRE(out.add("w", TensorView(back.data(), DType::f32, {static_cast<int64_t>(w.size())})).ok());
  REQUIRE((*rt)->load(out, h.path()).ok());
  CHECK(back == w);
}
