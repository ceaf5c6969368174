// The C ABI (src/include/ferry/ferry.h) over ferry::Runtime. Every entry
// point catches C++ exceptions: an exception crossing into a C caller (or
// into ctypes) would abort the whole interpreter.

#include "ferry/ferry.h"

#include <chrono>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <unordered_set>
#include <utility>
#include <vector>

#include "actors/c_api_internal.hpp"
#include "actors/runtime_access.hpp"
#include "catalog.hpp"
#include "ferry/catalog.hpp"
#include "ferry/export.hpp"
#include "ferry/filesystem.hpp"
#include "ferry/planner.hpp"
#include "ferry/runtime.hpp"
#include "layout.hpp"

struct ferry_save {
  ferry::SaveHandle h;
  std::string path;  // backs ferry_save_path's pointer
};

struct ferry_state_dict {
  ferry::StateDict sd;
};

struct ferry_manifest {
  explicit ferry_manifest(ferry::CheckpointManifest mm) : m(std::move(mm)), path(m.path) {}
  // Opened on a runtime: its decode, which that runtime's loads share.
  ferry_manifest(std::shared_ptr<const ferry::Manifest> d, std::string dir)
      : decoded(std::move(d)), path(std::move(dir)) {}
  // One of the two: the public catalog's form, or a runtime's decode.
  ferry::CheckpointManifest m;
  std::shared_ptr<const ferry::Manifest> decoded;
  std::string path;  // the checkpoint directory

  uint64_t step() const { return decoded ? decoded->step : m.step; }
  uint64_t commit_seq() const { return decoded ? decoded->commit_seq : m.commit_seq; }
  int32_t world_size() const { return decoded ? decoded->world_size : m.world_size; }
  const std::vector<std::pair<std::string, std::string>>& metadata() const {
    return decoded ? decoded->metadata : m.metadata;
  }
  size_t num_tensors() const { return decoded ? decoded->tensors.size() : m.tensors.size(); }
  const std::string& key(size_t i) const {
    return decoded ? decoded->tensors[i].key : m.tensors[i].key;
  }
  ferry::DType dtype(size_t i) const {
    return decoded ? decoded->tensors[i].dtype : m.tensors[i].dtype;
  }
  const std::vector<int64_t>& shape(size_t i) const {
    return decoded ? decoded->tensors[i].global_shape : m.tensors[i].global_shape;
  }
  size_t num_chunks(size_t i) const {
    return decoded ? decoded->tensors[i].chunks.size() : m.tensors[i].chunks.size();
  }
  uint64_t stored_bytes(size_t i) const {
    if (!decoded) return m.tensors[i].bytes;
    uint64_t n = 0;
    for (const ferry::ManifestChunk& c : decoded->tensors[i].chunks) n += c.byte_length;
    return n;
  }

  // ferry_manifest_tensor_table's columns, built once at its first call.
  mutable std::once_flag table_once;
  mutable std::string keys;
  mutable std::vector<int32_t> dtypes, ndims;
  mutable std::vector<int64_t> dims;
  mutable std::vector<uint64_t> bytes;
};

namespace {

thread_local std::string t_error;
thread_local std::string t_string;  // backs the strings handed out (string_out, plan bytes)

ferry_status to_c(const ferry::Status& s) {
  if (s.ok()) {
    t_error.clear();
    return FERRY_OK;
  }
  t_error = s.message();
  return static_cast<ferry_status>(s.code());
}

ferry_status fail(ferry_status code, std::string msg) {
  t_error = std::move(msg);
  return code;
}

// Answers ok with `s`, which the caller may read until this thread's next
// call that hands out a string.
ferry_status string_out(std::string s, const char** out) {
  t_string = std::move(s);
  *out = t_string.c_str();
  return to_c(ferry::Status());
}

// Runs f, turning any exception into FERRY_INTERNAL with its text.
template <class F>
ferry_status guarded(F&& f) noexcept {
  try {
    return f();
  } catch (const std::bad_alloc&) {
    return fail(FERRY_INTERNAL, "out of memory");
  } catch (const std::exception& e) {
    return fail(FERRY_INTERNAL, std::string("internal error: ") + e.what());
  } catch (...) {
    return fail(FERRY_INTERNAL, "internal error: unknown exception");
  }
}

bool valid_dtype(int32_t d) {
  return d >= FERRY_DTYPE_BOOL && d <= FERRY_DTYPE_F8_E5M2;
}

std::vector<ferry::Setting> to_settings(const ferry_kv* kv, size_t n) {
  std::vector<ferry::Setting> out;
  for (size_t i = 0; i < n; ++i)
    out.push_back({kv[i].key ? kv[i].key : "", kv[i].value ? kv[i].value : "", "code"});
  return out;
}

// One of the caller's tensors as a validated entry; the message names the
// tensor by index when it has no key to name it by.
ferry::Status to_entry(const ferry_tensor& t, size_t i, ferry::StateEntry* out) {
  std::string key = t.key ? t.key : "";
  // Built only for a message: a state dict of n entries is n calls.
  auto who = [&] { return key.empty() ? "tensor #" + std::to_string(i) : "tensor '" + key + "'"; };
  if (!valid_dtype(t.dtype))
    return ferry::Status::invalid_argument(who() + ": unknown dtype " + std::to_string(t.dtype));
  if (t.ndim < 0 || (t.ndim > 0 && !t.shape))
    return ferry::Status::invalid_argument(who() + ": bad ndim " + std::to_string(t.ndim) +
                                           " or NULL shape");
  if ((t.global_shape == nullptr) != (t.offsets == nullptr))
    return ferry::Status::invalid_argument(who() +
                                           ": global_shape and offsets must both be set or NULL");
  ferry::Device dev;
  if (t.device_type == FERRY_DEVICE_CUDA)
    dev = ferry::Device::cuda(t.device_index);
  else if (t.device_type != FERRY_DEVICE_HOST)
    return ferry::Status::invalid_argument(who() + ": unknown device type " +
                                           std::to_string(t.device_type));
  const size_t nd = static_cast<size_t>(t.ndim);
  std::vector<int64_t> shape(t.shape, t.shape + nd);
  std::vector<int64_t> strides;
  if (t.strides) strides.assign(t.strides, t.strides + nd);
  out->key = std::move(key);
  out->view = ferry::TensorView(t.data, static_cast<ferry::DType>(t.dtype), std::move(shape), dev,
                                std::move(strides));
  out->shard.reset();
  if (t.flags & ~(FERRY_TENSOR_PER_RANK | FERRY_TENSOR_RESIZE_FIRST))
    return ferry::Status::invalid_argument(who() + ": unknown flags " + std::to_string(t.flags));
  out->per_rank = (t.flags & FERRY_TENSOR_PER_RANK) != 0;
  out->on_resize =
      (t.flags & FERRY_TENSOR_RESIZE_FIRST) ? ferry::OnResize::first : ferry::OnResize::error;
  if (t.global_shape)
    out->shard = ferry::Shard{std::vector<int64_t>(t.global_shape, t.global_shape + nd),
                              std::vector<int64_t>(t.offsets, t.offsets + nd)};
  return ferry::validate_entry(*out);
}

// to_state_dict's entries, appended to `sd`.
ferry::Status add_entries(const ferry_tensor* ts, size_t n, ferry::StateDict* sd) {
  sd->reserve(sd->size() + n);
  ferry::StateEntry e;
  for (size_t i = 0; i < n; ++i) {
    FERRY_RETURN_IF_ERROR(to_entry(ts[i], i, &e));
    if (e.per_rank)
      FERRY_RETURN_IF_ERROR(sd->add_per_rank(std::move(e.key), std::move(e.view), e.on_resize));
    else
      FERRY_RETURN_IF_ERROR(sd->add(std::move(e.key), std::move(e.view), std::move(e.shard)));
  }
  return ferry::Status();
}

// From this many entries a state dict is built on a thread of its own
// (build_apart): starting one costs tens of microseconds, building 4096
// entries about a millisecond.
constexpr size_t kApartEntries = 4096;

// build() (a state dict's construction, `n` entries), on a thread of its own
// when n is large. Each entry is two small blocks (its key, its shape), and
// glibc's malloc gives a new thread an arena of its own (or one an ended
// thread left), where they are carved one after another; in the caller's
// heap (a Python process's, fragmented by its objects) each one searched the
// free lists first: 2/3 of ferry_state_dict_create_columns' time at 100,000
// entries. The caller waits: the state dict is its own as before.
template <class F>
ferry::Status build_apart(size_t n, F&& build) {
  if (n < kApartEntries) return build();
  ferry::Status st;
  std::exception_ptr ex;
  std::thread t;
  try {
    t = std::thread([&]() noexcept {
      try {
        st = build();
      } catch (...) {
        ex = std::current_exception();
      }
    });
  } catch (const std::system_error&) {
    return build();  // no thread to be had: here, as before
  }
  t.join();
  if (ex) std::rethrow_exception(ex);
  return st;
}

// Builds a StateDict of views over the caller's tensors.
ferry::Status to_state_dict(const ferry_tensor* ts, size_t n, ferry::StateDict* sd) {
  if (n > 0 && !ts) return ferry::Status::invalid_argument("tensors is NULL");
  return build_apart(n, [&] { return add_entries(ts, n, sd); });
}

// ferry_state_dict_create_columns' entries, appended to `sd`, each checked
// as a ferry_tensor as ferry_state_dict_create's are.
ferry::Status add_columns(const ferry_state_dict_columns& c, ferry::StateDict* sd) {
  const size_t n = c.num_tensors;
  sd->reserve(sd->size() + n);
  const char* key = c.keys;
  const char* const keys_end = c.keys + c.keys_bytes;
  const int64_t* shape = c.shapes;
  ferry_tensor t{};
  ferry::StateEntry e;
  for (size_t i = 0; i < n; ++i) {
    const void* nul = key < keys_end ? std::memchr(key, '\0', keys_end - key) : nullptr;
    if (!nul)
      return ferry::Status::invalid_argument(
          "ferry_state_dict_columns: keys_bytes = " + std::to_string(c.keys_bytes) + " holds " +
          std::to_string(i) + " keys, not " + std::to_string(n));
    t.key = key;
    t.data = c.data[i];
    t.dtype = c.dtypes[i];
    t.ndim = c.ndims[i];
    t.shape = t.ndim > 0 ? shape : nullptr;
    if (c.device_types) {
      t.device_type = c.device_types[i];
      t.device_index = c.device_indices[i];
    }
    FERRY_RETURN_IF_ERROR(to_entry(t, i, &e));
    FERRY_RETURN_IF_ERROR(sd->add(std::move(e.key), std::move(e.view)));
    key = static_cast<const char*>(nul) + 1;
    shape += t.ndim;
  }
  if (key != keys_end)
    return ferry::Status::invalid_argument(
        "ferry_state_dict_columns: keys_bytes = " + std::to_string(c.keys_bytes) +
        " holds more than " + std::to_string(n) + " keys");
  return ferry::Status();
}

// The caller's snapshot check as SaveOptions::snapshot_check.
std::function<ferry::Status()> snapshot_check(ferry_snapshot_check_fn fn, void* user) {
  return [fn, user]() {
    char msg[1024] = {0};
    if (fn(user, msg, sizeof msg) == 0) return ferry::Status();
    msg[sizeof msg - 1] = '\0';
    return ferry::Status::aborted(msg[0] ? std::string(msg)
                                         : std::string("the snapshot check failed"));
  };
}

ferry_status null_arg(const char* what) {
  return fail(FERRY_INVALID_ARGUMENT, std::string(what) + " is NULL");
}

// Sized structs (ferry.h): `first` is the size of the struct's first
// version; appending a field keeps it and raises sizeof(T).
template <class T, size_t first = sizeof(T)>
ferry_status size_error(size_t size, const char* name) {
  if (size >= first && size <= sizeof(T)) return FERRY_OK;
  return fail(
      FERRY_INVALID_ARGUMENT,
      std::string(name) + ".size = " + std::to_string(size) + ": this library reads " +
          (first == sizeof(T) ? std::to_string(first)
                              : std::to_string(first) + " to " + std::to_string(sizeof(T))) +
          " (sizeof(" + name + "))");
}

// A request as the caller filled it: its `size` bytes over zeroed fields.
template <class T>
ferry_status read_request(const T* in, const char* name, T* out) {
  if (!in) return null_arg(name);
  if (ferry_status e = size_error<T>(in->size, name); e != FERRY_OK) return e;
  *out = T{};
  std::memcpy(static_cast<void*>(out), in, in->size);
  return FERRY_OK;
}

// A result into the caller's struct: as much as its `size` holds.
template <class T>
ferry_status write_result(const T& full, const char* name, T* out) {
  if (!out) return null_arg(name);
  const size_t n = out->size;
  if (ferry_status e = size_error<T>(n, name); e != FERRY_OK) return e;
  std::memcpy(static_cast<void*>(out), &full, n);
  out->size = n;
  return FERRY_OK;
}

// The handles of one kind given out and not yet released. An entry point
// refuses a pointer that is not among them (released already, or never
// made here) instead of following it; a release of such a pointer does
// nothing. One table per kind for the process: the C ABI's handles are
// the process's, like the pointers themselves.
template <class T>
class Handles {
 public:
  T* add(std::unique_ptr<T> h) {
    std::lock_guard<std::mutex> lock(mu_);
    live_.insert(h.get());
    return h.release();
  }
  bool live(const T* h) const {
    std::lock_guard<std::mutex> lock(mu_);
    return live_.count(h) > 0;
  }
  // Ownership back from the table; null when `h` is not live.
  std::unique_ptr<T> take(T* h) {
    std::lock_guard<std::mutex> lock(mu_);
    if (live_.erase(h) == 0) return nullptr;
    return std::unique_ptr<T>(h);
  }

 private:
  mutable std::mutex mu_;
  std::unordered_set<const T*> live_;
};

template <class T>
Handles<T>& handles() {
  static Handles<T>* table = new Handles<T>();  // never destroyed: used until the process ends
  return *table;
}

template <class T>
bool live(const T* h) {
  return h && handles<T>().live(h);
}

// FERRY_OK for a live handle; otherwise the error naming it.
template <class T>
ferry_status check_handle(const T* h, const char* what) {
  if (!h) return null_arg(what);
  if (!handles<T>().live(h))
    return fail(FERRY_INVALID_ARGUMENT,
                std::string(what) + " is not a live handle (released already, or not one of ours)");
  return FERRY_OK;
}

#define FERRY_CHECK_HANDLE(h, what)                                               \
  do {                                                                            \
    if (ferry_status bad_ = check_handle(h, what); bad_ != FERRY_OK) return bad_; \
  } while (0)

// Turns a timed wait into the C answer: FERRY_WAIT_TIMED_OUT while `done`
// is false afterwards, else the wait's outcome (`wait`, which returns at once).
template <class Wait, class Done, class Final>
ferry_status timed_wait(int64_t timeout_ms, Wait&& wait, Done&& done, Final&& final_status) {
  if (timeout_ms < 0)
    return fail(FERRY_INVALID_ARGUMENT,
                "timeout_ms = " + std::to_string(timeout_ms) + ": must be >= 0");
  if (!done()) {
    (void)wait(std::chrono::milliseconds(timeout_ms));
    if (!done())
      return fail(FERRY_WAIT_TIMED_OUT,
                  "not done after " + std::to_string(timeout_ms) + " ms (still running)");
  }
  return to_c(final_status());
}

}  // namespace

ferry_runtime* ferry::detail::adopt_c_runtime(std::unique_ptr<Runtime> rt) {
  return handles<ferry_runtime>().add(
      std::unique_ptr<ferry_runtime>(new ferry_runtime{std::move(rt)}));
}

extern "C" {

const char* ferry_last_error(void) {
  return t_error.c_str();
}

const char* ferry_status_name(ferry_status code) {
  if (code == FERRY_WAIT_TIMED_OUT) return "wait_timed_out";
  if (code < FERRY_OK || code > FERRY_INTERNAL) return "unknown";
  return ferry::status_code_name(static_cast<ferry::StatusCode>(code));
}

int ferry_abi_version(void) {
  return FERRY_C_ABI_VERSION;
}

const char* ferry_dtype_name(int32_t dtype) {
  return valid_dtype(dtype) ? ferry::dtype_name(static_cast<ferry::DType>(dtype)) : nullptr;
}

size_t ferry_dtype_size(int32_t dtype) {
  return valid_dtype(dtype) ? ferry::dtype_size(static_cast<ferry::DType>(dtype)) : 0;
}

// --- runtime ---------------------------------------------------------------------

ferry_status ferry_runtime_create(const ferry_kv* settings, size_t num_settings, int32_t rank,
                                  int32_t world_size, ferry_runtime** out) {
  return guarded([&] {
    if (!out) return null_arg("out");
    *out = nullptr;
    if (num_settings > 0 && !settings) return null_arg("settings");
    ferry::RuntimeArgs args;
    args.settings = to_settings(settings, num_settings);
    args.rank = rank;
    args.world_size = world_size;
    auto r = ferry::Runtime::create(std::move(args));
    if (!r.ok()) return to_c(r.status());
    *out = handles<ferry_runtime>().add(
        std::unique_ptr<ferry_runtime>(new ferry_runtime{std::move(r).value()}));
    return to_c(ferry::Status());
  });
}

ferry_status ferry_runtime_from_env(const ferry_kv* settings, size_t num_settings,
                                    ferry_runtime** out) {
  return guarded([&] {
    if (!out) return null_arg("out");
    *out = nullptr;
    if (num_settings > 0 && !settings) return null_arg("settings");
    ferry::RuntimeArgs args;
    args.settings = to_settings(settings, num_settings);
    auto r = ferry::Runtime::from_env(std::move(args));
    if (!r.ok()) return to_c(r.status());
    *out = handles<ferry_runtime>().add(
        std::unique_ptr<ferry_runtime>(new ferry_runtime{std::move(r).value()}));
    return to_c(ferry::Status());
  });
}

ferry_status ferry_runtime_open(const ferry_runtime_options* options, ferry_runtime** out) {
  return guarded([&] {
    if (!out) return null_arg("out");
    *out = nullptr;
    ferry_runtime_options o;
    if (ferry_status e = read_request(options, "ferry_runtime_options", &o); e != FERRY_OK)
      return e;
    if (o.num_settings > 0 && !o.settings) return null_arg("options.settings");
    ferry::RuntimeArgs args;
    args.settings = to_settings(o.settings, o.num_settings);
    if (o.log) {
      args.logger = [fn = o.log, user = o.log_user](ferry::LogLevel level,
                                                    const std::string& message) {
        fn(user, static_cast<int32_t>(level), message.c_str());
      };
    }
    auto r = [&] {
      if (o.from_env) return ferry::Runtime::from_env(std::move(args));
      args.rank = o.rank;
      args.world_size = o.world_size > 0 ? o.world_size : 1;
      return ferry::Runtime::create(std::move(args));
    }();
    if (!r.ok()) return to_c(r.status());
    *out = handles<ferry_runtime>().add(
        std::unique_ptr<ferry_runtime>(new ferry_runtime{std::move(r).value()}));
    return to_c(ferry::Status());
  });
}

void ferry_runtime_destroy(ferry_runtime* rt) {
  guarded([&] {
    handles<ferry_runtime>().take(rt).reset();
    return FERRY_OK;
  });
}

int32_t ferry_runtime_rank(const ferry_runtime* rt) {
  return live(rt) ? rt->rt->rank() : -1;
}

int32_t ferry_runtime_world_size(const ferry_runtime* rt) {
  return live(rt) ? rt->rt->world_size() : 0;
}

// --- save ------------------------------------------------------------------------

ferry_status ferry_save_async(ferry_runtime* rt, const ferry_tensor* tensors, size_t num_tensors,
                              uint64_t step, const char* root, int overwrite,
                              const ferry_kv* metadata, size_t num_metadata, ferry_save** out) {
  ferry_save_request r{};
  r.size = sizeof r;
  r.tensors = tensors;
  r.num_tensors = num_tensors;
  r.step = step;
  r.root = root;
  r.overwrite = overwrite;
  r.metadata = metadata;
  r.num_metadata = num_metadata;
  return ferry_save_start(rt, &r, out);
}

namespace {

// The SaveOptions of a save or a planner from the C arguments they share;
// nullopt when metadata is malformed (the error is already set).
std::optional<ferry::SaveOptions> save_options(int overwrite, const ferry_kv* metadata,
                                               size_t num_metadata,
                                               const ferry_save_options* file_opts,
                                               ferry_status* error) {
  ferry::SaveOptions opts;
  opts.overwrite = overwrite != 0;
  if (num_metadata > 0 && !metadata) {
    *error = null_arg("metadata");
    return std::nullopt;
  }
  for (size_t i = 0; i < num_metadata; ++i) {
    if (!metadata[i].key || !metadata[i].value) {
      *error = null_arg("metadata key or value");
      return std::nullopt;
    }
    opts.metadata.emplace_back(metadata[i].key, metadata[i].value);
  }
  if (file_opts) {
    if (file_opts->filename_prefix) opts.filename_prefix = file_opts->filename_prefix;
    if (file_opts->shard_size != 0) opts.shard_size = file_opts->shard_size;
    if (file_opts->compress) opts.compress = file_opts->compress;
  }
  return opts;
}

ferry_status stream_device_error(int32_t device) {
  if (device >= 0) return FERRY_OK;
  return fail(FERRY_INVALID_ARGUMENT,
              "stream_device = " + std::to_string(device) + ": must be >= 0");
}

}  // namespace

ferry_status ferry_save_start(ferry_runtime* rt, const ferry_save_request* request,
                              ferry_save** out) {
  return guarded([&] {
    if (!out) return null_arg("out");
    *out = nullptr;
    FERRY_CHECK_HANDLE(rt, "runtime");
    ferry_save_request r;
    if (ferry_status e = read_request(request, "ferry_save_request", &r); e != FERRY_OK) return e;
    ferry::StateDict fresh;
    const ferry::StateDict* sd = &fresh;
    if (r.state_dict) {
      if (r.num_tensors)
        return fail(FERRY_INVALID_ARGUMENT,
                    "ferry_save_request: tensors and state_dict given; a save takes one of them");
      FERRY_CHECK_HANDLE(r.state_dict, "state dict");
      sd = &r.state_dict->sd;
    } else if (auto st = to_state_dict(r.tensors, r.num_tensors, &fresh); !st.ok()) {
      return to_c(st);
    }
    ferry_status error = FERRY_OK;
    auto opts = save_options(r.overwrite, r.metadata, r.num_metadata, &r.files, &error);
    if (!opts) return error;
    opts->root = r.root ? r.root : "";
    if (ferry_status e = stream_device_error(r.stream_device); e != FERRY_OK) return e;
    opts->stream = r.stream;
    opts->stream_device = ferry::Device::cuda(r.stream_device);
    if (r.snapshot_check)
      opts->snapshot_check = snapshot_check(r.snapshot_check, r.snapshot_check_user);
    auto s = std::make_unique<ferry_save>();
    // The options move into the save (Runtime::save_async would copy them).
    s->h = ferry::SaveHandle(ferry::detail::RuntimeAccess::start_save(
        *rt->rt, *sd, r.step, std::move(*opts), std::nullopt, false));
    *out = handles<ferry_save>().add(std::move(s));
    return to_c(ferry::Status());
  });
}

ferry_status ferry_save_wait_snapshot_stream(ferry_save* s, void* stream, int32_t stream_device) {
  return guarded([&] {
    FERRY_CHECK_HANDLE(s, "save");
    if (ferry_status e = stream_device_error(stream_device); e != FERRY_OK) return e;
    return to_c(s->h.wait_snapshot(stream, ferry::Device::cuda(stream_device)));
  });
}

// --- prepared state dicts ----------------------------------------------------

ferry_status ferry_state_dict_create(const ferry_tensor* tensors, size_t num_tensors,
                                     ferry_state_dict** out) {
  return guarded([&] {
    if (!out) return null_arg("out");
    *out = nullptr;
    auto h = std::make_unique<ferry_state_dict>();
    if (auto st = to_state_dict(tensors, num_tensors, &h->sd); !st.ok()) return to_c(st);
    *out = handles<ferry_state_dict>().add(std::move(h));
    return to_c(ferry::Status());
  });
}

ferry_status ferry_state_dict_create_columns(const ferry_state_dict_columns* columns,
                                             ferry_state_dict** out) {
  return guarded([&] {
    if (!out) return null_arg("out");
    *out = nullptr;
    ferry_state_dict_columns c;
    if (ferry_status e = read_request(columns, "ferry_state_dict_columns", &c); e != FERRY_OK)
      return e;
    const size_t n = c.num_tensors;
    if (n > 0 && (!c.keys || !c.data || !c.dtypes || !c.ndims))
      return fail(FERRY_INVALID_ARGUMENT,
                  "ferry_state_dict_columns: keys, data, dtypes and ndims must be set");
    if (!c.device_types != !c.device_indices)
      return fail(FERRY_INVALID_ARGUMENT,
                  "ferry_state_dict_columns: device_types and device_indices must both be set "
                  "or NULL");
    auto h = std::make_unique<ferry_state_dict>();
    if (auto st = build_apart(n, [&] { return add_columns(c, &h->sd); }); !st.ok()) return to_c(st);
    *out = handles<ferry_state_dict>().add(std::move(h));
    return to_c(ferry::Status());
  });
}

ferry_status ferry_state_dict_set(ferry_state_dict* sd, size_t index, const ferry_tensor* tensor) {
  return guarded([&] {
    FERRY_CHECK_HANDLE(sd, "state dict");
    if (!tensor) return null_arg("tensor");
    auto& entries = sd->sd.entries();
    if (index >= entries.size())
      return fail(FERRY_INVALID_ARGUMENT, "index " + std::to_string(index) +
                                              " is past the state dict's " +
                                              std::to_string(entries.size()) + " entries");
    ferry::StateEntry e;
    if (auto st = to_entry(*tensor, index, &e); !st.ok()) return to_c(st);
    if (e.key != entries[index].key)
      return fail(FERRY_INVALID_ARGUMENT, "tensor '" + e.key + "' at index " +
                                              std::to_string(index) + ": the entry there is '" +
                                              entries[index].key + "' (keys cannot change)");
    entries[index].view = std::move(e.view);
    entries[index].shard = std::move(e.shard);
    entries[index].per_rank = e.per_rank;
    entries[index].on_resize = e.on_resize;
    return to_c(ferry::Status());
  });
}

size_t ferry_state_dict_size(const ferry_state_dict* sd) {
  return live(sd) ? sd->sd.size() : 0;
}

void ferry_state_dict_release(ferry_state_dict* sd) {
  handles<ferry_state_dict>().take(sd).reset();
}

ferry_status ferry_save_wait_snapshot(ferry_save* s) {
  return guarded([&] {
    FERRY_CHECK_HANDLE(s, "save");
    return to_c(s->h.wait_snapshot());
  });
}

ferry_status ferry_save_wait(ferry_save* s) {
  return guarded([&] {
    FERRY_CHECK_HANDLE(s, "save");
    return to_c(s->h.wait_committed());
  });
}

ferry_status ferry_save_wait_snapshot_for(ferry_save* s, int64_t timeout_ms) {
  return guarded([&] {
    FERRY_CHECK_HANDLE(s, "save");
    const ferry::SaveHandle& h = s->h;
    return timed_wait(
        timeout_ms, [&](std::chrono::milliseconds t) { return h.wait_snapshot(t); },
        [&] { return h.snapshot_done(); }, [&] { return h.wait_snapshot(); });
  });
}

ferry_status ferry_save_wait_for(ferry_save* s, int64_t timeout_ms) {
  return guarded([&] {
    FERRY_CHECK_HANDLE(s, "save");
    const ferry::SaveHandle& h = s->h;
    return timed_wait(
        timeout_ms, [&](std::chrono::milliseconds t) { return h.wait_committed(t); },
        [&] { return h.done(); }, [&] { return h.wait_committed(); });
  });
}

int ferry_save_snapshot_done(const ferry_save* s) {
  return !live(s) || s->h.snapshot_done();
}

int ferry_save_done(const ferry_save* s) {
  return !live(s) || s->h.done();
}

uint64_t ferry_save_step(const ferry_save* s) {
  return live(s) ? s->h.step() : 0;
}

const char* ferry_save_path(ferry_save* s) {
  if (!live(s)) return "";
  try {
    s->path = s->h.path();
  } catch (...) {
    s->path.clear();
  }
  return s->path.c_str();
}

uint64_t ferry_save_bytes_persisted(const ferry_save* s) {
  return live(s) ? s->h.bytes_persisted() : 0;
}

uint64_t ferry_save_bytes_total(const ferry_save* s) {
  return live(s) ? s->h.bytes_total() : 0;
}

ferry_status ferry_save_metrics_get(const ferry_save* s, ferry_save_metrics* out) {
  return guarded([&] {
    FERRY_CHECK_HANDLE(s, "save");
    const ferry::SaveMetrics m = s->h.metrics();
    ferry_save_metrics full{sizeof full, m.save_async_ms, m.plan_ms,        m.snapshot_ms,
                            m.write_ms,  m.commit_ms,     m.total_ms,       m.bytes,
                            m.files,     m.slowest_rank,  m.slowest_rank_ms};
    return write_result(full, "ferry_save_metrics", out);
  });
}

void ferry_save_release(ferry_save* s) {
  handles<ferry_save>().take(s).reset();
}

// --- load ------------------------------------------------------------------------

ferry_status ferry_load(ferry_runtime* rt, const ferry_tensor* tensors, size_t num_tensors,
                        const char* path) {
  return guarded([&] {
    FERRY_CHECK_HANDLE(rt, "runtime");
    if (!path) return null_arg("path");
    ferry::StateDict sd;
    if (auto st = to_state_dict(tensors, num_tensors, &sd); !st.ok()) return to_c(st);
    // As Runtime::load: checkpoint tensors left out are logged.
    return to_c(rt->rt->load(sd, path));
  });
}

ferry_status ferry_load_run(ferry_runtime* rt, const ferry_load_request* request,
                            ferry_load_stats* stats) {
  return guarded([&] {
    FERRY_CHECK_HANDLE(rt, "runtime");
    ferry_load_request q;
    if (ferry_status e = read_request(request, "ferry_load_request", &q); e != FERRY_OK) return e;
    if (!q.path) return null_arg("ferry_load_request.path");
    // Checked before the load: a collective call must not fail on one rank afterwards.
    if (!stats) return null_arg("stats");
    if (ferry_status e = size_error<ferry_load_stats>(stats->size, "ferry_load_stats");
        e != FERRY_OK)
      return e;
    ferry::StateDict sd;
    if (auto st = to_state_dict(q.tensors, q.num_tensors, &sd); !st.ok()) return to_c(st);
    ferry::Result<ferry::LoadReport> r = rt->rt->load_report(sd, q.path);
    if (!r.ok()) return to_c(r.status());
    ferry_load_stats full{sizeof full,
                          r->step,
                          r->tensors_restored,
                          r->bytes_read,
                          r->bytes_received,
                          r->send_queue_peak,
                          r->share_frames_relayed,
                          r->shared_in_memory};
    return write_result(full, "ferry_load_stats", stats);
  });
}

ferry_status ferry_resolve(ferry_runtime* rt, const char* path, const char** dir_out,
                           uint64_t* step_out) {
  return guarded([&] {
    if (!rt) return null_arg("runtime");
    if (!path) return null_arg("path");
    if (!dir_out) return null_arg("dir_out");
    if (!step_out) return null_arg("step_out");
    *dir_out = "";
    *step_out = 0;
    ferry::Result<ferry::LoadReport> r = rt->rt->resolve(path);
    if (!r.ok()) return to_c(r.status());
    *step_out = r->step;
    return string_out(r->path, dir_out);
  });
}

ferry_status ferry_export(ferry_runtime* rt, const char* path, const char* out_dir,
                          uint64_t max_shard_bytes, uint64_t block_bytes,
                          const char* const* metadata_keys, const char* const* metadata_values,
                          size_t num_metadata, const char** index_out) {
  return guarded([&] {
    FERRY_CHECK_HANDLE(rt, "runtime");
    if (!path) return null_arg("path");
    if (!out_dir) return null_arg("out_dir");
    if (!index_out) return null_arg("index_out");
    if (num_metadata && (!metadata_keys || !metadata_values)) return null_arg("metadata");
    ferry::ExportOptions o;
    if (max_shard_bytes) o.max_shard_bytes = max_shard_bytes;
    if (block_bytes) o.block_bytes = block_bytes;
    for (size_t i = 0; i < num_metadata; ++i) {
      if (!metadata_keys[i] || !metadata_values[i]) return null_arg("metadata entry");
      o.metadata.emplace_back(metadata_keys[i], metadata_values[i]);
    }
    *index_out = "";
    auto r = ferry::export_checkpoint(*rt->rt, path, out_dir, o);
    if (!r.ok()) return to_c(r.status());
    return string_out(std::move(r).value(), index_out);
  });
}

// --- catalog ---------------------------------------------------------------------

ferry_status ferry_latest(const char* root, const char** out) {
  return guarded([&] {
    if (!root) return null_arg("root");
    if (!out) return null_arg("out");
    *out = "";
    auto r = ferry::Catalog().latest(root);
    if (!r.ok()) return to_c(r.status());
    return string_out(r->path, out);
  });
}

ferry_status ferry_list_steps(const char* root, uint64_t* steps, size_t capacity, size_t* count) {
  return guarded([&] {
    if (!root) return null_arg("root");
    if (!count) return null_arg("count");
    *count = 0;
    auto r = ferry::Catalog().list(root, ferry::ListOptions{/*include_uncommitted=*/false});
    if (!r.ok()) return to_c(r.status());
    size_t n = 0;
    for (const auto& c : *r) {
      if (c.state != ferry::CheckpointState::committed) continue;
      if (steps && n < capacity) steps[n] = c.step;
      ++n;
    }
    *count = n;
    return to_c(ferry::Status());
  });
}

ferry_status ferry_apply_retention(const char* root, uint32_t keep_last) {
  return guarded([&] {
    if (!root) return null_arg("root");
    auto r = ferry::Catalog().apply_retention(root, keep_last);
    return to_c(r.status());
  });
}

ferry_status ferry_manifest_open(ferry_runtime* rt, const char* path, ferry_manifest** out) {
  return guarded([&] {
    if (!out) return null_arg("out");
    *out = nullptr;
    if (rt) FERRY_CHECK_HANDLE(rt, "runtime");
    if (!path) return null_arg("path");
    if (!rt) {
      auto m = ferry::Catalog().manifest(path);
      if (!m.ok()) return to_c(m.status());
      *out = handles<ferry_manifest>().add(
          std::unique_ptr<ferry_manifest>(new ferry_manifest{std::move(m).value()}));
      return to_c(ferry::Status());
    }
    const ferry::RankContext& ctx = ferry::detail::RuntimeAccess::context(*rt->rt);
    const ferry::RootHold hold(ctx.fs, path);
    auto dir = ferry::resolve_checkpoint(*ctx.fs, path, ctx.manifests.get());
    if (!dir.ok()) return to_c(dir.status());
    auto m = ferry::read_manifest_shared(*ctx.fs, *dir, ctx.manifests.get());
    if (!m.ok()) return to_c(m.status());
    *out = handles<ferry_manifest>().add(
        std::make_unique<ferry_manifest>(std::move(m).value(), std::move(dir).value()));
    return to_c(ferry::Status());
  });
}

void ferry_manifest_close(ferry_manifest* m) {
  handles<ferry_manifest>().take(m).reset();
}

const char* ferry_manifest_path(const ferry_manifest* m) {
  return live(m) ? m->path.c_str() : "";
}

uint64_t ferry_manifest_step(const ferry_manifest* m) {
  return live(m) ? m->step() : 0;
}

uint64_t ferry_manifest_commit_seq(const ferry_manifest* m) {
  return live(m) ? m->commit_seq() : 0;
}

int32_t ferry_manifest_world_size(const ferry_manifest* m) {
  return live(m) ? m->world_size() : 0;
}

size_t ferry_manifest_num_tensors(const ferry_manifest* m) {
  return live(m) ? m->num_tensors() : 0;
}

ferry_status ferry_manifest_tensor(const ferry_manifest* m, size_t i, ferry_tensor_info* out) {
  FERRY_CHECK_HANDLE(m, "manifest");
  if (!out) return null_arg("out");
  if (i >= m->num_tensors())
    return fail(FERRY_INVALID_ARGUMENT, "tensor index " + std::to_string(i) + " out of range (" +
                                            std::to_string(m->num_tensors()) + " tensors)");
  out->key = m->key(i).c_str();
  out->dtype = static_cast<int32_t>(m->dtype(i));
  out->ndim = static_cast<int32_t>(m->shape(i).size());
  out->global_shape = m->shape(i).data();
  out->bytes = m->stored_bytes(i);
  out->num_chunks = m->num_chunks(i);
  return FERRY_OK;
}

ferry_status ferry_manifest_tensor_table(const ferry_manifest* m, ferry_manifest_table* out) {
  return guarded([&] {
    FERRY_CHECK_HANDLE(m, "manifest");
    if (!out) return null_arg("out");
    if (ferry_status e = size_error<ferry_manifest_table>(out->size, "ferry_manifest_table");
        e != FERRY_OK)
      return e;
    const size_t n = m->num_tensors();
    std::call_once(m->table_once, [&] {
      size_t key_bytes = 0, ndims = 0;
      for (size_t i = 0; i < n; ++i) {
        key_bytes += m->key(i).size() + 1;
        ndims += m->shape(i).size();
      }
      m->keys.reserve(key_bytes);
      m->dtypes.reserve(n);
      m->ndims.reserve(n);
      m->bytes.reserve(n);
      m->dims.reserve(ndims);
      for (size_t i = 0; i < n; ++i) {
        const std::vector<int64_t>& shape = m->shape(i);
        m->keys.append(m->key(i)).push_back('\0');
        m->dtypes.push_back(static_cast<int32_t>(m->dtype(i)));
        m->ndims.push_back(static_cast<int32_t>(shape.size()));
        m->dims.insert(m->dims.end(), shape.begin(), shape.end());
        m->bytes.push_back(m->stored_bytes(i));
      }
    });
    ferry_manifest_table full{sizeof full,      n,
                              m->keys.data(),   m->keys.size(),
                              m->dtypes.data(), m->ndims.data(),
                              m->dims.data(),   m->bytes.data()};
    return write_result(full, "ferry_manifest_table", out);
  });
}

size_t ferry_manifest_num_metadata(const ferry_manifest* m) {
  return live(m) ? m->metadata().size() : 0;
}

ferry_status ferry_manifest_metadata(const ferry_manifest* m, size_t i, const char** key,
                                     const char** value, size_t* value_len) {
  FERRY_CHECK_HANDLE(m, "manifest");
  if (i >= m->metadata().size())
    return fail(FERRY_INVALID_ARGUMENT, "metadata index " + std::to_string(i) + " out of range");
  const auto& kv = m->metadata()[i];
  if (key) *key = kv.first.c_str();
  if (value) *value = kv.second.data();
  if (value_len) *value_len = kv.second.size();
  return FERRY_OK;
}

}  // extern "C"

// --- planner -------------------------------------------------------------------

struct ferry_planner {
  std::unique_ptr<ferry::SavePlanner> p;
  std::string local;  // backs ferry_planner_local_plan's pointer
  std::string path;   // backs ferry_planner_barrier's
  ferry::WriteHandle written;
};

struct ferry_plans {
  std::vector<std::string> plans;  // by rank, SavePlan::to_bytes
};

namespace {

// JSON of the plans for the Python side, which has no other way to read them.
std::string json_str(const std::string& v) {
  return ferry::json_string(v);
}

template <class T>
std::string json_list(const std::vector<T>& v) {
  std::string o = "[";
  for (size_t i = 0; i < v.size(); ++i) o += (i ? "," : "") + std::to_string(v[i]);
  return o + "]";
}

std::string json_items(const std::vector<ferry::PlanItem>& items,
                       const std::vector<std::vector<int32_t>>* owners) {
  std::string o = "[";
  for (size_t i = 0; i < items.size(); ++i) {
    const auto& it = items[i];
    o += std::string(i ? "," : "") + "{\"key\":" + json_str(it.key) +
         ",\"dtype\":" + json_str(ferry::dtype_name(it.dtype)) +
         ",\"global_shape\":" + json_list(it.global_shape) +
         ",\"offsets\":" + json_list(it.offsets) + ",\"sizes\":" + json_list(it.sizes) +
         ",\"nbytes\":" + std::to_string(it.nbytes) + ",\"entry\":" + std::to_string(it.entry);
    if (owners) o += ",\"owners\":" + json_list((*owners)[i]);
    o += "}";
  }
  return o + "]";
}

// A local plan's or a rank plan's bytes, told apart by their magic.
ferry::Result<std::string> plan_json(const std::string& b) {
  if (auto l = ferry::LocalSavePlan::from_bytes(b); l.ok())
    return "{\"kind\":\"local\",\"rank\":" + std::to_string(l->rank) +
           ",\"items\":" + json_items(l->items, nullptr) + "}";
  FERRY_ASSIGN_OR_RETURN(ferry::SavePlan p, ferry::SavePlan::from_bytes(b));
  std::string writes = "[";
  for (size_t i = 0; i < p.writes.size(); ++i) {
    const auto& w = p.writes[i];
    writes += std::string(i ? "," : "") + "{\"item\":" + std::to_string(w.item) +
              ",\"offsets\":" + json_list(w.offsets) + ",\"sizes\":" + json_list(w.sizes) +
              ",\"nbytes\":" + std::to_string(w.nbytes) + ",\"file\":" + std::to_string(w.file) +
              "}";
  }
  std::string files = "[";
  for (size_t i = 0; i < p.files.size(); ++i) files += (i ? "," : "") + json_str(p.files[i]);
  return "{\"kind\":\"rank\",\"rank\":" + std::to_string(p.rank) +
         ",\"items\":" + json_items(p.items, &p.owners) + ",\"writes\":" + writes +
         "],\"files\":" + files + "],\"bytes\":" + std::to_string(p.bytes) + "}";
}

ferry::Result<std::string> plan_text(const std::string& b) {
  if (auto l = ferry::LocalSavePlan::from_bytes(b); l.ok()) return l->to_string();
  FERRY_ASSIGN_OR_RETURN(ferry::SavePlan p, ferry::SavePlan::from_bytes(b));
  return p.to_string();
}

// A C checkpoint_fn as a C++ one: the planned views as ferry_tensor records.
ferry::CheckpointFn wrap_checkpoint_fn(ferry_checkpoint_fn fn, void* user) {
  return [fn, user](const ferry::StateDict& planned, const std::string& file) {
    std::vector<ferry_tensor> ts;
    for (const auto& e : planned.entries())
      ts.push_back({e.key.c_str(), e.view.data, static_cast<int32_t>(e.view.dtype),
                    static_cast<int32_t>(e.view.shape.size()), e.view.shape.data(), nullptr,
                    FERRY_DEVICE_HOST, 0, nullptr, nullptr, 0, 0});
    char error[1024] = {0};
    if (fn(user, ts.data(), ts.size(), file.c_str(), error, sizeof(error)) == 0)
      return ferry::Status();
    error[sizeof(error) - 1] = '\0';
    return ferry::Status::aborted(error[0] ? std::string("raised: ") + error
                                           : std::string("returned an error"));
  };
}

// A C transform_local_plan as a C++ one: the plan crosses as bytes both ways.
std::function<ferry::Status(ferry::LocalSavePlan&)> wrap_transform(ferry_plan_transform_fn fn,
                                                                   void* user) {
  return [fn, user](ferry::LocalSavePlan& plan) {
    const std::string in = plan.to_bytes();
    const char* out = nullptr;
    size_t out_len = 0;
    char error[1024] = {0};
    if (fn(user, in.data(), in.size(), &out, &out_len, error, sizeof(error)) != 0) {
      error[sizeof(error) - 1] = '\0';
      return ferry::Status::aborted(error[0] ? std::string("raised: ") + error
                                             : std::string("returned an error"));
    }
    if (!out) return ferry::Status::invalid_argument("returned no plan");
    auto changed = ferry::LocalSavePlan::from_bytes(std::string(out, out_len));
    if (!changed.ok()) return changed.status().with_context("returned ");
    plan = std::move(changed).value();
    return ferry::Status();
  };
}

}  // namespace

extern "C" {

ferry_status ferry_planner_create(ferry_runtime* rt, const ferry_tensor* tensors,
                                  size_t num_tensors, const char* filename_prefix, const char* root,
                                  int has_step, uint64_t step, int overwrite,
                                  const ferry_kv* metadata, size_t num_metadata,
                                  ferry_checkpoint_fn fn, void* fn_user, ferry_planner** out) {
  ferry_planner_request r{};
  r.size = sizeof r;
  r.tensors = tensors;
  r.num_tensors = num_tensors;
  r.filename_prefix = filename_prefix;
  r.root = root;
  r.has_step = has_step;
  r.step = step;
  r.overwrite = overwrite;
  r.metadata = metadata;
  r.num_metadata = num_metadata;
  r.checkpoint_fn = fn;
  r.checkpoint_user = fn_user;
  return ferry_planner_open(rt, &r, out);
}

ferry_status ferry_planner_open(ferry_runtime* rt, const ferry_planner_request* request,
                                ferry_planner** out) {
  return guarded([&] {
    if (!out) return null_arg("out");
    *out = nullptr;
    FERRY_CHECK_HANDLE(rt, "runtime");
    ferry_planner_request r;
    if (ferry_status e = read_request(request, "ferry_planner_request", &r); e != FERRY_OK)
      return e;
    ferry::StateDict sd;
    if (auto st = to_state_dict(r.tensors, r.num_tensors, &sd); !st.ok()) return to_c(st);
    ferry::SavePlannerOptions o;
    ferry_status error = FERRY_OK;
    auto opts = save_options(r.overwrite, r.metadata, r.num_metadata, &r.files, &error);
    if (!opts) return error;
    o.save = std::move(*opts);
    if (r.checkpoint_fn) o.checkpoint_fn = wrap_checkpoint_fn(r.checkpoint_fn, r.checkpoint_user);
    switch (r.owner_policy) {
      case 0:
        break;
      case 1:
        o.owner_policy = ferry::OwnerPolicy::balanced;
        break;
      case 2:
        o.owner_policy = ferry::OwnerPolicy::lowest_rank;
        break;
      default:
        return fail(FERRY_INVALID_ARGUMENT,
                    "ferry_planner_request.owner_policy = " + std::to_string(r.owner_policy) +
                        ": expected 0 (configured), 1 (balanced) or 2 (lowest rank)");
    }
    if (r.transform_local_plan)
      o.transform_local_plan = wrap_transform(r.transform_local_plan, r.transform_user);
    if (r.snapshot_check)
      o.save.snapshot_check = snapshot_check(r.snapshot_check, r.snapshot_check_user);
    auto p = std::make_unique<ferry_planner>();
    p->p = std::make_unique<ferry::SavePlanner>(
        *rt->rt, sd, r.filename_prefix ? r.filename_prefix : "", std::move(o), r.root ? r.root : "",
        r.has_step ? std::optional<uint64_t>(r.step) : std::nullopt);
    *out = handles<ferry_planner>().add(std::move(p));
    return to_c(ferry::Status());
  });
}

void ferry_planner_destroy(ferry_planner* p) {
  try {
    handles<ferry_planner>().take(p).reset();
  } catch (...) {
  }
}

uint64_t ferry_planner_step(const ferry_planner* p) {
  return live(p) ? p->p->step() : 0;
}

ferry_status ferry_planner_local_plan(ferry_planner* p, const char** bytes, size_t* len) {
  return guarded([&] {
    FERRY_CHECK_HANDLE(p, "planner");
    if (!bytes || !len) return null_arg("bytes or len");
    auto l = p->p->create_local_plan();
    if (!l.ok()) return to_c(l.status());
    p->local = l->to_bytes();
    *bytes = p->local.data();
    *len = p->local.size();
    return to_c(ferry::Status());
  });
}

ferry_status ferry_planner_global_plan(ferry_planner* p, ferry_plans** out) {
  return guarded([&] {
    FERRY_CHECK_HANDLE(p, "planner");
    if (!out) return null_arg("out");
    *out = nullptr;
    auto g = p->p->create_global_plan();
    if (!g.ok()) return to_c(g.status());
    auto ps = std::make_unique<ferry_plans>();
    for (const auto& sp : *g) ps->plans.push_back(sp.to_bytes());
    *out = handles<ferry_plans>().add(std::move(ps));
    return to_c(ferry::Status());
  });
}

ferry_status ferry_planner_save(ferry_planner* p, const char* plan, size_t len) {
  return guarded([&] {
    FERRY_CHECK_HANDLE(p, "planner");
    if (!plan) return null_arg("plan");
    auto sp = ferry::SavePlan::from_bytes(std::string(plan, len));
    if (!sp.ok()) return to_c(sp.status());
    ferry::WriteHandle h = p->p->save_on_this_process(*sp);
    // A refused plan is over at once: say so here, not at the wait.
    if (h.done() && !h.wait().ok()) return to_c(h.wait());
    p->written = h;
    return to_c(ferry::Status());
  });
}

ferry_status ferry_planner_wait_written(ferry_planner* p) {
  return guarded([&] {
    FERRY_CHECK_HANDLE(p, "planner");
    return to_c(p->written.wait());
  });
}

ferry_status ferry_planner_wait_written_for(ferry_planner* p, int64_t timeout_ms) {
  return guarded([&] {
    FERRY_CHECK_HANDLE(p, "planner");
    const ferry::WriteHandle& w = p->written;
    return timed_wait(
        timeout_ms, [&](std::chrono::milliseconds t) { return w.wait(t); },
        [&] { return w.done(); }, [&] { return w.wait(); });
  });
}

ferry_status ferry_planner_barrier(ferry_planner* p, const char** path) {
  return ferry_planner_barrier_for(p, -1, path);
}

ferry_status ferry_planner_barrier_for(ferry_planner* p, int64_t timeout_ms, const char** path) {
  return guarded([&] {
    FERRY_CHECK_HANDLE(p, "planner");
    auto r =
        timeout_ms < 0 ? p->p->barrier() : p->p->barrier(std::chrono::milliseconds(timeout_ms));
    if (!r.ok() && r.status().code() == ferry::StatusCode::timeout && !p->p->handle().done())
      return fail(FERRY_WAIT_TIMED_OUT, r.status().message());
    if (!r.ok()) return to_c(r.status());
    p->path = *r;
    if (path) *path = p->path.c_str();
    return to_c(ferry::Status());
  });
}

ferry_status ferry_plan_global(const char* const* local_plans, const size_t* lens, size_t num_ranks,
                               int lowest_rank, const ferry_save_options* files,
                               ferry_plans** out) {
  return guarded([&] {
    if (!out) return null_arg("out");
    *out = nullptr;
    if (num_ranks > 0 && (!local_plans || !lens)) return null_arg("local_plans or lens");
    std::vector<ferry::LocalSavePlan> locals;
    for (size_t r = 0; r < num_ranks; ++r) {
      auto l = ferry::LocalSavePlan::from_bytes(std::string(local_plans[r], lens[r]));
      if (!l.ok()) return to_c(l.status().with_context("local_plans[" + std::to_string(r) + "]: "));
      locals.push_back(std::move(l).value());
    }
    ferry_status error = FERRY_OK;
    auto opts = save_options(0, nullptr, 0, files, &error);
    if (!opts) return error;
    auto g = ferry::plan::global_plan(
        locals, lowest_rank ? ferry::OwnerPolicy::lowest_rank : ferry::OwnerPolicy::balanced,
        *opts);
    if (!g.ok()) return to_c(g.status());
    auto ps = std::make_unique<ferry_plans>();
    for (const auto& sp : *g) ps->plans.push_back(sp.to_bytes());
    *out = handles<ferry_plans>().add(std::move(ps));
    return to_c(ferry::Status());
  });
}

size_t ferry_plans_count(const ferry_plans* ps) {
  return live(ps) ? ps->plans.size() : 0;
}

ferry_status ferry_plans_get(const ferry_plans* ps, size_t rank, const char** bytes, size_t* len) {
  FERRY_CHECK_HANDLE(ps, "plans");
  if (!bytes || !len) return null_arg("bytes or len");
  if (rank >= ps->plans.size())
    return fail(FERRY_INVALID_ARGUMENT, "rank " + std::to_string(rank) + " of " +
                                            std::to_string(ps->plans.size()) + " plans");
  *bytes = ps->plans[rank].data();
  *len = ps->plans[rank].size();
  return FERRY_OK;
}

void ferry_plans_release(ferry_plans* ps) {
  handles<ferry_plans>().take(ps).reset();
}

ferry_status ferry_local_plan_edit(const char* plan, size_t len, const uint32_t* items,
                                   const char* const* keys, size_t num_items, const char** out,
                                   size_t* out_len) {
  return guarded([&] {
    if (!plan || !out || !out_len || (num_items > 0 && !items))
      return null_arg("plan, items, out or out_len");
    auto parsed = ferry::LocalSavePlan::from_bytes(std::string(plan, len));
    if (!parsed.ok()) return to_c(parsed.status());
    const ferry::LocalSavePlan& in = *parsed;
    ferry::LocalSavePlan edited;
    edited.rank = in.rank;
    for (size_t k = 0; k < num_items; ++k) {
      if (items[k] >= in.items.size())
        return fail(FERRY_INVALID_ARGUMENT,
                    "items[" + std::to_string(k) + "] = " + std::to_string(items[k]) +
                        ": the plan has " + std::to_string(in.items.size()) + " items");
      edited.items.push_back(in.items[items[k]]);
      if (keys && keys[k]) edited.items.back().key = keys[k];
    }
    t_string = edited.to_bytes();
    *out = t_string.data();
    *out_len = t_string.size();
    return to_c(ferry::Status());
  });
}

ferry_status ferry_plan_json(const char* bytes, size_t len, const char** json) {
  return guarded([&] {
    if (!bytes || !json) return null_arg("bytes or json");
    auto j = plan_json(std::string(bytes, len));
    if (!j.ok()) return to_c(j.status());
    return string_out(std::move(j).value(), json);
  });
}

ferry_status ferry_plan_text(const char* bytes, size_t len, const char** text) {
  return guarded([&] {
    if (!bytes || !text) return null_arg("bytes or text");
    auto t = plan_text(std::string(bytes, len));
    if (!t.ok()) return to_c(t.status());
    return string_out(std::move(t).value(), text);
  });
}

}  // extern "C"
