/* Ferry's C ABI: a plain C interface over ferry::Runtime, for callers that
 * cannot (or should not) link C++: the `ferry` Python package loads it with
 * ctypes, so one build of libferry_c.so serves every CPython and every torch.
 *
 * Conventions
 * - Every fallible function returns a ferry_status (FERRY_OK = 0). On an
 *   error, ferry_last_error() returns Ferry's message ("tensor 'w': dtype F16
 *   requested, checkpoint has F32"). The message is thread-local: it belongs
 *   to the thread that made the failing call and stays valid until that
 *   thread's next call into this library.
 * - Handles are opaque. Each *_create / *_open / ferry_save_async has a
 *   matching release function; releasing NULL is a no-op. A handle is
 *   released once, and never while another thread is inside a call on it.
 *   Past that contract, the cheap mistakes are caught: releasing a handle
 *   again does nothing, and passing a released handle (or a pointer that
 *   never was one) fails with FERRY_INVALID_ARGUMENT ("... is not a live
 *   handle"), or returns the function's empty value (0, "", -1) where it
 *   returns no status. (A released handle's address reused by a newer handle
 *   of the same kind reaches that newer one.)
 * - No function throws or aborts: C++ exceptions are caught at this boundary
 *   and returned as FERRY_INTERNAL.
 * - Strings passed in are NUL-terminated UTF-8 and only read during the call.
 *   Strings returned are owned by the handle they came from and live as long
 *   as it, unless said otherwise.
 * - Thread safety: a runtime may be used from several threads, as
 *   ferry::Runtime may; a save handle may be waited on from any thread.
 * - Waits: each blocking wait has a timed form (*_for, timeout_ms >= 0)
 *   that returns FERRY_WAIT_TIMED_OUT when the time passed first; the save
 *   goes on, and the caller may wait again (e.g. in short slices, to notice
 *   a signal such as Ctrl-C between them).
 */
#ifndef FERRY_FERRY_H_
#define FERRY_FERRY_H_

#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__)
#define FERRY_API __attribute__((visibility("default")))
#else
#define FERRY_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped when a struct layout or a function signature changes. */
#define FERRY_C_ABI_VERSION 6

/* Mirrors ferry::StatusCode. */
typedef enum ferry_status {
  FERRY_OK = 0,
  FERRY_INVALID_ARGUMENT = 1,
  FERRY_NOT_FOUND = 2,
  FERRY_ALREADY_EXISTS = 3,
  FERRY_IO_ERROR = 4,
  FERRY_CORRUPTION = 5,
  FERRY_UNSUPPORTED = 6,
  FERRY_BUSY = 7,
  FERRY_ABORTED = 8,
  FERRY_TIMEOUT = 9,
  FERRY_OUTCOME_UNKNOWN = 10,
  FERRY_INTERNAL = 11,
  /* A timed wait's time passed before what it waits for: not a failure (the
   * save goes on). Unlike FERRY_TIMEOUT, a save that failed by a deadline. */
  FERRY_WAIT_TIMED_OUT = 12
} ferry_status;

/* Mirrors ferry::DType (safetensors names in comments). */
typedef enum ferry_dtype {
  FERRY_DTYPE_BOOL = 0, /* BOOL */
  FERRY_DTYPE_U8 = 1,
  FERRY_DTYPE_I8 = 2,
  FERRY_DTYPE_I16 = 3,
  FERRY_DTYPE_U16 = 4,
  FERRY_DTYPE_I32 = 5,
  FERRY_DTYPE_U32 = 6,
  FERRY_DTYPE_I64 = 7,
  FERRY_DTYPE_U64 = 8,
  FERRY_DTYPE_F16 = 9,
  FERRY_DTYPE_BF16 = 10,
  FERRY_DTYPE_F32 = 11,
  FERRY_DTYPE_F64 = 12,
  FERRY_DTYPE_F8_E4M3 = 13,
  FERRY_DTYPE_F8_E5M2 = 14
} ferry_dtype;

typedef enum ferry_device_type { FERRY_DEVICE_HOST = 0, FERRY_DEVICE_CUDA = 1 } ferry_device_type;

/* One tensor of a state dict: a non-owning view of the caller's memory.
 * For a save the memory must stay valid and unchanged until the save's
 * snapshot is done (ferry_save_wait_snapshot); for a load, during the call. */
typedef struct ferry_tensor {
  const char* key;        /* unique in the state dict, e.g. "layer0.weight" */
  void* data;             /* first element (NULL only when the tensor is empty) */
  int32_t dtype;          /* a ferry_dtype */
  int32_t ndim;           /* 0 for a scalar */
  const int64_t* shape;   /* ndim sizes (of this view, i.e. of the local shard) */
  const int64_t* strides; /* ndim strides in elements, or NULL for row-major contiguous */
  int32_t device_type;    /* a ferry_device_type */
  int32_t device_index;   /* CUDA ordinal; 0 for host */
  /* When this view is a shard of a larger tensor: the global shape and this
   * view's offsets in every dimension (ndim each). Both NULL: the view is
   * the whole tensor. */
  const int64_t* global_shape;
  const int64_t* offsets;
  /* 0, or FERRY_TENSOR_PER_RANK (a whole tensor, no shard): one value per
   * rank (an RNG state, a data position), stored as "<key>@rank<r>" (keys of
   * that form are reserved) and never a replica; a load gives each rank its
   * own. Into another world size the load fails naming the key and both
   * sizes, unless FERRY_TENSOR_RESIZE_FIRST is set too: every rank then
   * gets rank 0's value. */
  uint32_t flags;
  uint32_t reserved; /* 0 */
} ferry_tensor;
#define FERRY_TENSOR_PER_RANK 1u
#define FERRY_TENSOR_RESIZE_FIRST 2u

/* A key/value pair: settings (the keys of the [ferry] config section, e.g.
 * "pool-bytes" = "64MiB") or manifest metadata. */
typedef struct ferry_kv {
  const char* key;
  const char* value;
} ferry_kv;

typedef struct ferry_runtime ferry_runtime;
typedef struct ferry_save ferry_save;
typedef struct ferry_manifest ferry_manifest;
typedef struct ferry_state_dict ferry_state_dict;

/* --- errors and versions ------------------------------------------------- */

/* The message of this thread's last failed call ("" if none). */
FERRY_API const char* ferry_last_error(void);
/* "invalid_argument", "io_error", ... */
FERRY_API const char* ferry_status_name(ferry_status code);
FERRY_API int ferry_abi_version(void);
/* Safetensors name of a dtype ("F32"), or NULL for an unknown one. */
FERRY_API const char* ferry_dtype_name(int32_t dtype);
/* Bytes per element, 0 for an unknown dtype. */
FERRY_API size_t ferry_dtype_size(int32_t dtype);

/* --- runtime ------------------------------------------------------------- */

/* Starts a runtime for `rank` of `world_size` (1 process: 0 of 1). Settings
 * have the highest precedence, above FERRY_CONFIG and the config file. A
 * runtime with world_size > 1 connects to its peers before it returns. */
FERRY_API ferry_status ferry_runtime_create(const ferry_kv* settings, size_t num_settings,
                                            int32_t rank, int32_t world_size, ferry_runtime** out);
/* The same, with rank and world size from RANK / WORLD_SIZE (torchrun). */
FERRY_API ferry_status ferry_runtime_from_env(const ferry_kv* settings, size_t num_settings,
                                              ferry_runtime** out);
/* Waits (bounded) for an in-flight save, then stops the runtime. A writer
 * thread stuck in storage or in a checkpoint_fn (abandoned by its save's
 * deadline) is left running after a short wait, so this always returns. */
FERRY_API void ferry_runtime_destroy(ferry_runtime* rt);
FERRY_API int32_t ferry_runtime_rank(const ferry_runtime* rt);
FERRY_API int32_t ferry_runtime_world_size(const ferry_runtime* rt);

/* Where a runtime's messages go (a checkpoint committed with warnings,
 * tensors a load left out, threads left running at shutdown): `level` is a
 * ferry_log_level, `message` one line without its newline, valid during the
 * call. Called from any of Ferry's threads, several at once: it must be
 * thread-safe and quick, and must not call into the runtime. It may be
 * called as long as the process lives (a thread a runtime left running at
 * shutdown may still log): keep it and `log_user` valid until then. */
typedef enum ferry_log_level {
  FERRY_LOG_DEBUG = 0,
  FERRY_LOG_INFO = 1,
  FERRY_LOG_WARNING = 2,
  FERRY_LOG_ERROR = 3
} ferry_log_level;
typedef void (*ferry_log_fn)(void* user, int32_t level, const char* message);

/* Sized structs. Every operation with options has one entry point taking a
 * request struct whose first field, `size`, is sizeof(the struct) as the
 * caller was compiled: a later ferry.h appends fields, which a smaller size
 * leaves at their zero defaults; a size larger than this library knows, or
 * smaller than the first version's, is invalid. Results structs (stats,
 * metrics) work the same way: the caller sets `size`, the library fills
 * that much. Zero fields mean the defaults. */

/* What ferry_runtime_open starts. */
typedef struct ferry_runtime_options {
  size_t size;
  const ferry_kv* settings; /* highest precedence, as ferry_runtime_create's */
  size_t num_settings;
  int32_t rank;       /* with world_size; ignored with from_env */
  int32_t world_size; /* 0: 1 */
  int32_t from_env;   /* non-zero: rank and world size from RANK / WORLD_SIZE (torchrun) */
  ferry_log_fn log;   /* NULL: each message and a newline on stderr */
  void* log_user;     /* passed to log */
} ferry_runtime_options;

/* Starts a runtime, as ferry_runtime_create / ferry_runtime_from_env (which
 * stay, as the forms without options; new fields come here only). */
FERRY_API ferry_status ferry_runtime_open(const ferry_runtime_options* options,
                                          ferry_runtime** out);

/* --- save ---------------------------------------------------------------- */

/* Starts a checkpoint of the tensors at `step` under `root` (NULL or "" =
 * the configured root) and returns at once with a handle in *out. Metadata
 * is stored in the manifest. An invalid state dict (duplicate key, bad
 * dtype, shard outside its global shape) fails here, with no handle; any
 * later failure is reported by the waits. Every root or path of this API may
 * also be an S3 bucket prefix, "s3://bucket/prefix" (setting s3-endpoint,
 * credentials from AWS_*; docs/format.md section 8). */
FERRY_API ferry_status ferry_save_async(ferry_runtime* rt, const ferry_tensor* tensors,
                                        size_t num_tensors, uint64_t step, const char* root,
                                        int overwrite, const ferry_kv* metadata,
                                        size_t num_metadata, ferry_save** out);
/* How a save lays out its data files: NULL strings and shard_size 0 keep
 * the configured ferry.filename-prefix, ferry.shard-size and ferry.compress.
 * A bad value (a prefix with a path separator or "..", a negative
 * shard_size, an unknown codec) fails the save's start naming the field. */
typedef struct ferry_save_options {
  const char* filename_prefix; /* data files <prefix>-<rank>-<k>.<ext> */
  int64_t shard_size;          /* most data bytes per file */
  const char* compress;        /* "none", "true", "zstd", "zstd:<level>" */
} ferry_save_options;
/* Called once when this rank's snapshot of a save has ended (every byte is
 * off the tensors), on one of Ferry's threads, before the snapshot waits
 * return. Returns 0 to go on; otherwise it may put a message in error
 * (error_len bytes, NUL-terminated) and the save fails with it on every
 * rank. It must not wait for that save. (The Python package compares
 * torch's tensor versions here: a tensor changed during the snapshot.) */
typedef int (*ferry_snapshot_check_fn)(void* user, char* error, size_t error_len);
/* A prepared state dict: the tensors validated and copied (keys, shapes,
 * pointers; not their bytes) once, for saves that repeat with the same
 * tensors, so a save of n tensors costs O(1) here instead of O(n). The
 * memory rules of ferry_tensor apply to each save of it. */
FERRY_API ferry_status ferry_state_dict_create(const ferry_tensor* tensors, size_t num_tensors,
                                               ferry_state_dict** out);
/* The same state dict from columns, one array per field, for a caller that
 * holds its tensors' fields as arrays (the Python package): no ferry_tensor
 * per tensor to pack. Whole tensors, row-major contiguous, not per-rank
 * (other entries go through ferry_state_dict_create). Sized: see above. */
typedef struct ferry_state_dict_columns {
  size_t size;
  size_t num_tensors;
  /* The keys, each NUL-terminated, one after another: keys_bytes bytes (the
   * NULs included) holding exactly num_tensors keys. */
  const char* keys;
  size_t keys_bytes;
  void* const* data;     /* each tensor's first element (NULL when empty) */
  const int32_t* dtypes; /* ferry_dtype each */
  const int32_t* ndims;
  const int64_t* shapes; /* every tensor's ndims[i] sizes, one after another */
  /* ferry_device_type and CUDA ordinal of each tensor; NULL: all on the host. */
  const int32_t* device_types;
  const int32_t* device_indices;
} ferry_state_dict_columns;
FERRY_API ferry_status ferry_state_dict_create_columns(const ferry_state_dict_columns* columns,
                                                       ferry_state_dict** out);
/* Replaces entry `index` (a tensor moved, was reshaped, ...); its key must
 * stay the same. A save already started keeps the entries it was given. */
FERRY_API ferry_status ferry_state_dict_set(ferry_state_dict* sd, size_t index,
                                            const ferry_tensor* tensor);
FERRY_API size_t ferry_state_dict_size(const ferry_state_dict* sd);
FERRY_API void ferry_state_dict_release(ferry_state_dict* sd);
/* Everything a save may carry (sized: see above). */
typedef struct ferry_save_request {
  size_t size;
  /* The state: tensors (num_tensors of them), or a prepared state dict. */
  const ferry_tensor* tensors;
  size_t num_tensors;
  const ferry_state_dict* state_dict;
  uint64_t step;
  const char* root; /* NULL or "": the configured root */
  int32_t overwrite;
  const ferry_kv* metadata; /* stored in the manifest */
  size_t num_metadata;
  ferry_save_options files;
  /* The caller's CUDA stream (a cudaStream_t) on CUDA device stream_device:
   * copies off CUDA tensors are ordered after the work queued on it before
   * the save. NULL: the legacy default stream. */
  void* stream;
  int32_t stream_device;
  ferry_snapshot_check_fn snapshot_check; /* NULL: none */
  void* snapshot_check_user;              /* its first argument */
} ferry_save_request;
/* ferry_save_async with everything a request carries. */
FERRY_API ferry_status ferry_save_start(ferry_runtime* rt, const ferry_save_request* request,
                                        ferry_save** out);
/* Blocks until every byte is off the caller's tensors (or the save failed). */
FERRY_API ferry_status ferry_save_wait_snapshot(ferry_save* s);
/* Stream-ordered: makes the CUDA stream `stream` (a cudaStream_t on device
 * stream_device; NULL: the legacy default stream) wait, on the GPU, for the
 * copies off the CUDA tensors, so work queued on it afterwards may change
 * them; the host waits only until every copy is queued (host tensors of the
 * save: until they are copied). A copy that fails afterwards fails the save
 * (ferry_save_wait reports it). */
FERRY_API ferry_status ferry_save_wait_snapshot_stream(ferry_save* s, void* stream,
                                                       int32_t stream_device);
/* Blocks until the checkpoint is committed (or failed). Every save ends by
 * its phase deadlines (plan-, write-, commit-timeout, plus a short drain):
 * a write or checkpoint_fn that never returns fails it with FERRY_TIMEOUT
 * naming the rank, the phase and the file. */
FERRY_API ferry_status ferry_save_wait(ferry_save* s);
/* The same, waiting at most timeout_ms: FERRY_WAIT_TIMED_OUT if the
 * snapshot (the save) is not over by then. */
FERRY_API ferry_status ferry_save_wait_snapshot_for(ferry_save* s, int64_t timeout_ms);
FERRY_API ferry_status ferry_save_wait_for(ferry_save* s, int64_t timeout_ms);
FERRY_API int ferry_save_snapshot_done(const ferry_save* s);
FERRY_API int ferry_save_done(const ferry_save* s);
FERRY_API uint64_t ferry_save_step(const ferry_save* s);
/* The committed directory once done, else "". Valid until the next call of
 * this function on the same handle, or its release. */
FERRY_API const char* ferry_save_path(ferry_save* s);
FERRY_API uint64_t ferry_save_bytes_persisted(const ferry_save* s);
FERRY_API uint64_t ferry_save_bytes_total(const ferry_save* s);

typedef struct ferry_save_metrics {
  size_t size; /* set by the caller (sized: see above) */
  double save_async_ms;
  double plan_ms;
  double snapshot_ms;
  double write_ms;
  double commit_ms;
  double total_ms;
  uint64_t bytes;
  uint64_t files;
  int32_t slowest_rank;
  double slowest_rank_ms;
} ferry_save_metrics;
FERRY_API ferry_status ferry_save_metrics_get(const ferry_save* s, ferry_save_metrics* out);
/* Drops the handle; the save itself goes on (the runtime keeps it). */
FERRY_API void ferry_save_release(ferry_save* s);

/* --- load ---------------------------------------------------------------- */

/* Fills the tensors from the checkpoint at `path` (a step directory, or a
 * root: then its latest), resharding as their shards ask. Every tensor must
 * be in the checkpoint with the same dtype and global shape. In a job of
 * several ranks every rank calls it with the same path (rank 0 picks the
 * checkpoint; ranks naming different ones fail at once), and every rank
 * gets the same outcome. A load that fails (a checksum mismatch included)
 * leaves the tensors partly written, bytes that failed their check among
 * them: the error names the tensors holding such bytes. */
FERRY_API ferry_status ferry_load(ferry_runtime* rt, const ferry_tensor* tensors,
                                  size_t num_tensors, const char* path);

/* What one load did on this rank. */
typedef struct ferry_load_stats {
  size_t size;               /* set by the caller (sized: see above) */
  uint64_t step;             /* of the checkpoint loaded */
  uint64_t tensors_restored; /* the tensors given, every one filled */
  uint64_t bytes_read;       /* from the data files, by this rank */
  uint64_t bytes_received;   /* replicated bytes another rank of its node read for it */
  /* The most bytes this rank had queued for other ranks at once (bounded by
   * the share-window option whatever the state's size). */
  uint64_t send_queue_peak;
  /* Rank 0: frames of shared bytes it passed on between two other ranks (0
   * when the ranks of a node reach each other over direct lanes). */
  uint64_t share_frames_relayed;
  /* Bytes this rank read for other ranks of its node and put straight in
   * their share rings (share-memory), not in frames. */
  uint64_t shared_in_memory;
} ferry_load_stats;
/* What a load reads into (sized: see above). */
typedef struct ferry_load_request {
  size_t size;
  const ferry_tensor* tensors;
  size_t num_tensors;
  const char* path; /* a step directory, or a root: its latest */
} ferry_load_request;
/* ferry_load of a request, which also fills *stats (its size set by the
 * caller) when the load succeeds. Unlike ferry_load it does not log the
 * checkpoint tensors left out (the caller chose them). */
FERRY_API ferry_status ferry_load_run(ferry_runtime* rt, const ferry_load_request* request,
                                      ferry_load_stats* stats);

/* The checkpoint a load of `path` reads now (a root: its latest), as rank 0
 * resolves it for every rank: its directory in *dir_out (owned by this
 * thread, valid until its next call into this library), its step in
 * *step_out; nothing is loaded. In a job of several ranks every rank calls
 * it, in the same order, and gets the same answer: loading *dir_out then
 * reads that checkpoint whatever commits meanwhile. */
FERRY_API ferry_status ferry_resolve(ferry_runtime* rt, const char* path, const char** dir_out,
                                     uint64_t* step_out);

/* Writes the checkpoint at `path` (or a root's latest) consolidated into
 * out_dir: model-0000i-of-0000N.safetensors files of at most
 * max_shard_bytes each (0: 5 GiB) and model.safetensors.index.json, whose
 * path goes to *index_out (owned by this thread, valid until its next call
 * into this library). Memory stays near block_bytes (0: 256 MiB). The
 * num_metadata key/value pairs are added to every file's __metadata__.
 * `rt` must be a single-process runtime. */
FERRY_API ferry_status ferry_export(ferry_runtime* rt, const char* path, const char* out_dir,
                                    uint64_t max_shard_bytes, uint64_t block_bytes,
                                    const char* const* metadata_keys,
                                    const char* const* metadata_values, size_t num_metadata,
                                    const char** index_out);

/* --- catalog (no runtime needed) ---------------------------------------- */

/* The latest committed checkpoint under root in *out (owned by this thread,
 * valid until its next call into this library); FERRY_NOT_FOUND if none.
 * Like every reader of a root, it first puts back a step that an overwrite
 * killed half-way left aside (under ROOT's lock): if it cannot, that is an
 * error naming the step, never FERRY_NOT_FOUND. */
FERRY_API ferry_status ferry_latest(const char* root, const char** out);
/* Steps of the committed, readable checkpoints under root, by commit order.
 * Writes at most `capacity` steps and sets *count to how many there are. */
FERRY_API ferry_status ferry_list_steps(const char* root, uint64_t* steps, size_t capacity,
                                        size_t* count);
/* Keeps the keep_last newest committed checkpoints, deleting older ones
 * (taken out of sight under ROOT's lock, as a commit does, then deleted). */
FERRY_API ferry_status ferry_apply_retention(const char* root, uint32_t keep_last);

/* Reads the manifest of `path` (a checkpoint, or a root: its latest).
 * With a runtime `rt` (NULL: none), through its filesystem, and the decoded
 * manifest is shared with rt's loads, so opening a checkpoint and then
 * loading it decodes its manifest once; a manifest changed on disk meanwhile
 * is decoded again by the load (its bytes are checked each time). */
FERRY_API ferry_status ferry_manifest_open(ferry_runtime* rt, const char* path,
                                           ferry_manifest** out);
FERRY_API void ferry_manifest_close(ferry_manifest* m);
FERRY_API const char* ferry_manifest_path(const ferry_manifest* m); /* the checkpoint dir */
FERRY_API uint64_t ferry_manifest_step(const ferry_manifest* m);
FERRY_API uint64_t ferry_manifest_commit_seq(const ferry_manifest* m);
FERRY_API int32_t ferry_manifest_world_size(const ferry_manifest* m);
FERRY_API size_t ferry_manifest_num_tensors(const ferry_manifest* m);

/* Tensor i (sorted by key) of a manifest; pointers owned by the manifest. */
typedef struct ferry_tensor_info {
  const char* key;
  int32_t dtype;
  int32_t ndim;
  const int64_t* global_shape;
  uint64_t bytes; /* stored bytes of all its chunks */
  uint64_t num_chunks;
} ferry_tensor_info;
FERRY_API ferry_status ferry_manifest_tensor(const ferry_manifest* m, size_t i,
                                             ferry_tensor_info* out);

/* Every tensor of a manifest at once, in ferry_manifest_tensor's order (a
 * reader of tens of thousands makes one call, not one each): their keys
 * NUL-terminated one after another in `keys` (keys_len bytes in all), the
 * dtype, ndim and stored bytes of each, and their global shapes one after
 * another in `dims` (the sum of the ndims). Sized (see above); the arrays
 * are owned by the manifest. */
typedef struct ferry_manifest_table {
  size_t size; /* set by the caller */
  size_t num_tensors;
  const char* keys;
  size_t keys_len;
  const int32_t* dtypes;
  const int32_t* ndims;
  const int64_t* dims;
  const uint64_t* bytes;
} ferry_manifest_table;
FERRY_API ferry_status ferry_manifest_tensor_table(const ferry_manifest* m,
                                                   ferry_manifest_table* out);

FERRY_API size_t ferry_manifest_num_metadata(const ferry_manifest* m);
/* Metadata pair i; values may hold any bytes, so their length is returned. */
FERRY_API ferry_status ferry_manifest_metadata(const ferry_manifest* m, size_t i, const char** key,
                                               const char** value, size_t* value_len);

/* --- planner (ferry/planner.hpp) ------------------------------------------
 * A checkpoint driven in steps: ferry_planner_create, then on every rank
 * ferry_planner_global_plan (collective), ferry_planner_save with this
 * rank's plan, ferry_planner_barrier (collective; rank 0 commits). Plans
 * travel as bytes (a local plan or one rank's plan); ferry_plan_json and
 * ferry_plan_text show them. */
typedef struct ferry_planner ferry_planner;
typedef struct ferry_plans ferry_plans; /* every rank's plan */

/* Writes this rank's file itself (SavePlannerOptions::checkpoint_fn): the
 * planned tensors (host views, keyed by entry name) and the file to write
 * as safetensors holding exactly them (anything else, torch.save output
 * say, fails the checkpoint; compress does not apply to these files).
 * Returns 0 on success; otherwise it may put a message in error
 * (error_len bytes, NUL-terminated) and the checkpoint fails on every
 * rank. A function still running at the write deadline is abandoned:
 * the checkpoint fails, and the function may go on reading the tensors it
 * was handed until it returns, so the caller keeps them alive until then. */
typedef int (*ferry_checkpoint_fn)(void* user, const ferry_tensor* planned, size_t num_planned,
                                   const char* filename, char* error, size_t error_len);

/* root NULL or "": the configured root; with none configured, the
 * directory part of filename_prefix ("ckpt/model": root ckpt, files model-*;
 * a bare name: the working directory). has_step 0: one more than the
 * latest committed step there (0 in an empty root). filename_prefix NULL,
 * "" or "rank". fn NULL: Ferry writes the files. The tensors' memory must
 * stay valid until the planner is destroyed. */
FERRY_API ferry_status ferry_planner_create(ferry_runtime* rt, const ferry_tensor* tensors,
                                            size_t num_tensors, const char* filename_prefix,
                                            const char* root, int has_step, uint64_t step,
                                            int overwrite, const ferry_kv* metadata,
                                            size_t num_metadata, ferry_checkpoint_fn fn,
                                            void* fn_user, ferry_planner** out);
/* Changes this rank's local plan before it is sent to rank 0
 * (SavePlannerOptions::transform_local_plan): `plan` holds the local plan's
 * bytes; the function points *out / *out_len at the bytes of the plan to
 * send instead (e.g. from ferry_local_plan_edit; they must stay valid until
 * the planner call that ran the function returns). It may drop items and
 * rename keys, nothing else. Returns 0 on success; otherwise it may put a
 * message in error (error_len bytes, NUL-terminated) and the checkpoint
 * fails on every rank with that message. */
typedef int (*ferry_plan_transform_fn)(void* user, const char* plan, size_t len, const char** out,
                                       size_t* out_len, char* error, size_t error_len);

/* Everything a planner may carry (sized: see above; SavePlannerOptions). */
typedef struct ferry_planner_request {
  size_t size;
  const ferry_tensor* tensors; /* must stay valid until the planner is destroyed */
  size_t num_tensors;
  const char* filename_prefix; /* as ferry_planner_create's; else files.filename_prefix */
  const char* root;            /* as ferry_planner_create's */
  int32_t has_step;
  uint64_t step;
  int32_t overwrite;
  const ferry_kv* metadata;
  size_t num_metadata;
  ferry_save_options files;
  /* Who writes replicated tensors: 0 the configured owner-policy, 1
   * balanced, 2 lowest rank; every rank must pass the same. */
  int32_t owner_policy;
  ferry_plan_transform_fn transform_local_plan; /* NULL: the plan as made */
  void* transform_user;                         /* its first argument */
  ferry_snapshot_check_fn snapshot_check;       /* as ferry_save_request's; NULL: none */
  void* snapshot_check_user;                    /* its first argument */
  ferry_checkpoint_fn checkpoint_fn;            /* NULL: Ferry writes the files */
  void* checkpoint_user;                        /* its first argument */
} ferry_planner_request;
/* ferry_planner_create with everything a request carries. */
FERRY_API ferry_status ferry_planner_open(ferry_runtime* rt, const ferry_planner_request* request,
                                          ferry_planner** out);
/* Abandons an unfinished checkpoint (on every rank), then frees. */
FERRY_API void ferry_planner_destroy(ferry_planner* p);
FERRY_API uint64_t ferry_planner_step(const ferry_planner* p);
/* This rank's local plan (bytes owned by the planner). */
FERRY_API ferry_status ferry_planner_local_plan(ferry_planner* p, const char** bytes, size_t* len);
/* Collective: every rank's plan. */
FERRY_API ferry_status ferry_planner_global_plan(ferry_planner* p, ferry_plans** out);
/* Starts writing this rank's files from its plan's bytes (another rank's is
 * refused) and returns at once; ferry_planner_wait_written waits until they
 * are durable (or the checkpoint failed). */
FERRY_API ferry_status ferry_planner_save(ferry_planner* p, const char* plan, size_t len);
FERRY_API ferry_status ferry_planner_wait_written(ferry_planner* p);
FERRY_API ferry_status ferry_planner_wait_written_for(ferry_planner* p, int64_t timeout_ms);
/* Collective: commits; *path (owned by the planner) is the checkpoint. */
FERRY_API ferry_status ferry_planner_barrier(ferry_planner* p, const char** path);
/* The same, waiting at most timeout_ms (FERRY_WAIT_TIMED_OUT: call it again
 * to wait on; timeout_ms < 0: no limit). */
FERRY_API ferry_status ferry_planner_barrier_for(ferry_planner* p, int64_t timeout_ms,
                                                 const char** path);

/* The global plan of local plans gathered by any means, with no job; its
 * files are named and cut as a save with `files` would write them (NULL or
 * zeroed: prefix "rank", no cap, raw). */
FERRY_API ferry_status ferry_plan_global(const char* const* local_plans, const size_t* lens,
                                         size_t num_ranks, int lowest_rank,
                                         const ferry_save_options* files, ferry_plans** out);
FERRY_API size_t ferry_plans_count(const ferry_plans* ps);
FERRY_API ferry_status ferry_plans_get(const ferry_plans* ps, size_t rank, const char** bytes,
                                       size_t* len);
FERRY_API void ferry_plans_release(ferry_plans* ps);
/* A local plan of some of `plan`'s items: item k of the result is item
 * items[k] of `plan` (an index into its items), keyed keys[k] (NULL: its own
 * key). *out (valid until this thread's next call) holds its bytes. */
FERRY_API ferry_status ferry_local_plan_edit(const char* plan, size_t len, const uint32_t* items,
                                             const char* const* keys, size_t num_items,
                                             const char** out, size_t* out_len);
/* A local or rank plan's bytes as JSON / as text (valid until this thread's
 * next call of either). */
FERRY_API ferry_status ferry_plan_json(const char* bytes, size_t len, const char** json);
FERRY_API ferry_status ferry_plan_text(const char* bytes, size_t len, const char** text);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* FERRY_FERRY_H_ */
