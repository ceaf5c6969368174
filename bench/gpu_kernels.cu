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
