// The CUDA device backend: copies between cuda:N tensors and host memory on
// one non-blocking copy stream per device, ordered after the caller's stream
// by events, completed by polling events from one thread.
//
// Threads. copy_out/copy_in only queue a request (they may be called from an
// actor's scheduler thread: no CUDA call there). One device thread per
// CudaDevice issues the copies (cudaSetDevice first, then event waits and
// cudaMemcpyAsync), polls their events and calls `done` from that thread.
// Nothing blocks on the GPU: completion is found by cudaEventQuery. The
// order_* calls run on the caller's thread; they set the device they need
// and put the caller's current device back.
//
// Ordering. order_copies_after(d, stream) records an event on the caller's
// stream now; every copy of d queued afterwards starts after it (the snapshot
// is of the tensors as that stream leaves them at save time, not as the
// training loop changes them later). Until it is called once for a device,
// each copy is ordered after the legacy default stream as of its issue.
// order_stream_after(d, stream) makes the caller's stream wait, on the GPU,
// for every copy of d queued so far: the basis of wait_snapshot(stream).
//
// Bounds. At most `max_inflight` copy requests (pool blocks) per device are
// on the GPU at once; more wait in the backend's queue, in order.
//
// Errors end the request with a Status naming the device, the CUDA call and
// CUDA's error name and string; the caller adds the tensor key. A call that
// fails at once and an error reported later by cudaEventQuery (CUDA's
// asynchronous errors) read the same. Never use a CudaDevice in a forked
// child: requests there fail with an error instead of touching CUDA.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cuda/cuda_api.hpp"
#include "ferry/device.hpp"
#include "ferry/options.hpp"
#include "ferry/tensor.hpp"
#include "pool.hpp"

namespace ferry {

struct CudaDeviceOptions {
  uint32_t max_inflight = 16;  // copy requests on the GPU per device
  // How often the device thread queries the events of copies in flight.
  std::chrono::microseconds poll_interval{20};
};

class CudaDevice final : public DeviceBackend {
 public:
  // Fails when the API reports no device (the message says why, e.g. no
  // driver): callers then use host_device().
  static Result<std::shared_ptr<CudaDevice>> create(std::shared_ptr<cuda::CudaApi> api,
                                                    CudaDeviceOptions opts = {});
  // Fails queued requests with `aborted`, waits (bounded) for the copies on
  // the GPU, then destroys the streams and events.
  ~CudaDevice() override;
  CudaDevice(const CudaDevice&) = delete;
  CudaDevice& operator=(const CudaDevice&) = delete;

  bool handles(const Device& d) const override;
  void copy_out(const TensorView& src, uint64_t offset, uint64_t len, void* dst,
                Done done) override;
  void copy_in(const void* src, const TensorView& dst, uint64_t offset, uint64_t len,
               Done done) override;
  void copy_in_runs(const uint8_t* src, const TensorView& dst, const std::vector<Run>& runs,
                    Done done) override;
  std::optional<uint64_t> copy_in_summed(const uint8_t* src, const TensorView& dst, uint64_t offset,
                                         uint64_t len) override;

  // See the header comment. `stream` is a cudaStream_t (null: the legacy
  // default stream). REQUIRES: d is a cuda device this backend handles.
  Status order_copies_after(const Device& d, void* stream);
  // Returns once the wait is enqueued. When more than max_inflight requests
  // are queued it first waits, on the host, until they are all issued.
  Status order_stream_after(const Device& d, void* stream);

  // cudaHostRegister in segments of at most 64 GiB, for StagingPool.
  HostRegistrar host_registrar();
  int device_count() const { return devices_; }
  cuda::CudaApi& api() { return *api_; }

 private:
  struct Request;
  struct InFlight;
  struct PerDevice;
  CudaDevice(std::shared_ptr<cuda::CudaApi> api, int devices, CudaDeviceOptions opts);
  void submit(Request r);
  void run();
  bool issue_locked(PerDevice& pd, int device, Request& r, std::vector<InFlight>* failed);
  Status ensure_stream_locked(PerDevice& pd, int device);
  Result<cuda::EventHandle> take_event_locked(PerDevice& pd);
  Status cuda_error(int device, const char* call, int err) const;
  // Why `op` may not order work on the caller's stream of `d`: not one of
  // this process's CUDA devices, or called in a forked child.
  Status check_stream_device(const char* op, const Device& d) const;
  bool use_device_on_worker(int device);

  std::shared_ptr<cuda::CudaApi> api_;
  const int devices_;
  const CudaDeviceOptions opts_;
  const int pid_;
  std::shared_ptr<DeviceBackend> host_;
  std::mutex mu_;
  std::condition_variable cv_;      // wakes the device thread
  std::condition_variable issued_;  // a queue shrank (order_stream_after)
  bool stop_ = false;
  std::vector<std::unique_ptr<PerDevice>> per_device_;
  int worker_device_ = -1;  // the device thread's current device
  std::thread thread_;
};

// The backend a Runtime should use: CUDA (host tensors included) when the
// build has CUDA and the machine has a device, else the host device, with
// `note` (if given) saying why no CUDA.
std::shared_ptr<DeviceBackend> make_default_device(const Options& opts, Status* note = nullptr);

// The Runtime's hooks, one call each: for every CUDA device among `sd`'s
// tensors (once per device), CudaDevice::order_copies_after /
// order_stream_after with the caller's `stream` for `stream_device` (the
// device the stream belongs to) and the legacy default stream for any other
// device. A no-op when `device` is not a CudaDevice or `sd` holds host
// tensors only. An error names the tensor that brought the device in.
Status order_copies_after(DeviceBackend& device, const StateDict& sd, const Device& stream_device,
                          void* stream);
Status order_stream_after(DeviceBackend& device, const StateDict& sd, const Device& stream_device,
                          void* stream);

// Pins the staging pool for `device` when it is a CudaDevice and
// ferry.cuda-register-pool is true; an error names the pool size and the key
// that opts out. A no-op for other backends.
Status register_pool_for_device(StagingPool& pool, DeviceBackend& device, const Options& opts);

}  // namespace ferry
