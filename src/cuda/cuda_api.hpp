// The narrow seam between Ferry and the CUDA runtime: exactly the calls the
// CUDA device backend and the pool registration make, behind an interface so
// the backend's logic is tested on machines without a GPU (tests/fake_cuda.*)
// and the same code runs against the real runtime on a GPU machine.
//
// Handles are opaque pointers (cudaStream_t / cudaEvent_t in the real
// implementation) so no CUDA header leaks into the headers that include this
// one. A null stream is the legacy default stream of the current device.
// Return values are CUDA error codes (cudaError_t as int); the constants below
// are the ones the backend branches on, checked against the real enum in
// cuda_api_real.cpp.
//
// Thread-safety: every method may be called from any thread, as the CUDA
// runtime allows. The current device is per thread: a thread calls
// set_device before anything that touches a device.
#pragma once

#include <cstddef>
#include <memory>

namespace ferry::cuda {

using StreamHandle = void*;
using EventHandle = void*;

constexpr int kSuccess = 0;
constexpr int kErrorInvalidValue = 1;
constexpr int kErrorInsufficientDriver = 35;
constexpr int kErrorNoDevice = 100;
constexpr int kErrorNotReady = 600;
constexpr int kErrorIllegalAddress = 700;

enum class CopyKind { device_to_host, host_to_device };

class CudaApi {
 public:
  virtual ~CudaApi() = default;

  virtual int get_device_count(int* count) = 0;
  virtual int set_device(int device) = 0;
  virtual int get_device(int* device) = 0;
  // cudaStreamCreateWithFlags(cudaStreamNonBlocking): no implicit
  // synchronisation with the legacy default stream.
  virtual int stream_create_nonblocking(StreamHandle* stream) = 0;
  virtual int stream_destroy(StreamHandle stream) = 0;
  // cudaEventCreateWithFlags(cudaEventDisableTiming): the cheap kind.
  virtual int event_create(EventHandle* event) = 0;
  virtual int event_destroy(EventHandle event) = 0;
  virtual int event_record(EventHandle event, StreamHandle stream) = 0;
  // kSuccess when the work before the event's last record is done,
  // kErrorNotReady while it is not, or an (asynchronous) error.
  virtual int event_query(EventHandle event) = 0;
  // The stream waits for the event's last record as of this call; the host
  // does not wait.
  virtual int stream_wait_event(StreamHandle stream, EventHandle event) = 0;
  virtual int memcpy_async(void* dst, const void* src, size_t bytes, CopyKind kind,
                           StreamHandle stream) = 0;
  // `height` rows of `width` bytes, rows `spitch` apart at the source and
  // `dpitch` apart at the destination.
  virtual int memcpy_2d_async(void* dst, size_t dpitch, const void* src, size_t spitch,
                              size_t width, size_t height, CopyKind kind, StreamHandle stream) = 0;
  // cudaHostRegister(cudaHostRegisterPortable): page-locked for every device.
  virtual int host_register(void* ptr, size_t bytes) = 0;
  virtual int host_unregister(void* ptr) = 0;
  // "cudaErrorIllegalAddress" and "an illegal memory access was encountered".
  virtual const char* error_name(int err) = 0;
  virtual const char* error_string(int err) = 0;
};

// The CUDA runtime (statically linked), or, in a build without the toolkit, a
// stub whose every call returns kErrorInsufficientDriver with the message
// "Ferry was built without CUDA". Safe to call on machines without a driver:
// calls then fail with kErrorInsufficientDriver or kErrorNoDevice.
std::shared_ptr<CudaApi> real_cuda_api();
bool built_with_cuda();

}  // namespace ferry::cuda
