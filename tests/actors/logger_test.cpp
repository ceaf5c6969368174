// RuntimeArgs::logger: a runtime's messages go to its own logger (here the
// warning a load gives when it leaves checkpoint tensors out), in place of
// stderr, and never to another runtime's logger in the same process.

#include <catch2/catch.hpp>

#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "ferry/logger.hpp"
#include "ferry/runtime.hpp"
#include "test_util.hpp"

namespace {

struct Lines {
  std::mutex mu;
  std::vector<std::pair<ferry::LogLevel, std::string>> got;
  ferry::Logger logger() {
    return [this](ferry::LogLevel level, const std::string& message) {
      std::lock_guard<std::mutex> lock(mu);
      got.emplace_back(level, message);
    };
  }
  std::vector<std::pair<ferry::LogLevel, std::string>> taken() {
    std::lock_guard<std::mutex> lock(mu);
    return std::move(got);
  }
};

std::unique_ptr<ferry::Runtime> logged_runtime(const std::string& root, ferry::Logger logger) {
  ferry::RuntimeArgs args;
  args.set("root", root).set("pool-bytes", "4MiB").set("chunk-bytes", "256KiB");
  args.logger = std::move(logger);
  auto rt = ferry::Runtime::create(std::move(args));
  REQUIRE(rt.ok());
  return std::move(rt).value();
}

}  // namespace

TEST_CASE("a runtime's warnings reach its own logger, not another runtime's", "[runtime][log]") {
  ferry::testing::TempDir dir;
  Lines a_lines, b_lines;
  auto a = logged_runtime(dir.sub("root"), a_lines.logger());
  auto b = logged_runtime(dir.sub("other"), b_lines.logger());

  std::vector<float> w(64, 2.0f), v(32, 3.0f);
  ferry::StateDict saved;
  REQUIRE(saved.add("a.w", {w.data(), ferry::DType::f32, {64}}).ok());
  REQUIRE(saved.add("b.w", {v.data(), ferry::DType::f32, {32}}).ok());
  REQUIRE(a->save_async(saved, 3).wait_committed().ok());

  std::vector<float> back(64, 0.0f);
  ferry::StateDict some;
  REQUIRE(some.add("a.w", {back.data(), ferry::DType::f32, {64}}).ok());
  REQUIRE(a->load(some, dir.sub("root")).ok());
  CHECK(back == w);

  const auto lines = a_lines.taken();
  REQUIRE(lines.size() == 1);
  CHECK(lines[0].first == ferry::LogLevel::warning);
  // The line stderr got before the hook, whole and without its newline.
  CHECK_THAT(lines[0].second,
             Catch::StartsWith("ferry[rank 0]: loaded 1 tensors of step 3 from ") &&
                 Catch::EndsWith("1 checkpoint tensors not restored: b.w"));
  CHECK(b_lines.taken().empty());
}
