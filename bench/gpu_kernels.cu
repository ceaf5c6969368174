// The "training step" of ferry_bench_gpu: a memory-bound update of a float
// buffer, repeated `passes` times per launch, so a save's copies and the
// step compete for the same HBM and PCIe as in training. Compiled only when
// nvcc is found; no Cap'n Proto header may be included here (nvcc rejects them).
#include <cuda_runtime_api.h>

#include <cstddef>

namespace {

__global__ void step_kernel(float* x, size_t n, int passes) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (int p = 0; p < passes; ++p)
    for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n; i += stride)
      x[i] = x[i] * 0.999f + 0.001f;
}

}  // namespace

extern "C" int ferry_bench_step(void* stream, float* x, size_t n, int passes) {
  step_kernel<<<1024, 256, 0, static_cast<cudaStream_t>(stream)>>>(x, n, passes);
  return static_cast<int>(cudaGetLastError());
}

// --- ferry demo --device cuda -----------------------------------------------------
// The demo's GPU tensors and its "optimizer step": every element is a pure
// function of (seed, global index), computed on the GPU exactly as the
// demo's host code does (tools/demo.cpp, fill), so a restore checks every
// byte the GPU wrote. Compiled into the CLI only when nvcc is found.

namespace {

__device__ unsigned int demo_mix32(unsigned long long x) {
  x = (x ^ (x >> 33)) * 0xff51afd7ed558ccdull;
  x = (x ^ (x >> 33)) * 0xc4ceb9fe1a85ec53ull;
  return static_cast<unsigned int>(x ^ (x >> 33));
}

// rows x cols words of a piece at (row0, col0) of a tensor gcols wide; a
// tensor of rank < 2 is one row indexed from 0 (gcols = 0).
__global__ void demo_fill_kernel(unsigned int* out, long long rows, long long cols, long long gcols,
                                 long long row0, long long col0, unsigned long long seed) {
  const long long n = rows * cols;
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += stride) {
    const long long r = i / cols, c = i % cols;
    const unsigned long long at =
        gcols == 0 ? static_cast<unsigned long long>(i)
                   : static_cast<unsigned long long>((row0 + r) * gcols + col0 + c);
    out[i] = demo_mix32(seed + at);
  }
}

__global__ void demo_set_kernel(unsigned int* p, unsigned int v) {
  *p = v;
}

}  // namespace

extern "C" int ferry_demo_device_count(int* n) {
  return static_cast<int>(cudaGetDeviceCount(n));
}
extern "C" int ferry_demo_set_device(int d) {
  return static_cast<int>(cudaSetDevice(d));
}
extern "C" int ferry_demo_alloc(void** p, size_t bytes) {
  return static_cast<int>(cudaMalloc(p, bytes));
}
extern "C" int ferry_demo_free(void* p) {
  return static_cast<int>(cudaFree(p));
}
extern "C" int ferry_demo_stream(void** s) {
  return static_cast<int>(
      cudaStreamCreateWithFlags(reinterpret_cast<cudaStream_t*>(s), cudaStreamNonBlocking));
}
extern "C" int ferry_demo_sync(void* s) {
  return static_cast<int>(cudaStreamSynchronize(static_cast<cudaStream_t>(s)));
}
extern "C" int ferry_demo_fill(void* stream, unsigned int* out, long long rows, long long cols,
                               long long gcols, long long row0, long long col0,
                               unsigned long long seed) {
  if (rows * cols == 0) return 0;
  demo_fill_kernel<<<512, 256, 0, static_cast<cudaStream_t>(stream)>>>(out, rows, cols, gcols, row0,
                                                                       col0, seed);
  return static_cast<int>(cudaGetLastError());
}
extern "C" int ferry_demo_set(void* stream, unsigned int* p, unsigned int v) {
  demo_set_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(p, v);
  return static_cast<int>(cudaGetLastError());
}
extern "C" const char* ferry_demo_error(int err) {
  return cudaGetErrorString(static_cast<cudaError_t>(err));
}
