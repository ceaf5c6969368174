#include "fake_cuda.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>

namespace ferry::testing {
namespace {

// The current device is per thread and per fake (tests create several fakes
// one after another on the same threads).
std::atomic<uint64_t> next_instance{1};
thread_local std::map<uint64_t, int> current_device;

// A new stream or event of `device`, owned by `live` (keyed by its handle).
template <class T>
T* add_handle(std::map<T*, std::unique_ptr<T>>& live, int device) {
  auto owned = std::make_unique<T>();
  owned->device = device;
  T* h = owned.get();
  live.emplace(h, std::move(owned));
  return h;
}

// Ends `handle` for the caller; the object moves to `retired`, alive for ops
// that still point at it.
template <class T>
int retire_handle(std::map<T*, std::unique_ptr<T>>& live, std::vector<std::unique_ptr<T>>& retired,
                  void* handle) {
  auto it = live.find(static_cast<T*>(handle));
  if (it == live.end()) return cuda::kErrorInvalidValue;
  retired.push_back(std::move(it->second));
  live.erase(it);
  return cuda::kSuccess;
}

}  // namespace

FakeCuda::FakeCuda(int devices)
    : devices_(devices), copies_pending_(devices, 0), async_error_(devices, 0) {
  instance_ = next_instance++;
  for (int d = 0; d < devices; ++d) {
    default_streams_.push_back(std::make_unique<Stream>());
    default_streams_.back()->device = d;
  }
  worker_ = std::thread([this] { worker(); });
}

FakeCuda::~FakeCuda() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  worker_.join();
}

int FakeCuda::current_device_locked() {
  auto it = current_device.find(instance_);
  if (it == current_device.end()) {
    ++unset_device_;
    return 0;
  }
  return it->second;
}

bool FakeCuda::injected_locked(const char* call, int* err) {
  auto it = fail_calls_.find(call);
  if (it == fail_calls_.end()) return false;
  *err = it->second;
  fail_calls_.erase(it);
  return true;
}

void FakeCuda::enqueue_locked(Stream* s, Op op) {
  // Only copies count as copying: the worker takes a device's count down
  // when it runs a copy, never for a record, a wait or a kernel.
  if (op.kind == Op::copy) {
    ++copies_pending_[s->device];
    const int copying = static_cast<int>(
        std::count_if(copies_pending_.begin(), copies_pending_.end(), [](int n) { return n > 0; }));
    max_devices_copying_ = std::max(max_devices_copying_, copying);
  }
  s->ops.push_back(std::move(op));
  cv_.notify_all();
}

FakeCuda::Stream* FakeCuda::stream_locked(cuda::StreamHandle s) {
  if (s == nullptr) return default_streams_[current_device_locked()].get();
  auto it = streams_.find(static_cast<Stream*>(s));
  return it == streams_.end() ? nullptr : it->second.get();
}

int FakeCuda::get_device_count(int* count) {
  std::lock_guard<std::mutex> lock(mu_);
  int err;
  if (injected_locked("cudaGetDeviceCount", &err)) {
    *count = 0;
    return err;
  }
  *count = devices_;
  return devices_ > 0 ? cuda::kSuccess : cuda::kErrorNoDevice;
}

int FakeCuda::set_device(int device) {
  std::lock_guard<std::mutex> lock(mu_);
  int err;
  if (injected_locked("cudaSetDevice", &err)) return err;
  if (device < 0 || device >= devices_) return cuda::kErrorInvalidValue;
  current_device[instance_] = device;
  return cuda::kSuccess;
}

int FakeCuda::get_device(int* device) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = current_device.find(instance_);
  *device = it == current_device.end() ? 0 : it->second;
  return cuda::kSuccess;
}

int FakeCuda::stream_create_nonblocking(cuda::StreamHandle* stream) {
  std::lock_guard<std::mutex> lock(mu_);
  int err;
  if (injected_locked("cudaStreamCreateWithFlags", &err)) return err;
  *stream = add_handle(streams_, current_device_locked());
  return cuda::kSuccess;
}

int FakeCuda::stream_destroy(cuda::StreamHandle stream) {
  std::lock_guard<std::mutex> lock(mu_);
  // CUDA lets the work already enqueued finish; tests drain before this. The
  // object outlives the handle in case the worker is running its last op.
  return retire_handle(streams_, retired_streams_, stream);
}

int FakeCuda::event_create(cuda::EventHandle* event) {
  std::lock_guard<std::mutex> lock(mu_);
  int err;
  if (injected_locked("cudaEventCreateWithFlags", &err)) return err;
  *event = add_handle(events_, current_device_locked());
  return cuda::kSuccess;
}

int FakeCuda::event_destroy(cuda::EventHandle event) {
  std::lock_guard<std::mutex> lock(mu_);
  // Ops that still point at it are dropped from their streams' view by
  // keeping the object alive: CUDA defers the release the same way.
  return retire_handle(events_, retired_events_, event);
}

int FakeCuda::event_record(cuda::EventHandle event, cuda::StreamHandle stream) {
  std::lock_guard<std::mutex> lock(mu_);
  int err;
  if (injected_locked("cudaEventRecord", &err)) return err;
  auto it = events_.find(static_cast<Event*>(event));
  Stream* s = stream_locked(stream);
  if (it == events_.end() || s == nullptr) return cuda::kErrorInvalidValue;
  Event* e = it->second.get();
  if (e->device != s->device) return cuda::kErrorInvalidValue;
  Op op{Op::record, {}, e, ++e->recorded};
  enqueue_locked(s, std::move(op));
  return cuda::kSuccess;
}

int FakeCuda::event_query(cuda::EventHandle event) {
  std::lock_guard<std::mutex> lock(mu_);
  int err;
  if (injected_locked("cudaEventQuery", &err)) return err;
  auto it = events_.find(static_cast<Event*>(event));
  if (it == events_.end()) return cuda::kErrorInvalidValue;
  Event* e = it->second.get();
  if (int& pending = async_error_[e->device]; pending != 0) {
    err = pending;
    pending = 0;
    return err;
  }
  return e->completed >= e->recorded ? cuda::kSuccess : cuda::kErrorNotReady;
}

int FakeCuda::stream_wait_event(cuda::StreamHandle stream, cuda::EventHandle event) {
  std::lock_guard<std::mutex> lock(mu_);
  int err;
  if (injected_locked("cudaStreamWaitEvent", &err)) return err;
  auto it = events_.find(static_cast<Event*>(event));
  Stream* s = stream_locked(stream);
  if (it == events_.end() || s == nullptr) return cuda::kErrorInvalidValue;
  ++waits_;
  // The wait is for the record as of now; a later re-record does not move it.
  Op op{Op::wait, {}, it->second.get(), it->second->recorded};
  enqueue_locked(s, std::move(op));
  return cuda::kSuccess;
}

int FakeCuda::enqueue_copy(const char* call, void* dst, const void* src, size_t dpitch,
                           size_t spitch, size_t width, size_t height, cuda::CopyKind kind,
                           cuda::StreamHandle stream) {
  std::lock_guard<std::mutex> lock(mu_);
  int err;
  if (injected_locked(call, &err)) return err;
  Stream* s = stream_locked(stream);
  if (s == nullptr) return cuda::kErrorInvalidValue;
  if (height == 0 || width == 0) return cuda::kSuccess;
  const size_t dspan = dpitch * (height - 1) + width;
  const size_t sspan = spitch * (height - 1) + width;
  // Which allocation (if any) holds [p, p + n) entirely; -2 = partly device.
  auto device_of = [this](const void* p, size_t n) -> int {
    const auto a = reinterpret_cast<uintptr_t>(p);
    auto it = allocs_.upper_bound(a);
    if (it == allocs_.begin()) return -1;
    --it;
    if (a >= it->first + it->second.bytes) return -1;
    return a + n <= it->first + it->second.bytes ? it->second.device : -2;
  };
  const bool d2h = kind == cuda::CopyKind::device_to_host;
  const int dev_side = d2h ? device_of(src, sspan) : device_of(dst, dspan);
  const int host_side = d2h ? device_of(dst, dspan) : device_of(src, sspan);
  // Like CUDA with an explicit direction: the device side must be device
  // memory of the stream's device, the host side must not be device memory.
  if (dev_side < 0 || host_side != -1 || dev_side != s->device) return cuda::kErrorInvalidValue;
  const auto host_addr = reinterpret_cast<uintptr_t>(d2h ? dst : src);
  const size_t host_span = d2h ? dspan : sspan;
  auto reg = registered_.upper_bound(host_addr);
  bool pinned = false;
  if (reg != registered_.begin()) {
    --reg;
    pinned = host_addr + host_span <= reg->first + reg->second;
  }
  if (!pinned) ++pageable_;
  ++copies_;
  Op op{Op::copy,
        [dst, src, dpitch, spitch, width, height] {
          for (size_t r = 0; r < height; ++r)
            std::memcpy(static_cast<uint8_t*>(dst) + r * dpitch,
                        static_cast<const uint8_t*>(src) + r * spitch, width);
        },
        nullptr, 0};
  enqueue_locked(s, std::move(op));
  return cuda::kSuccess;
}

int FakeCuda::memcpy_async(void* dst, const void* src, size_t bytes, cuda::CopyKind kind,
                           cuda::StreamHandle stream) {
  return enqueue_copy("cudaMemcpyAsync", dst, src, bytes, bytes, bytes, 1, kind, stream);
}

int FakeCuda::memcpy_2d_async(void* dst, size_t dpitch, const void* src, size_t spitch,
                              size_t width, size_t height, cuda::CopyKind kind,
                              cuda::StreamHandle stream) {
  if (width > dpitch || width > spitch) return cuda::kErrorInvalidValue;
  return enqueue_copy("cudaMemcpy2DAsync", dst, src, dpitch, spitch, width, height, kind, stream);
}

int FakeCuda::host_register(void* ptr, size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  ++register_calls_;
  int err;
  if (injected_locked("cudaHostRegister", &err)) return err;
  const auto a = reinterpret_cast<uintptr_t>(ptr);
  for (const auto& [start, n] : registered_)
    if (a < start + n && start < a + bytes) return 712;  // cudaErrorHostMemoryAlreadyRegistered
  registered_.emplace(a, bytes);
  return cuda::kSuccess;
}

int FakeCuda::host_unregister(void* ptr) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = registered_.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == registered_.end()) return 713;  // cudaErrorHostMemoryNotRegistered
  registered_.erase(it);
  return cuda::kSuccess;
}

const char* FakeCuda::error_name(int err) {
  switch (err) {
    case cuda::kSuccess:
      return "cudaSuccess";
    case cuda::kErrorInvalidValue:
      return "cudaErrorInvalidValue";
    case 2:
      return "cudaErrorMemoryAllocation";
    case cuda::kErrorNotReady:
      return "cudaErrorNotReady";
    case cuda::kErrorIllegalAddress:
      return "cudaErrorIllegalAddress";
    case 712:
      return "cudaErrorHostMemoryAlreadyRegistered";
    default:
      return "cudaErrorUnknown";
  }
}

const char* FakeCuda::error_string(int err) {
  switch (err) {
    case cuda::kSuccess:
      return "no error";
    case cuda::kErrorInvalidValue:
      return "invalid argument";
    case 2:
      return "out of memory";
    case cuda::kErrorNotReady:
      return "device not ready";
    case cuda::kErrorIllegalAddress:
      return "an illegal memory access was encountered";
    case 712:
      return "part or all of the requested memory range is already mapped";
    default:
      return "unknown error";
  }
}

void* FakeCuda::device_alloc(int device, size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  Alloc a{std::make_unique<uint8_t[]>(bytes + 1), bytes, device};  // +1: distinct addresses
  std::memset(a.mem.get(), 0, bytes + 1);
  void* p = a.mem.get();
  allocs_.emplace(reinterpret_cast<uintptr_t>(p), std::move(a));
  return p;
}

cuda::StreamHandle FakeCuda::user_stream(int device) {
  std::lock_guard<std::mutex> lock(mu_);
  return add_handle(streams_, device);
}

void FakeCuda::launch(cuda::StreamHandle stream, std::function<void()> fn) {
  std::lock_guard<std::mutex> lock(mu_);
  enqueue_locked(stream_locked(stream), Op{Op::kernel, std::move(fn), nullptr, 0});
}

void FakeCuda::write_on_stream(cuda::StreamHandle stream, void* dst, std::vector<uint8_t> bytes) {
  auto data = std::make_shared<std::vector<uint8_t>>(std::move(bytes));
  launch(stream, [dst, data] { std::memcpy(dst, data->data(), data->size()); });
}

void FakeCuda::hold(cuda::StreamHandle stream) {
  std::lock_guard<std::mutex> lock(mu_);
  stream_locked(stream)->held = true;
}

void FakeCuda::release(cuda::StreamHandle stream) {
  std::lock_guard<std::mutex> lock(mu_);
  stream_locked(stream)->held = false;
  cv_.notify_all();
}

void FakeCuda::pause() {
  std::lock_guard<std::mutex> lock(mu_);
  paused_ = true;
}

void FakeCuda::resume() {
  std::lock_guard<std::mutex> lock(mu_);
  paused_ = false;
  cv_.notify_all();
}

bool FakeCuda::runnable_locked(const Stream& s) const {
  if (s.held || s.running || s.ops.empty()) return false;
  const Op& op = s.ops.front();
  return op.kind != Op::wait || op.event->completed >= op.generation;
}

bool FakeCuda::drain() {
  std::unique_lock<std::mutex> lock(mu_);
  auto idle = [this] {
    if (busy_) return false;
    if (paused_) return true;
    for (auto& s : default_streams_)
      if (runnable_locked(*s)) return false;
    for (auto& [p, s] : streams_)
      if (runnable_locked(*s)) return false;
    return true;
  };
  cv_.wait(lock, idle);
  for (auto& s : default_streams_)
    if (!s->ops.empty()) return false;
  for (auto& [p, s] : streams_)
    if (!s->ops.empty()) return false;
  return true;
}

void FakeCuda::worker() {
  std::unique_lock<std::mutex> lock(mu_);
  size_t rr = 0;  // round robin over streams, so none starves another
  while (true) {
    std::vector<Stream*> all;
    for (auto& s : default_streams_) all.push_back(s.get());
    for (auto& [p, s] : streams_) all.push_back(s.get());
    Stream* pick = nullptr;
    if (!paused_) {
      for (size_t i = 0; i < all.size() && !pick; ++i) {
        Stream* s = all[(rr + i) % all.size()];
        if (runnable_locked(*s)) pick = s;
      }
    }
    if (!pick) {
      if (stop_) return;
      cv_.notify_all();  // drain() waiters
      cv_.wait(lock);
      continue;
    }
    ++rr;
    Op op = std::move(pick->ops.front());
    pick->ops.pop_front();
    switch (op.kind) {
      case Op::record:
        if (op.event->completed < op.generation) op.event->completed = op.generation;
        break;
      case Op::wait:
        break;
      case Op::copy:
        --copies_pending_[pick->device];
        if (fail_copy_device_ < 0 || fail_copy_device_ == pick->device) {
          if (fail_copy_countdown_ == 0) {
            fail_copy_countdown_ = -1;
            async_error_[pick->device] = fail_copy_err_;
            break;
          }
          if (fail_copy_countdown_ > 0) --fail_copy_countdown_;
        }
        [[fallthrough]];
      case Op::kernel:
        // Outside the lock: a kernel may take long or call back into tests.
        pick->running = true;
        busy_ = true;
        lock.unlock();
        op.fn();
        lock.lock();
        busy_ = false;
        pick->running = false;
        break;
    }
    cv_.notify_all();
  }
}

void FakeCuda::fail_next_call(const std::string& call, int err) {
  std::lock_guard<std::mutex> lock(mu_);
  fail_calls_[call] = err;
}

void FakeCuda::fail_async_copy(int err, int nth, int device) {
  std::lock_guard<std::mutex> lock(mu_);
  fail_copy_err_ = err;
  fail_copy_countdown_ = nth;
  fail_copy_device_ = device;
}

int FakeCuda::max_devices_copying() const {
  std::lock_guard<std::mutex> lock(mu_);
  return max_devices_copying_;
}

uint64_t FakeCuda::copies_enqueued() const {
  std::lock_guard<std::mutex> lock(mu_);
  return copies_;
}
uint64_t FakeCuda::pageable_copies() const {
  std::lock_guard<std::mutex> lock(mu_);
  return pageable_;
}
uint64_t FakeCuda::stream_waits() const {
  std::lock_guard<std::mutex> lock(mu_);
  return waits_;
}
uint64_t FakeCuda::unset_device_calls() const {
  std::lock_guard<std::mutex> lock(mu_);
  return unset_device_;
}
uint64_t FakeCuda::host_register_calls() const {
  std::lock_guard<std::mutex> lock(mu_);
  return register_calls_;
}
std::vector<std::pair<void*, size_t>> FakeCuda::registrations() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::pair<void*, size_t>> out;
  for (const auto& [a, n] : registered_) out.emplace_back(reinterpret_cast<void*>(a), n);
  return out;
}
int FakeCuda::streams_alive() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(streams_.size());
}
int FakeCuda::events_alive() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(events_.size());
}

}  // namespace ferry::testing
