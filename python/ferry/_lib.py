"""Loads libferry_c.so and declares its C ABI (src/include/ferry/ferry.h).

The library is looked up, first found wins:
  1. the file named by the FERRY_LIB environment variable;
  2. libferry_c.so next to this file (the package as assembled in
     build/python/ferry/, or a pip-installed copy that had it placed there);
  3. the build tree of a source checkout: <repo>/build/lib/libferry_c.so.

ctypes.CDLL releases the GIL for the duration of every call, so Ferry's
waits and loads never block other Python threads.
"""

import ctypes
import os
import pathlib
import threading
import time

__all__ = ["FerryError", "lib", "check", "library_path", "wait_sliced", "call_interruptibly"]

ABI_VERSION = 6

_STATUS_NAMES = {
    0: "ok",
    1: "invalid_argument",
    2: "not_found",
    3: "already_exists",
    4: "io_error",
    5: "corruption",
    6: "unsupported",
    7: "busy",
    8: "aborted",
    9: "timeout",
    10: "outcome_unknown",
    11: "internal",
    12: "wait_timed_out",
}

WAIT_TIMED_OUT = 12  # a timed wait's time passed first (ferry.h FERRY_WAIT_TIMED_OUT)
# A blocking wait from Python waits in slices this long, so that a signal
# (Ctrl-C) is handled between two of them, not only when the wait ends.
WAIT_SLICE_MS = 50


class FerryError(RuntimeError):
    """A Ferry failure. str(e) is Ferry's message; e.code names its kind
    ("not_found", "io_error", "invalid_argument", ...)."""

    def __init__(self, message, code="invalid_argument"):
        super().__init__(message)
        self.code = code
        self.message = message


c_int64_p = ctypes.POINTER(ctypes.c_int64)


class Tensor(ctypes.Structure):
    _fields_ = [
        ("key", ctypes.c_char_p),
        ("data", ctypes.c_void_p),
        ("dtype", ctypes.c_int32),
        ("ndim", ctypes.c_int32),
        ("shape", c_int64_p),
        ("strides", c_int64_p),
        ("device_type", ctypes.c_int32),
        ("device_index", ctypes.c_int32),
        ("global_shape", c_int64_p),
        ("offsets", c_int64_p),
        ("flags", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
    ]


# ferry_tensor.flags (ferry.h)
TENSOR_PER_RANK = 1
TENSOR_RESIZE_FIRST = 2


class KV(ctypes.Structure):
    _fields_ = [("key", ctypes.c_char_p), ("value", ctypes.c_char_p)]


# void (*)(void* user, int32_t level, const char* message): ferry_log_fn
LogFn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int32, ctypes.c_char_p)


class RuntimeOptions(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("settings", ctypes.POINTER(KV)),
        ("num_settings", ctypes.c_size_t),
        ("rank", ctypes.c_int32),
        ("world_size", ctypes.c_int32),
        ("from_env", ctypes.c_int32),
        ("log", LogFn),
        ("log_user", ctypes.c_void_p),
    ]


class SaveOptions(ctypes.Structure):
    _fields_ = [
        ("filename_prefix", ctypes.c_char_p),
        ("shard_size", ctypes.c_int64),
        ("compress", ctypes.c_char_p),
    ]


# int (*)(void* user, char* error, size_t error_len): ferry_snapshot_check_fn
SnapshotCheckFn = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)


def sized(struct_type, *args, **fields):
    """A sized struct of ferry.h (its first field `size`) as this package
    was written against."""
    return struct_type(ctypes.sizeof(struct_type), *args, **fields)


class StateDictColumns(ctypes.Structure):
    # Addresses as plain ints: the columns are arrays whose buffers C reads.
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("num_tensors", ctypes.c_size_t),
        ("keys", ctypes.c_void_p),
        ("keys_bytes", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("dtypes", ctypes.c_void_p),
        ("ndims", ctypes.c_void_p),
        ("shapes", ctypes.c_void_p),
        ("device_types", ctypes.c_void_p),
        ("device_indices", ctypes.c_void_p),
    ]


class SaveRequest(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("tensors", ctypes.POINTER(Tensor)),
        ("num_tensors", ctypes.c_size_t),
        ("state_dict", ctypes.c_void_p),
        ("step", ctypes.c_uint64),
        ("root", ctypes.c_char_p),
        ("overwrite", ctypes.c_int32),
        ("metadata", ctypes.POINTER(KV)),
        ("num_metadata", ctypes.c_size_t),
        ("files", SaveOptions),
        ("stream", ctypes.c_void_p),
        ("stream_device", ctypes.c_int32),
        ("snapshot_check", SnapshotCheckFn),
        ("snapshot_check_user", ctypes.c_void_p),
    ]


class LoadRequest(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("tensors", ctypes.POINTER(Tensor)),
        ("num_tensors", ctypes.c_size_t),
        ("path", ctypes.c_char_p),
    ]


class SaveMetrics(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("save_async_ms", ctypes.c_double),
        ("plan_ms", ctypes.c_double),
        ("snapshot_ms", ctypes.c_double),
        ("write_ms", ctypes.c_double),
        ("commit_ms", ctypes.c_double),
        ("total_ms", ctypes.c_double),
        ("bytes", ctypes.c_uint64),
        ("files", ctypes.c_uint64),
        ("slowest_rank", ctypes.c_int32),
        ("slowest_rank_ms", ctypes.c_double),
    ]


class LoadStats(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("step", ctypes.c_uint64),
        ("tensors_restored", ctypes.c_uint64),
        ("bytes_read", ctypes.c_uint64),
        ("bytes_received", ctypes.c_uint64),
        ("send_queue_peak", ctypes.c_uint64),
        ("share_frames_relayed", ctypes.c_uint64),
        ("shared_in_memory", ctypes.c_uint64),
    ]


class ManifestTable(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("num_tensors", ctypes.c_size_t),
        ("keys", ctypes.c_void_p),
        ("keys_len", ctypes.c_size_t),
        ("dtypes", ctypes.c_void_p),
        ("ndims", ctypes.c_void_p),
        ("dims", ctypes.c_void_p),
        ("bytes", ctypes.c_void_p),
    ]


def _candidates():
    env = os.environ.get("FERRY_LIB")
    if env:
        yield pathlib.Path(env)
        return
    here = pathlib.Path(__file__).resolve().parent
    yield here / "libferry_c.so"
    # python/ferry/ in a source checkout, or build/python/ferry/.
    yield here.parent.parent / "build" / "lib" / "libferry_c.so"
    yield here.parent.parent / "lib" / "libferry_c.so"


def library_path() -> str:
    """The path of the libferry_c.so this package uses (or would use)."""
    tried = []
    for p in _candidates():
        if p.is_file():
            return p
        tried.append(str(p))
    raise ImportError(
        "ferry: libferry_c.so not found (tried: %s). Build it with "
        "`cmake --build build --target ferry_c`, or set FERRY_LIB to its path." % ", ".join(tried)
    )


_lib = None
_lib_lock = threading.Lock()


def _declare(L):
    vp = ctypes.c_void_p
    sz = ctypes.c_size_t
    st = ctypes.c_int
    kvp = ctypes.POINTER(KV)
    tp = ctypes.POINTER(Tensor)
    sig = {
        "ferry_last_error": (ctypes.c_char_p, []),
        "ferry_status_name": (ctypes.c_char_p, [st]),
        "ferry_abi_version": (ctypes.c_int, []),
        "ferry_dtype_name": (ctypes.c_char_p, [ctypes.c_int32]),
        "ferry_dtype_size": (sz, [ctypes.c_int32]),
        "ferry_runtime_create": (st, [kvp, sz, ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(vp)]),
        "ferry_runtime_from_env": (st, [kvp, sz, ctypes.POINTER(vp)]),
        "ferry_runtime_open": (st, [ctypes.POINTER(RuntimeOptions), ctypes.POINTER(vp)]),
        "ferry_runtime_destroy": (None, [vp]),
        "ferry_runtime_rank": (ctypes.c_int32, [vp]),
        "ferry_runtime_world_size": (ctypes.c_int32, [vp]),
        "ferry_save_async": (
            st,
            [vp, tp, sz, ctypes.c_uint64, ctypes.c_char_p, ctypes.c_int, kvp, sz, ctypes.POINTER(vp)],
        ),
        "ferry_save_start": (st, [vp, ctypes.POINTER(SaveRequest), ctypes.POINTER(vp)]),
        "ferry_save_wait_snapshot_stream": (st, [vp, vp, ctypes.c_int32]),
        "ferry_state_dict_create": (st, [tp, sz, ctypes.POINTER(vp)]),
        "ferry_state_dict_create_columns": (st, [ctypes.POINTER(StateDictColumns),
                                                 ctypes.POINTER(vp)]),
        "ferry_state_dict_set": (st, [vp, sz, tp]),
        "ferry_state_dict_size": (sz, [vp]),
        "ferry_state_dict_release": (None, [vp]),
        "ferry_save_wait_snapshot": (st, [vp]),
        "ferry_save_wait": (st, [vp]),
        "ferry_save_wait_snapshot_for": (st, [vp, ctypes.c_int64]),
        "ferry_save_wait_for": (st, [vp, ctypes.c_int64]),
        "ferry_save_snapshot_done": (ctypes.c_int, [vp]),
        "ferry_save_done": (ctypes.c_int, [vp]),
        "ferry_save_step": (ctypes.c_uint64, [vp]),
        "ferry_save_path": (ctypes.c_char_p, [vp]),
        "ferry_save_bytes_persisted": (ctypes.c_uint64, [vp]),
        "ferry_save_bytes_total": (ctypes.c_uint64, [vp]),
        "ferry_save_metrics_get": (st, [vp, ctypes.POINTER(SaveMetrics)]),
        "ferry_save_release": (None, [vp]),
        "ferry_load": (st, [vp, tp, sz, ctypes.c_char_p]),
        "ferry_load_run": (st, [vp, ctypes.POINTER(LoadRequest), ctypes.POINTER(LoadStats)]),
        "ferry_resolve": (
            st, [vp, ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_uint64)]
        ),
        "ferry_export": (
            st,
            [vp, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_uint64, ctypes.c_uint64,
             ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_char_p), sz,
             ctypes.POINTER(ctypes.c_char_p)],
        ),
        "ferry_latest": (st, [ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p)]),
        "ferry_list_steps": (
            st,
            [ctypes.c_char_p, ctypes.POINTER(ctypes.c_uint64), sz, ctypes.POINTER(sz)],
        ),
        "ferry_apply_retention": (st, [ctypes.c_char_p, ctypes.c_uint32]),
        "ferry_manifest_open": (st, [vp, ctypes.c_char_p, ctypes.POINTER(vp)]),
        "ferry_manifest_close": (None, [vp]),
        "ferry_manifest_path": (ctypes.c_char_p, [vp]),
        "ferry_manifest_step": (ctypes.c_uint64, [vp]),
        "ferry_manifest_commit_seq": (ctypes.c_uint64, [vp]),
        "ferry_manifest_world_size": (ctypes.c_int32, [vp]),
        "ferry_manifest_tensor_table": (st, [vp, ctypes.POINTER(ManifestTable)]),
        "ferry_manifest_num_metadata": (sz, [vp]),
        "ferry_manifest_metadata": (
            st,
            [
                vp,
                sz,
                ctypes.POINTER(ctypes.c_char_p),
                ctypes.POINTER(ctypes.c_void_p),
                ctypes.POINTER(sz),
            ],
        ),
    }
    for name, (res, args) in sig.items():
        f = getattr(L, name)
        f.restype = res
        f.argtypes = args


def lib():
    """The loaded library (loaded on first use)."""
    global _lib
    if _lib is None:
        with _lib_lock:
            if _lib is None:
                path = library_path()
                # A bundle (python/make_bundle.py) carries UCX's transport
                # modules beside the library; UCX reads this when it starts.
                ucx = path.parent / "ucx"
                if ucx.is_dir() and "UCX_MODULE_DIR" not in os.environ:
                    os.environ["UCX_MODULE_DIR"] = str(ucx)
                L = ctypes.CDLL(str(path))
                _declare(L)
                v = L.ferry_abi_version()
                if v != ABI_VERSION:
                    raise ImportError(
                        "ferry: %s has C ABI version %d, this package expects %d"
                        % (path, v, ABI_VERSION)
                    )
                _lib = L
    return _lib


def wait_sliced(timed_wait, timeout_s=None):
    """Calls timed_wait(ms) in short slices until it is not
    FERRY_WAIT_TIMED_OUT (then raises as check() does), so Python runs its
    signal handlers (KeyboardInterrupt) between slices. With timeout_s,
    returns False once that much time passed first; else True."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        ms = WAIT_SLICE_MS
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            ms = max(0, min(ms, int(left * 1000)))
        st = timed_wait(ms)
        if st != WAIT_TIMED_OUT:
            check(st)
            return True


def call_interruptibly(fn, args, keep=(), inflight=None):
    """Runs fn(*args), one blocking C call that returns a ferry_status (a
    load, a collective plan), on a thread of its own and waits for it in
    slices, so that Ctrl-C raises KeyboardInterrupt at once. The call goes
    on to its end (other ranks still see this one take part); its thread
    holds `args` and `keep` (the tensors it writes) until then, and is in
    the set `inflight` meanwhile, which the owner's close() waits for
    before it frees what the call uses. Raises as check() does."""
    done = threading.Event()
    out = []

    def run():
        try:
            st = fn(*args)
            # The message is this thread's own (ferry_last_error).
            out.append((st, lib().ferry_last_error() if st != 0 else b""))
        except BaseException as e:  # a bad argument: raised in the caller
            out.append(e)
        finally:
            if inflight is not None:
                inflight.discard(threading.current_thread())
            done.set()

    # A daemon: an interrupted call must not hold the interpreter's exit.
    t = threading.Thread(target=run, name="ferry-call", daemon=True)
    t.keep = (args, keep)
    if inflight is not None:
        inflight.add(t)
    t.start()
    while not done.wait(WAIT_SLICE_MS / 1000):
        pass
    if isinstance(out[0], BaseException):
        raise out[0]
    st, msg = out[0]
    if st != 0:
        raise FerryError(msg.decode("utf-8", "replace") or "ferry call failed",
                         _STATUS_NAMES.get(st, "unknown"))


def join_inflight(inflight, timeout_s):
    """Waits up to timeout_s for the calls in `inflight` to end; False if
    one is still running then."""
    deadline = time.monotonic() + timeout_s
    for t in list(inflight):
        t.join(max(0.0, deadline - time.monotonic()))
    return not inflight


def check(status):
    """Raises FerryError with this thread's last message when status != 0."""
    if status != 0:
        L = lib()
        msg = L.ferry_last_error().decode("utf-8", "replace")
        raise FerryError(msg or "ferry call failed", _STATUS_NAMES.get(status, "unknown"))
