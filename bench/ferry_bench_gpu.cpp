// ferry_bench_gpu: what a GPU training job gets from Ferry's CUDA path,
// measured against the machine's own limits in the same run.
//   1. D2H snapshot throughput: Ferry's CUDA backend copying the state block
//      by block into the registered staging pool, and the Runtime's
//      snapshot, vs raw cudaMemcpyAsync of the same bytes into the same
//      registered memory (target >= 0.9x).
//   2. Host blocking: save_async, and order_stream_after (the basis of
//      wait_snapshot(stream)), while a long kernel runs on the training
//      stream, for a small and the full state (target < 1 ms, flat in bytes).
//   3. Training-step slowdown: a kernel loop timed alone and with a save
//      persisting (needs the nvcc-built kernel).
//   4. End-to-end save to local disk vs a raw O_DIRECT writer (both fsync).
// Ends with one JSON line. Without a usable GPU it says so and exits 77.
// Environment: FERRY_BENCH_GPU_BYTES (default 4GiB), FERRY_BENCH_DIR
// (default /tmp/ferry-bench-gpu), FERRY_BENCH_CHUNK (default: Ferry's
// chunk-bytes); sizes as the settings write them (512MiB, 4GiB, 4096).

#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>

#include "cuda/device_cuda.hpp"
#include "ferry/runtime.hpp"
#include "pool.hpp"
#include "tools/flags.hpp"

#ifdef FERRY_BENCH_HAVE_KERNEL
extern "C" int ferry_bench_step(void* stream, float* x, size_t n, int passes);
#endif

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}
double gbps(uint64_t bytes, double ms) {
  return ms > 0 ? bytes / ms / 1e6 : 0;
}

#define CK(x)                                                                               \
  do {                                                                                      \
    cudaError_t e_ = (x);                                                                   \
    if (e_ != cudaSuccess) {                                                                \
      std::fprintf(stderr, "ferry_bench_gpu: %s failed: %s\n", #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                         \
    }                                                                                       \
  } while (0)

void die(const std::string& what, const ferry::Status& s) {
  std::fprintf(stderr, "ferry_bench_gpu: %s: %s\n", what.c_str(), s.to_string().c_str());
  std::exit(1);
}

// Copies [0, bytes) of `v` into `dst` block by block through the backend, as
// the snapshot actor does; returns once the last block is on the host.
void backend_copy(ferry::CudaDevice& dev, const ferry::TensorView& v, uint64_t bytes,
                  uint64_t chunk, uint8_t* dst, double* issue_ms = nullptr,
                  std::atomic<bool>* issued = nullptr) {
  std::atomic<uint64_t> done{0};
  std::atomic<bool> failed{false};
  const uint64_t blocks = (bytes + chunk - 1) / chunk;
  auto t0 = Clock::now();
  for (uint64_t i = 0; i < blocks; ++i) {
    const uint64_t off = i * chunk, len = std::min(chunk, bytes - off);
    dev.copy_out(v, off, len, dst + off, [&done, &failed](ferry::Status s) {
      if (!s.ok()) {
        std::fprintf(stderr, "ferry_bench_gpu: copy failed: %s\n", s.to_string().c_str());
        failed = true;
      }
      ++done;
    });
  }
  if (issue_ms) *issue_ms = ms_since(t0);
  if (issued) *issued = true;
  while (done.load() < blocks) std::this_thread::yield();
  if (failed) std::exit(1);
}

double raw_d2h_ms(const void* src, uint64_t bytes, uint64_t chunk, uint8_t* dst, cudaStream_t s) {
  auto t0 = Clock::now();
  for (uint64_t off = 0; off < bytes; off += chunk)
    CK(cudaMemcpyAsync(dst + off, static_cast<const uint8_t*>(src) + off,
                       std::min(chunk, bytes - off), cudaMemcpyDeviceToHost, s));
  CK(cudaStreamSynchronize(s));
  return ms_since(t0);
}

double raw_odirect_ms(const std::string& path, const uint8_t* src, uint64_t bytes, uint64_t chunk) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_DIRECT, 0644);
  if (fd < 0) fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);  // tmpfs
  if (fd < 0) {
    std::perror("ferry_bench_gpu: open raw file");
    std::exit(1);
  }
  auto t0 = Clock::now();
  for (uint64_t off = 0; off < bytes; off += chunk) {
    const uint64_t n = std::min(chunk, bytes - off);
    if (::pwrite(fd, src + off, n, static_cast<off_t>(off)) != static_cast<ssize_t>(n)) {
      std::perror("ferry_bench_gpu: pwrite");
      std::exit(1);
    }
  }
  ::fsync(fd);
  const double ms = ms_since(t0);
  ::close(fd);
  ::unlink(path.c_str());
  return ms;
}

}  // namespace

int main() {
  // Sizes in the settings' syntax ("512MiB", "4GiB"); a bad one is a usage
  // error naming the variable, with or without a GPU.
  const uint64_t chunk = ferry::cli::env_size_or_exit("ferry_bench_gpu", "FERRY_BENCH_CHUNK",
                                                      ferry::Options{}.chunk_bytes);
  uint64_t bytes =
      ferry::cli::env_size_or_exit("ferry_bench_gpu", "FERRY_BENCH_GPU_BYTES", 4ull << 30);
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    std::printf("ferry_bench_gpu: no usable CUDA device (%s: %s); nothing to measure\n",
                cudaGetErrorName(err), cudaGetErrorString(err));
    std::printf("{\"bench\":\"ferry_bench_gpu\",\"gpu\":false,\"reason\":\"%s\"}\n",
                cudaGetErrorName(err));
    return 77;
  }
  CK(cudaSetDevice(0));
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  bytes = std::max(chunk, bytes / chunk * chunk);
  const uint64_t small = std::min<uint64_t>(bytes, 256ull << 20);
  const char* dir_env = std::getenv("FERRY_BENCH_DIR");
  const std::string root = dir_env && *dir_env ? dir_env : "/tmp/ferry-bench-gpu";
  std::filesystem::remove_all(root);
  std::filesystem::create_directories(root);
  std::printf("ferry_bench_gpu: %s, state %.2f GiB in %llu MiB blocks, root %s\n", prop.name,
              bytes / double(1ull << 30), (unsigned long long)(chunk >> 20), root.c_str());

  auto dev_r = ferry::CudaDevice::create(ferry::cuda::real_cuda_api());
  if (!dev_r.ok()) die("CUDA backend", dev_r.status());
  auto dev = *dev_r;

  void* state = nullptr;
  CK(cudaMalloc(&state, bytes));
  CK(cudaMemset(state, 0x3c, bytes));
  ferry::TensorView view(state, ferry::DType::u8, {static_cast<int64_t>(bytes)},
                         ferry::Device::cuda(0));
  cudaStream_t train, raw;
  CK(cudaStreamCreateWithFlags(&train, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking));
  CK(cudaDeviceSynchronize());

  // --- 1. D2H throughput ------------------------------------------------------
  auto pool_r = ferry::StagingPool::create(bytes, chunk);
  if (!pool_r.ok()) die("staging pool", pool_r.status());
  auto& pool = *pool_r;
  auto t_reg = Clock::now();
  if (auto s = ferry::register_pool_for_device(*pool, *dev, ferry::Options{}); !s.ok())
    die("registering the pool", s);
  const double register_ms = ms_since(t_reg);
  double best_raw = 1e18, best_ferry = 1e18;
  for (int rep = 0; rep < 3; ++rep) {
    best_raw = std::min(best_raw, raw_d2h_ms(state, bytes, chunk, pool->base(), raw));
    auto t0 = Clock::now();
    if (auto s = dev->order_copies_after(ferry::Device::cuda(0), train); !s.ok())
      die("order_copies_after", s);
    backend_copy(*dev, view, bytes, chunk, pool->base());
    best_ferry = std::min(best_ferry, ms_since(t0));
  }
  const double raw_gbps = gbps(bytes, best_raw), ferry_gbps = gbps(bytes, best_ferry);
  std::printf(
      "D2H: raw cudaMemcpyAsync %.1f GB/s, Ferry backend %.1f GB/s (%.2fx, target >= "
      "0.9x); pool registration %.0f ms\n",
      raw_gbps, ferry_gbps, ferry_gbps / raw_gbps, register_ms);

  ferry::RuntimeArgs args;
  args.set("root", root)
      .set("pool-bytes", std::to_string(bytes))
      .set("chunk-bytes", std::to_string(chunk))
      .set("writers", "4")
      .set("keep-last", "1");
  args.device = dev;
  auto rt_r = ferry::Runtime::create(args);
  if (!rt_r.ok()) die("Runtime::create", rt_r.status());
  auto& rt = *rt_r;
  ferry::StateDict sd;
  if (auto s = sd.add("state", view); !s.ok()) die("state dict", s);
  uint64_t step = 0;
  auto save = [&](cudaStream_t s) {
    if (auto st = dev->order_copies_after(ferry::Device::cuda(0), s); !st.ok())
      die("order_copies_after", st);
    return rt->save_async(sd, ++step);
  };
  double rt_snapshot_ms = 0, e2e_ms = 0;
  {
    auto t0 = Clock::now();
    auto h = save(train);
    if (auto s = h.wait_snapshot(); !s.ok()) die("wait_snapshot", s);
    rt_snapshot_ms = ms_since(t0);
    if (auto s = h.wait_committed(); !s.ok()) die("wait_committed", s);
    e2e_ms = ms_since(t0);
  }
  std::printf(
      "Runtime snapshot %.1f GB/s (%.2fx raw; its pool is pinned once the Runtime "
      "calls register_pool_for_device)\n",
      gbps(bytes, rt_snapshot_ms), gbps(bytes, rt_snapshot_ms) / raw_gbps);

  // --- 2. Host blocking while the training stream is busy ----------------------
  double save_block_ms[2] = {0, 0}, order_block_ms[2] = {0, 0}, issue_ms[2] = {0, 0};
  bool kernel_running = false;
#ifdef FERRY_BENCH_HAVE_KERNEL
  const size_t step_floats = (1ull << 30) / sizeof(float);
  float* work = nullptr;
  CK(cudaMalloc(reinterpret_cast<void**>(&work), step_floats * sizeof(float)));
  CK(cudaMemset(work, 0, step_floats * sizeof(float)));
  // Calibrate: passes of one launch so that it runs ~300 ms.
  auto t_cal = Clock::now();
  CK(static_cast<cudaError_t>(ferry_bench_step(train, work, step_floats, 4)));
  CK(cudaStreamSynchronize(train));
  const double pass_ms = std::max(0.01, ms_since(t_cal) / 4);
  const int long_passes = std::max(1, static_cast<int>(300 / pass_ms));
  const uint64_t sizes[2] = {small, bytes};
  for (int i = 0; i < 2; ++i) {
    CK(static_cast<cudaError_t>(ferry_bench_step(train, work, step_floats, long_passes)));
    ferry::TensorView part(state, ferry::DType::u8, {static_cast<int64_t>(sizes[i])},
                           ferry::Device::cuda(0));
    if (auto s = dev->order_copies_after(ferry::Device::cuda(0), train); !s.ok())
      die("order_copies_after", s);
    std::atomic<bool> issued{false};
    std::thread copier(
        [&, i] { backend_copy(*dev, part, sizes[i], chunk, pool->base(), &issue_ms[i], &issued); });
    // Wait until every block is issued (what wait_snapshot(stream) waits for).
    while (!issued) std::this_thread::yield();
    auto t1 = Clock::now();
    if (auto s = dev->order_stream_after(ferry::Device::cuda(0), train); !s.ok())
      die("order_stream_after", s);
    order_block_ms[i] = ms_since(t1);
    if (i == 1) kernel_running = cudaStreamQuery(train) == cudaErrorNotReady;
    copier.join();
    CK(cudaStreamSynchronize(train));
  }
  // save_async through the Runtime while the kernel runs.
  for (int i = 0; i < 2; ++i) {
    ferry::StateDict part_sd;
    if (auto s = part_sd.add(
            "state", ferry::TensorView(state, ferry::DType::u8, {static_cast<int64_t>(sizes[i])},
                                       ferry::Device::cuda(0)));
        !s.ok())
      die("StateDict::add", s);
    CK(static_cast<cudaError_t>(ferry_bench_step(train, work, step_floats, long_passes)));
    auto t0 = Clock::now();
    if (auto s = dev->order_copies_after(ferry::Device::cuda(0), train); !s.ok())
      die("order_copies_after", s);
    auto h = rt->save_async(part_sd, ++step);
    save_block_ms[i] = ms_since(t0);
    if (auto s = h.wait_committed(); !s.ok()) die("save while the kernel runs", s);
    CK(cudaStreamSynchronize(train));
  }
  std::printf(
      "host blocked: save_async %.3f / %.3f ms, order_stream_after %.3f / %.3f ms "
      "(%llu MiB / %llu MiB; target < 1 ms); kernel still running after: %s\n",
      save_block_ms[0], save_block_ms[1], order_block_ms[0], order_block_ms[1],
      (unsigned long long)(small >> 20), (unsigned long long)(bytes >> 20),
      kernel_running ? "yes" : "no");

  // --- 3. Training-step slowdown ------------------------------------------------
  const int step_passes = std::max(1, static_cast<int>(5 / pass_ms));  // ~5 ms steps
  auto run_steps = [&](int n) {
    auto t0 = Clock::now();
    for (int k = 0; k < n; ++k) {
      CK(static_cast<cudaError_t>(ferry_bench_step(train, work, step_floats, step_passes)));
      CK(cudaStreamSynchronize(train));  // a step ends with a host sync, as in training
    }
    return ms_since(t0) / n;
  };
  run_steps(5);
  const int steps = std::max(20, static_cast<int>(e2e_ms / 5));
  const double step_alone = run_steps(steps);
  auto h = save(train);
  const double step_with = run_steps(steps);
  const bool overlapped = !h.done();
  if (auto s = h.wait_committed(); !s.ok()) die("save during steps", s);
  std::printf(
      "training step %.2f ms alone, %.2f ms with a save in flight (%.2fx; save still "
      "running at the end: %s)\n",
      step_alone, step_with, step_with / step_alone, overlapped ? "yes" : "no");
#else
  const double step_alone = 0, step_with = 0;
  std::printf("host blocking and step slowdown: skipped (built without nvcc: no kernel)\n");
#endif

  // --- 4. End to end vs raw O_DIRECT ----------------------------------------------
  const double raw_disk_ms = raw_odirect_ms(root + "/raw.bin", pool->base(), bytes, chunk);
  std::printf("end to end: Ferry save %.2f GB/s, raw O_DIRECT writer %.2f GB/s (%.2fx)\n",
              gbps(bytes, e2e_ms), gbps(bytes, raw_disk_ms),
              gbps(bytes, e2e_ms) / gbps(bytes, raw_disk_ms));

  std::printf(
      "{\"bench\":\"ferry_bench_gpu\",\"gpu\":true,\"device\":\"%s\",\"bytes\":%llu,"
      "\"chunk\":%llu,\"raw_d2h_gbps\":%.2f,\"ferry_d2h_gbps\":%.2f,\"d2h_ratio\":%.3f,"
      "\"runtime_snapshot_gbps\":%.2f,\"pool_register_ms\":%.1f,"
      "\"save_async_block_ms\":[%.3f,%.3f],\"order_stream_after_block_ms\":[%.3f,%.3f],"
      "\"issue_ms\":[%.3f,%.3f],\"kernel_still_running\":%s,\"step_ms_alone\":%.3f,"
      "\"step_ms_with_save\":%.3f,\"step_slowdown\":%.3f,\"ferry_e2e_gbps\":%.3f,"
      "\"raw_odirect_gbps\":%.3f,\"e2e_ratio\":%.3f}\n",
      prop.name, (unsigned long long)bytes, (unsigned long long)chunk, raw_gbps, ferry_gbps,
      ferry_gbps / raw_gbps, gbps(bytes, rt_snapshot_ms), register_ms, save_block_ms[0],
      save_block_ms[1], order_block_ms[0], order_block_ms[1], issue_ms[0], issue_ms[1],
      kernel_running ? "true" : "false", step_alone, step_with,
      step_alone > 0 ? step_with / step_alone : 0.0, gbps(bytes, e2e_ms), gbps(bytes, raw_disk_ms),
      gbps(bytes, e2e_ms) / gbps(bytes, raw_disk_ms));
  rt.reset();
  std::filesystem::remove_all(root);
  return 0;
}
