#include "cuda/device_cuda.hpp"

#include <unistd.h>

#include <algorithm>
#include <utility>

namespace ferry {

namespace {

constexpr uint64_t kMaxRegisterSegment = 64ull << 30;
// How long the destructor waits for copies already on the GPU.
constexpr auto kShutdownWait = std::chrono::seconds(10);

std::string shape_text(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

// One cudaMemcpy(2D)Async of a request: `height` rows of `width` bytes,
// `pitch` apart in the tensor and back to back on the host.
struct Piece {
  uint64_t tensor_off;  // bytes from the view's data pointer
  uint64_t host_off;
  uint64_t width;
  uint64_t pitch;
  uint64_t height;
};

// Splits bytes [offset, offset + len) of the view's row-major stream into
// copies. A contiguous view is one copy; a view whose dims merge into rows
// with a pitch (a column slice, a padded row) is a 2D copy between partial
// first and last rows. Anything else would be one copy per element: refused.
Result<std::vector<Piece>> plan_pieces(const TensorView& v, uint64_t offset, uint64_t len) {
  std::vector<Piece> out;
  if (len == 0) return out;
  const uint64_t es = dtype_size(v.dtype);
  // Drop size-1 dims, merge dims that are contiguous with each other.
  const auto strides = v.effective_strides();
  std::vector<std::pair<int64_t, int64_t>> dims;  // size, stride (elements)
  for (size_t k = 0; k < v.shape.size(); ++k) {
    if (v.shape[k] == 1) continue;
    if (!dims.empty() && dims.back().second == strides[k] * v.shape[k]) {
      dims.back() = {dims.back().first * v.shape[k], strides[k]};
    } else {
      dims.push_back({v.shape[k], strides[k]});
    }
  }
  if (dims.empty() || (dims.size() == 1 && dims[0].second == 1)) {
    out.push_back({offset, 0, len, len, 1});
    return out;
  }
  if (dims.size() != 2 || dims[1].second != 1 || dims[0].second < dims[1].first) {
    return Status::unsupported(v.device.to_string() + ": a strided view (shape " +
                               shape_text(v.shape) + ", strides " + shape_text(strides) +
                               ") is not rows with a pitch, so cudaMemcpy2DAsync cannot copy it; "
                               "make the tensor contiguous before saving or loading it");
  }
  const uint64_t width = static_cast<uint64_t>(dims[1].first) * es;
  const uint64_t pitch = static_cast<uint64_t>(dims[0].second) * es;
  uint64_t row = offset / width, col = offset % width, host = 0, left = len;
  if (col != 0) {
    const uint64_t n = std::min(left, width - col);
    out.push_back({row * pitch + col, host, n, n, 1});
    host += n;
    left -= n;
    ++row;
  }
  if (left >= width) {
    const uint64_t rows = left / width;
    out.push_back({row * pitch, host, width, pitch, rows});
    host += rows * width;
    left -= rows * width;
    row += rows;
  }
  if (left > 0) out.push_back({row * pitch, host, left, left, 1});
  return out;
}

}  // namespace

struct CudaDevice::Request {
  bool to_host = true;
  TensorView view;
  uint64_t offset = 0;
  uint64_t len = 0;
  void* host = nullptr;
  Done done;
};

struct CudaDevice::InFlight {
  cuda::EventHandle event = nullptr;
  Done done;
  Status status;  // an error found while issuing, reported at completion
};

struct CudaDevice::PerDevice {
  cuda::StreamHandle copy_stream = nullptr;
  bool has_stream = false;
  std::vector<cuda::EventHandle> free_events;
  std::vector<cuda::EventHandle> all_events;  // for the destructor
  std::deque<Request> queue;
  std::deque<InFlight> inflight;
  cuda::EventHandle mark = nullptr;  // the caller's order point, not waited on yet
  bool explicit_marks = false;       // order_copies_after was called once
};

Result<std::shared_ptr<CudaDevice>> CudaDevice::create(std::shared_ptr<cuda::CudaApi> api,
                                                       CudaDeviceOptions opts) {
  int count = 0;
  const int err = api->get_device_count(&count);
  if (err != cuda::kSuccess || count <= 0) {
    const int e = err != cuda::kSuccess ? err : cuda::kErrorNoDevice;
    return Status::unsupported(std::string("no CUDA device: cudaGetDeviceCount: ") +
                               api->error_name(e) + " (" + api->error_string(e) + ")");
  }
  if (opts.max_inflight == 0) opts.max_inflight = 1;
  return std::shared_ptr<CudaDevice>(new CudaDevice(std::move(api), count, opts));
}

CudaDevice::CudaDevice(std::shared_ptr<cuda::CudaApi> api, int devices, CudaDeviceOptions opts)
    : api_(std::move(api)),
      devices_(devices),
      opts_(opts),
      pid_(static_cast<int>(::getpid())),
      host_(host_device()) {
  for (int d = 0; d < devices_; ++d) per_device_.push_back(std::make_unique<PerDevice>());
  thread_ = std::thread([this] { run(); });
}

CudaDevice::~CudaDevice() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

Status CudaDevice::cuda_error(int device, const char* call, int err) const {
  return Status::io_error("cuda:" + std::to_string(device) + ": " + call + " failed: " +
                          api_->error_name(err) + " (" + api_->error_string(err) + ")");
}

bool CudaDevice::handles(const Device& d) const {
  return d.is_host() || (d.index >= 0 && d.index < devices_);
}

Status CudaDevice::check_stream_device(const char* op, const Device& d) const {
  if (d.is_host() || !handles(d))
    return Status::invalid_argument(std::string(op) + ": " + d.to_string() +
                                    " is not a CUDA device of this process");
  if (static_cast<int>(::getpid()) != pid_)
    return Status::internal(d.to_string() + ": CUDA used in a forked child");
  return Status();
}

void CudaDevice::copy_out(const TensorView& src, uint64_t offset, uint64_t len, void* dst,
                          Done done) {
  if (src.device.is_host()) return host_->copy_out(src, offset, len, dst, std::move(done));
  submit(Request{true, src, offset, len, dst, std::move(done)});
}

void CudaDevice::copy_in(const void* src, const TensorView& dst, uint64_t offset, uint64_t len,
                         Done done) {
  if (dst.device.is_host()) return host_->copy_in(src, dst, offset, len, std::move(done));
  submit(Request{false, dst, offset, len, const_cast<void*>(src), std::move(done)});
}

void CudaDevice::copy_in_runs(const uint8_t* src, const TensorView& dst,
                              const std::vector<Run>& runs, Done done) {
  if (dst.device.is_host()) return host_->copy_in_runs(src, dst, runs, std::move(done));
  DeviceBackend::copy_in_runs(src, dst, runs, std::move(done));
}

std::optional<uint64_t> CudaDevice::copy_in_summed(const uint8_t* src, const TensorView& dst,
                                                   uint64_t offset, uint64_t len) {
  if (dst.device.is_host()) return host_->copy_in_summed(src, dst, offset, len);
  return std::nullopt;
}

void CudaDevice::submit(Request r) {
  const Device& d = r.view.device;
  Status bad;
  if (static_cast<int>(::getpid()) != pid_) {
    bad = Status::internal(d.to_string() +
                           ": CUDA copy requested in a forked child; CUDA must not be used "
                           "after fork");
  } else if (!handles(d)) {
    bad = Status::invalid_argument(d.to_string() + ": no such device (this process sees " +
                                   std::to_string(devices_) + ")");
  } else if (r.offset > r.view.nbytes() || r.len > r.view.nbytes() - r.offset) {
    bad = Status::invalid_argument(d.to_string() + ": byte range [" + std::to_string(r.offset) +
                                   ", " + std::to_string(r.offset + r.len) +
                                   ") exceeds the tensor's " + std::to_string(r.view.nbytes()) +
                                   " bytes");
  }
  if (!bad.ok()) return r.done(std::move(bad));
  if (r.len == 0) return r.done(Status());
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) {
      bad = Status::aborted(d.to_string() + ": the CUDA device backend is shutting down");
    } else {
      per_device_[d.index]->queue.push_back(std::move(r));
    }
  }
  if (!bad.ok()) return r.done(std::move(bad));
  cv_.notify_all();
}

bool CudaDevice::use_device_on_worker(int device) {
  if (worker_device_ == device) return true;
  if (api_->set_device(device) != cuda::kSuccess) return false;
  worker_device_ = device;
  return true;
}

Status CudaDevice::ensure_stream_locked(PerDevice& pd, int device) {
  if (pd.has_stream) return Status();
  int err = api_->stream_create_nonblocking(&pd.copy_stream);
  if (err != cuda::kSuccess) return cuda_error(device, "cudaStreamCreateWithFlags", err);
  pd.has_stream = true;
  return Status();
}

// REQUIRES: the calling thread's current device is the PerDevice's device.
Result<cuda::EventHandle> CudaDevice::take_event_locked(PerDevice& pd) {
  if (!pd.free_events.empty()) {
    cuda::EventHandle e = pd.free_events.back();
    pd.free_events.pop_back();
    return e;
  }
  cuda::EventHandle e = nullptr;
  int err = api_->event_create(&e);
  if (err != cuda::kSuccess) {
    int dev = 0;
    api_->get_device(&dev);
    return cuda_error(dev, "cudaEventCreateWithFlags", err);
  }
  pd.all_events.push_back(e);
  return e;
}

// Issues one request on the device thread. Returns false (with the failure in
// `failed`) when nothing of it is on the GPU, so its callback can run at once.
bool CudaDevice::issue_locked(PerDevice& pd, int device, Request& r,
                              std::vector<InFlight>* failed) {
  auto fail = [&](Status s) {
    failed->push_back(InFlight{nullptr, std::move(r.done), std::move(s)});
    return false;
  };
  if (!use_device_on_worker(device)) {
    int err = api_->set_device(device);
    return fail(cuda_error(device, "cudaSetDevice", err));
  }
  if (Status s = ensure_stream_locked(pd, device); !s.ok()) return fail(std::move(s));
  auto pieces = plan_pieces(r.view, r.offset, r.len);
  if (!pieces.ok()) return fail(pieces.status());

  // Order after the caller: its mark, or (never marked) the legacy default
  // stream as it is now.
  if (pd.mark != nullptr) {
    int err = api_->stream_wait_event(pd.copy_stream, pd.mark);
    // The wait captured the mark's record: the event can be reused.
    pd.free_events.push_back(pd.mark);
    pd.mark = nullptr;
    if (err != cuda::kSuccess) return fail(cuda_error(device, "cudaStreamWaitEvent", err));
  } else if (!pd.explicit_marks) {
    auto ev = take_event_locked(pd);
    if (!ev.ok()) return fail(ev.status());
    int err = api_->event_record(*ev, nullptr);
    if (err == cuda::kSuccess) err = api_->stream_wait_event(pd.copy_stream, *ev);
    pd.free_events.push_back(*ev);
    if (err != cuda::kSuccess)
      return fail(cuda_error(device, "ordering after the default stream", err));
  }

  const auto kind = r.to_host ? cuda::CopyKind::device_to_host : cuda::CopyKind::host_to_device;
  auto* tensor = static_cast<uint8_t*>(r.view.data);
  auto* host = static_cast<uint8_t*>(r.host);
  Status issue_status;
  size_t issued = 0;
  for (const Piece& p : *pieces) {
    int err;
    const char* call;
    if (p.height == 1) {
      call = "cudaMemcpyAsync";
      err = r.to_host ? api_->memcpy_async(host + p.host_off, tensor + p.tensor_off, p.width, kind,
                                           pd.copy_stream)
                      : api_->memcpy_async(tensor + p.tensor_off, host + p.host_off, p.width, kind,
                                           pd.copy_stream);
    } else {
      call = "cudaMemcpy2DAsync";
      err = r.to_host ? api_->memcpy_2d_async(host + p.host_off, p.width, tensor + p.tensor_off,
                                              p.pitch, p.width, p.height, kind, pd.copy_stream)
                      : api_->memcpy_2d_async(tensor + p.tensor_off, p.pitch, host + p.host_off,
                                              p.width, p.width, p.height, kind, pd.copy_stream);
    }
    if (err != cuda::kSuccess) {
      issue_status = cuda_error(device, call, err)
                         .with_context(std::string(r.to_host ? "copy to host" : "copy to device") +
                                       " of " + std::to_string(p.width * p.height) + " bytes");
      break;
    }
    ++issued;
  }
  if (issued == 0) return fail(std::move(issue_status));
  // Some pieces are on the GPU and still use the host memory: the request
  // ends (with the error, if any) only when they are done.
  auto ev = take_event_locked(pd);
  if (!ev.ok()) return fail(ev.status());
  int err = api_->event_record(*ev, pd.copy_stream);
  if (err != cuda::kSuccess) {
    pd.free_events.push_back(*ev);
    return fail(cuda_error(device, "cudaEventRecord", err));
  }
  pd.inflight.push_back(InFlight{*ev, std::move(r.done), std::move(issue_status)});
  return true;
}

void CudaDevice::run() {
  std::unique_lock<std::mutex> lock(mu_);
  std::chrono::steady_clock::time_point stop_deadline{};
  while (true) {
    std::vector<InFlight> finished;
    bool any_inflight = false, any_queued = false;
    for (int d = 0; d < devices_; ++d) {
      PerDevice& pd = *per_device_[d];
      if (stop_) {
        for (Request& r : pd.queue)
          finished.push_back(InFlight{
              nullptr, std::move(r.done),
              Status::aborted("cuda:" + std::to_string(d) + ": the CUDA backend shut down")});
        pd.queue.clear();
      }
      bool shrank = false;
      while (!pd.queue.empty() && pd.inflight.size() < opts_.max_inflight) {
        Request r = std::move(pd.queue.front());
        pd.queue.pop_front();
        issue_locked(pd, d, r, &finished);
        shrank = true;
      }
      if (shrank) issued_.notify_all();
      // Events complete in stream order: stop at the first that is not done.
      while (!pd.inflight.empty()) {
        if (!use_device_on_worker(d)) break;
        InFlight& f = pd.inflight.front();
        const int err = api_->event_query(f.event);
        if (err == cuda::kErrorNotReady) break;
        if (err != cuda::kSuccess && f.status.ok())
          f.status = cuda_error(d, "a copy (reported by cudaEventQuery)", err);
        pd.free_events.push_back(f.event);
        finished.push_back(std::move(f));
        pd.inflight.pop_front();
      }
      any_inflight |= !pd.inflight.empty();
      any_queued |= !pd.queue.empty();
    }
    if (!finished.empty()) {
      // Callbacks post messages and may queue more copies: not under mu_.
      lock.unlock();
      for (InFlight& f : finished) f.done(std::move(f.status));
      lock.lock();
      continue;
    }
    if (stop_ && !any_inflight) break;
    if (stop_) {
      if (stop_deadline == std::chrono::steady_clock::time_point{})
        stop_deadline = std::chrono::steady_clock::now() + kShutdownWait;
      if (std::chrono::steady_clock::now() > stop_deadline) {
        // A GPU that never finishes: report and leak the events rather than
        // hang the process at exit.
        std::vector<InFlight> hung;
        for (auto& pd : per_device_) {
          for (auto& f : pd->inflight) hung.push_back(std::move(f));
          pd->inflight.clear();
        }
        lock.unlock();
        for (auto& f : hung) f.done(Status::timeout("CUDA copy still running at shutdown"));
        lock.lock();
        break;
      }
    }
    if (any_inflight) {
      cv_.wait_for(lock, opts_.poll_interval);
    } else if (!any_queued || stop_) {
      cv_.wait(lock, [this] {
        if (stop_) return true;
        for (auto& pd : per_device_)
          if (!pd->queue.empty()) return true;
        return false;
      });
    }
  }
  // Shutdown: nothing is in flight any more.
  for (int d = 0; d < devices_; ++d) {
    PerDevice& pd = *per_device_[d];
    if (pd.all_events.empty() && !pd.has_stream) continue;
    if (api_->set_device(d) != cuda::kSuccess) continue;
    for (cuda::EventHandle e : pd.all_events) api_->event_destroy(e);
    if (pd.has_stream) api_->stream_destroy(pd.copy_stream);
  }
}

namespace {

// Sets `device` on the caller's thread for the scope and puts the caller's
// own current device back: a user's thread must not change device under it.
class DeviceScope {
 public:
  DeviceScope(cuda::CudaApi& api, int device) : api_(api) {
    if (api_.get_device(&previous_) != cuda::kSuccess) previous_ = -1;
    err_ = previous_ == device ? cuda::kSuccess : api_.set_device(device);
  }
  ~DeviceScope() {
    if (previous_ >= 0 && err_ == cuda::kSuccess) api_.set_device(previous_);
  }
  int error() const { return err_; }

 private:
  cuda::CudaApi& api_;
  int previous_ = -1;
  int err_ = cuda::kSuccess;
};

}  // namespace

Status CudaDevice::order_copies_after(const Device& d, void* stream) {
  FERRY_RETURN_IF_ERROR(check_stream_device("order_copies_after", d));
  DeviceScope scope(*api_, d.index);
  if (scope.error() != cuda::kSuccess) return cuda_error(d.index, "cudaSetDevice", scope.error());
  std::lock_guard<std::mutex> lock(mu_);
  PerDevice& pd = *per_device_[d.index];
  auto ev = take_event_locked(pd);
  if (!ev.ok()) return ev.status();
  int err = api_->event_record(*ev, stream);
  if (err != cuda::kSuccess) {
    pd.free_events.push_back(*ev);
    return cuda_error(d.index, "cudaEventRecord on the caller's stream", err);
  }
  // A newer mark supersedes one no copy has waited on yet: it is later on
  // the same stream (or on another stream the caller now uses).
  if (pd.mark != nullptr) pd.free_events.push_back(pd.mark);
  pd.mark = *ev;
  pd.explicit_marks = true;
  return Status();
}

Status CudaDevice::order_stream_after(const Device& d, void* stream) {
  FERRY_RETURN_IF_ERROR(check_stream_device("order_stream_after", d));
  DeviceScope scope(*api_, d.index);
  if (scope.error() != cuda::kSuccess) return cuda_error(d.index, "cudaSetDevice", scope.error());
  std::unique_lock<std::mutex> lock(mu_);
  PerDevice& pd = *per_device_[d.index];
  issued_.wait(lock, [&pd, this] { return pd.queue.empty() || stop_; });
  // Nothing was ever copied on this device: nothing to wait for.
  if (!pd.has_stream) return Status();
  auto ev = take_event_locked(pd);
  if (!ev.ok()) return ev.status();
  int err = api_->event_record(*ev, pd.copy_stream);
  if (err == cuda::kSuccess) err = api_->stream_wait_event(stream, *ev);
  pd.free_events.push_back(*ev);
  if (err != cuda::kSuccess)
    return cuda_error(d.index, "ordering the caller's stream after the copies", err);
  return Status();
}

HostRegistrar CudaDevice::host_registrar() {
  HostRegistrar r;
  r.name = "CUDA (cudaHostRegister)";
  r.max_segment_bytes = kMaxRegisterSegment;
  // Portable registration: device 0's context does it for every device.
  // Captures the API, not this backend: the pool may outlive it.
  r.pin = [api = api_](void* p, uint64_t n) {
    auto fail = [&api](const char* call, int err) {
      return Status::io_error(std::string("cuda:0: ") + call + " failed: " + api->error_name(err) +
                              " (" + api->error_string(err) + ")");
    };
    DeviceScope scope(*api, 0);
    if (scope.error() != cuda::kSuccess) return fail("cudaSetDevice", scope.error());
    int err = api->host_register(p, static_cast<size_t>(n));
    return err == cuda::kSuccess ? Status() : fail("cudaHostRegister", err);
  };
  r.unpin = [api = api_](void* p) {
    DeviceScope scope(*api, 0);
    api->host_unregister(p);
  };
  return r;
}

std::shared_ptr<DeviceBackend> make_default_device(const Options& opts, Status* note) {
  (void)opts;
  if (!cuda::built_with_cuda()) {
    if (note) *note = Status::unsupported("Ferry was built without CUDA: host tensors only");
    return host_device();
  }
  auto dev = CudaDevice::create(cuda::real_cuda_api());
  if (!dev.ok()) {
    if (note) *note = dev.status().with_context("using the host path");
    return host_device();
  }
  if (note) *note = Status();
  return std::move(dev).value();
}

namespace {

template <class Fn>
Status for_each_cuda_device(DeviceBackend& device, const StateDict& sd, Fn fn) {
  auto* cuda_dev = dynamic_cast<CudaDevice*>(&device);
  if (cuda_dev == nullptr) return Status();
  std::vector<int> seen;
  for (const StateEntry& e : sd.entries()) {
    const Device& d = e.view.device;
    if (d.is_host() || std::find(seen.begin(), seen.end(), d.index) != seen.end()) continue;
    seen.push_back(d.index);
    Status st = fn(*cuda_dev, d);
    if (!st.ok()) return st.with_context("tensor '" + e.key + "'");
  }
  return Status();
}

}  // namespace

Status order_copies_after(DeviceBackend& device, const StateDict& sd, const Device& stream_device,
                          void* stream) {
  return for_each_cuda_device(device, sd, [&](CudaDevice& c, const Device& d) {
    return c.order_copies_after(d, d == stream_device ? stream : nullptr);
  });
}

Status order_stream_after(DeviceBackend& device, const StateDict& sd, const Device& stream_device,
                          void* stream) {
  return for_each_cuda_device(device, sd, [&](CudaDevice& c, const Device& d) {
    return c.order_stream_after(d, d == stream_device ? stream : nullptr);
  });
}

Status register_pool_for_device(StagingPool& pool, DeviceBackend& device, const Options& opts) {
  auto* cuda_dev = dynamic_cast<CudaDevice*>(&device);
  if (cuda_dev == nullptr || !opts.cuda_register_pool) return Status();
  Status st = pool.register_memory(cuda_dev->host_registrar());
  if (!st.ok())
    return Status(st.code(), st.message() +
                                 "; set ferry.cuda-register-pool = false to run with pageable "
                                 "(slower) device copies");
  return st;
}

}  // namespace ferry
