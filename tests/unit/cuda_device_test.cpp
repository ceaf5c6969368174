// The CUDA device backend through the fake CUDA runtime: ordering against the
// caller's stream, completion by polling, bounds, errors, strided views, load
// copies and pool registration, with no GPU.

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <thread>

#include "cuda/device_cuda.hpp"
#include "fake_cuda.hpp"
#include "pool.hpp"
#include "test_util.hpp"

using ferry::CudaDevice;
using ferry::Device;
using ferry::DType;
using ferry::Status;
using ferry::TensorView;
using ferry::testing::eventually;
using ferry::testing::FakeCuda;

namespace {

// A copy's outcome, observable without blocking.
struct Outcome {
  std::promise<Status> p;
  std::shared_future<Status> f{p.get_future().share()};
  ferry::DeviceBackend::Done cb() {
    return [this](Status s) { p.set_value(std::move(s)); };
  }
  bool ready() const { return f.wait_for(std::chrono::seconds(0)) == std::future_status::ready; }
  Status get() const {
    if (f.wait_for(std::chrono::seconds(10)) != std::future_status::ready)
      return Status::timeout("copy never completed");
    return f.get();
  }
};

std::vector<uint8_t> pattern(size_t n, uint8_t seed) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(seed + i * 7);
  return v;
}

struct Rig {
  std::shared_ptr<FakeCuda> fake;
  std::shared_ptr<CudaDevice> dev;
  explicit Rig(int devices = 1, ferry::CudaDeviceOptions o = {})
      : fake(std::make_shared<FakeCuda>(devices)) {
    auto d = CudaDevice::create(fake, o);
    REQUIRE(d.ok());
    dev = std::move(d).value();
    fake->set_device(0);  // the test thread is a CUDA thread too
  }
  ~Rig() {
    dev.reset();
    // Every thread of the backend set its device before touching one.
    CHECK(fake->unset_device_calls() == 0);
  }
  void* upload(int device, const std::vector<uint8_t>& bytes) {
    void* p = fake->device_alloc(device, bytes.size());
    std::memcpy(p, bytes.data(), bytes.size());
    return p;
  }
};

}  // namespace

TEST_CASE("cuda device: a device-to-host copy completes later, when the device ran it", "[cuda]") {
  Rig rig;
  const auto bytes = pattern(1000, 3);
  TensorView v(rig.upload(0, bytes), DType::u8, {1000}, Device::cuda(0));
  std::vector<uint8_t> host(1000, 0);
  rig.fake->pause();
  Outcome out;
  rig.dev->copy_out(v, 0, 1000, host.data(), out.cb());
  REQUIRE(eventually([&] { return rig.fake->copies_enqueued() == 1; }));
  rig.fake->drain();
  CHECK_FALSE(out.ready());  // the GPU has not run it: no completion yet
  CHECK(host[5] == 0);
  rig.fake->resume();
  REQUIRE(out.get().ok());
  CHECK(host == bytes);
}

TEST_CASE("cuda device: copies start after the caller's work queued before the order point",
          "[cuda]") {
  Rig rig;
  auto* p = rig.fake->device_alloc(0, 4096);
  TensorView v(p, DType::u8, {4096}, Device::cuda(0));
  auto stream = rig.fake->user_stream(0);
  // The training stream is busy: its write has not run yet.
  rig.fake->hold(stream);
  const auto written = pattern(4096, 42);
  rig.fake->write_on_stream(stream, p, written);
  REQUIRE(rig.dev->order_copies_after(Device::cuda(0), stream).ok());

  std::vector<uint8_t> host(4096, 0);
  Outcome out;
  rig.dev->copy_out(v, 0, 4096, host.data(), out.cb());
  REQUIRE(eventually([&] { return rig.fake->copies_enqueued() == 1; }));
  // Everything that can run has run: the copy must still wait for the write.
  rig.fake->drain();
  CHECK_FALSE(out.ready());
  rig.fake->release(stream);
  REQUIRE(out.get().ok());
  CHECK(host == written);
}

TEST_CASE("cuda device: without an order point, copies follow the legacy default stream",
          "[cuda]") {
  Rig rig;
  auto* p = rig.fake->device_alloc(0, 256);
  TensorView v(p, DType::u8, {256}, Device::cuda(0));
  rig.fake->hold(nullptr);
  const auto written = pattern(256, 9);
  rig.fake->write_on_stream(nullptr, p, written);
  std::vector<uint8_t> host(256, 0);
  Outcome out;
  rig.dev->copy_out(v, 0, 256, host.data(), out.cb());
  REQUIRE(eventually([&] { return rig.fake->copies_enqueued() == 1; }));
  rig.fake->drain();
  CHECK_FALSE(out.ready());
  rig.fake->release(nullptr);
  REQUIRE(out.get().ok());
  CHECK(host == written);
}

TEST_CASE("cuda device: order_stream_after makes the stream wait for the copies, not the host",
          "[cuda]") {
  Rig rig;
  const auto before = pattern(8192, 1);
  auto* p = rig.upload(0, before);
  TensorView v(p, DType::u8, {8192}, Device::cuda(0));
  auto stream = rig.fake->user_stream(0);
  REQUIRE(rig.dev->order_copies_after(Device::cuda(0), stream).ok());
  rig.fake->pause();  // the copies cannot finish while the host asks
  std::vector<uint8_t> host(8192, 0);
  Outcome a, b;
  rig.dev->copy_out(v, 0, 4096, host.data(), a.cb());
  rig.dev->copy_out(v, 4096, 4096, host.data() + 4096, b.cb());
  REQUIRE(eventually([&] { return rig.fake->copies_enqueued() == 2; }));

  auto ordered = std::async(std::launch::async, [&] {
    rig.fake->set_device(0);
    return rig.dev->order_stream_after(Device::cuda(0), stream);
  });
  // Returns although nothing has been copied yet: the host did not wait.
  REQUIRE(ordered.wait_for(std::chrono::seconds(10)) == std::future_status::ready);
  REQUIRE(ordered.get().ok());
  CHECK_FALSE(a.ready());

  // The optimizer step, queued right after: it must see the copies done.
  std::atomic<bool> saw_copies{false};
  rig.fake->launch(stream, [&] {
    saw_copies = std::memcmp(host.data(), before.data(), before.size()) == 0;
    std::memset(p, 0xff, 8192);
  });
  rig.fake->resume();
  REQUIRE(a.get().ok());
  REQUIRE(b.get().ok());
  REQUIRE(rig.fake->drain());
  CHECK(saw_copies);
  CHECK(host == before);
  CHECK(static_cast<uint8_t*>(p)[0] == 0xff);
}

TEST_CASE("cuda device: at most max_inflight requests per device are on the GPU", "[cuda]") {
  ferry::CudaDeviceOptions o;
  o.max_inflight = 2;
  Rig rig(1, o);
  const auto bytes = pattern(5 * 512, 5);
  TensorView v(rig.upload(0, bytes), DType::u8, {5 * 512}, Device::cuda(0));
  std::vector<uint8_t> host(bytes.size(), 0);
  rig.fake->pause();
  std::vector<Outcome> outs(5);
  for (int i = 0; i < 5; ++i)
    rig.dev->copy_out(v, i * 512, 512, host.data() + i * 512, outs[i].cb());
  REQUIRE(eventually([&] { return rig.fake->copies_enqueued() == 2; }));
  std::this_thread::yield();
  CHECK(rig.fake->copies_enqueued() == 2);
  rig.fake->resume();
  for (auto& o2 : outs) REQUIRE(o2.get().ok());
  CHECK(rig.fake->copies_enqueued() == 5);
  CHECK(host == bytes);
}

TEST_CASE("cuda device: an error at the call ends the copy naming device and CUDA error",
          "[cuda]") {
  Rig rig;
  const auto bytes = pattern(64, 8);
  TensorView v(rig.upload(0, bytes), DType::u8, {64}, Device::cuda(0));
  std::vector<uint8_t> host(64, 0);
  rig.fake->fail_next_call("cudaMemcpyAsync", 2);
  Outcome bad;
  rig.dev->copy_out(v, 0, 64, host.data(), bad.cb());
  Status s = bad.get();
  REQUIRE_FALSE(s.ok());
  CHECK_THAT(s.message(), Catch::Contains("cuda:0") && Catch::Contains("cudaMemcpyAsync") &&
                              Catch::Contains("cudaErrorMemoryAllocation") &&
                              Catch::Contains("out of memory"));
  Outcome good;  // the device is healthy again
  rig.dev->copy_out(v, 0, 64, host.data(), good.cb());
  REQUIRE(good.get().ok());
  CHECK(host == bytes);
}

TEST_CASE("cuda device: an asynchronous error reported at a later query ends the copy", "[cuda]") {
  Rig rig;
  const auto bytes = pattern(64, 8);
  TensorView v(rig.upload(0, bytes), DType::u8, {64}, Device::cuda(0));
  std::vector<uint8_t> host(64, 0);
  rig.fake->fail_async_copy(ferry::cuda::kErrorIllegalAddress);
  Outcome bad;
  rig.dev->copy_out(v, 0, 64, host.data(), bad.cb());
  Status s = bad.get();
  REQUIRE_FALSE(s.ok());
  CHECK_THAT(s.message(), Catch::Contains("cuda:0") && Catch::Contains("cudaEventQuery") &&
                              Catch::Contains("cudaErrorIllegalAddress") &&
                              Catch::Contains("an illegal memory access was encountered"));
  Outcome good;
  rig.dev->copy_out(v, 0, 64, host.data(), good.cb());
  REQUIRE(good.get().ok());
  CHECK(host == bytes);
}

TEST_CASE("cuda device: rows with a pitch go through cudaMemcpy2DAsync, other strides refuse",
          "[cuda]") {
  Rig rig;
  // A 5 x 6 f32 slice of a 5 x 8 buffer (padded rows).
  const auto full = pattern(5 * 8 * 4, 11);
  void* p = rig.upload(0, full);
  std::vector<uint8_t> shadow = full;  // the same view on the host, as reference
  TensorView dv(p, DType::f32, {5, 6}, Device::cuda(0), {8, 1});
  TensorView hv(shadow.data(), DType::f32, {5, 6}, Device::host(), {8, 1});
  for (auto [off, len] : std::vector<std::pair<uint64_t, uint64_t>>{
           {0, 120}, {10, 50}, {24, 48}, {30, 3}, {0, 24}, {7, 100}}) {
    INFO("offset " << off << " len " << len);
    std::vector<uint8_t> got(len, 0), want(len, 0);
    ferry::strided_copy_out(hv, off, len, want.data());
    Outcome out;
    rig.dev->copy_out(dv, off, len, got.data(), out.cb());
    REQUIRE(out.get().ok());
    CHECK(got == want);
  }
  // copy_in scatters into the rows and leaves the padding alone.
  const auto in = pattern(120, 77);
  Outcome o;
  rig.dev->copy_in(in.data(), dv, 0, 120, o.cb());
  REQUIRE(o.get().ok());
  ferry::strided_copy_in(in.data(), hv, 0, 120);
  CHECK(std::memcmp(p, shadow.data(), shadow.size()) == 0);

  TensorView transposed(p, DType::f32, {4, 5}, Device::cuda(0), {1, 8});
  std::vector<uint8_t> host(80);
  Outcome refused;
  rig.dev->copy_out(transposed, 0, 80, host.data(), refused.cb());
  Status s = refused.get();
  CHECK(s.code() == ferry::StatusCode::unsupported);
  CHECK_THAT(s.message(), Catch::Contains("cuda:0") && Catch::Contains("contiguous"));
}

TEST_CASE("cuda device: copy_in lands in device memory after the caller's work", "[cuda]") {
  Rig rig;
  auto* p = rig.fake->device_alloc(0, 3000);
  TensorView v(p, DType::u8, {3000}, Device::cuda(0));
  auto stream = rig.fake->user_stream(0);
  rig.fake->hold(stream);
  rig.fake->write_on_stream(stream, p, std::vector<uint8_t>(3000, 0xee));
  REQUIRE(rig.dev->order_copies_after(Device::cuda(0), stream).ok());
  const auto bytes = pattern(3000, 4);
  Outcome out;
  rig.dev->copy_in(bytes.data(), v, 0, 3000, out.cb());
  REQUIRE(eventually([&] { return rig.fake->copies_enqueued() == 1; }));
  rig.fake->drain();
  CHECK_FALSE(out.ready());
  rig.fake->release(stream);
  REQUIRE(out.get().ok());
  // The load came after the caller's old write, so its bytes are what stays.
  CHECK(std::memcmp(p, bytes.data(), 3000) == 0);
}

TEST_CASE("cuda device: host tensors take the host path, several devices each get a stream",
          "[cuda]") {
  Rig rig(2);
  std::vector<uint8_t> src = pattern(100, 1), host(100, 0);
  Outcome h;
  rig.dev->copy_out(TensorView(src.data(), DType::u8, {100}), 0, 100, host.data(), h.cb());
  REQUIRE(h.get().ok());
  CHECK(host == src);
  CHECK(rig.fake->copies_enqueued() == 0);

  const auto b0 = pattern(100, 20), b1 = pattern(100, 30);
  TensorView v0(rig.upload(0, b0), DType::u8, {100}, Device::cuda(0));
  TensorView v1(rig.upload(1, b1), DType::u8, {100}, Device::cuda(1));
  std::vector<uint8_t> h0(100), h1(100);
  Outcome o0, o1;
  rig.dev->copy_out(v0, 0, 100, h0.data(), o0.cb());
  rig.dev->copy_out(v1, 0, 100, h1.data(), o1.cb());
  REQUIRE(o0.get().ok());
  REQUIRE(o1.get().ok());
  CHECK(h0 == b0);
  CHECK(h1 == b1);
  CHECK(rig.dev->handles(Device::cuda(1)));
  CHECK_FALSE(rig.dev->handles(Device::cuda(2)));
  Outcome bad;
  rig.dev->copy_out(TensorView(h0.data(), DType::u8, {100}, Device::cuda(2)), 0, 100, h1.data(),
                    bad.cb());
  CHECK_THAT(bad.get().message(), Catch::Contains("cuda:2"));
}

TEST_CASE("cuda device: streams and events are released at destruction", "[cuda]") {
  auto fake = std::make_shared<FakeCuda>(1);
  {
    auto d = CudaDevice::create(fake);
    REQUIRE(d.ok());
    const auto bytes = pattern(64, 1);
    void* p = fake->device_alloc(0, 64);
    std::vector<uint8_t> host(64);
    Outcome o;
    (*d)->copy_out(TensorView(p, DType::u8, {64}, Device::cuda(0)), 0, 64, host.data(), o.cb());
    REQUIRE(o.get().ok());
    CHECK(fake->streams_alive() == 1);
    CHECK(fake->events_alive() >= 1);
  }
  CHECK(fake->streams_alive() == 0);
  CHECK(fake->events_alive() == 0);
}

TEST_CASE("cuda device: create fails with CUDA's reason when there is no device", "[cuda]") {
  auto none = std::make_shared<FakeCuda>(0);
  auto d = CudaDevice::create(none);
  REQUIRE_FALSE(d.ok());
  CHECK_THAT(d.status().message(), Catch::Contains("no CUDA device"));

  // This build on this machine: the real runtime (or the stub) without a GPU
  // gives the host path and says why; with a GPU, the CUDA backend.
  Status note;
  auto dev = ferry::make_default_device(ferry::Options{}, &note);
  REQUIRE(dev != nullptr);
  CHECK(dev->handles(Device::host()));
  if (!note.ok()) {
    CHECK_FALSE(dev->handles(Device::cuda(0)));
    CHECK_THAT(note.message(), Catch::Contains("CUDA"));
  } else {
    CHECK(dev->handles(Device::cuda(0)));
  }
}

TEST_CASE(
    "cuda pool: StagingPool registers in segments, unregisters at the end, names its size on "
    "failure",
    "[cuda][pool]") {
  auto fake = std::make_shared<FakeCuda>(1);
  auto counted = [&fake](uint64_t seg) {
    ferry::HostRegistrar r;
    r.name = "fake";
    r.max_segment_bytes = seg;
    r.pin = [&fake](void* p, uint64_t n) {
      return fake->host_register(p, n) == 0 ? Status() : Status::io_error("pin refused");
    };
    r.unpin = [&fake](void* p) { fake->host_unregister(p); };
    return r;
  };
  {
    auto pool = ferry::StagingPool::create(10 * 4096, 4096);
    REQUIRE(pool.ok());
    // 3 blocks per segment: 3 + 3 + 3 + 1.
    REQUIRE((*pool)->register_memory(counted(3 * 4096 + 100)).ok());
    CHECK((*pool)->registered());
    auto regs = fake->registrations();
    REQUIRE(regs.size() == 4);
    uint64_t total = 0;
    for (auto& [p, n] : regs) {
      CHECK(n <= 3 * 4096);
      total += n;
    }
    CHECK(total == 10 * 4096);
    CHECK(regs.front().first == (*pool)->base());
    CHECK_FALSE((*pool)->register_memory(counted(0)).ok());  // only once
  }
  CHECK(fake->registrations().empty());

  auto pool = ferry::StagingPool::create(10 * 4096, 4096);
  REQUIRE(pool.ok());
  fake->fail_next_call("cudaHostRegister", 2);
  // The first segment is refused; the second call would succeed.
  Status s = (*pool)->register_memory(counted(5 * 4096));
  REQUIRE_FALSE(s.ok());
  CHECK_THAT(s.message(), Catch::Contains("40960 bytes") && Catch::Contains("pin refused"));
  CHECK(fake->registrations().empty());
  CHECK_FALSE((*pool)->registered());
}

TEST_CASE(
    "cuda pool: register_pool_for_device pins through CUDA unless ferry.cuda-register-pool is "
    "false",
    "[cuda][pool]") {
  Rig rig;
  ferry::Options opts;
  {
    auto pool = ferry::StagingPool::create(8 * 4096, 4096);
    REQUIRE(pool.ok());
    REQUIRE(ferry::register_pool_for_device(**pool, *rig.dev, opts).ok());
    CHECK(rig.fake->registrations().size() == 1);
    // Copies into the pinned pool are not pageable copies.
    const auto bytes = pattern(4096, 2);
    TensorView v(rig.upload(0, bytes), DType::u8, {4096}, Device::cuda(0));
    Outcome o;
    rig.dev->copy_out(v, 0, 4096, (*pool)->base(), o.cb());
    REQUIRE(o.get().ok());
    CHECK(rig.fake->pageable_copies() == 0);
  }
  CHECK(rig.fake->registrations().empty());

  auto pool = ferry::StagingPool::create(8 * 4096, 4096);
  REQUIRE(pool.ok());
  rig.fake->fail_next_call("cudaHostRegister", 2);
  Status s = ferry::register_pool_for_device(**pool, *rig.dev, opts);
  REQUIRE_FALSE(s.ok());
  CHECK_THAT(s.message(), Catch::Contains("32768 bytes") && Catch::Contains("cudaHostRegister") &&
                              Catch::Contains("cuda-register-pool"));
  opts.cuda_register_pool = false;
  rig.fake->fail_next_call("cudaHostRegister", 2);
  CHECK(ferry::register_pool_for_device(**pool, *rig.dev, opts).ok());
  CHECK_FALSE((*pool)->registered());
  // A host-only backend has nothing to pin.
  opts.cuda_register_pool = true;
  CHECK(ferry::register_pool_for_device(**pool, *ferry::host_device(), opts).ok());
}

TEST_CASE("cuda device: the state dict hooks order every CUDA device of the dict once", "[cuda]") {
  Rig rig(2);
  std::vector<uint8_t> h(16);
  ferry::StateDict sd;
  REQUIRE(sd.add("h", TensorView(h.data(), DType::u8, {16})).ok());
  REQUIRE(sd.add("a", TensorView(rig.fake->device_alloc(1, 16), DType::u8, {16}, Device::cuda(1)))
              .ok());
  REQUIRE(sd.add("b", TensorView(rig.fake->device_alloc(1, 16), DType::u8, {16}, Device::cuda(1)))
              .ok());
  auto stream = rig.fake->user_stream(1);
  REQUIRE(ferry::order_copies_after(*rig.dev, sd, Device::cuda(1), stream).ok());
  // cuda:1 is marked: its copies wait for that stream.
  rig.fake->hold(stream);
  rig.fake->write_on_stream(stream, sd.entries()[1].view.data, std::vector<uint8_t>(16, 9));
  REQUIRE(ferry::order_copies_after(*rig.dev, sd, Device::cuda(1), stream).ok());
  std::vector<uint8_t> out(16);
  Outcome o;
  rig.dev->copy_out(sd.entries()[1].view, 0, 16, out.data(), o.cb());
  REQUIRE(eventually([&] { return rig.fake->copies_enqueued() == 1; }));
  rig.fake->drain();
  CHECK_FALSE(o.ready());
  rig.fake->release(stream);
  REQUIRE(o.get().ok());
  CHECK(out == std::vector<uint8_t>(16, 9));
  const auto waits = rig.fake->stream_waits();
  REQUIRE(ferry::order_stream_after(*rig.dev, sd, Device::cuda(1), stream).ok());
  CHECK(rig.fake->stream_waits() == waits + 1);  // one device, one wait
  // Host-only backends and dicts: nothing to do.
  CHECK(ferry::order_copies_after(*ferry::host_device(), sd, Device::cuda(1), stream).ok());
  // A failing record names the tensor that brought the device in.
  rig.fake->fail_next_call("cudaEventRecord", 1);
  Status s = ferry::order_copies_after(*rig.dev, sd, Device::cuda(1), stream);
  CHECK_THAT(s.message(), Catch::Contains("tensor 'a'") && Catch::Contains("cuda:1"));
}
