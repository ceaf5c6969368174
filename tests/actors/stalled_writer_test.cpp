// A write or a checkpoint_fn that never returns (a dead NFS mount, a stuck
// user function): the save ends by its phase deadline with an error naming
// the rank, the phase and the file, the runtime takes the next save, and its
// destruction returns although the stuck thread never does.

#include <catch2/catch.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <fstream>
#include <future>
#include <mutex>
#include <sstream>
#include <thread>

#include "drills/fault_fs.hpp"
#include "ferry/planner.hpp"
#include "ferry/runtime.hpp"
#include "test_util.hpp"

using ferry::testing::TempDir;
using Clock = std::chrono::steady_clock;

namespace {

struct Model {
  std::vector<float> a;
  ferry::StateDict sd;
  explicit Model(float seed) : a(64 * 1024) {
    for (size_t i = 0; i < a.size(); ++i) a[i] = seed + static_cast<float>(i);
    REQUIRE(sd.add("w", {a.data(), ferry::DType::f32, {256, 256}}).ok());
  }
};

std::unique_ptr<ferry::Runtime> runtime(const std::string& root,
                                        std::shared_ptr<ferry::Filesystem> fsys) {
  ferry::RuntimeArgs args;
  args.set("root", root).set("pool-bytes", "1MiB").set("chunk-bytes", "64KiB");
  args.set("writers", "2").set("write-timeout", "1s");
  args.fs = std::move(fsys);
  auto rt = ferry::Runtime::create(args);
  REQUIRE(rt.ok());
  return std::move(rt).value();
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

bool loads_as(ferry::Runtime& rt, const std::string& path, float seed) {
  Model want(seed), got(-1);
  return rt.load(got.sd, path).ok() && got.a == want.a;
}

// write-timeout 1 s; the drain's grace (2 s), rank 0's verdict (at most 2 s)
// and a loaded machine's scheduling come on top. Without the fix: never.
constexpr double kBound = 15;

// Holds the first call of `op` on a path containing `path` until released.
ferry::FaultRule stall_first(ferry::FaultOp op, const char* path) {
  ferry::FaultRule r;
  r.action = ferry::FaultRule::Action::stall;
  r.op = op;
  r.nth = 1;
  r.path_contains = path;
  return r;
}

}  // namespace

TEST_CASE("a pwrite that never returns fails the save by its deadline, and the next save works",
          "[actors][faults][stall]") {
  TempDir dir;
  auto faults = std::make_shared<ferry::FaultFilesystem>(ferry::posix_filesystem());
  faults->add_rule(stall_first(ferry::FaultOp::write, ".safetensors"));
  auto rt = runtime(dir.path(), faults);

  Model m1(1);
  const auto t0 = Clock::now();
  ferry::SaveHandle h = rt->save_async(m1.sd, 1);
  REQUIRE(faults->wait_stalled(1, std::chrono::seconds(30)));
  const ferry::Status st = h.wait_committed(std::chrono::seconds(60));
  const double took = seconds_since(t0);
  INFO(st.to_string() << " after " << took << " s");
  CHECK(st.code() == ferry::StatusCode::timeout);
  // Which side names it first (the rank's abandonment or rank 0's phase
  // deadline) is a race; both name the rank and the phase.
  CHECK(st.message().find("write phase") != std::string::npos);
  CHECK(st.message().find("rank 0") != std::string::npos);
  CHECK(st.message().find("pwrite of ") != std::string::npos);
  CHECK(st.message().find("rank-00000-0000.safetensors") != std::string::npos);
  CHECK(st.message().find("abandoned writer") != std::string::npos);
  CHECK(took < kBound);
  CHECK(faults->stalled_now() == 1);  // still stuck: the save did not wait for it

  // The same runtime takes the next save, its writers replaced.
  Model m2(2);
  const ferry::Status st2 = rt->save_async(m2.sd, 2).wait_committed(std::chrono::seconds(60));
  INFO(st2.to_string());
  REQUIRE(st2.ok());
  CHECK(loads_as(*rt, rt->latest(), 2));

  // Destruction returns although the writer thread is still in its pwrite.
  const auto t1 = Clock::now();
  rt.reset();
  CHECK(seconds_since(t1) < kBound);
  CHECK(faults->stalled_now() == 1);
  faults->release_stalls();  // the abandoned thread ends, writing nothing more
}

TEST_CASE("a stall released after its save failed writes nothing and shuts down cleanly",
          "[actors][faults][stall]") {
  TempDir dir;
  auto faults = std::make_shared<ferry::FaultFilesystem>(ferry::posix_filesystem());
  faults->add_rule(stall_first(ferry::FaultOp::sync, ".safetensors"));
  auto rt = runtime(dir.path(), faults);
  Model m1(1);
  const ferry::Status st = rt->save_async(m1.sd, 1).wait_committed(std::chrono::seconds(60));
  INFO(st.to_string());
  CHECK(st.code() == ferry::StatusCode::timeout);
  CHECK(st.message().find("fsync and close of ") != std::string::npos);
  CHECK(rt->latest().empty());
  faults->release_stalls();
  // The retired writer's call returns and it ends: destruction joins every thread.
  Model m2(2);
  REQUIRE(rt->save_async(m2.sd, 2).wait_committed(std::chrono::seconds(60)).ok());
  CHECK(loads_as(*rt, rt->latest(), 2));
  rt.reset();
}

TEST_CASE("a checkpoint_fn that never returns fails barrier() by the write deadline",
          "[actors][faults][stall]") {
  TempDir dir;
  auto rt = runtime(dir.path(), ferry::posix_filesystem());
  // Shared with the function, which outlives this test's frame.
  struct Gate {
    std::mutex mu;
    std::condition_variable cv;
    bool entered = false, released = false;
  };
  auto gate = std::make_shared<Gate>();
  Model m1(1);
  {
    ferry::SavePlannerOptions o;
    o.checkpoint_fn = [gate](const ferry::StateDict&, const std::string&) {
      std::unique_lock<std::mutex> lock(gate->mu);
      gate->entered = true;
      gate->cv.wait(lock, [&] { return gate->released; });
      return ferry::Status::aborted("released");
    };
    ferry::SavePlanner p(*rt, m1.sd, "", std::move(o), "", 1);
    auto plans = p.create_global_plan();
    REQUIRE(plans.ok());
    const auto t0 = Clock::now();
    ferry::WriteHandle w = p.save_on_this_process((*plans)[0]);
    auto r = p.barrier();
    const double took = seconds_since(t0);
    REQUIRE_FALSE(r.ok());
    INFO(r.status().to_string() << " after " << took << " s");
    CHECK(r.status().code() == ferry::StatusCode::timeout);
    CHECK(r.status().message().find("write phase") != std::string::npos);
    CHECK(r.status().message().find("rank 0") != std::string::npos);
    CHECK(r.status().message().find("checkpoint_fn writing ") != std::string::npos);
    CHECK(r.status().message().find("rank-00000-0000.safetensors") != std::string::npos);
    CHECK(took < kBound);
    CHECK_FALSE(w.wait(std::chrono::seconds(0)).ok());
  }
  {
    std::lock_guard<std::mutex> lock(gate->mu);
    CHECK(gate->entered);
  }
  Model m2(2);
  const ferry::Status st2 = rt->save_async(m2.sd, 2).wait_committed(std::chrono::seconds(60));
  INFO(st2.to_string());
  REQUIRE(st2.ok());
  const auto t1 = Clock::now();
  rt.reset();
  CHECK(seconds_since(t1) < kBound);
  {
    std::lock_guard<std::mutex> lock(gate->mu);
    gate->released = true;
  }
  gate->cv.notify_all();
}

TEST_CASE("a commit whose rename never returns does not hold the runtime's destruction",
          "[actors][faults][stall]") {
  TempDir dir;
  auto faults = std::make_shared<ferry::FaultFilesystem>(ferry::posix_filesystem());
  // The commit rename, pending -> step.
  faults->add_rule(stall_first(ferry::FaultOp::rename, "step-00000001"));
  ferry::RuntimeArgs args;
  args.set("root", dir.path()).set("pool-bytes", "1MiB").set("chunk-bytes", "64KiB");
  args.set("commit-timeout", "1s");
  args.fs = faults;
  auto created = ferry::Runtime::create(args);
  REQUIRE(created.ok());
  std::unique_ptr<ferry::Runtime> rt = std::move(created).value();

  Model m1(1);
  const ferry::Status st = rt->save_async(m1.sd, 1).wait_committed(std::chrono::seconds(60));
  INFO(st.to_string());
  CHECK(st.code() == ferry::StatusCode::outcome_unknown);
  REQUIRE(faults->stalled_now() == 1);

  // Destroyed on a thread of its own, so that a hang fails this test instead
  // of holding it; what the runtime abandons it says on stderr.
  const std::string log = dir.sub("stderr.log");
  const int saved = ::dup(2);
  const int to = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  REQUIRE(saved >= 0);
  REQUIRE(to >= 0);
  ::dup2(to, 2);
  ::close(to);
  auto done = std::make_shared<std::promise<void>>();
  auto destroyed = done->get_future();
  const auto t0 = Clock::now();
  std::thread([rt = std::move(rt), done]() mutable {
    rt.reset();
    done->set_value();
  }).detach();
  const bool returned = destroyed.wait_for(std::chrono::seconds(static_cast<int>(kBound))) ==
                        std::future_status::ready;
  const double took = seconds_since(t0);
  ::dup2(saved, 2);
  ::close(saved);
  std::stringstream said;
  said << std::ifstream(log).rdbuf();
  INFO(said.str() << " after " << took << " s");
  REQUIRE(returned);
  CHECK(took < kBound);
  CHECK(said.str().find("rank 0's coordinator (in the commit of step 1 from ") !=
        std::string::npos);
  CHECK(said.str().find(".pending-00000001") != std::string::npos);
  CHECK(faults->stalled_now() == 1);  // destruction did not wait for it
  faults->release_stalls();
}
