// GPU saves and loads end to end through the Runtime, with the CUDA backend
// running over the fake CUDA runtime (RuntimeArgs::device). The Runtime orders
// its copies itself (save_async after SaveOptions::stream, load after the
// legacy default stream, SaveHandle::wait_snapshot(stream) the caller's stream
// after the copies).

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <map>
#include <thread>

#include "actors/c_api_internal.hpp"
#include "cuda/device_cuda.hpp"
#include "fake_cuda.hpp"
#include "ferry/planner.hpp"
#include "ferry/runtime.hpp"
#include "safetensors_writer.hpp"
#include "test_util.hpp"

using ferry::Device;
using ferry::DType;
using ferry::TensorView;
using ferry::testing::eventually;
using ferry::testing::FakeCuda;
using ferry::testing::random_bytes;
using ferry::testing::TempDir;

namespace {

struct GpuRig {
  std::shared_ptr<FakeCuda> fake = std::make_shared<FakeCuda>(2);
  std::shared_ptr<ferry::CudaDevice> dev;
  std::unique_ptr<ferry::Runtime> rt;
  ferry::cuda::StreamHandle stream = nullptr;

  GpuRig(const std::string& root, std::vector<std::pair<std::string, std::string>> kv = {}) {
    auto d = ferry::CudaDevice::create(fake);
    REQUIRE(d.ok());
    dev = *d;
    fake->set_device(0);
    stream = fake->user_stream(0);
    ferry::RuntimeArgs args;
    args.set("root", root).set("pool-bytes", "4MiB").set("chunk-bytes", "256KiB");
    args.set("checksum-block-bytes", "64KiB");
    for (auto& [k, v] : kv) args.set(k, v);
    args.device = dev;
    auto r = ferry::Runtime::create(args);
    REQUIRE(r.ok());
    rt = std::move(r).value();
  }
  ~GpuRig() {
    rt.reset();
    dev.reset();
    CHECK(fake->unset_device_calls() == 0);
  }
  // A "GPU tensor" holding `bytes`.
  TensorView upload(int device, const std::vector<uint8_t>& bytes) {
    void* p = fake->device_alloc(device, bytes.size());
    std::memcpy(p, bytes.data(), bytes.size());
    return TensorView(p, DType::u8, {static_cast<int64_t>(bytes.size())}, Device::cuda(device));
  }
  // Saves `bytes` from host memory as tensor "a" of checkpoint `step`; its
  // path once committed.
  std::string save_host_a(const std::vector<uint8_t>& bytes, uint64_t step) {
    auto src = bytes;
    ferry::StateDict sd;
    REQUIRE(
        sd.add("a", TensorView(src.data(), DType::u8, {static_cast<int64_t>(src.size())})).ok());
    auto h = rt->save_async(sd, step);
    REQUIRE(h.wait_committed().ok());
    return h.path();
  }
  // A save ordered after the training stream, as a training loop asks for it.
  ferry::SaveHandle save(const ferry::StateDict& sd, uint64_t step) {
    ferry::SaveOptions o;
    o.stream = stream;
    o.stream_device = Device::cuda(0);
    return rt->save_async(sd, step, o);
  }
};

std::vector<uint8_t> bytes_of(const TensorView& v) {
  const auto* p = static_cast<const uint8_t*>(v.data);
  return {p, p + v.nbytes()};
}

// Loads `keys` of the checkpoint at `path` into fresh host buffers.
std::vector<std::vector<uint8_t>> load_host(
    ferry::Runtime& rt, const std::string& path,
    const std::vector<std::pair<std::string, size_t>>& keys) {
  std::vector<std::vector<uint8_t>> out;
  for (auto& [k, n] : keys) out.emplace_back(n, 0);
  ferry::StateDict sd;
  for (size_t i = 0; i < keys.size(); ++i)
    REQUIRE(sd.add(keys[i].first,
                   TensorView(out[i].data(), DType::u8, {static_cast<int64_t>(keys[i].second)}))
                .ok());
  auto st = rt.load(sd, path);
  INFO(st.to_string());
  REQUIRE(st.ok());
  return out;
}

}  // namespace

TEST_CASE("cuda save: the write queued on the caller's stream before save_async is saved",
          "[actors][cuda]") {
  TempDir dir;
  GpuRig rig(dir.path());
  auto t = rig.upload(0, std::vector<uint8_t>(300000, 0));
  const auto written = random_bytes(300000, 1);
  rig.fake->hold(rig.stream);  // the training step is still running
  rig.fake->write_on_stream(rig.stream, t.data, written);
  ferry::StateDict sd;
  REQUIRE(sd.add("w", t).ok());
  auto h = rig.save(sd, 1);
  REQUIRE(eventually([&] { return rig.fake->copies_enqueued() >= 1; }));
  rig.fake->drain();
  CHECK_FALSE(h.snapshot_done());  // the copies wait for the training step
  rig.fake->release(rig.stream);
  REQUIRE(h.wait_snapshot().ok());
  auto st = h.wait_committed();
  INFO(st.to_string());
  REQUIRE(st.ok());
  auto got = load_host(*rig.rt, h.path(), {{"w", written.size()}});
  CHECK(got[0] == written);
}

TEST_CASE("cuda save: mutating after wait_snapshot leaves the checkpoint unchanged",
          "[actors][cuda]") {
  TempDir dir;
  GpuRig rig(dir.path(), {{"pool-bytes", "8MiB"}});
  const auto orig = random_bytes(3 << 20, 2);
  auto t = rig.upload(0, orig);
  ferry::StateDict sd;
  REQUIRE(sd.add("p", t).ok());
  auto h = rig.save(sd, 5);
  REQUIRE(h.wait_snapshot().ok());
  // The optimizer step, on the GPU, right after the snapshot.
  rig.fake->launch(rig.stream, [&t] { std::memset(t.data, 0x5a, t.nbytes()); });
  REQUIRE(h.wait_committed().ok());
  REQUIRE(rig.fake->drain());
  CHECK(static_cast<uint8_t*>(t.data)[7] == 0x5a);
  auto got = load_host(*rig.rt, h.path(), {{"p", orig.size()}});
  CHECK(got[0] == orig);
}

TEST_CASE("cuda save: a state larger than the pool streams through it", "[actors][cuda]") {
  TempDir dir;
  GpuRig rig(dir.path(), {{"pool-bytes", "1MiB"}, {"chunk-bytes", "128KiB"}});
  const auto a = random_bytes(3 << 20, 3), b = random_bytes((2 << 20) + 12345, 4);
  ferry::StateDict sd;
  REQUIRE(sd.add("a", rig.upload(0, a)).ok());
  REQUIRE(sd.add("b", rig.upload(1, b)).ok());  // a second GPU
  auto h = rig.save(sd, 2);
  auto st = h.wait_committed();
  INFO(st.to_string());
  REQUIRE(st.ok());
  CHECK(h.bytes_persisted() == h.bytes_total());
  CHECK(rig.fake->copies_enqueued() >= (a.size() + b.size()) / (128 << 10));
  auto got = load_host(*rig.rt, h.path(), {{"a", a.size()}, {"b", b.size()}});
  CHECK(got[0] == a);
  CHECK(got[1] == b);
}

TEST_CASE("cuda save: host and device tensors in one save, loaded back into both",
          "[actors][cuda]") {
  TempDir dir;
  GpuRig rig(dir.path());
  auto host_bytes = random_bytes(100000, 5);
  const auto dev_bytes = random_bytes(200000, 6);
  // Small tensors pack into one block with the others.
  const auto tiny = random_bytes(10, 7);
  ferry::StateDict sd;
  REQUIRE(sd.add("h", TensorView(host_bytes.data(), DType::u8, {100000})).ok());
  REQUIRE(sd.add("d", rig.upload(0, dev_bytes)).ok());
  REQUIRE(sd.add("tiny", rig.upload(0, tiny)).ok());
  auto h = rig.save(sd, 3);
  REQUIRE(h.wait_committed().ok());

  std::vector<uint8_t> host_out(100000, 0);
  auto dev_out = rig.upload(0, std::vector<uint8_t>(200000, 0));
  auto tiny_out = rig.upload(1, std::vector<uint8_t>(10, 0));
  ferry::StateDict out;
  REQUIRE(out.add("h", TensorView(host_out.data(), DType::u8, {100000})).ok());
  REQUIRE(out.add("d", dev_out).ok());
  REQUIRE(out.add("tiny", tiny_out).ok());
  REQUIRE(rig.rt->load(out, h.path()).ok());
  CHECK(host_out == host_bytes);
  CHECK(bytes_of(dev_out) == dev_bytes);
  CHECK(bytes_of(tiny_out) == tiny);
}

TEST_CASE("cuda save: an error reported at a later query ends the save, the last checkpoint stays",
          "[actors][cuda]") {
  TempDir dir;
  GpuRig rig(dir.path(), {{"chunk-bytes", "64KiB"}, {"pool-bytes", "1MiB"}});
  const auto first = random_bytes(500000, 8);
  auto t = rig.upload(0, first);
  ferry::StateDict sd;
  REQUIRE(sd.add("w", t).ok());
  auto h1 = rig.save(sd, 1);
  REQUIRE(h1.wait_committed().ok());
  const std::string good = rig.rt->latest();
  REQUIRE(good == h1.path());

  std::memset(t.data, 0x11, t.nbytes());
  rig.fake->fail_async_copy(ferry::cuda::kErrorIllegalAddress, 3);
  auto h2 = rig.save(sd, 2);
  auto st = h2.wait_committed();
  REQUIRE_FALSE(st.ok());
  CHECK_THAT(st.message(), Catch::Contains("tensor 'w'") && Catch::Contains("cuda:0") &&
                               Catch::Contains("cudaErrorIllegalAddress") &&
                               Catch::Contains("an illegal memory access was encountered"));
  CHECK(rig.rt->latest() == good);
  CHECK(load_host(*rig.rt, rig.rt->latest(), {{"w", first.size()}})[0] == first);

  // The device is healthy again: the next save works.
  auto h3 = rig.save(sd, 3);
  auto st3 = h3.wait_committed();
  INFO(st3.to_string());
  REQUIRE(st3.ok());
  CHECK(rig.rt->latest() == h3.path());
  CHECK(load_host(*rig.rt, h3.path(), {{"w", first.size()}})[0] ==
        std::vector<uint8_t>(first.size(), 0x11));
}

TEST_CASE("cuda save: a checkpoint_fn gets device tensors as host copies", "[actors][cuda]") {
  TempDir dir;
  GpuRig rig(dir.path());
  const auto dev_bytes = random_bytes(200000, 11);
  auto host_bytes = random_bytes(5000, 12);
  ferry::StateDict sd;
  REQUIRE(sd.add("d", rig.upload(0, dev_bytes)).ok());
  REQUIRE(sd.add("h", TensorView(host_bytes.data(), DType::u8, {5000})).ok());
  std::map<std::string, std::vector<uint8_t>> got;
  ferry::SavePlannerOptions o;
  o.save.stream = rig.stream;
  o.save.stream_device = Device::cuda(0);
  o.checkpoint_fn = [&](const ferry::StateDict& planned, const std::string& filename) {
    for (const auto& e : planned.entries()) {
      if (!e.view.device.is_host()) return ferry::Status::internal("a device view: " + e.key);
      got[e.key.substr(0, e.key.find('@'))] = bytes_of(e.view);
    }
    return ferry::testing::write_safetensors(planned, filename);
  };
  ferry::SavePlanner p(*rig.rt, sd, "", o);
  auto global = p.create_global_plan();
  REQUIRE(global.ok());
  auto wrote = p.save_on_this_process((*global)[0]).wait();
  INFO(wrote.to_string());
  REQUIRE(wrote.ok());
  CHECK(got["d"] == dev_bytes);
  CHECK(got["h"] == host_bytes);
  auto path = p.barrier();
  REQUIRE(path.ok());
  auto back = load_host(*rig.rt, *path, {{"d", dev_bytes.size()}, {"h", host_bytes.size()}});
  CHECK(back[0] == dev_bytes);
  CHECK(back[1] == host_bytes);
}

TEST_CASE("cuda load: device tensors get the checkpoint's bytes, after the caller's stream",
          "[actors][cuda]") {
  TempDir dir;
  GpuRig rig(dir.path());
  const auto a = random_bytes(777777, 9);
  const std::string path = rig.save_host_a(a, 4);

  auto target = rig.upload(1, std::vector<uint8_t>(a.size(), 0));
  ferry::StateDict out;
  REQUIRE(out.add("a", target).ok());
  REQUIRE(rig.rt->load(out, path).ok());
  CHECK(bytes_of(target) == a);
  // The load's last copy is ordered before the caller's stream continues.
  REQUIRE(rig.dev->order_stream_after(Device::cuda(1), nullptr).ok());
}

TEST_CASE("cuda save: wait_snapshot(stream) makes the training stream wait, not the host",
          "[actors][cuda]") {
  TempDir dir;
  GpuRig rig(dir.path(), {{"pool-bytes", "8MiB"}});
  const auto orig = random_bytes(1 << 20, 10);
  auto t = rig.upload(0, orig);
  ferry::StateDict sd;
  REQUIRE(sd.add("p", t).ok());
  rig.fake->pause();  // the GPU copies nothing until resume()
  auto h = rig.save(sd, 6);
  // On another thread, so a host that blocked would fail the test instead of
  // hanging it.
  auto waited = std::async(std::launch::async, [&] {
    rig.fake->set_device(0);
    return h.wait_snapshot(rig.stream, Device::cuda(0));
  });
  REQUIRE(waited.wait_for(std::chrono::seconds(20)) == std::future_status::ready);
  REQUIRE(waited.get().ok());
  // The host went on while no copy has run on the GPU.
  CHECK_FALSE(h.snapshot_done());
  CHECK(rig.fake->copies_enqueued() >= (1u << 20) / (256u << 10));
  // The optimizer step, queued on the training stream after the wait: it
  // must run only once the copies have read the tensor.
  std::atomic<bool> step_ran{false};
  rig.fake->launch(rig.stream, [&] {
    step_ran = true;
    std::memset(t.data, 0, t.nbytes());
  });
  rig.fake->resume();
  auto st = h.wait_committed();
  INFO(st.to_string());
  REQUIRE(st.ok());
  REQUIRE(rig.fake->drain());
  CHECK(step_ran);
  CHECK(bytes_of(t) == std::vector<uint8_t>(orig.size(), 0));
  CHECK(load_host(*rig.rt, h.path(), {{"p", orig.size()}})[0] == orig);
}

TEST_CASE("cuda save: wait_snapshot(stream) with a host tensor in the save waits on the host",
          "[actors][cuda]") {
  TempDir dir;
  GpuRig rig(dir.path());
  auto host_bytes = random_bytes(100000, 11);
  ferry::StateDict sd;
  REQUIRE(sd.add("h", TensorView(host_bytes.data(), DType::u8, {100000})).ok());
  REQUIRE(sd.add("d", rig.upload(0, random_bytes(200000, 12))).ok());
  auto h = rig.save(sd, 7);
  REQUIRE(h.wait_snapshot(rig.stream).ok());
  // The host tensor may be mutated now: its copy is done.
  CHECK(h.snapshot_done());
  const auto saved = host_bytes;
  std::memset(host_bytes.data(), 0, host_bytes.size());
  REQUIRE(h.wait_committed().ok());
  CHECK(load_host(*rig.rt, h.path(), {{"h", saved.size()}})[0] == saved);
}

TEST_CASE("cuda load: an asynchronous copy error names the tensor, the next load works",
          "[actors][cuda]") {
  TempDir dir;
  GpuRig rig(dir.path());
  const auto a = random_bytes(300000, 13);
  const std::string path = rig.save_host_a(a, 8);

  auto target = rig.upload(1, std::vector<uint8_t>(a.size(), 0));
  ferry::StateDict out;
  REQUIRE(out.add("a", target).ok());
  rig.fake->fail_async_copy(ferry::cuda::kErrorIllegalAddress, 0);
  auto st = rig.rt->load(out, path);
  REQUIRE_FALSE(st.ok());
  CHECK_THAT(st.message(), Catch::Contains("tensor 'a'") && Catch::Contains("cuda:1") &&
                               Catch::Contains("cudaErrorIllegalAddress") &&
                               Catch::Contains("an illegal memory access was encountered"));
  // The device is healthy again.
  auto st2 = rig.rt->load(out, path);
  INFO(st2.to_string());
  REQUIRE(st2.ok());
  CHECK(bytes_of(target) == a);
}

TEST_CASE("cuda save: cuda:0, cuda:1 and host tensors in one save copy on both GPUs at once",
          "[actors][cuda]") {
  TempDir dir;
  GpuRig rig(dir.path(), {{"pool-bytes", "8MiB"}});
  // Interleaved, with tiny ones, so blocks hold bytes of several devices.
  std::vector<std::pair<std::string, std::vector<uint8_t>>> want;
  std::vector<std::vector<uint8_t>> host_store;
  ferry::StateDict sd;
  for (int i = 0; i < 12; ++i) {
    const int where = i % 3;  // cuda:0, cuda:1, host
    const size_t n = i % 4 == 3 ? 10 : 100000 + 37777 * static_cast<size_t>(i);
    const std::string key = "t" + std::to_string(i) + (where == 2 ? "@host" : "@cuda");
    want.emplace_back(key, random_bytes(n, 100 + static_cast<uint64_t>(i)));
    if (where == 2) {
      host_store.push_back(want.back().second);
      REQUIRE(
          sd.add(key, TensorView(host_store.back().data(), DType::u8, {static_cast<int64_t>(n)}))
              .ok());
    } else {
      REQUIRE(sd.add(key, rig.upload(where, want.back().second)).ok());
    }
  }
  rig.fake->pause();  // no copy completes: what is enqueued stays in flight
  auto h = rig.save(sd, 4);
  CHECK(eventually([&] { return rig.fake->max_devices_copying() >= 2; }));
  CHECK_FALSE(h.snapshot_done());
  rig.fake->resume();
  auto st = h.wait_committed();
  INFO(st.to_string());
  REQUIRE(st.ok());
  std::vector<std::pair<std::string, size_t>> keys;
  for (auto& [k, v] : want) keys.emplace_back(k, v.size());
  auto got = load_host(*rig.rt, h.path(), keys);
  for (size_t i = 0; i < want.size(); ++i) {
    INFO(want[i].first);
    CHECK(got[i] == want[i].second);
  }
}

TEST_CASE("cuda save: an error on cuda:1 ends a mixed save naming the tensor and the device",
          "[actors][cuda]") {
  TempDir dir;
  GpuRig rig(dir.path(), {{"chunk-bytes", "64KiB"}, {"pool-bytes", "1MiB"}});
  const auto a = random_bytes(400000, 20), b = random_bytes(300000, 21);
  auto c = random_bytes(200000, 22);
  ferry::StateDict sd;
  REQUIRE(sd.add("on0", rig.upload(0, a)).ok());
  REQUIRE(sd.add("on1", rig.upload(1, b)).ok());
  REQUIRE(sd.add("host", TensorView(c.data(), DType::u8, {200000})).ok());
  auto h1 = rig.save(sd, 1);
  REQUIRE(h1.wait_committed().ok());
  const std::string good = rig.rt->latest();

  rig.fake->fail_async_copy(ferry::cuda::kErrorIllegalAddress, 1, /*device=*/1);
  auto h2 = rig.save(sd, 2);
  auto st = h2.wait_committed();
  REQUIRE_FALSE(st.ok());
  CHECK_THAT(st.message(), Catch::Contains("tensor 'on1'") && Catch::Contains("cuda:1") &&
                               Catch::Contains("cudaErrorIllegalAddress"));
  CHECK(rig.rt->latest() == good);

  auto h3 = rig.save(sd, 3);
  auto st3 = h3.wait_committed();
  INFO(st3.to_string());
  REQUIRE(st3.ok());
  auto got =
      load_host(*rig.rt, h3.path(), {{"on0", a.size()}, {"on1", b.size()}, {"host", c.size()}});
  CHECK(got[0] == a);
  CHECK(got[1] == b);
  CHECK(got[2] == c);
}

// The C ABI carries the stream (the Python package passes torch's current
// stream): the same ordering as SaveOptions::stream and wait_snapshot(stream).
namespace {

// The rig's runtime as a C handle, destroyed before the rig.
struct CRuntime {
  ferry_runtime* rt;
  explicit CRuntime(GpuRig& rig) : rt(ferry::detail::adopt_c_runtime(std::move(rig.rt))) {}
  ~CRuntime() { ferry_runtime_destroy(rt); }
};

ferry_save* c_save(ferry_runtime* rt, void* data, int64_t n, uint64_t step, void* stream) {
  ferry_tensor t{};
  t.key = "w";
  t.data = data;
  t.dtype = FERRY_DTYPE_U8;
  t.ndim = 1;
  t.shape = &n;
  t.device_type = FERRY_DEVICE_CUDA;
  t.device_index = 0;
  ferry_save_request req{};
  req.size = sizeof req;
  req.tensors = &t;
  req.num_tensors = 1;
  req.step = step;
  req.stream = stream;
  req.stream_device = 0;
  ferry_save* s = nullptr;
  INFO(ferry_last_error());
  REQUIRE(ferry_save_start(rt, &req, &s) == FERRY_OK);
  return s;
}

}  // namespace

TEST_CASE("cuda save through the C ABI: the copies wait for the caller's stream",
          "[actors][cuda]") {
  TempDir dir;
  GpuRig rig(dir.path());
  auto t = rig.upload(0, std::vector<uint8_t>(300000, 0));
  const auto written = random_bytes(300000, 21);
  rig.fake->hold(rig.stream);  // the training step is still running
  rig.fake->write_on_stream(rig.stream, t.data, written);
  CRuntime c(rig);
  ferry_save* s = c_save(c.rt, t.data, 300000, 1, rig.stream);
  REQUIRE(eventually([&] { return rig.fake->copies_enqueued() >= 1; }));
  rig.fake->drain();
  CHECK_FALSE(ferry_save_snapshot_done(s));  // the copies wait for the training step
  rig.fake->release(rig.stream);
  REQUIRE(ferry_save_wait(s) == FERRY_OK);
  CHECK(load_host(*c.rt->rt, ferry_save_path(s), {{"w", written.size()}})[0] == written);
  ferry_save_release(s);
}

TEST_CASE("cuda save through the C ABI: ferry_save_wait_snapshot_stream makes the stream wait",
          "[actors][cuda]") {
  TempDir dir;
  GpuRig rig(dir.path(), {{"pool-bytes", "8MiB"}});
  const auto orig = random_bytes(1 << 20, 22);
  auto t = rig.upload(0, orig);
  CRuntime c(rig);
  rig.fake->pause();  // the GPU copies nothing until resume()
  ferry_save* s = c_save(c.rt, t.data, 1 << 20, 2, rig.stream);
  auto waited = std::async(std::launch::async, [&] {
    rig.fake->set_device(0);
    return ferry_save_wait_snapshot_stream(s, rig.stream, 0);
  });
  REQUIRE(waited.wait_for(std::chrono::seconds(20)) == std::future_status::ready);
  REQUIRE(waited.get() == FERRY_OK);
  CHECK_FALSE(ferry_save_snapshot_done(s));  // the host went on; no copy ran yet
  std::atomic<bool> step_ran{false};
  rig.fake->launch(rig.stream, [&] {
    step_ran = true;
    std::memset(t.data, 0, t.nbytes());
  });
  rig.fake->resume();
  REQUIRE(ferry_save_wait(s) == FERRY_OK);
  REQUIRE(rig.fake->drain());
  CHECK(step_ran);
  CHECK(load_host(*c.rt->rt, ferry_save_path(s), {{"w", orig.size()}})[0] == orig);
  CHECK(ferry_save_wait_snapshot_stream(s, rig.stream, -1) == FERRY_INVALID_ARGUMENT);
  ferry_save_release(s);
}
