// A CUDA runtime that runs on the host, for testing the CUDA backend without a
// GPU. It behaves like a device where the backend's correctness depends on it:
//   - "device memory" is host memory tagged with its device; a copy whose
//     direction does not match the memory is refused like CUDA refuses it;
//   - work enqueued on a stream runs later, in stream order, on the fake's
//     own worker thread; streams are independent of each other;
//   - an event reports kErrorNotReady until the work before its last record
//     has run; stream_wait_event orders a stream after that record;
//   - an injected error appears at the call, or later at an event query on
//     the device, as CUDA's asynchronous errors do.
// Tests steer time with hold/release (per stream) and pause/resume (all
// streams), and wait for the device to go idle with drain().
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cuda/cuda_api.hpp"

namespace ferry::testing {

class FakeCuda final : public cuda::CudaApi {
 public:
  explicit FakeCuda(int devices = 1);
  ~FakeCuda() override;
  FakeCuda(const FakeCuda&) = delete;
  FakeCuda& operator=(const FakeCuda&) = delete;

  // --- the seam --------------------------------------------------------------
  int get_device_count(int* count) override;
  int set_device(int device) override;
  int get_device(int* device) override;
  int stream_create_nonblocking(cuda::StreamHandle* stream) override;
  int stream_destroy(cuda::StreamHandle stream) override;
  int event_create(cuda::EventHandle* event) override;
  int event_destroy(cuda::EventHandle event) override;
  int event_record(cuda::EventHandle event, cuda::StreamHandle stream) override;
  int event_query(cuda::EventHandle event) override;
  int stream_wait_event(cuda::StreamHandle stream, cuda::EventHandle event) override;
  int memcpy_async(void* dst, const void* src, size_t bytes, cuda::CopyKind kind,
                   cuda::StreamHandle stream) override;
  int memcpy_2d_async(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                      size_t height, cuda::CopyKind kind, cuda::StreamHandle stream) override;
  int host_register(void* ptr, size_t bytes) override;
  int host_unregister(void* ptr) override;
  const char* error_name(int err) override;
  const char* error_string(int err) override;

  // --- the test's side ---------------------------------------------------------
  // Zero-filled "device memory" on `device`; freed with the fake.
  void* device_alloc(int device, size_t bytes);
  // The caller's stream (what a training loop would use); null is the
  // legacy default stream of the current device.
  cuda::StreamHandle user_stream(int device);
  // A "kernel": fn runs on the fake's worker when the stream reaches it.
  void launch(cuda::StreamHandle stream, std::function<void()> fn);
  // A write "on the stream": like a kernel that stores `bytes` at dst.
  void write_on_stream(cuda::StreamHandle stream, void* dst, std::vector<uint8_t> bytes);

  void hold(cuda::StreamHandle stream);     // its work does not start until release
  void release(cuda::StreamHandle stream);  // (null: the current device's default)
  void pause();                             // no stream makes progress
  void resume();
  // Waits until no work can run (all done, or what is left is held/paused or
  // waits on such work). Returns true when every stream is empty.
  bool drain();

  // The next call named `call` (e.g. "cudaMemcpyAsync") fails with `err`
  // without enqueueing anything.
  void fail_next_call(const std::string& call, int err);
  // The `nth` copy (0 = the next) to run on the device fails: its bytes are not
  // moved and the next event_query on that device returns `err` (once).
  // With `device` >= 0 only copies on that device count.
  void fail_async_copy(int err, int nth = 0, int device = -1);

  uint64_t copies_enqueued() const;
  // The most devices that had copies enqueued and not yet run at one time.
  int max_devices_copying() const;
  uint64_t pageable_copies() const;  // copies whose host side was not registered
  uint64_t stream_waits() const;     // stream_wait_event calls
  // Calls that needed a current device on a thread that never set one.
  uint64_t unset_device_calls() const;
  std::vector<std::pair<void*, size_t>> registrations() const;  // live host_register ranges
  uint64_t host_register_calls() const;
  int streams_alive() const;  // created (user streams included), not destroyed
  int events_alive() const;

 private:
  struct Event {
    int device = 0;
    uint64_t recorded = 0;   // generation of the last record
    uint64_t completed = 0;  // generation whose preceding work has run
  };
  struct Op {
    enum Kind { copy, kernel, record, wait } kind;
    std::function<void()> fn;  // copy / kernel
    Event* event = nullptr;    // record / wait
    uint64_t generation = 0;
  };
  struct Stream {
    int device = 0;
    bool held = false;
    bool running = false;  // its head op is executing on the worker
    std::deque<Op> ops;
  };

  int current_device_locked();
  Stream* stream_locked(cuda::StreamHandle s);
  bool injected_locked(const char* call, int* err);
  // Queues op on s and wakes the worker.
  void enqueue_locked(Stream* s, Op op);
  int enqueue_copy(const char* call, void* dst, const void* src, size_t dpitch, size_t spitch,
                   size_t width, size_t height, cuda::CopyKind kind, cuda::StreamHandle stream);
  bool runnable_locked(const Stream& s) const;
  void worker();

  const int devices_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  bool paused_ = false;
  bool busy_ = false;
  std::vector<std::unique_ptr<Stream>> default_streams_;
  std::map<Stream*, std::unique_ptr<Stream>> streams_;
  std::map<Event*, std::unique_ptr<Event>> events_;
  std::vector<std::unique_ptr<Event>> retired_events_;
  std::vector<std::unique_ptr<Stream>> retired_streams_;
  uint64_t instance_ = 0;
  struct Alloc {
    std::unique_ptr<uint8_t[]> mem;
    size_t bytes;
    int device;
  };
  std::map<uintptr_t, Alloc> allocs_;  // by start address
  std::map<uintptr_t, size_t> registered_;
  std::map<std::string, int> fail_calls_;
  int fail_copy_err_ = 0;
  int fail_copy_countdown_ = -1;
  int fail_copy_device_ = -1;        // -1: any
  std::vector<int> copies_pending_;  // per device: enqueued, not yet run
  int max_devices_copying_ = 0;
  std::vector<int> async_error_;  // per device, reported at the next query
  uint64_t copies_ = 0, pageable_ = 0, waits_ = 0, unset_device_ = 0, register_calls_ = 0;
  std::thread worker_;
};

}  // namespace ferry::testing
