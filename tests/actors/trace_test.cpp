// trace-dir on one rank, through the Runtime: a bad value is refused at start
// naming the option; a directory that cannot be written costs a warning
// naming it, never the save or the load; off, nothing is written.

#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <vector>

#include "ferry/runtime.hpp"
#include "runtime_rig.hpp"
#include "test_util.hpp"
#include "trace_file.hpp"

namespace fs = std::filesystem;
using ferry::testing::files_starting;
using ferry::testing::TempDir;

namespace {

bool contains(const std::string& s, const std::string& what) {
  return s.find(what) != std::string::npos;
}

struct Model {
  std::vector<float> a = std::vector<float>(64 * 1024, 1.5f);
  std::vector<float> b = std::vector<float>(1000, -2.0f);
  ferry::StateDict sd() {
    ferry::StateDict s;
    REQUIRE(s.add("a", ferry::TensorView(a.data(), ferry::DType::f32, {64, 1024})).ok());
    REQUIRE(s.add("b", ferry::TensorView(b.data(), ferry::DType::f32, {1000})).ok());
    return s;
  }
};

}  // namespace

TEST_CASE("trace-dir with a control character is refused at start, naming the option", "[trace]") {
  TempDir d;
  ferry::RuntimeArgs args;
  args.set("root", d.path()).set("pool-bytes", "4MiB").set("trace-dir", d.sub("a\nb"));
  auto rt = ferry::Runtime::create(args);
  REQUIRE_FALSE(rt.ok());
  CHECK(contains(rt.status().message(), "ferry.trace-dir"));
  CHECK(contains(rt.status().message(), "control characters"));
}

TEST_CASE("a trace-dir that cannot be written warns naming it, and the save and load succeed",
          "[trace]") {
  TempDir d;
  // A regular file where the directory would have to be.
  { std::ofstream(d.sub("blocker")) << "x"; }
  const std::string traces = d.sub("blocker") + "/traces";
  auto rt = ferry::testing::make_test_runtime(d.sub("root"), {{{"trace-dir", traces}}});
  Model m;
  ferry::StateDict sd = m.sd();
  ferry::SaveHandle h = rt->save_async(sd, 1);
  REQUIRE(h.wait_committed().ok());
  const auto warnings = h.warnings();
  REQUIRE(warnings.size() == 1);
  CHECK(contains(warnings[0], "trace-dir"));
  CHECK(contains(warnings[0], traces));
  std::fill(m.a.begin(), m.a.end(), 0.0f);
  REQUIRE(rt->load(sd, d.sub("root")).ok());
  CHECK(m.a[77] == 1.5f);
}

TEST_CASE("one rank: a save and a load each write a timeline, and without trace-dir none do",
          "[trace]") {
  TempDir d;
  const std::string traces = d.sub("traces");
  {
    auto rt = ferry::testing::make_test_runtime(d.sub("root"), {{{"trace-dir", traces}}});
    Model m;
    ferry::StateDict sd = m.sd();
    ferry::SaveHandle h = rt->save_async(sd, 3);
    REQUIRE(h.wait_committed().ok());
    CHECK(h.warnings().empty());
    REQUIRE(rt->load(sd, d.sub("root")).ok());
  }
  const auto saves = files_starting(traces, "save-00000003-");
  REQUIRE(saves.size() == 1);
  const auto s = ferry::testing::read_trace_file(saves[0]);
  for (const char* phase : {"plan", "snapshot", "serialize", "write rank-00000-0000.safetensors",
                            "fsync rank-00000-0000.safetensors", "commit"}) {
    INFO(phase);
    CHECK(s.find(0, phase) != nullptr);
  }
  CHECK(s.slowest_rank == 0);
  const auto loads = files_starting(traces, "load-");
  REQUIRE(loads.size() == 1);
  const auto l = ferry::testing::read_trace_file(loads[0]);
  for (const char* phase : {"resolve", "plan", "read", "verify"}) {
    INFO(phase);
    CHECK(l.find(0, phase) != nullptr);
  }

  // Off: another root, no trace-dir, nothing new anywhere.
  auto rt = ferry::testing::make_test_runtime(d.sub("root2"));
  Model m;
  ferry::StateDict sd = m.sd();
  REQUIRE(rt->save_async(sd, 4).wait_committed().ok());
  CHECK(files_starting(traces, "save-00000004-").empty());
  CHECK(files_starting(d.sub("root2"), "save-").empty());
}
