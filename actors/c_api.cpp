// The C ABI (src/include/ferry/ferry.h) over ferry::Runtime. Every entry
// point catches C++ exceptions: an exception crossing into a C caller (or
// into ctypes) would abort the whole interpreter.

#include "ferry/ferry.h"

#include <exception>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "catalog.hpp"
#include "ferry/export.hpp"
#include "ferry/filesystem.hpp"
#include "ferry/runtime.hpp"
#include "manifest.hpp"

struct ferry_runtime {
  std::unique_ptr<ferry::Runtime> rt;
};

struct ferry_save {
  ferry::SaveHandle h;
  std::string path;  // backs ferry_save_path's pointer
};

struct ferry_manifest {
  std::string dir;
  ferry::Manifest m;
};

namespace {

thread_local std::string t_error;
thread_local std::string t_string;  // backs ferry_latest's pointer

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

// Builds a StateDict of views over the caller's tensors; the message names
// the tensor by index when it has no key to name it by.
ferry::Status to_state_dict(const ferry_tensor* ts, size_t n, ferry::StateDict* sd) {
  if (n > 0 && !ts) return ferry::Status::invalid_argument("tensors is NULL");
  for (size_t i = 0; i < n; ++i) {
    const ferry_tensor& t = ts[i];
    const std::string key = t.key ? t.key : "";
    const std::string who = key.empty() ? "tensor #" + std::to_string(i) : "tensor '" + key + "'";
    if (!valid_dtype(t.dtype))
      return ferry::Status::invalid_argument(who + ": unknown dtype " + std::to_string(t.dtype));
    if (t.ndim < 0 || (t.ndim > 0 && !t.shape))
      return ferry::Status::invalid_argument(who + ": bad ndim " + std::to_string(t.ndim) +
                                             " or NULL shape");
    if ((t.global_shape == nullptr) != (t.offsets == nullptr))
      return ferry::Status::invalid_argument(who +
                                             ": global_shape and offsets must both be set or NULL");
    ferry::Device dev;
    if (t.device_type == FERRY_DEVICE_CUDA)
      dev = ferry::Device::cuda(t.device_index);
    else if (t.device_type != FERRY_DEVICE_HOST)
      return ferry::Status::invalid_argument(who + ": unknown device type " +
                                             std::to_string(t.device_type));
    const size_t nd = static_cast<size_t>(t.ndim);
    std::vector<int64_t> shape(t.shape, t.shape + nd);
    std::vector<int64_t> strides;
    if (t.strides) strides.assign(t.strides, t.strides + nd);
    ferry::TensorView v(t.data, static_cast<ferry::DType>(t.dtype), std::move(shape), dev,
                        std::move(strides));
    std::optional<ferry::Shard> shard;
    if (t.global_shape)
      shard = ferry::Shard{std::vector<int64_t>(t.global_shape, t.global_shape + nd),
                           std::vector<int64_t>(t.offsets, t.offsets + nd)};
    ferry::StateEntry probe{key, v, shard};
    FERRY_RETURN_IF_ERROR(ferry::validate_entry(probe));
    FERRY_RETURN_IF_ERROR(sd->add(key, std::move(v), std::move(shard)));
  }
  return ferry::Status();
}

ferry_status null_arg(const char* what) {
  return fail(FERRY_INVALID_ARGUMENT, std::string(what) + " is NULL");
}

}  // namespace

extern "C" {

const char* ferry_last_error(void) {
  return t_error.c_str();
}

const char* ferry_status_name(ferry_status code) {
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
    ferry::RuntimeArgs args;
    args.settings = to_settings(settings, num_settings);
    args.rank = rank;
    args.world_size = world_size;
    auto r = ferry::Runtime::create(std::move(args));
    if (!r.ok()) return to_c(r.status());
    *out = new ferry_runtime{std::move(r).value()};
    return to_c(ferry::Status());
  });
}

ferry_status ferry_runtime_from_env(const ferry_kv* settings, size_t num_settings,
                                    ferry_runtime** out) {
  return guarded([&] {
    if (!out) return null_arg("out");
    *out = nullptr;
    ferry::RuntimeArgs args;
    args.settings = to_settings(settings, num_settings);
    auto r = ferry::Runtime::from_env(std::move(args));
    if (!r.ok()) return to_c(r.status());
    *out = new ferry_runtime{std::move(r).value()};
    return to_c(ferry::Status());
  });
}

void ferry_runtime_destroy(ferry_runtime* rt) {
  guarded([&] {
    delete rt;
    return FERRY_OK;
  });
}

int32_t ferry_runtime_rank(const ferry_runtime* rt) {
  return rt ? rt->rt->rank() : -1;
}

int32_t ferry_runtime_world_size(const ferry_runtime* rt) {
  return rt ? rt->rt->world_size() : 0;
}

// --- save ------------------------------------------------------------------------

ferry_status ferry_save_async(ferry_runtime* rt, const ferry_tensor* tensors, size_t num_tensors,
                              uint64_t step, const char* root, int overwrite,
                              const ferry_kv* metadata, size_t num_metadata, ferry_save** out) {
  return ferry_save_async_opts(rt, tensors, num_tensors, step, root, overwrite, metadata,
                               num_metadata, nullptr, out);
}

ferry_status ferry_save_async_opts(ferry_runtime* rt, const ferry_tensor* tensors,
                                   size_t num_tensors, uint64_t step, const char* root,
                                   int overwrite, const ferry_kv* metadata, size_t num_metadata,
                                   const ferry_save_options* file_opts, ferry_save** out) {
  return guarded([&] {
    if (!out) return null_arg("out");
    *out = nullptr;
    if (!rt) return null_arg("runtime");
    ferry::StateDict sd;
    if (auto st = to_state_dict(tensors, num_tensors, &sd); !st.ok()) return to_c(st);
    ferry::SaveOptions opts;
    opts.overwrite = overwrite != 0;
    opts.root = root ? root : "";
    if (num_metadata > 0 && !metadata) return null_arg("metadata");
    for (size_t i = 0; i < num_metadata; ++i) {
      if (!metadata[i].key || !metadata[i].value) return null_arg("metadata key or value");
      opts.metadata.emplace_back(metadata[i].key, metadata[i].value);
    }
    if (file_opts) {
      if (file_opts->filename_prefix) opts.filename_prefix = file_opts->filename_prefix;
      if (file_opts->shard_size != 0) opts.shard_size = file_opts->shard_size;
      if (file_opts->compress) opts.compress = file_opts->compress;
    }
    auto s = std::make_unique<ferry_save>();
    s->h = rt->rt->save_async(sd, step, opts);
    *out = s.release();
    return to_c(ferry::Status());
  });
}

ferry_status ferry_save_wait_snapshot(ferry_save* s) {
  return guarded([&] { return s ? to_c(s->h.wait_snapshot()) : null_arg("save"); });
}

ferry_status ferry_save_wait(ferry_save* s) {
  return guarded([&] { return s ? to_c(s->h.wait_committed()) : null_arg("save"); });
}

int ferry_save_snapshot_done(const ferry_save* s) {
  return !s || s->h.snapshot_done();
}

int ferry_save_done(const ferry_save* s) {
  return !s || s->h.done();
}

uint64_t ferry_save_step(const ferry_save* s) {
  return s ? s->h.step() : 0;
}

const char* ferry_save_path(ferry_save* s) {
  if (!s) return "";
  try {
    s->path = s->h.path();
  } catch (...) {
    s->path.clear();
  }
  return s->path.c_str();
}

uint64_t ferry_save_bytes_persisted(const ferry_save* s) {
  return s ? s->h.bytes_persisted() : 0;
}

uint64_t ferry_save_bytes_total(const ferry_save* s) {
  return s ? s->h.bytes_total() : 0;
}

void ferry_save_metrics_get(const ferry_save* s, ferry_save_metrics* out) {
  if (!out) return;
  *out = ferry_save_metrics{};
  if (!s) return;
  const ferry::SaveMetrics m = s->h.metrics();
  out->save_async_ms = m.save_async_ms;
  out->plan_ms = m.plan_ms;
  out->snapshot_ms = m.snapshot_ms;
  out->write_ms = m.write_ms;
  out->commit_ms = m.commit_ms;
  out->total_ms = m.total_ms;
  out->bytes = m.bytes;
  out->files = m.files;
  out->slowest_rank = m.slowest_rank;
  out->slowest_rank_ms = m.slowest_rank_ms;
}

void ferry_save_release(ferry_save* s) {
  delete s;
}

// --- load ------------------------------------------------------------------------

ferry_status ferry_load(ferry_runtime* rt, const ferry_tensor* tensors, size_t num_tensors,
                        const char* path) {
  return guarded([&] {
    if (!rt) return null_arg("runtime");
    if (!path) return null_arg("path");
    ferry::StateDict sd;
    if (auto st = to_state_dict(tensors, num_tensors, &sd); !st.ok()) return to_c(st);
    return to_c(rt->rt->load(sd, path));
  });
}

ferry_status ferry_export(ferry_runtime* rt, const char* path, const char* out_dir,
                          uint64_t max_shard_bytes, uint64_t block_bytes,
                          const char* const* metadata_keys, const char* const* metadata_values,
                          size_t num_metadata, const char** index_out) {
  return guarded([&] {
    if (!rt) return null_arg("runtime");
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
    t_string = *r;
    *index_out = t_string.c_str();
    return to_c(ferry::Status());
  });
}

// --- catalog ---------------------------------------------------------------------

ferry_status ferry_latest(const char* root, const char** out) {
  return guarded([&] {
    if (!root) return null_arg("root");
    if (!out) return null_arg("out");
    *out = "";
    auto r = ferry::find_latest(*ferry::posix_filesystem(), root);
    if (!r.ok()) return to_c(r.status());
    t_string = r->path;
    *out = t_string.c_str();
    return to_c(ferry::Status());
  });
}

ferry_status ferry_list_steps(const char* root, uint64_t* steps, size_t capacity, size_t* count) {
  return guarded([&] {
    if (!root) return null_arg("root");
    if (!count) return null_arg("count");
    *count = 0;
    auto r = ferry::list_checkpoints(*ferry::posix_filesystem(), root);
    if (!r.ok()) return to_c(r.status());
    size_t n = 0;
    for (const auto& c : *r) {
      if (!c.status.ok()) continue;
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
    auto r = ferry::apply_retention(*ferry::posix_filesystem(), root, keep_last);
    return to_c(r.status());
  });
}

ferry_status ferry_manifest_open(const char* path, ferry_manifest** out) {
  return guarded([&] {
    if (!out) return null_arg("out");
    *out = nullptr;
    if (!path) return null_arg("path");
    auto fs = ferry::posix_filesystem();
    auto dir = ferry::resolve_checkpoint(*fs, path);
    if (!dir.ok()) return to_c(dir.status());
    auto m = ferry::read_manifest(*fs, *dir);
    if (!m.ok()) return to_c(m.status());
    *out = new ferry_manifest{std::move(dir).value(), std::move(m).value()};
    return to_c(ferry::Status());
  });
}

void ferry_manifest_close(ferry_manifest* m) {
  delete m;
}

const char* ferry_manifest_path(const ferry_manifest* m) {
  return m ? m->dir.c_str() : "";
}

uint64_t ferry_manifest_step(const ferry_manifest* m) {
  return m ? m->m.step : 0;
}

uint64_t ferry_manifest_commit_seq(const ferry_manifest* m) {
  return m ? m->m.commit_seq : 0;
}

int32_t ferry_manifest_world_size(const ferry_manifest* m) {
  return m ? m->m.world_size : 0;
}

size_t ferry_manifest_num_tensors(const ferry_manifest* m) {
  return m ? m->m.tensors.size() : 0;
}

ferry_status ferry_manifest_tensor(const ferry_manifest* m, size_t i, ferry_tensor_info* out) {
  if (!m) return null_arg("manifest");
  if (!out) return null_arg("out");
  if (i >= m->m.tensors.size())
    return fail(FERRY_INVALID_ARGUMENT, "tensor index " + std::to_string(i) + " out of range (" +
                                            std::to_string(m->m.tensors.size()) + " tensors)");
  const ferry::ManifestTensor& t = m->m.tensors[i];
  out->key = t.key.c_str();
  out->dtype = static_cast<int32_t>(t.dtype);
  out->ndim = static_cast<int32_t>(t.global_shape.size());
  out->global_shape = t.global_shape.data();
  out->bytes = 0;
  for (const auto& c : t.chunks) out->bytes += c.byte_length;
  out->num_chunks = t.chunks.size();
  return FERRY_OK;
}

size_t ferry_manifest_num_metadata(const ferry_manifest* m) {
  return m ? m->m.metadata.size() : 0;
}

ferry_status ferry_manifest_metadata(const ferry_manifest* m, size_t i, const char** key,
                                     const char** value, size_t* value_len) {
  if (!m) return null_arg("manifest");
  if (i >= m->m.metadata.size())
    return fail(FERRY_INVALID_ARGUMENT, "metadata index " + std::to_string(i) + " out of range");
  const auto& kv = m->m.metadata[i];
  if (key) *key = kv.first.c_str();
  if (value) *value = kv.second.data();
  if (value_len) *value_len = kv.second.size();
  return FERRY_OK;
}

}  // extern "C"
