// What a SaveHandle promises whatever happens underneath: every phase ends
// within its deadline, waits end when the actors die, a save that cannot
// keep its lease fails, an empty state dict is refused, and failures after
// the commit point leave a committed save with warnings.

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <stdexcept>

#include "catalog.hpp"
#include "drills/fault_fs.hpp"
#include "ferry/device.hpp"
#include "ferry/runtime.hpp"
#include "test_util.hpp"

using ferry::testing::TempDir;
using namespace std::chrono_literals;

namespace {

struct Model {
  std::vector<float> w;
  ferry::StateDict sd;
  Model() : w(1 << 20) {  // 4 MiB: 16 blocks of 256 KiB
    for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(i);
    REQUIRE(sd.add("w", {w.data(), ferry::DType::f32, {1024, 1024}}).ok());
  }
};

std::unique_ptr<ferry::Runtime> runtime(const std::string& root, const std::string& faults,
                                        std::vector<std::pair<std::string, std::string>> kv = {},
                                        std::shared_ptr<ferry::DeviceBackend> device = nullptr) {
  ferry::RuntimeArgs args;
  args.set("root", root).set("pool-bytes", "4MiB").set("chunk-bytes", "256KiB");
  args.set("direct-io", "false");
  for (auto& [k, v] : kv) args.set(k, v);
  auto fsys = ferry::filesystem_from_spec(ferry::posix_filesystem(), faults);
  REQUIRE(fsys.ok());
  args.fs = *fsys;
  args.device = std::move(device);
  auto rt = ferry::Runtime::create(args);
  REQUIRE(rt.ok());
  return std::move(rt).value();
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// A device whose copies throw: a bug in a backend must not hang the caller.
class ThrowingDevice : public ferry::DeviceBackend {
 public:
  bool handles(const ferry::Device& d) const override { return d.is_host(); }
  void copy_out(const ferry::TensorView&, uint64_t, uint64_t, void*, Done) override {
    throw std::runtime_error("device lost");
  }
  void copy_in(const void*, const ferry::TensorView&, uint64_t, uint64_t, Done) override {
    throw std::runtime_error("device lost");
  }
};

// Host copies that count themselves; a copy that runs after `over` is set
// breaks the contract that nothing touches the caller's tensors afterwards.
class CountingDevice : public ferry::DeviceBackend {
 public:
  std::atomic<bool> over{false};
  std::atomic<int> running{0};
  std::atomic<int> after_over{0};
  std::atomic<int> copies{0};
  bool handles(const ferry::Device& d) const override { return d.is_host(); }
  void copy_out(const ferry::TensorView& src, uint64_t offset, uint64_t len, void* dst,
                Done done) override {
    ++running;
    ++copies;
    if (over.load()) ++after_over;
    ferry::strided_copy_out(src, offset, len, dst);
    --running;
    done(ferry::Status());
  }
  void copy_in(const void* src, const ferry::TensorView& dst, uint64_t offset, uint64_t len,
               Done done) override {
    ferry::strided_copy_in(src, dst, offset, len);
    done(ferry::Status());
  }
};

}  // namespace

TEST_CASE("destroying the runtime with a save in flight ends it, no copy runs afterwards",
          "[actors][save][contract]") {
  TempDir dir;
  auto device = std::make_shared<CountingDevice>();
  // 16 MiB through a 1 MiB pool, each write slowed: the snapshot is still
  // copying when the runtime goes.
  auto rt = runtime(dir.path(), "latency:write:2ms", {{"pool-bytes", "1MiB"}}, device);
  std::vector<float> big(4 << 20, 1.5f);
  ferry::StateDict sd;
  REQUIRE(sd.add("big", {big.data(), ferry::DType::f32, {4096, 1024}}).ok());
  auto h = rt->save_async(sd, 1);
  rt.reset();
  device->over = true;
  CHECK(h.done());
  CHECK(device->running.load() == 0);
  CHECK(device->copies.load() > 0);
  // The save's actors and copy lane are gone: nothing can copy any more.
  CHECK(device->after_over.load() == 0);
}

TEST_CASE("saving an empty state dict is an error", "[actors][save][contract]") {
  TempDir dir;
  auto rt = runtime(dir.path(), "");
  ferry::StateDict empty;
  auto h = rt->save_async(empty, 1);
  const ferry::Status st = h.wait_committed();
  CHECK(st.code() == ferry::StatusCode::invalid_argument);
  CHECK_THAT(st.message(), Catch::Contains("state dict is empty"));
  CHECK(rt->latest().empty());
}

TEST_CASE("waits take a deadline", "[actors][save][contract]") {
  TempDir dir;
  // 16 writes of 40 ms over 2 writers: the save takes a few hundred ms.
  auto rt = runtime(dir.path(), "latency:write:40ms");
  Model m;
  auto h = rt->save_async(m.sd, 1);
  const ferry::Status early = h.wait_committed(1ms);
  CHECK(early.code() == ferry::StatusCode::timeout);
  CHECK_THAT(early.message(), Catch::Contains("step 1"));
  CHECK_FALSE(h.done());
  REQUIRE(h.wait_snapshot(60s).ok());
  REQUIRE(h.wait_committed(60s).ok());
  CHECK_FALSE(h.path().empty());
  CHECK(h.warnings().empty());
}

TEST_CASE("if the planner dies, every wait ends with an error", "[actors][save][contract]") {
  TempDir dir;
  auto rt = runtime(dir.path(), "", {}, std::make_shared<ThrowingDevice>());
  Model m;
  auto h = rt->save_async(m.sd, 1);
  const ferry::Status st = h.wait_committed(30s);
  CHECK(st.code() != ferry::StatusCode::timeout);
  CHECK_FALSE(st.ok());
  CHECK_THAT(st.message(), Catch::Contains("planner"));
  CHECK_FALSE(h.wait_snapshot(1s).ok());
  // Nothing is left to run a save: the next one fails at once.
  auto next = rt->save_async(m.sd, 2);
  CHECK(next.done());
  CHECK_FALSE(next.wait_committed(30s).ok());
  CHECK(rt->latest().empty());
}

TEST_CASE("rank 0 enforces the plan timeout", "[actors][save][contract][timeout]") {
  TempDir dir;
  // The pending directory takes 1.5 s to create: longer than the plan phase may.
  auto rt = runtime(dir.path(), "latency:mkdir:1500ms:path=.pending", {{"plan-timeout", "200ms"}});
  Model m;
  const auto t0 = std::chrono::steady_clock::now();
  const ferry::Status st = rt->save_async(m.sd, 1).wait_committed(30s);
  CHECK(seconds_since(t0) < 1.4);
  CHECK(st.code() == ferry::StatusCode::timeout);
  CHECK_THAT(st.message(), Catch::Contains("rank 0") && Catch::Contains("plan phase timed out"));
}

TEST_CASE("rank 0 enforces the commit timeout: outcome unknown",
          "[actors][save][contract][timeout]") {
  TempDir dir;
  // The commit rename takes 1.5 s: longer than the commit phase may.
  auto rt = runtime(dir.path(), "latency:rename:1500ms:path=step-", {{"commit-timeout", "200ms"}});
  Model m;
  const auto t0 = std::chrono::steady_clock::now();
  const ferry::Status st = rt->save_async(m.sd, 1).wait_committed(30s);
  CHECK(seconds_since(t0) < 1.4);
  CHECK(st.code() == ferry::StatusCode::outcome_unknown);
  CHECK_THAT(st.message(), Catch::Contains("rank 0") && Catch::Contains("commit phase timed out"));
}

TEST_CASE("a save that cannot refresh its lease fails instead of committing",
          "[actors][save][contract][lease]") {
  TempDir dir;
  // The first lease (at creation) is written; every refresh fails. The
  // writes take longer than a refresh period (lease / 3 = 100 ms).
  auto rt = runtime(dir.path(), "latency:write:40ms,enospc:open:2+:path=LEASE.tmp",
                    {{"lease-seconds", "300ms"}});
  Model m;
  const ferry::Status st = rt->save_async(m.sd, 1).wait_committed(30s);
  CHECK(st.code() == ferry::StatusCode::io_error);
  CHECK_THAT(st.message(), Catch::Contains("lease") && Catch::Contains("(injected)"));
  CHECK(rt->latest().empty());
}

TEST_CASE("a failure after the commit point is a warning of a committed save",
          "[actors][save][contract]") {
  TempDir dir;
  auto rt = runtime(dir.path(), "eio:rename:1:path=/LATEST$");
  Model m;
  auto h = rt->save_async(m.sd, 1);
  const ferry::Status st = h.wait_committed(30s);
  INFO(st.to_string());
  REQUIRE(st.ok());
  CHECK_FALSE(h.path().empty());
  REQUIRE(h.warnings().size() == 1);
  CHECK_THAT(h.warnings()[0], Catch::Contains("LATEST"));
  CHECK(rt->latest() == h.path());
}

size_t trash_dirs(const std::string& root) {
  size_t n = 0;
  for (const auto& e : std::filesystem::directory_iterator(root))
    n += ferry::is_trash_dir_name(e.path().filename().string()) ? 1 : 0;
  return n;
}

TEST_CASE("retention deletes old checkpoints after the save reports, never before",
          "[actors][save][contract][retention]") {
  TempDir dir;
  Model m;
  auto steps = [&] {
    std::vector<uint64_t> out;
    auto list = ferry::list_checkpoints(*ferry::posix_filesystem(), dir.path());
    REQUIRE(list.ok());
    for (const auto& c : *list) out.push_back(c.step);
    return out;
  };
  {
    // Deleting a retired checkpoint takes seconds here (each unlink inside
    // a trash directory 500 ms), as on a disk that discards what is freed.
    auto rt = runtime(dir.path(), "latency:unlink:500ms:path=.trash-", {{"keep-last", "1"}});
    REQUIRE(rt->save_async(m.sd, 1).wait_committed(30s).ok());
    REQUIRE(rt->save_async(m.sd, 2).wait_committed(30s).ok());
    // Step 1 is retired, out of sight, when step 2 reports committed; its
    // bytes are still being deleted.
    CHECK(steps() == std::vector<uint64_t>{2});
    CHECK(trash_dirs(dir.path()) == 1);

    // The next save does not take space before that deletion is over (its
    // gc finishes it), and retires step 2 in turn.
    auto h = rt->save_async(m.sd, 3);
    REQUIRE(h.wait_committed(30s).ok());
    CHECK(h.warnings().empty());
    CHECK(steps() == std::vector<uint64_t>{3});
    CHECK(trash_dirs(dir.path()) == 1);
  }
  // A runtime that ends right after a save deletes what it retired.
  CHECK(trash_dirs(dir.path()) == 0);
  CHECK(steps() == std::vector<uint64_t>{3});
}

TEST_CASE("a leftover in the root that the gc at a save's start cannot delete is a warning, once",
          "[actors][save][contract][retention]") {
  TempDir dir;
  Model m;
  // A trash directory a crashed job left, with a file that cannot be
  // unlinked, and one that can: the gc deletes the second all the same.
  const std::string stuck = dir.path() + "/.trash-stuck", gone = dir.path() + "/.trash-gone";
  for (const std::string& d : {stuck, gone}) {
    std::filesystem::create_directories(d);
    std::ofstream(d + "/rank-00000-0000.safetensors") << "old bytes";
  }
  auto rt = runtime(dir.path(), "eio:unlink:1+:path=.trash-stuck/");
  auto h1 = rt->save_async(m.sd, 1);
  const ferry::Status st = h1.wait_committed(30s);
  INFO(st.to_string());
  REQUIRE(st.ok());
  REQUIRE(h1.warnings().size() == 1);
  CHECK_THAT(h1.warnings()[0], Catch::Contains(stuck));
  CHECK_THAT(h1.warnings()[0], Catch::Contains("leftover"));
  CHECK_THAT(h1.warnings()[0], Catch::Contains("Input/output error"));
  CHECK_FALSE(std::filesystem::exists(gone));
  CHECK(std::filesystem::exists(stuck));
  // Every save's gc tries it again; the caller heard of it already.
  auto h2 = rt->save_async(m.sd, 2);
  REQUIRE(h2.wait_committed(30s).ok());
  CHECK(h2.warnings().empty());
}

TEST_CASE("a retired checkpoint that cannot be deleted is a warning of the next save, once",
          "[actors][save][contract][retention]") {
  TempDir dir;
  Model m;
  // Nothing inside a trash directory can be unlinked (a disk gone bad under
  // it); the deletion runs after the commit that retired it has answered.
  auto rt = runtime(dir.path(), "eio:unlink:1+:path=.trash-", {{"keep-last", "1"}});
  auto h1 = rt->save_async(m.sd, 1);
  REQUIRE(h1.wait_committed(30s).ok());
  auto h2 = rt->save_async(m.sd, 2);
  REQUIRE(h2.wait_committed(30s).ok());
  CHECK(h2.warnings().empty());
  auto h3 = rt->save_async(m.sd, 3);
  const ferry::Status st = h3.wait_committed(30s);
  INFO(st.to_string());
  REQUIRE(st.ok());
  // Step 1's deletion failed after step 2 answered: step 3 says so, naming
  // the directory left behind and the error.
  REQUIRE(h3.warnings().size() == 1);
  CHECK_THAT(h3.warnings()[0], Catch::Contains(dir.path() + "/.trash-"));
  // Step 3's own gc may reach the directory before the deletion queued
  // after step 2 does: either says it, once.
  CHECK_THAT(h3.warnings()[0], Catch::Contains("retired by an earlier commit") ||
                                   Catch::Contains("a leftover in the checkpoint root"));
  CHECK_THAT(h3.warnings()[0], Catch::Contains("Input/output error"));
  CHECK(trash_dirs(dir.path()) == 2);
  // Step 4 reports step 2's, not step 1's again.
  auto h4 = rt->save_async(m.sd, 4);
  REQUIRE(h4.wait_committed(30s).ok());
  REQUIRE(h4.warnings().size() == 1);
  CHECK(h4.warnings()[0] != h3.warnings()[0]);
  auto list = ferry::list_checkpoints(*ferry::posix_filesystem(), dir.path());
  REQUIRE(list.ok());
  REQUIRE(list->size() == 1);
  CHECK(list->front().step == 4);
}
