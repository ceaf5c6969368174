// The CUDA backend against the real CUDA runtime: the cases the fake runs
// (tests/unit/cuda_device_test.cpp, tests/actors/cuda_save_test.cpp), on a
// GPU. Without a usable GPU the binary exits 77, which ctest reports as
// skipped, unless FERRY_REQUIRE_GPU=1: then it fails.
//
// "Work on the caller's stream" is a host-to-device copy there, queued behind
// a large one so it is still pending when the snapshot is asked for.

#define CATCH_CONFIG_RUNNER
#include <cuda_runtime_api.h>
#include <catch2/catch.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>

#include "cuda/device_cuda.hpp"
#include "ferry/runtime.hpp"
#include "pool.hpp"
#include "test_util.hpp"

using ferry::Device;
using ferry::DType;
using ferry::Status;
using ferry::TensorView;
using ferry::testing::random_bytes;
using ferry::testing::TempDir;

namespace {

constexpr int kSkip = 77;

// Device memory freed at scope end.
struct DevBuf {
  void* p = nullptr;
  size_t n = 0;
  explicit DevBuf(size_t bytes) : n(bytes) { REQUIRE(cudaMalloc(&p, bytes) == cudaSuccess); }
  ~DevBuf() { cudaFree(p); }
  TensorView view(int device = 0) const {
    return TensorView(p, DType::u8, {static_cast<int64_t>(n)}, Device::cuda(device));
  }
  void upload(const std::vector<uint8_t>& b) {
    REQUIRE(cudaMemcpy(p, b.data(), b.size(), cudaMemcpyHostToDevice) == cudaSuccess);
  }
  std::vector<uint8_t> download() const {
    std::vector<uint8_t> out(n);
    REQUIRE(cudaMemcpy(out.data(), p, n, cudaMemcpyDeviceToHost) == cudaSuccess);
    return out;
  }
};

// Pinned host memory, so copies on the caller's stream are asynchronous.
struct Pinned {
  void* p = nullptr;
  explicit Pinned(size_t n) { REQUIRE(cudaMallocHost(&p, n) == cudaSuccess); }
  ~Pinned() { cudaFreeHost(p); }
  uint8_t* data() const { return static_cast<uint8_t*>(p); }
};

Status copy_out_wait(ferry::DeviceBackend& dev, const TensorView& v, uint64_t off, uint64_t len,
                     void* dst) {
  std::promise<Status> p;
  auto f = p.get_future();
  dev.copy_out(v, off, len, dst, [&p](Status s) { p.set_value(std::move(s)); });
  if (f.wait_for(std::chrono::seconds(60)) != std::future_status::ready)
    return Status::timeout("copy never completed");
  return f.get();
}

std::shared_ptr<ferry::CudaDevice> make_device() {
  auto d = ferry::CudaDevice::create(ferry::cuda::real_cuda_api());
  REQUIRE(d.ok());
  return *d;
}

}  // namespace

TEST_CASE("gpu: D2H copies into the registered pool, bytes equal", "[gpu]") {
  auto dev = make_device();
  auto pool = ferry::StagingPool::create(64 << 20, 8 << 20);
  REQUIRE(pool.ok());
  REQUIRE(ferry::register_pool_for_device(**pool, *dev, ferry::Options{}).ok());
  REQUIRE((*pool)->registered());
  const auto bytes = random_bytes(64 << 20, 1);
  DevBuf t(bytes.size());
  t.upload(bytes);
  for (uint64_t off = 0; off < bytes.size(); off += 8 << 20)
    REQUIRE(copy_out_wait(*dev, t.view(), off, 8 << 20, (*pool)->base() + off).ok());
  CHECK(std::memcmp((*pool)->base(), bytes.data(), bytes.size()) == 0);
}

TEST_CASE("gpu: a write queued on the caller's stream before the order point is copied", "[gpu]") {
  auto dev = make_device();
  cudaStream_t s;
  REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
  const size_t big = 512 << 20, n = 16 << 20;
  DevBuf busy(big), t(n);
  Pinned busy_src(big), src(n);
  t.upload(std::vector<uint8_t>(n, 0));
  const auto written = random_bytes(n, 2);
  std::memcpy(src.data(), written.data(), n);
  REQUIRE(cudaMemcpyAsync(busy.p, busy_src.p, big, cudaMemcpyHostToDevice, s) == cudaSuccess);
  REQUIRE(cudaMemcpyAsync(t.p, src.p, n, cudaMemcpyHostToDevice, s) == cudaSuccess);
  REQUIRE(dev->order_copies_after(Device::cuda(0), s).ok());
  std::vector<uint8_t> host(n);
  REQUIRE(copy_out_wait(*dev, t.view(), 0, n, host.data()).ok());
  CHECK(host == written);
  cudaStreamSynchronize(s);
  cudaStreamDestroy(s);
}

TEST_CASE("gpu: order_stream_after orders the caller's stream after the copies", "[gpu]") {
  auto dev = make_device();
  cudaStream_t s;
  REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
  const size_t n = 256 << 20;
  const auto orig = random_bytes(n, 3);
  DevBuf t(n);
  t.upload(orig);
  Pinned host(n), zeros(n);
  std::memset(zeros.data(), 0, n);
  REQUIRE(dev->order_copies_after(Device::cuda(0), s).ok());
  std::promise<Status> done;
  dev->copy_out(t.view(), 0, n, host.data(), [&done](Status st) { done.set_value(st); });
  const auto t0 = std::chrono::steady_clock::now();
  REQUIRE(dev->order_stream_after(Device::cuda(0), s).ok());
  const double host_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  // The "optimizer step" overwrites the tensor, on the stream.
  REQUIRE(cudaMemcpyAsync(t.p, zeros.p, n, cudaMemcpyHostToDevice, s) == cudaSuccess);
  REQUIRE(done.get_future().get().ok());
  REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
  CHECK(std::memcmp(host.data(), orig.data(), n) == 0);
  CHECK(t.download()[12345] == 0);
  WARN("order_stream_after blocked the host " << host_ms << " ms");
  cudaStreamDestroy(s);
}

TEST_CASE("gpu: refused copies name the device, the device stays usable", "[gpu]") {
  auto dev = make_device();
  DevBuf t(4096);
  t.upload(random_bytes(4096, 4));
  std::vector<uint8_t> host(4096);
  // A transposed view is not rows with a pitch: refused before any CUDA call.
  TensorView transposed(t.p, DType::f32, {32, 32}, Device::cuda(0), {1, 32});
  Status s = copy_out_wait(*dev, transposed, 0, 4096, host.data());
  CHECK(s.code() == ferry::StatusCode::unsupported);
  CHECK_THAT(s.message(), Catch::Contains("cuda:0"));
  const int missing = dev->device_count();
  Status m = copy_out_wait(*dev, t.view(missing), 0, 4096, host.data());
  CHECK_THAT(m.message(), Catch::Contains("cuda:" + std::to_string(missing)));
  CHECK(copy_out_wait(*dev, t.view(), 0, 4096, host.data()).ok());
}

TEST_CASE("gpu: Runtime save larger than the pool, mixed host and device, loaded back", "[gpu]") {
  TempDir dir;
  auto dev = make_device();
  ferry::RuntimeArgs args;
  args.set("root", dir.path()).set("pool-bytes", "32MiB").set("chunk-bytes", "4MiB");
  args.device = dev;
  auto rt = ferry::Runtime::create(args);
  REQUIRE(rt.ok());
  const auto a = random_bytes(96 << 20, 5), b = random_bytes(3 << 20, 6);
  DevBuf da(a.size());
  da.upload(a);
  auto hb = b;
  ferry::StateDict sd;
  REQUIRE(sd.add("a", da.view()).ok());
  REQUIRE(sd.add("b", TensorView(hb.data(), DType::u8, {static_cast<int64_t>(hb.size())})).ok());
  REQUIRE(dev->order_copies_after(Device::cuda(0), nullptr).ok());
  auto h = (*rt)->save_async(sd, 1);
  auto st = h.wait_committed();
  INFO(st.to_string());
  REQUIRE(st.ok());

  DevBuf la(a.size());
  std::vector<uint8_t> lb(b.size(), 0);
  ferry::StateDict out;
  REQUIRE(out.add("a", la.view()).ok());
  REQUIRE(out.add("b", TensorView(lb.data(), DType::u8, {static_cast<int64_t>(lb.size())})).ok());
  REQUIRE((*rt)->load(out, h.path()).ok());
  REQUIRE(dev->order_stream_after(Device::cuda(0), nullptr).ok());
  CHECK(la.download() == a);
  CHECK(lb == b);
}

TEST_CASE("gpu: Runtime wait_snapshot(stream) lets the host go on, the stream waits", "[gpu]") {
  TempDir dir;
  auto dev = make_device();
  ferry::RuntimeArgs args;
  args.set("root", dir.path()).set("pool-bytes", "320MiB").set("chunk-bytes", "8MiB");
  args.device = dev;
  auto rt = ferry::Runtime::create(args);
  REQUIRE(rt.ok());
  cudaStream_t s;
  REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
  const size_t n = 256 << 20;
  const auto orig = random_bytes(n, 7);
  DevBuf t(n);
  t.upload(orig);
  Pinned zeros(n);
  std::memset(zeros.data(), 0, n);
  ferry::StateDict sd;
  REQUIRE(sd.add("t", t.view()).ok());
  ferry::SaveOptions so;
  so.stream = s;
  so.stream_device = Device::cuda(0);
  const auto t0 = std::chrono::steady_clock::now();
  auto h = (*rt)->save_async(sd, 1, so);
  REQUIRE(h.wait_snapshot(s, Device::cuda(0)).ok());
  const double host_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  // The optimizer step, on the stream: after the copies, whatever the host did.
  REQUIRE(cudaMemcpyAsync(t.p, zeros.p, n, cudaMemcpyHostToDevice, s) == cudaSuccess);
  auto st = h.wait_committed();
  INFO(st.to_string());
  REQUIRE(st.ok());
  REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
  CHECK(t.download()[4321] == 0);
  DevBuf back(n);
  ferry::StateDict out;
  REQUIRE(out.add("t", back.view()).ok());
  REQUIRE((*rt)->load(out, h.path()).ok());
  CHECK(back.download() == orig);
  WARN("save_async + wait_snapshot(stream) blocked the host " << host_ms << " ms");
  cudaStreamDestroy(s);
}

int main(int argc, char** argv) {
  const char* req = std::getenv("FERRY_REQUIRE_GPU");
  const bool required = req && std::string(req) == "1";
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    std::printf(
        "%s: no usable CUDA device (%s: %s)%s\n", required ? "FAIL" : "SKIP", cudaGetErrorName(err),
        cudaGetErrorString(err),
        required ? " but FERRY_REQUIRE_GPU=1" : "; set FERRY_REQUIRE_GPU=1 to fail instead");
    return required ? 1 : kSkip;
  }
  return Catch::Session().run(argc, argv);
}
