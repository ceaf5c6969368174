// A state of 100,000 entries costs about ten times one of 10,000 (issue 45):
// building the state dict, the save (plan, files, manifest, commit) and the
// load back are linear in the entries, not quadratic. The bound is loose
// (25x) so a shared, loaded machine does not fail it; a quadratic step
// makes 100x.

#include <catch2/catch.hpp>

#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "ferry/runtime.hpp"
#include "runtime_rig.hpp"
#include "test_util.hpp"

using ferry::testing::TempDir;

namespace {

using Clock = std::chrono::steady_clock;

constexpr int64_t kElems = 16;  // floats per entry: the cost is per entry, not per byte

struct Timed {
  double build_s = 0;  // StateDict of n entries (CPU time)
  double save_s = 0;   // save_async to committed, twice (cold and repeated)
  double load_s = 0;   // load back
};

double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// This thread's CPU seconds: on a loaded machine a build of milliseconds
// runs within one time slice and one of a tenth of a second shares the
// core, so wall time would favour the small one.
double thread_cpu_s() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

ferry::StateDict make_dict(std::vector<float>& buf, size_t n) {
  ferry::StateDict sd;
  for (size_t i = 0; i < n; ++i) {
    const ferry::Status st =
        sd.add("layers." + std::to_string(i) + ".expert.w",
               ferry::TensorView{buf.data() + i * kElems, ferry::DType::f32, {kElems}});
    if (!st.ok()) FAIL(st.to_string());
  }
  return sd;
}

Timed save_and_load(size_t n) {
  TempDir dir;
  auto rt = ferry::testing::make_test_runtime(dir.path(), {{{"pool-bytes", "16MiB"}}});
  std::vector<float> state(n * kElems);
  for (size_t i = 0; i < state.size(); ++i) state[i] = static_cast<float>(i) * 0.5f;
  Timed t;
  // A build of 10,000 entries is timed as one tenth of ten kept side by
  // side: the same work and memory as one of 100,000, not one that runs in
  // a warm cache. The best of three.
  const size_t builds = n < 100'000 ? 10 : 1;
  t.build_s = 1e9;
  for (int rep = 0; rep < 3; ++rep) {
    std::vector<ferry::StateDict> kept;
    const double t0 = thread_cpu_s();
    for (size_t b = 0; b < builds; ++b) kept.push_back(make_dict(state, n));
    t.build_s = std::min(t.build_s, (thread_cpu_s() - t0) / static_cast<double>(builds));
  }
  const ferry::StateDict sd = make_dict(state, n);
  std::string path;
  auto t0 = Clock::now();
  for (uint64_t step = 1; step <= 2; ++step) {
    state[step] = -1.0f * static_cast<float>(step);  // the second save has its own bytes
    auto h = rt->save_async(sd, step);
    const ferry::Status st = h.wait_committed();
    INFO(st.to_string());
    REQUIRE(st.ok());
    path = h.path();
  }
  t.save_s = since(t0);
  std::vector<float> back(state.size(), 0.0f);
  ferry::StateDict target = make_dict(back, n);
  t0 = Clock::now();
  const ferry::Status st = rt->load(target, path);
  t.load_s = since(t0);
  INFO(st.to_string());
  REQUIRE(st.ok());
  REQUIRE(std::memcmp(back.data(), state.data(), state.size() * sizeof(float)) == 0);
  return t;
}

}  // namespace

TEST_CASE("100,000 entries cost about 10x 10,000: build, save, load back (issue 45)",
          "[actors][scale]") {
  const Timed small = save_and_load(10'000);
  const Timed big = save_and_load(100'000);
  auto ratio = [](double b, double s) { return b / std::max(s, 1e-4); };
  INFO("build " << small.build_s << " s -> " << big.build_s << " s; save " << small.save_s
                << " s -> " << big.save_s << " s; load " << small.load_s << " s -> " << big.load_s
                << " s");
  WARN("ratios (100,000 / 10,000): build "
       << ratio(big.build_s, small.build_s) << ", save+load "
       << ratio(big.save_s + big.load_s, small.save_s + small.load_s));
  CHECK(ratio(big.build_s, small.build_s) <= 25);
  // Save and load together: one stall of a shared disk moves either alone.
  CHECK(ratio(big.save_s + big.load_s, small.save_s + small.load_s) <= 25);
}
