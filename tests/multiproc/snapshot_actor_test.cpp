// The snapshot actor alone: its copies run on a copy lane of its own, an
// abandoned save is answered only once no copy of it runs (queued copies are
// skipped), and the actor exits cleanly with copies still queued.

#include <catch2/catch.hpp>

#include <pthread.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "actor_fixture.hpp"
#include "layout.hpp"

namespace {

using ferry::testing::ActorSystem;
using ferry::testing::Ask;

std::string thread_name() {
  char name[32] = {};
  pthread_getname_np(pthread_self(), name, sizeof(name));
  return name;
}

// Host copies that wait at a gate while it is closed, take `copy_time` (the
// copy engine's time), and note where and how many of them ran.
class GatedDevice : public ferry::DeviceBackend {
 public:
  std::chrono::microseconds copy_time{0};

  bool handles(const ferry::Device& d) const override { return d.is_host(); }
  void copy_out(const ferry::TensorView& src, uint64_t offset, uint64_t len, void* dst,
                Done done) override {
    {
      std::unique_lock<std::mutex> lock(mu_);
      ++started_;
      ++running_;
      threads_.insert(thread_name());
      thread_ids_.insert(std::this_thread::get_id());
      cv_.notify_all();
      cv_.wait(lock, [this] { return open_; });
    }
    std::this_thread::sleep_for(copy_time);
    ferry::strided_copy_out(src, offset, len, dst);
    {
      std::lock_guard<std::mutex> lock(mu_);
      --running_;
    }
    done(ferry::Status());
  }
  void copy_in(const void*, const ferry::TensorView&, uint64_t, uint64_t, Done done) override {
    done(ferry::Status::unsupported("copy_in"));
  }

  void open() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = true;
    cv_.notify_all();
  }
  void wait_started(int n) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this, n] { return started_ >= n; });
  }
  int started() const {
    std::lock_guard<std::mutex> lock(mu_);
    return started_;
  }
  int running() const {
    std::lock_guard<std::mutex> lock(mu_);
    return running_;
  }
  std::set<std::string> threads() const {
    std::lock_guard<std::mutex> lock(mu_);
    return threads_;
  }
  size_t thread_count() const {
    std::lock_guard<std::mutex> lock(mu_);
    return thread_ids_.size();
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
  int started_ = 0;
  int running_ = 0;
  std::set<std::string> threads_;
  std::set<std::thread::id> thread_ids_;
};

constexpr uint64_t kBlock = 4096;
constexpr int kTensors = 512;  // one block each, after the header's block

struct Rig {
  // Declared first, so freed last: after `sys`, whose end waits for the
  // snapshot actor and joins its copy lane, which may still be copying from
  // them when a test ends (ASan saw it).
  std::vector<std::vector<uint8_t>> tensors;
  ActorSystem sys;
  std::shared_ptr<GatedDevice> device = std::make_shared<GatedDevice>();
  ferry::StreamJob job;
  ferry::snapshot_actor snapshot;
  caf::scoped_actor parent{*sys.sys};

  explicit Rig(uint32_t lanes) {
    auto ctx = ferry::testing::rank_context(0, 1);
    ctx->opts.copy_threads = lanes;
    ctx->device = device;
    auto pool = ferry::StagingPool::create(2 * kTensors * kBlock, kBlock);
    REQUIRE(pool.ok());
    ctx->pool = std::move(pool).value();
    std::vector<ferry::ChunkRef> refs;
    std::vector<ferry::ChunkSource> sources;
    for (int i = 0; i < kTensors; ++i) {
      tensors.emplace_back(kBlock, static_cast<uint8_t>(i));
      const auto n = static_cast<int64_t>(kBlock);
      refs.push_back({"t" + std::to_string(i), ferry::DType::u8, {n}, {{0}, {n}}, nullptr});
      sources.push_back({ferry::TensorView(tensors.back().data(), ferry::DType::u8, {n}), 0});
    }
    auto layout = ferry::layout_file("f.safetensors", refs);
    REQUIRE(layout.ok());
    job.save = 7;
    job.files = std::make_shared<std::vector<ferry::FileLayout>>(
        std::vector<ferry::FileLayout>{std::move(layout).value()});
    job.sources = std::make_shared<std::vector<std::vector<ferry::ChunkSource>>>(
        std::vector<std::vector<ferry::ChunkSource>>{std::move(sources)});
    job.block_bytes = kBlock;
    // No serializer and no planner: what the snapshot sends them is dropped.
    snapshot =
        ferry::spawn_snapshot(parent.ptr(), ctx, ferry::serializer_actor{}, ferry::planner_actor{});
    // Watched through monitors below, not through the link.
    parent->unlink_from(snapshot);
  }
};

}  // namespace

TEST_CASE("snapshot: copies run on the snapshot's copy lanes, not the caller's or a scheduler's",
          "[actors][snapshot]") {
  const uint32_t lanes = GENERATE(1u, 3u);
  Rig rig(lanes);
  rig.device->open();
  caf::anon_send(rig.snapshot, ferry::atom::stream_v, rig.job);
  rig.device->wait_started(kTensors);
  CHECK(rig.device->threads() == std::set<std::string>{"ferry.copy"});
  // Blocks are dealt to the lanes in turn: every lane copied some.
  CHECK(rig.device->thread_count() == lanes);
  caf::anon_send_exit(rig.snapshot, caf::exit_reason::user_shutdown);
}

TEST_CASE("snapshot: abandon is answered once the running copy ends, queued copies are skipped",
          "[actors][snapshot]") {
  const uint32_t lanes = GENERATE(1u, 3u);
  Rig rig(lanes);
  caf::anon_send(rig.snapshot, ferry::atom::stream_v, rig.job);
  rig.device->wait_started(static_cast<int>(lanes));  // each lane is inside its first copy
  Ask<bool> abandon(*rig.sys.sys, rig.snapshot, ferry::atom::abandon_v, rig.job.save);
  // Another save's abandon is answered at once, and after the first one was
  // handled (one mailbox, in order): the save is abandoned now.
  Ask<bool> other(*rig.sys.sys, rig.snapshot, ferry::atom::abandon_v, uint64_t{999});
  CHECK(other.answer());
  rig.device->open();
  CHECK(abandon.answer());
  CHECK(rig.device->running() == 0);
  CHECK(rig.device->started() == static_cast<int>(lanes));
  caf::anon_send_exit(rig.snapshot, caf::exit_reason::user_shutdown);
}

TEST_CASE("snapshot: exiting with copies queued joins the lanes and runs none of them",
          "[actors][snapshot]") {
  Rig rig(2);
  // Long enough that the queued copies cannot all run before the exit.
  rig.device->copy_time = std::chrono::milliseconds(2);
  caf::anon_send(rig.snapshot, ferry::atom::stream_v, rig.job);
  rig.device->wait_started(1);
  rig.parent->monitor(rig.snapshot);
  caf::anon_send_exit(rig.snapshot, caf::exit_reason::user_shutdown);
  // The exit waits for the copy that runs; the queued ones are dropped. The
  // gate opens while the actor may still be exiting or already waiting.
  std::thread opener([&rig] { rig.device->open(); });
  bool down = false;
  rig.parent->receive([&down](const caf::down_msg&) { down = true; },
                      caf::after(std::chrono::seconds(30)) >> [] {});
  opener.join();
  REQUIRE(down);
  CHECK(rig.device->running() == 0);
  // Some queued copies may have run between the gate opening and the exit;
  // at 2 ms each, not all of them.
  CHECK(rig.device->started() < kTensors);
}
