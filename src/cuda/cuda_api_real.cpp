// The CUDA runtime behind the seam. Compiled by the host C++ compiler against
// the toolkit's headers and linked with the static cudart, so libferry.so
// starts on machines without libcuda.so.1 (every call then fails with
// cudaErrorInsufficientDriver and Ferry keeps to the host path).
#include <cuda_runtime_api.h>

#include "cuda/cuda_api.hpp"

namespace ferry::cuda {

static_assert(kSuccess == cudaSuccess);
static_assert(kErrorInvalidValue == cudaErrorInvalidValue);
static_assert(kErrorInsufficientDriver == cudaErrorInsufficientDriver);
static_assert(kErrorNoDevice == cudaErrorNoDevice);
static_assert(kErrorNotReady == cudaErrorNotReady);
static_assert(kErrorIllegalAddress == cudaErrorIllegalAddress);

namespace {

cudaStream_t stream_of(StreamHandle s) {
  return static_cast<cudaStream_t>(s);
}
cudaEvent_t event_of(EventHandle e) {
  return static_cast<cudaEvent_t>(e);
}
cudaMemcpyKind kind_of(CopyKind k) {
  return k == CopyKind::device_to_host ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice;
}

class RealApi final : public CudaApi {
 public:
  int get_device_count(int* count) override {
    *count = 0;
    return cudaGetDeviceCount(count);
  }
  int set_device(int device) override { return cudaSetDevice(device); }
  int get_device(int* device) override { return cudaGetDevice(device); }
  int stream_create_nonblocking(StreamHandle* stream) override {
    cudaStream_t s = nullptr;
    int err = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    *stream = s;
    return err;
  }
  int stream_destroy(StreamHandle stream) override { return cudaStreamDestroy(stream_of(stream)); }
  int event_create(EventHandle* event) override {
    cudaEvent_t e = nullptr;
    int err = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
    *event = e;
    return err;
  }
  int event_destroy(EventHandle event) override { return cudaEventDestroy(event_of(event)); }
  int event_record(EventHandle event, StreamHandle stream) override {
    return cudaEventRecord(event_of(event), stream_of(stream));
  }
  int event_query(EventHandle event) override { return cudaEventQuery(event_of(event)); }
  int stream_wait_event(StreamHandle stream, EventHandle event) override {
    return cudaStreamWaitEvent(stream_of(stream), event_of(event), 0);
  }
  int memcpy_async(void* dst, const void* src, size_t bytes, CopyKind kind,
                   StreamHandle stream) override {
    return cudaMemcpyAsync(dst, src, bytes, kind_of(kind), stream_of(stream));
  }
  int memcpy_2d_async(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                      size_t height, CopyKind kind, StreamHandle stream) override {
    return cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, kind_of(kind),
                             stream_of(stream));
  }
  int host_register(void* ptr, size_t bytes) override {
    return cudaHostRegister(ptr, bytes, cudaHostRegisterPortable);
  }
  int host_unregister(void* ptr) override { return cudaHostUnregister(ptr); }
  const char* error_name(int err) override {
    return cudaGetErrorName(static_cast<cudaError_t>(err));
  }
  const char* error_string(int err) override {
    return cudaGetErrorString(static_cast<cudaError_t>(err));
  }
};

}  // namespace

std::shared_ptr<CudaApi> real_cuda_api() {
  return std::make_shared<RealApi>();
}
bool built_with_cuda() {
  return true;
}

}  // namespace ferry::cuda
