// Compiled instead of cuda_api_real.cpp when the CUDA toolkit was not found:
// Ferry then runs on the host path only, and says why when asked for CUDA.
#include "cuda/cuda_api.hpp"

namespace ferry::cuda {
namespace {

class StubApi final : public CudaApi {
 public:
  int get_device_count(int* count) override {
    *count = 0;
    return kErrorInsufficientDriver;
  }
  int set_device(int) override { return kErrorInsufficientDriver; }
  int get_device(int* device) override {
    *device = 0;
    return kErrorInsufficientDriver;
  }
  int stream_create_nonblocking(StreamHandle*) override { return kErrorInsufficientDriver; }
  int stream_destroy(StreamHandle) override { return kErrorInsufficientDriver; }
  int event_create(EventHandle*) override { return kErrorInsufficientDriver; }
  int event_destroy(EventHandle) override { return kErrorInsufficientDriver; }
  int event_record(EventHandle, StreamHandle) override { return kErrorInsufficientDriver; }
  int event_query(EventHandle) override { return kErrorInsufficientDriver; }
  int stream_wait_event(StreamHandle, EventHandle) override { return kErrorInsufficientDriver; }
  int memcpy_async(void*, const void*, size_t, CopyKind, StreamHandle) override {
    return kErrorInsufficientDriver;
  }
  int memcpy_2d_async(void*, size_t, const void*, size_t, size_t, size_t, CopyKind,
                      StreamHandle) override {
    return kErrorInsufficientDriver;
  }
  int host_register(void*, size_t) override { return kErrorInsufficientDriver; }
  int host_unregister(void*) override { return kErrorInsufficientDriver; }
  const char* error_name(int) override { return "cudaErrorInsufficientDriver"; }
  const char* error_string(int) override { return "Ferry was built without CUDA"; }
};

}  // namespace

std::shared_ptr<CudaApi> real_cuda_api() {
  return std::make_shared<StubApi>();
}
bool built_with_cuda() {
  return false;
}

}  // namespace ferry::cuda
