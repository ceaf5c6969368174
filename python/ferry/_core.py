"""Runtime, save_async, load and the manifest reader over the C ABI."""

from __future__ import annotations

import array
import atexit
import contextlib
import ctypes
import functools
import gc
import itertools
import json
import logging
import operator
import os
import sys
import threading
import weakref
from collections import namedtuple
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Union

from . import _lib, _pack, _save_cache, _tree
from ._lib import FerryError, check, lib, wait_sliced
from ._shards import PathLike, StateDict, _as_shard, _dtype_tables, torch_dtype

if TYPE_CHECKING:
    import torch


class _Entries:
    """ctypes ferry_tensor records for a list of (key, tensor, global shape,
    offsets); keeps every buffer they point at alive for as long as it lives."""

    def __init__(self, items, flags=None):
        for key, _, _, _ in items:
            if "\0" in key:
                _no_nul("tensor key", key)
        self.flags = flags  # per-rank entries: the save cache leaves such trees alone
        self.array, self.keep = _pack.pack_items(items, flags)


@contextlib.contextmanager
def _gc_paused():
    """The tree walk makes a few objects per tensor: at tens of thousands of
    tensors the cyclic collector would otherwise run over the caller's whole
    heap many times meanwhile, most of the walk's time. They are collected
    later as usual."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _no_nul(what, s):
    """C strings end at a NUL: a key with one would be cut short and saved
    under another name, so it is refused, named."""
    if "\0" in s:
        raise FerryError("%s %r contains a NUL character, which Ferry cannot store" % (what, s),
                         "invalid_argument")


def _save_entries(state_dict, metadata):
    """What a save hands the C ABI: (items, staged keys, _Entries, metadata
    pairs), shared by save_async and ferry.SavePlanner."""
    with _gc_paused():
        return _save_entries_of(state_dict, metadata)


def _save_entries_of(state_dict, metadata):
    flat = _tree.flatten(state_dict)
    items, staged = [], []
    for key, v in flat.tensors.items():
        shard = _as_shard(key, v)
        t = shard.tensor if shard is not None else v
        if t.requires_grad:  # detach() costs a new tensor object; only when needed
            t = t.detach()
        if not t.is_contiguous():
            # Staged: Ferry reads the copy, which the handle keeps alive.
            t = t.contiguous()
            staged.append(key)
        if shard is None:
            items.append((key, t, None, None))
        else:
            items.append((key, t, shard.global_shape, shard.offsets))
    flags = {}
    if flat.per_rank:
        items, flags = _per_rank_items(flat, items, staged)
    entries = _Entries(items, flags)
    pairs = [(k, v) for k, v in (metadata or {}).items()]
    pairs += _tree.encode_meta(flat)
    return items, staged, entries, pairs


def _per_rank_flags(policy):
    return _lib.TENSOR_PER_RANK | (_lib.TENSOR_RESIZE_FIRST if policy == "first" else 0)


def _per_rank_items(flat, items, staged):
    """items plus the per-rank leaves as tensors (generator states, encoded
    values: private copies, so staged), and the C flags of every per-rank item."""
    import torch

    items = list(items)
    for key, g in flat.generators.items():
        items.append((key, g.get_state(), None, None))
        staged.append(key)
    for key, b in flat.per_rank_bytes.items():
        items.append((key, torch.frombuffer(bytearray(b), dtype=torch.uint8).clone(), None, None))
        staged.append(key)
    flags = {i: _per_rank_flags(flat.per_rank[it[0]])
             for i, it in enumerate(items) if it[0] in flat.per_rank}
    return items, flags


def _kvs(pairs):
    arr = (_lib.KV * max(len(pairs), 1))()
    keep = []
    for i, (k, v) in enumerate(pairs):
        _no_nul("metadata key", str(k))
        _no_nul("value of metadata key %r:" % (str(k),), str(v))
        kb, vb = str(k).encode("utf-8"), str(v).encode("utf-8")
        keep += [kb, vb]
        arr[i].key = kb
        arr[i].value = vb
    return arr, keep


def _settings(options):
    return [(k.replace("_", "-"), _setting_value(v)) for k, v in (options or {}).items()]


def _setting_value(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


# --- tensors changed during the snapshot ------------------------------------------

_ON_MUTATION = ("error", "warn", "ignore")


_version_of = operator.attrgetter("_version")
_is_cuda = operator.attrgetter("is_cuda")


class _VersionCheck:
    """torch's version counters of a save's tensors at save_async, compared
    once, when the snapshot ends (Ferry's thread calls it just before the
    snapshot is reported done) or when wait_snapshot(stream=...) hands the
    tensors back to a stream. Keeps the tensors alive until then."""

    def __init__(self, recs, on_mutation):
        # (keys, tensors, versions and data_ptrs at save_async): columns,
        # zipped only when compared, on Ferry's thread.
        self.recs = recs
        self.on_mutation = on_mutation
        self.warnings = []
        self._lock = threading.Lock()

    def run(self):
        """None when no tensor changed or on_mutation="warn"; else the error."""
        with self._lock:
            recs, self.recs = self.recs, None
            if recs is None:
                return None
            # A tensor moved to other memory (t.set_) left the saved bytes,
            # which the handle keeps alive, as they were.
            changed = ["'%s' (version %d -> %d)" % (k, v, t._version)
                       for k, t, v, ptr in zip(*recs) if t._version != v and t.data_ptr() == ptr]
            if not changed:
                return None
            shown = ", ".join(changed[:8]) + (
                " and %d more" % (len(changed) - 8) if len(changed) > 8 else "")
            what = "tensor %s was" % shown if len(changed) == 1 else "tensors %s were" % shown
            msg = ("%s changed in place between save_async and the end of the snapshot, so the "
                   "checkpoint may hold a mix of old and new bytes: call h.wait_snapshot() "
                   "before changing saved tensors (optimizer.step())" % what)
            if self.on_mutation == "warn":
                self.warnings.append(msg + " (on_mutation='warn': committed anyway)")
                return None
            return msg + ", or pass on_mutation='warn' to commit anyway"


_checks = {}  # id -> _VersionCheck, until it ran (or its save ended without a snapshot)
_check_ids = itertools.count(1)


def _snapshot_check(user, error, error_len):
    chk = _checks.pop(user or 0, None)
    try:
        msg = chk.run() if chk is not None else None
    except Exception as e:  # never let a Python error pass for "no change"
        msg = "the tensor version check failed: %r" % (e,)
    if msg is None:
        return 0
    raw = msg.encode("utf-8")[: max(int(error_len) - 1, 0)]
    if error and error_len:
        ctypes.memmove(error, raw + b"\0", len(raw) + 1)
    return 1


# One callback for the process, never freed: Ferry may call it after every
# Python object of the save is gone.
_SNAPSHOT_CHECK_FN = _lib.SnapshotCheckFn(_snapshot_check)


def _check_on_mutation(what, on_mutation):
    if on_mutation not in _ON_MUTATION:
        raise FerryError("%s: on_mutation = %r: expected one of %s"
                         % (what, on_mutation, ", ".join(repr(x) for x in _ON_MUTATION)))


def _version_check(items, staged, on_mutation, prep=None):
    """(the _VersionCheck of a save's tensors, its id for _SNAPSHOT_CHECK_FN),
    registered; (None, None) for on_mutation="ignore". With `prep` (a save
    cache's answer) its columns give the records instead of `items`."""
    if on_mutation == "ignore":
        return None, None
    if prep is not None and prep.items is None:  # prepared: nothing staged
        # Read with the cache's other columns, in its one pass over the tensors.
        records = (prep.keys, prep.tensors, prep.versions, prep.ptrs)
    else:
        # Staged tensors are private copies: the caller cannot change them.
        skip = set(staged)
        kept = [it for it in items if it[0] not in skip] if skip else items
        tensors = [it[1] for it in kept]
        records = ([it[0] for it in kept], tensors, list(map(_version_of, tensors)),
                   list(map(_pack.data_ptr_fn(), tensors)))
    chk = _VersionCheck(records, on_mutation)
    cid = next(_check_ids)
    _checks[cid] = chk
    return chk, cid


def _cuda_stream_of(tensors, any_cuda=None):
    """(cudaStream_t, device index) of torch's current stream on the device
    of the first CUDA tensor, or (None, 0) when none is on a GPU. `any_cuda`:
    whether one is, when known."""
    if any_cuda is None:
        any_cuda = any(map(_is_cuda, tensors))
    if not any_cuda:
        return None, 0
    for t in tensors:
        if t.is_cuda:
            import torch

            s = torch.cuda.current_stream(t.device)
            return s.cuda_stream, t.device.index or 0
    return None, 0


class CheckpointOptions:
    """How a save lays out its data files (each None: the configured
    ferry.filename-prefix / shard-size / compress).

    compress: False/"none", True (= zstd), "zstd" or "zstd:<level>" (1-22);
    compressed files are <prefix>-<rank>-<k>.ferryz, decoded transparently
    on load. shard_size: the most data bytes per file (an int > 0); larger
    items are split across files. filename_prefix: data files are
    <prefix>-<rank>-<k>.<ext>; only A-Z a-z 0-9 . _ - and no "..".
    Bad values raise FerryError naming the option."""

    def __init__(self, compress: Union[bool, str, None] = None, shard_size: Optional[int] = None,
                 filename_prefix: Optional[str] = None) -> None:
        if shard_size is not None:
            if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size <= 0:
                raise FerryError("CheckpointOptions: shard_size = %r: must be a positive number "
                                 "of bytes (None for the configured ferry.shard-size)"
                                 % (shard_size,))
        if compress is not None and not isinstance(compress, (bool, str)):
            raise FerryError("CheckpointOptions: compress = %r: expected a bool or a string "
                             "such as 'zstd:3'" % (compress,))
        if filename_prefix is not None and not isinstance(filename_prefix, str):
            raise FerryError("CheckpointOptions: filename_prefix = %r: expected a string"
                             % (filename_prefix,))
        self.compress = compress
        self.shard_size = shard_size
        self.filename_prefix = filename_prefix

    def _c(self):
        c = self.compress
        if isinstance(c, bool):
            c = "true" if c else "none"
        return _lib.SaveOptions(
            self.filename_prefix.encode("utf-8") if self.filename_prefix is not None else None,
            self.shard_size or 0,
            c.encode("utf-8") if c is not None else None,
        )

    def __repr__(self):
        return "CheckpointOptions(compress=%r, shard_size=%r, filename_prefix=%r)" % (
            self.compress, self.shard_size, self.filename_prefix)


_LOG_LEVELS = (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR)


def _log(user, level, message):
    logging.getLogger("ferry").log(
        _LOG_LEVELS[level] if 0 <= level < len(_LOG_LEVELS) else logging.ERROR,
        "%s", message.decode("utf-8", "replace"))


# One for the process, never freed: a thread a runtime left running at
# shutdown may still log.
_LOG_FN = _lib.LogFn(_log)


class Runtime:
    """One Ferry runtime (its actors, its staging pool) in this process.

    options: the keys of the [ferry] config section, as a dict (underscores
    or dashes: {"pool_bytes": "256MiB", "writers": 4}); they override
    FERRY_CONFIG and the config file. rank / world_size default to the
    torchrun environment (RANK, WORLD_SIZE), else 0 of 1. Several ranks
    connect to each other when the runtime starts (MASTER_ADDR,
    MASTER_PORT, FERRY_JOB_TOKEN). Its messages (warnings) go to the
    logging module's "ferry" logger."""

    def __init__(self, options: Optional[Mapping[str, Any]] = None, rank: Optional[int] = None,
                 world_size: Optional[int] = None) -> None:
        L = lib()
        arr, keep = _kvs(_settings(options))
        o = _lib.RuntimeOptions()
        o.size = ctypes.sizeof(_lib.RuntimeOptions)
        o.settings = ctypes.cast(arr, ctypes.POINTER(_lib.KV))
        o.num_settings = len(options or {})
        o.from_env = 1 if rank is None and world_size is None else 0
        o.rank = int(rank or 0)
        o.world_size = int(world_size or 1)
        o.log = _LOG_FN
        out = ctypes.c_void_p()
        check(L.ferry_runtime_open(ctypes.byref(o), ctypes.byref(out)))
        del keep
        self._ptr = out
        self._pid = os.getpid()
        self._last = None  # the latest SaveHandle: keeps its tensors alive
        self._lock = threading.Lock()
        self._calls = set()  # loads still running after an interrupt (_lib.call_interruptibly)
        self._save_cache = None  # _save_cache.SaveCache, from the first save
        self._kv = self._kv_of = None  # the last save's metadata array, and of which pairs
        self._save_lock = threading.Lock()
        _runtimes.add(self)

    @property
    def rank(self) -> int:
        return lib().ferry_runtime_rank(self._ptr)

    @property
    def world_size(self) -> int:
        return lib().ferry_runtime_world_size(self._ptr)

    def _alive(self):
        if self._ptr is None:
            raise FerryError("this ferry.Runtime is closed")
        if os.getpid() != self._pid:
            raise FerryError(
                "a ferry.Runtime cannot be used in a forked child process "
                "(create a new one in the child)"
            )
        return self._ptr

    def save_async(self, *args: Any, **kwargs: Any) -> SaveHandle:
        """See ferry.save_async."""
        # Whole: the save cache's C state dict is read by the save it prepared.
        with self._save_lock:
            return self._save_async(*args, **kwargs)

    def _save_async(self, state_dict, root, step, overwrite=False, metadata=None, options=None,
                    on_mutation="error", stream=None):
        ptr = self._alive()
        if options is not None and not isinstance(options, CheckpointOptions):
            raise FerryError("save_async: options must be a ferry.CheckpointOptions, not %s"
                             % type(options).__name__)
        _check_on_mutation("save_async", on_mutation)
        copts = options._c() if options is not None else None
        if self._save_cache is None:
            self._save_cache = _save_cache.SaveCache()
        with _gc_paused():  # as _save_entries: a few objects per tensor
            prep = self._save_cache.prepare(state_dict, metadata, _save_entries)
        items, staged, entries, pairs = prep.items, prep.staged, prep.entries, prep.pairs
        # A cached save hands the same pairs again (the tree's JSON among them).
        if self._kv_of is not pairs:
            self._kv, self._kv_of = _kvs(pairs), pairs
        kv, kv_keep = self._kv
        out = ctypes.c_void_p()
        root_b = os.fspath(root).encode("utf-8") if root else None
        req = _lib.sized(_lib.SaveRequest)
        if prep.sd is not None:  # prepared: only its changed entries were passed
            req.state_dict = prep.sd
        else:
            req.tensors, req.num_tensors = entries.array, len(items)
        req.step, req.root, req.overwrite = int(step), root_b, 1 if overwrite else 0
        req.metadata, req.num_metadata = kv, len(pairs)
        if copts is not None:
            req.files = copts
        if stream is not None:
            req.stream, req.stream_device = stream.cuda_stream, stream.device.index or 0
        else:
            req.stream, req.stream_device = _cuda_stream_of(prep.tensors, prep.any_cuda)
        chk, cid = _version_check(items, staged, on_mutation, prep)
        if chk is not None:
            req.snapshot_check = _SNAPSHOT_CHECK_FN
            req.snapshot_check_user = cid
        with self._lock:
            try:
                check(lib().ferry_save_start(ptr, ctypes.byref(req), ctypes.byref(out)))
            except BaseException:
                _checks.pop(cid, None)
                raise
            # The C++ runtime waited for the previous save's snapshot before
            # it started this one: its check ran, or never will.
            if self._last is not None:
                _checks.pop(self._last._check_id, None)
            with _gc_paused():  # one storage object per tensor
                h = SaveHandle(out, entries, prep.tensors, staged, prep.storages)
            h._check, h._check_id = chk, cid
            # The previous tensors may go now.
            self._last = h
        del kv_keep
        return h

    def load(self, state_dict: StateDict, path: PathLike, strict: Optional[bool] = None,
             cast: bool = False, key_map: Optional[Mapping[str, str]] = None,
             allow_pickle: bool = False) -> LoadResult:
        """See ferry.load."""
        with _gc_paused():
            return _load(self, state_dict, path, strict, cast, key_map, allow_pickle)

    def wait_for_inflight(self, timeout_s: Optional[float] = None) -> bool:
        """Waits for the latest save to end; False if still running after timeout_s."""
        h = self._last
        if h is None:
            return True
        return h._wait_over(timeout_s)

    def close(self, timeout_s: float = 60.0) -> None:
        """Waits (bounded) for an in-flight save, then stops the runtime."""
        if self._ptr is None or os.getpid() != self._pid:
            return
        if not self.wait_for_inflight(timeout_s):
            h = self._last
            sys.stderr.write(
                "ferry: the save of step %d is still in flight after %.0f s at shutdown; "
                "it is abandoned (its pending directory is left for `ferry gc`)\n"
                % (h.step, timeout_s)
            )
            # Stopping the actors now would wait for the stuck save again.
            self._ptr = None
            return
        if not _lib.join_inflight(self._calls, timeout_s):
            sys.stderr.write("ferry: a load interrupted earlier is still running after %.0f s at "
                             "shutdown; the runtime is left running\n" % timeout_s)
            self._ptr = None
            return
        # Save handles stay usable: they share the save's state, not the runtime.
        ptr, self._ptr = self._ptr, None
        lib().ferry_runtime_destroy(ptr)
        # The cache holds the last save's storages: the caller's memory, not ours to keep.
        cache, self._save_cache = self._save_cache, None
        if cache is not None:
            cache.close()


# Handles whose snapshot may still read their tensors' memory.
_snapshotting = weakref.WeakSet()
_resize_guarded = False


def _guard_resizes():
    """torch's resize_ reallocates a storage in place, freeing the memory a
    pending snapshot copies from, and does not bump _version: resize_ of a
    tensor or storage a pending snapshot reads waits for that snapshot to
    end first. Installed at the first save."""
    global _resize_guarded
    if _resize_guarded:
        return
    import torch

    storage_of = _pack.storage_fn()

    def guard(cls, name, storage):
        orig = getattr(cls, name)

        def resize(self, *args, **kwargs):
            if _snapshotting:
                _end_snapshots_reading(storage(self))
            return orig(self, *args, **kwargs)

        resize.__name__, resize.__doc__ = orig.__name__, orig.__doc__
        setattr(cls, name, resize)

    guard(torch.Tensor, "resize_", storage_of)
    guard(torch.Tensor, "resize_as_", storage_of)
    untyped = getattr(torch, "UntypedStorage", None) or torch.storage.UntypedStorage
    guard(untyped, "resize_", lambda st: st)  # TypedStorage.resize_ resizes through it
    _resize_guarded = True


def _end_snapshots_reading(storage):
    ptr = storage.data_ptr()
    if ptr == 0:
        return
    for h in list(_snapshotting):
        if ptr in h._storage_ptrs():
            h._end_snapshot_quietly()


class SaveHandle:
    """An asynchronous save, returned by save_async at once.

    wait_snapshot(): the tensors may be mutated afterwards.
    wait(): the checkpoint is committed; raises FerryError if it failed.
    The handle holds the tensors, their storages (so t.set_(...) cannot free
    what the snapshot copies) and staged copies until the snapshot is done,
    even if the caller drops it, since the runtime keeps the latest; and
    t.resize_(...) (which reallocates in place) waits for the snapshot.
    Waits wake every few milliseconds for signals: Ctrl-C raises
    KeyboardInterrupt at once, and the save goes on."""

    _check = None  # the _VersionCheck of its tensors (on_mutation)
    _check_id = None

    def __init__(self, ptr: ctypes.c_void_p, entries: Any, tensors: Any, staged: Any,
                 storages: Any = None) -> None:
        self._ptr = ptr
        self._entries = entries
        self._tensors = tensors
        # `storages`: those of `tensors`, or others holding their bytes (a save cache's).
        self._storages = storages if storages is not None else list(
            map(_pack.storage_fn(), tensors))
        self._ptrs = None  # addresses of the storages, found at the first resize_
        self.staged = staged  # keys of non-contiguous tensors copied before the save
        self._lock = threading.Lock()
        self.step = lib().ferry_save_step(ptr)
        _guard_resizes()
        _snapshotting.add(self)

    def _p(self):
        if self._ptr is None:
            raise FerryError("this SaveHandle was released")
        return self._ptr

    # Waits run in short slices (ferry._lib.wait_sliced), so Ctrl-C raises
    # KeyboardInterrupt at once; the save goes on, and may be waited on again.
    def wait_snapshot(self, stream: Any = None) -> None:
        """stream: a torch.cuda.Stream that is made to wait, on the GPU, for
        the copies off the CUDA tensors (kernels queued on it afterwards may
        change them); the host waits only until every copy is queued. Host
        tensors are waited for on the host either way."""
        p = self._p()
        if stream is None:
            wait_sliced(lambda ms: lib().ferry_save_wait_snapshot_for(p, ms))
        else:
            check(lib().ferry_save_wait_snapshot_stream(p, stream.cuda_stream,
                                                        stream.device.index or 0))
            # From here the stream may change the tensors: compare now.
            chk = _checks.pop(self._check_id, None)
            msg = chk.run() if chk is not None else None
            if msg is not None:
                raise FerryError(msg, "aborted")
        self._drop_tensors()

    def warnings(self) -> List[str]:
        """What the save committed despite: tensors changed during the
        snapshot under on_mutation="warn"."""
        return list(self._check.warnings) if self._check is not None else []

    def wait(self) -> str:
        """Blocks until committed; returns the checkpoint's path."""
        p = self._p()
        wait_sliced(lambda ms: lib().ferry_save_wait_for(p, ms))
        self._drop_tensors()
        return self.path

    def _wait_over(self, timeout_s):
        """True once the save ended (committed or failed), False if it still
        runs after timeout_s (None: no limit)."""
        if self._ptr is None:
            return True
        try:
            p = self._ptr
            return wait_sliced(lambda ms: lib().ferry_save_wait_for(p, ms), timeout_s=timeout_s)
        except FerryError:
            return True

    def snapshot_done(self) -> bool:
        done = bool(lib().ferry_save_snapshot_done(self._p()))
        if done:
            self._drop_tensors()
        return done

    def done(self) -> bool:
        if self._ptr is None:
            return True
        return bool(lib().ferry_save_done(self._ptr))

    @property
    def path(self) -> str:
        return lib().ferry_save_path(self._p()).decode("utf-8")

    def metrics(self) -> Dict[str, Any]:
        m = _lib.sized(_lib.SaveMetrics)
        check(lib().ferry_save_metrics_get(self._p(), ctypes.byref(m)))
        d = {name: getattr(m, name) for name, _ in _lib.SaveMetrics._fields_[1:]}
        d["bytes_persisted"] = lib().ferry_save_bytes_persisted(self._ptr)
        d["bytes_total"] = lib().ferry_save_bytes_total(self._ptr)
        return d

    def _storage_ptrs(self):
        with self._lock:
            if self._ptrs is None:
                self._ptrs = frozenset(s.data_ptr() for s in self._storages or ())
            return self._ptrs

    def _end_snapshot_quietly(self):
        # For resize_: the save's own outcome (a mutation found) is for its waits to report.
        p = self._ptr
        if p is not None:
            try:
                wait_sliced(lambda ms: lib().ferry_save_wait_snapshot_for(p, ms))
            except FerryError:
                pass
        _snapshotting.discard(self)

    def _drop_tensors(self):
        _snapshotting.discard(self)
        _checks.pop(self._check_id, None)
        with self._lock:
            self._tensors = None
            self._storages = None
            self._entries = None

    def _release(self):
        ptr, self._ptr = self._ptr, None
        if ptr is not None:
            lib().ferry_save_release(ptr)

    def __del__(self):
        try:
            self._release()
        except Exception:
            pass

    def __repr__(self):
        return "<ferry.SaveHandle step=%d done=%s>" % (self.step, self.done())


# --- the manifest ----------------------------------------------------------------

TensorInfo = namedtuple("TensorInfo", "key dtype shape nbytes")


def _column(addr, typecode, n):
    a = array.array(typecode)
    if n:
        a.frombytes(ctypes.string_at(addr, n * a.itemsize))
    return a


def _tensor_infos(L, m):
    """key -> TensorInfo of every tensor of manifest `m`, from one
    ferry_manifest_tensor_table call read column by column."""
    tab = _lib.sized(_lib.ManifestTable)
    check(L.ferry_manifest_tensor_table(m, ctypes.byref(tab)))
    n = tab.num_tensors
    if n == 0:
        return {}
    keys = ctypes.string_at(tab.keys, tab.keys_len).decode("utf-8").split("\0")
    if len(keys) != n + 1:
        raise FerryError("manifest %s: a tensor key holds a NUL character"
                         % L.ferry_manifest_path(m).decode("utf-8", "replace"), "corruption")
    del keys[n]
    ndims = _column(tab.ndims, "i", n)
    dims = _column(tab.dims, "q", sum(ndims))
    ends = list(itertools.accumulate(ndims))
    shapes = map(tuple, map(dims.__getitem__, map(slice, [0] + ends[:-1], ends)))
    infos = map(functools.partial(tuple.__new__, TensorInfo),
                zip(keys, _column(tab.dtypes, "i", n), shapes, _column(tab.bytes, "Q", n)))
    return dict(zip(keys, infos))


class Manifest:
    """What a committed checkpoint holds: path, step, world_size, tensors
    (key -> TensorInfo with the torch dtype and global shape), metadata (the
    user's key/values, and the package's own)."""

    def __init__(self, path: PathLike, _runtime_ptr: Any = None) -> None:
        L = lib()
        m = ctypes.c_void_p()
        p = os.fspath(path).encode("utf-8")
        # With a runtime, its load of the checkpoint plans against this decode.
        check(L.ferry_manifest_open(_runtime_ptr, p, ctypes.byref(m)))
        try:
            self.path = L.ferry_manifest_path(m).decode("utf-8")
            self.step = L.ferry_manifest_step(m)
            self.commit_seq = L.ferry_manifest_commit_seq(m)
            self.world_size = L.ferry_manifest_world_size(m)
            self.tensors = _tensor_infos(L, m)
            self.metadata = {}
            k = ctypes.c_char_p()
            v = ctypes.c_void_p()
            n = ctypes.c_size_t()
            for i in range(L.ferry_manifest_num_metadata(m)):
                check(L.ferry_manifest_metadata(m, i, ctypes.byref(k), ctypes.byref(v), ctypes.byref(n)))
                raw = ctypes.string_at(v, n.value) if n.value else b""
                self.metadata[k.value.decode("utf-8")] = raw.decode("utf-8", "replace")
        finally:
            L.ferry_manifest_close(m)
        # The paths (one per entry) only when a load rebuilds a subtree.
        self._paths = None
        self.leaves = _tree.decode_leaves(self.metadata)
        # Typed leaves (tuples, pickled objects: those as ferry.Pickled until
        # a load allows them); `pickled` names the keys that hold pickle.
        values, self.pickled = _tree.decode_values(self.metadata)
        self.leaves.update(values)

    @property
    def paths(self) -> Dict[str, List[Any]]:
        """Flat key -> the path in the saved tree (list of components)."""
        if self._paths is None:
            self._paths = _tree.decode_paths(self.metadata)
        return self._paths

    def torch_dtype(self, key: str) -> torch.dtype:
        return torch_dtype(self.tensors[key].dtype)

    @property
    def user_metadata(self) -> Dict[str, str]:
        return {k: v for k, v in self.metadata.items() if not k.startswith("ferry.python.")}


def read_manifest(path: PathLike) -> Manifest:
    return Manifest(path)


def latest(root: PathLike) -> Optional[str]:
    """Path of the latest committed checkpoint under root, or None."""
    out = ctypes.c_char_p()
    st = lib().ferry_latest(os.fspath(root).encode("utf-8"), ctypes.byref(out))
    if st == 2:  # not_found
        return None
    check(st)
    return out.value.decode("utf-8")


def list_steps(root: PathLike) -> List[Dict[str, Any]]:
    """Steps of the committed checkpoints under root, in commit order."""
    L = lib()
    n = ctypes.c_size_t()
    rb = os.fspath(root).encode("utf-8")
    st = L.ferry_list_steps(rb, None, 0, ctypes.byref(n))
    if st == 2:
        return []
    check(st)
    while True:
        cap = n.value
        arr = (ctypes.c_uint64 * max(cap, 1))()
        check(L.ferry_list_steps(rb, arr, cap, ctypes.byref(n)))
        if n.value <= cap:
            return [int(arr[i]) for i in range(n.value)]


def apply_retention(root: PathLike, keep_last: int) -> None:
    check(lib().ferry_apply_retention(os.fspath(root).encode("utf-8"), int(keep_last)))


# --- load --------------------------------------------------------------------------

class LoadResult(namedtuple("LoadResult", "missing_keys unexpected_keys")):
    """What load did: the keys it left alone (missing_keys: only with
    strict=False; unexpected_keys: checkpoint keys nobody asked for), `path`
    and `step` of the checkpoint it read (rank 0's pick for every rank), and
    in `stats` this rank's figures (step, tensors_restored, bytes_read,
    bytes_received: replicated bytes another rank of its node read for it,
    send_queue_peak, share_frames_relayed, shared_in_memory: bytes it read
    for others of its node and put in their share rings). Compares and
    unpacks as the pair of lists."""

    stats = None
    path = None
    step = None


def _load_stats(st):
    return {name: getattr(st, name) for name, _ in _lib.LoadStats._fields_[1:]}


def _map_key(key_map, key):
    if key_map is None:
        return key
    if callable(key_map):
        return key_map(key)
    return key_map.get(key, key)


def _under(key, prefix):
    return prefix == "" or key == prefix or key.startswith(prefix + ".")


def _resolve(ptr, path):
    """(directory, step) of the checkpoint a load of `path` reads, as rank 0
    resolves it for every rank: a root's "latest" is decided once, so the
    manifest, leaves and key checks come from the step the tensors come from."""
    out = ctypes.c_char_p()
    step = ctypes.c_uint64()
    check(lib().ferry_resolve(ptr, os.fspath(path).encode("utf-8"), ctypes.byref(out),
                              ctypes.byref(step)))
    return out.value.decode("utf-8"), int(step.value)


def _is_module(obj):
    import torch

    return isinstance(obj, torch.nn.Module)


def _refuse_pickle(man, keys):
    """The error for checkpoint values stored with pickle that a load without
    allow_pickle=True would need."""
    what = ", ".join("'%s' (%s)" % (k, "/".join(_tree.pickled_types(man.leaves[k])))
                     for k in sorted(keys))
    return FerryError(
        "load %s: %s stored with pickle, and unpickling runs code from the checkpoint: pass "
        "allow_pickle=True to load it if you trust the checkpoint" % (man.path, what),
        "invalid_argument")


def _load(rt, state_dict, path, strict, cast, key_map, allow_pickle=False):
    import torch

    if strict not in (None, True, False):
        raise TypeError("ferry.load: strict must be None, True or False, got %r" % (strict,))
    ptr = rt._alive()
    flat = _save_cache.plain_flat(state_dict) or _tree.flatten(state_dict)
    resolved, step = _resolve(ptr, path)
    man = Manifest(resolved, ptr)
    # Per-rank entries stand in the checks below as one key each; which
    # rank's copy this rank gets is decided once the claims are known.
    copies = _hide_per_rank_copies(man)

    # Checkpoint key -> target key for everything the target names.
    if key_map is None:  # tensor and leaf keys never meet: each names itself
        claims = dict(zip(flat.tensors, flat.tensors))
        claims.update(zip(flat.leaves, flat.leaves))
    else:
        claims = {}
        for key in list(flat.tensors) + list(flat.leaves):
            claims.setdefault(_map_key(key_map, key), key)
    ckpt_keys = set(man.tensors) | set(man.leaves)
    # Objects whose state the checkpoint decides (an optimizer: a fresh one
    # has no state yet, and its load_state_dict judges). A module's keys are
    # fixed by its layers, so they are checked like a plain dict's.
    open_prefixes = {
        (_map_key(key_map, p) if p else p): p
        for p, (obj, _, _) in flat.stateful.items()
        if not _is_module(obj)
    }
    # An empty dict outside any object's state dict is a placeholder: it
    # takes whatever the checkpoint holds under its key.
    placeholders = {}  # ckpt key -> (target key, the dict)
    for key, v in flat.leaves.items():
        if type(v) is dict and not v and not any(_under(key, p) for p in flat.stateful):
            ck = _map_key(key_map, key)
            if ck not in ckpt_keys and any(_under(k, ck) for k in ckpt_keys):
                placeholders[ck] = (key, v)
                open_prefixes[ck] = key

    def in_open(ck):
        return any(_under(ck, p) for p in open_prefixes)

    missing = []
    for ck in claims.keys() - ckpt_keys:
        key = claims[ck]
        owner = next((p for p in open_prefixes if _under(ck, p)), None)
        if owner is not None and any(_under(k, owner) for k in ckpt_keys):
            continue
        missing.append(key)
    unexpected = sorted(k for k in ckpt_keys - claims.keys() if not in_open(k))
    missing.sort()
    # Default: what the state dict asks for must be there; what the
    # checkpoint has besides is reported. strict=True: the exact match.
    # strict=False: whatever matches.
    if (strict is not False and missing) or (strict is True and unexpected):
        parts = []
        if missing:
            parts.append("missing from the checkpoint: " + ", ".join(missing))
        if unexpected and strict is True:
            parts.append("in the checkpoint but not in the state dict: " + ", ".join(unexpected))
        raise FerryError(
            "load %s: %s; %s"
            % (
                man.path,
                "state dict and checkpoint disagree (strict=True)"
                if strict
                else "the state dict asks for keys the checkpoint lacks (strict=False loads "
                "what matches)",
                "; ".join(parts),
            ),
            "invalid_argument",
        )

    items = []  # (ckpt key, buffer to load into, global shape, offsets)
    copy_back = []  # (destination tensor, loaded buffer)
    adopted = {}  # ckpt key -> tensor allocated for a stateful object's state dict
    mismatched = []
    _, code_dtypes = _dtype_tables()
    man_tensors = man.tensors
    pending = flat.tensors
    if key_map is None:
        items, pending = _plain_load_items(flat.tensors, man_tensors, code_dtypes)
    for key, v in pending.items():
        ck = key if key_map is None else _map_key(key_map, key)
        info = man_tensors.get(ck)
        if info is None:
            continue
        shard = None if type(v) is torch.Tensor else _as_shard(key, v)
        dest = shard.tensor if shard is not None else v
        saved = code_dtypes.get(info.dtype)
        if saved is None:
            saved = torch_dtype(info.dtype)  # raises, naming the dtype
        buf = dest
        if dest.dtype != saved:
            if not cast:
                mismatched.append("'%s' is %s here, %s in the checkpoint" % (key, dest.dtype, saved))
                continue
            buf = torch.empty(dest.shape, dtype=saved, device=dest.device)
        elif not dest.is_contiguous():
            buf = torch.empty(dest.shape, dtype=saved, device=dest.device)
        if buf is not dest:
            copy_back.append((dest, buf))
        if buf.requires_grad:  # detach() costs a new tensor object; only when needed
            buf = buf.detach()
        if shard is None:
            items.append((ck, buf, None, None))
        else:
            items.append((ck, buf, shard.global_shape, shard.offsets))
    if mismatched:
        raise FerryError(
            "load %s: dtype mismatch (pass cast=True to convert): %s"
            % (man.path, "; ".join(mismatched)),
            "invalid_argument",
        )
    # Tensors of an object's state dict that the target does not hold yet.
    claimed = {it[0] for it in items}
    for ck, info in (man.tensors.items() if open_prefixes else ()):
        if ck in claimed or ck in claims or not in_open(ck):
            continue
        t = torch.empty(info.shape, dtype=torch_dtype(info.dtype))
        adopted[ck] = t
        items.append((ck, t, None, None))

    # Refused before anything is loaded: pickled values this load would use.
    used = [ck for ck in man.pickled if ck in claims or in_open(ck)]
    if used and not allow_pickle:
        raise _refuse_pickle(man, used)

    def owner_of(ck):
        # The object whose state dict holds ck (innermost), for pickled references to it.
        best = None
        for p, (obj, _, _) in flat.stateful.items():
            cp = _map_key(key_map, p) if p else p
            if _under(ck, cp) and (best is None or len(cp) >= len(best[0])):
                best = (cp, obj)
        return best[1] if best else None

    def leaf(ck):
        v = man.leaves[ck]
        return _tree.unpickle(ck, v, owner_of(ck)) if ck in man.pickled else v

    wanted = {b: claims.get(b) for b in copies if b in claims or in_open(b)}
    per_rank_bufs = _per_rank_reads(man, copies, wanted, flat, rt, items)

    entries = _Entries(items)
    stats = _lib.sized(_lib.LoadStats)
    req = _lib.sized(_lib.LoadRequest, entries.array, len(items), man.path.encode("utf-8"))
    # Ctrl-C is seen at once; the load goes on, holding its tensors.
    _lib.call_interruptibly(lib().ferry_load_run, (ptr, ctypes.byref(req), ctypes.byref(stats)),
                            keep=(entries, items, req, stats, copy_back), inflight=rt._calls)
    with torch.no_grad():
        for dest, buf in copy_back:
            dest.copy_(buf)
    _per_rank_values(man, per_rank_bufs, wanted, flat, rt, allow_pickle)

    # Leaves go back into their containers.
    for key in flat.leaves:
        ck = _map_key(key_map, key)
        if ck in man.leaves:
            g = flat.generators.get(key)
            if g is not None and (type(man.leaves[ck]) is type(g)
                                  or isinstance(man.leaves[ck], torch.Tensor)):
                # In place: the caller holds the generator.
                v = man.leaves[ck]
                g.set_state(v if isinstance(v, torch.Tensor) else v.get_state())
                continue
            slot = flat.slots.get(key)
            if slot is not None and not isinstance(slot[0], tuple):  # a tuple cannot take it
                slot[0][slot[1]] = leaf(ck)

    # Placeholders get the subtree the checkpoint holds under them.
    for ck, (key, ph) in placeholders.items():
        values = {k: adopted[k] for k in adopted if _under(k, ck)}
        values.update({k: leaf(k) for k in man.leaves if _under(k, ck)})
        some = next((man.paths[k] for k in values if k in man.paths), None)
        depth = len(flat.paths[key]) if some is None else _prefix_depth(some, ck)
        sub = _tree.build(values, man.paths, strip=depth - 1)
        sub = next(iter(sub.values())) if sub else {}
        if isinstance(sub, dict) and "state" in sub and _tree.is_named_optim_state(sub):
            sub = _tree.optim_state_by_id(sub)
        if isinstance(sub, dict):
            ph.update(sub)  # in place: the caller's reference to the dict sees it
        else:
            slot = flat.slots.get(key)
            if slot is not None and not isinstance(slot[0], tuple):
                slot[0][slot[1]] = sub

    # Objects get their state dict back through their own load_state_dict.
    inv = {}
    for key in (flat.tensors if flat.stateful else ()):
        inv[_map_key(key_map, key)] = flat.tensors[key]
    for prefix, (obj, sd, opath) in flat.stateful.items():
        cp = _map_key(key_map, prefix) if prefix else prefix
        module = _is_module(obj)
        values = {}
        for ck in list(man.tensors) + list(man.leaves):
            if not _under(ck, cp) or (module and ck not in claims):
                continue
            if ck in adopted:
                values[ck] = adopted[ck]
            elif ck in inv:
                values[ck] = inv[ck]
            else:
                values[ck] = leaf(ck)
        if not values:
            continue  # nothing of it in the checkpoint (strict=False): left as it is
        if (_tree.is_optimizer(obj) and _tree.is_named_optim_state(sd)
                and _tree.load_optim_by_name(obj, values, cp, flat.param_names)):
            continue
        depth = len(man.paths[cp]) if cp in man.paths else len(opath)
        paths = {ck: man.paths.get(ck) or flat.paths.get(claims.get(ck, ""), [ck]) for ck in values}
        sub = _tree.build(values, paths, strip=depth)
        if module and strict is False:
            obj.load_state_dict(sub, strict=False)  # what it has of the checkpoint's
        else:
            obj.load_state_dict(sub)
    result = LoadResult(missing, unexpected)
    result.stats = _load_stats(stats)
    result.path = man.path
    result.step = step
    return result


def _plain_load_items(tensors, man_tensors, code_dtypes):
    """(items, the tensors left for the full loop) of a load without a
    key_map: the plain tensors (no shards) in the checkpoint with its dtype,
    contiguous, read column by column; all of them are left when any is not."""
    import torch

    keys = list(tensors)
    vals = list(tensors.values())
    infos = list(map(man_tensors.get, keys))
    if None in infos or not set(map(type, vals)) <= {torch.Tensor, torch.nn.Parameter}:
        return [], tensors
    saved = list(map(code_dtypes.get, map(_info_dtype, infos)))
    if saved != list(map(_pack.dtype_of, vals)) or not all(map(torch.Tensor.is_contiguous, vals)):
        return [], tensors
    if any(map(_requires_grad, vals)):  # detach() costs a new tensor object; only when needed
        vals = [t.detach() if t.requires_grad else t for t in vals]
    return list(zip(keys, vals, itertools.repeat(None), itertools.repeat(None))), {}


_info_dtype = operator.attrgetter("dtype")
_requires_grad = operator.attrgetter("requires_grad")


def _hide_per_rank_copies(man):
    """Takes the per-rank copies ("<key>@rank<r>") out of man.tensors, puts
    their entry key among the leaves (its value comes with the load), and
    returns entry key -> {saved rank: TensorInfo}."""
    copies = {}
    for b, by_rank in _tree.per_rank_copies(man.tensors).items():
        if b in man.tensors or b in man.leaves:
            continue  # an ordinary entry of that name too: the copies stay plain tensors
        copies[b] = {r: man.tensors.pop(k) for r, k in by_rank.items()}
        man.leaves[b] = None
    return copies


def _per_rank_policy(flat, target):
    return flat.per_rank.get(target, "error") if target is not None else "error"


def _per_rank_reads(man, copies, wanted, flat, rt, items):
    """Appends to `items` the copies this rank reads of the per-rank entries
    it asks for (its own rank's into the same world size, else by each
    entry's on_resize); returns entry key -> [(saved rank, buffer)]. Raises
    before anything is read when a policy refuses the new world size."""
    import torch

    saved_world, rank, world = man.world_size, rt.rank, rt.world_size
    out = {}
    for b, target in wanted.items():
        policy = _per_rank_policy(flat, target)
        if saved_world == world:
            ranks = [rank]
        elif callable(policy):
            ranks = list(range(saved_world))
        elif policy == "first":
            ranks = [0]
        else:
            raise FerryError(
                "load %s: '%s' is per-rank: saved by %d ranks, loaded by %d, and its on_resize "
                "policy is 'error'; wrap it in ferry.per_rank(value, on_resize='first' or a "
                "function (values, rank, world_size) -> value) to say what each rank gets"
                % (man.path, b, saved_world, world), "invalid_argument")
        bufs = []
        for r in ranks:
            info = copies[b].get(r)
            if info is None:
                raise FerryError("load %s: '%s' is per-rank and the checkpoint has no value of "
                                 "rank %d (saved by %d ranks)" % (man.path, b, r, saved_world),
                                 "corruption")
            t = torch.empty(info.shape, dtype=torch_dtype(info.dtype))
            items.append((info.key, t, None, None))
            bufs.append((r, t))
        out[b] = bufs
    return out


def _per_rank_values(man, bufs, wanted, flat, rt, allow_pickle):
    """Decodes what _per_rank_reads read into man.leaves (a callable
    on_resize picks from all of them) and copies per-rank tensors into the
    state dict's own."""
    import torch

    kinds = {}
    if _tree.PER_RANK_META_KEY in man.metadata:
        kinds = json.loads(man.metadata[_tree.PER_RANK_META_KEY])
    resized = man.world_size != rt.world_size
    for b, got in bufs.items():
        values = [_tree.decode_per_rank(b, kinds.get(b, "tensor"), t) for _, t in got]
        if any(_tree.pickled_types(v) for v in values):
            if not allow_pickle:
                man.leaves[b] = next(v for v in values if _tree.pickled_types(v))
                raise _refuse_pickle(man, [b])
            man.pickled.add(b)
        policy = _per_rank_policy(flat, wanted[b])
        if resized and callable(policy):
            if b in man.pickled:
                values = [_tree.unpickle(b, v) for v in values]
                man.pickled.discard(b)
            v = policy(values, rt.rank, rt.world_size)
        else:
            v = values[0]
        man.leaves[b] = v
        dest = flat.tensors.get(wanted[b]) if wanted[b] is not None else None
        if dest is not None:
            if isinstance(v, torch.Generator):
                v = v.get_state()
            if not isinstance(dest, torch.Tensor) or not isinstance(v, torch.Tensor) or (
                    dest.shape != v.shape or dest.dtype != v.dtype):
                raise FerryError("load %s: per-rank tensor '%s' is %s here, %s in the checkpoint"
                                 % (man.path, b, _describe(dest), _describe(v)),
                                 "invalid_argument")
            with torch.no_grad():
                dest.copy_(v)


def _describe(v):
    import torch

    if isinstance(v, torch.Tensor):
        return "%s %s" % (v.dtype, tuple(v.shape))
    return type(v).__name__


def load_state_dict(path: PathLike, runtime: Optional[Runtime] = None, prefix: Optional[str] = None,
                    allow_pickle: bool = False) -> Dict[str, Any]:
    """A new state dict with everything in the checkpoint (tensors allocated
    on the CPU with their saved dtypes and global shapes, leaves restored),
    nested as it was saved. `prefix` selects one subtree ("optim").
    allow_pickle: values stored with pickle are refused unless True."""
    import torch

    rt = runtime or default_runtime()
    ptr = rt._alive()
    resolved, _ = _resolve(ptr, path)
    man = Manifest(resolved, ptr)
    used = [k for k in man.pickled if prefix is None or _under(k, prefix)]
    if used and not allow_pickle:
        raise _refuse_pickle(man, used)
    # Per-rank values: this rank's (on_resize "error" across world sizes).
    copies = _hide_per_rank_copies(man)
    wanted = {b: None for b in copies if prefix is None or _under(b, prefix)}
    keys = [k for k in man.tensors if prefix is None or _under(k, prefix)]
    tensors = {k: torch.empty(man.tensors[k].shape, dtype=man.torch_dtype(k)) for k in keys}
    items = [(k, t, None, None) for k, t in tensors.items()]
    bufs = _per_rank_reads(man, copies, wanted, None, rt, items)
    entries = _Entries(items)
    _lib.call_interruptibly(lib().ferry_load,
                            (ptr, entries.array, len(items), man.path.encode("utf-8")),
                            keep=(entries, items, bufs), inflight=rt._calls)
    _per_rank_values(man, bufs, wanted, None, rt, allow_pickle)
    values = dict(tensors)
    for k, v in man.leaves.items():
        if prefix is None or _under(k, prefix):
            values[k] = _tree.unpickle(k, v) if k in man.pickled else v
    strip = 0
    if prefix:
        some = next((man.paths[k] for k in values if k in man.paths), None)
        strip = len(prefix.split(".")) if some is None else _prefix_depth(some, prefix)
    return _tree.build(values, man.paths, strip=strip)


def _prefix_depth(path, prefix):
    for i in range(len(path) + 1):
        if _tree.join(path[:i]) == prefix:
            return i
    return len(prefix.split("."))


# --- the process's default runtime -----------------------------------------------

# Every runtime of this process, so that exit stops each one cleanly (its
# actor threads must not outlive the interpreter's teardown).
_runtimes = weakref.WeakSet()
_default = None
_default_lock = threading.Lock()
_default_options = {}
_EXIT_WAIT_S = float(os.environ.get("FERRY_EXIT_WAIT_S", "60"))


def configure(**options: Any) -> None:
    """Options for the default runtime (before its first use): the keys of
    the [ferry] config section, e.g. configure(pool_bytes="256MiB")."""
    global _default_options
    if _default is not None:
        raise FerryError("ferry.configure() must come before the first save or load")
    _default_options = dict(options)


def default_runtime() -> Runtime:
    global _default
    if _default is None or _default._pid != os.getpid():
        with _default_lock:
            if _default is None or _default._pid != os.getpid():
                _default = Runtime(_default_options)
    return _default


def _forget_in_child():
    # A forked child (a DataLoader worker) must not touch the parent's
    # runtime, nor stop it at exit: it builds its own if it saves.
    global _default
    _default = None


def _at_exit():
    for rt in list(_runtimes):
        rt.close(timeout_s=_EXIT_WAIT_S)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
atexit.register(_at_exit)


def save_async(state_dict: StateDict, root: PathLike, step: int, overwrite: bool = False,
               metadata: Optional[Mapping[str, str]] = None, runtime: Optional[Runtime] = None,
               options: Optional[CheckpointOptions] = None, on_mutation: str = "error",
               stream: Any = None) -> SaveHandle:
    """Starts a checkpoint of `state_dict` at `step` under `root` and returns
    a SaveHandle at once. Tensors must not change until
    handle.wait_snapshot(); non-contiguous ones are copied first.
    options: a ferry.CheckpointOptions (file prefix, shard size, compression).
    on_mutation: a tensor changed in place before the snapshot ended (torch's
    version counter moved) fails the save naming it ("error"), or the save
    commits and handle.warnings() says so ("warn"); "ignore" skips the check.
    stream: the torch.cuda.Stream the copies off CUDA tensors are ordered
    after (default: torch's current stream on their device)."""
    rt = runtime or _runtime_for_save(step)
    return rt.save_async(state_dict, root, step, overwrite=overwrite, metadata=metadata,
                         options=options, on_mutation=on_mutation, stream=stream)


def _runtime_for_save(step):
    """The default runtime. A save that starts it and finds the other ranks
    absent is the `if rank == 0: save` habit: the error says so."""
    try:
        return default_runtime()
    except FerryError as e:
        if e.code != "timeout" or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            raise
        raise FerryError(
            "rank %s is saving step %d; the other ranks have not started Ferry: %s"
            % (os.environ.get("RANK", "0"), int(step), e.message),
            e.code,
        ) from None


def save(state_dict: StateDict, root: PathLike, step: int, overwrite: bool = False,
         metadata: Optional[Mapping[str, str]] = None, runtime: Optional[Runtime] = None,
         options: Optional[CheckpointOptions] = None, on_mutation: str = "error") -> str:
    """save_async + wait: returns the committed checkpoint's path."""
    return save_async(state_dict, root, step, overwrite, metadata, runtime, options,
                      on_mutation).wait()


def load(state_dict: StateDict, path: PathLike, strict: Optional[bool] = None, cast: bool = False,
         key_map: Optional[Mapping[str, str]] = None, runtime: Optional[Runtime] = None,
         allow_pickle: bool = False) -> LoadResult:
    """Fills `state_dict` in place from the checkpoint at `path` (a step
    directory, or a root: its latest, as rank 0 picks it for every rank).

    Tensors are filled in place; ferry.Shard entries (and torch sharded
    tensors) get their box of the global tensor, whatever sharding saved it;
    other values are put back with their types (tuples stay tuples); an
    empty dict takes whatever the checkpoint holds under its key; objects
    with load_state_dict() (modules, optimizers) get their state dict
    through it.
    allow_pickle: values the save stored with pickle (what JSON and the
    typed encoding cannot hold, e.g. OneCycleLR's anneal_func) are refused,
    naming their keys, unless True: unpickling runs code from the
    checkpoint (torch.load's weights_only, the other way round).
    strict: by default a key the state dict asks for that the checkpoint
    lacks raises a FerryError naming it, and checkpoint keys nobody asked
    for are only reported (LoadResult.unexpected_keys): a pipeline stage or
    a model-only resume loads its part. strict=True also raises for those;
    strict=False loads whatever matches (modules and optimizers included)
    and reports both lists.
    cast: a dtype that differs from the saved one is an error unless True
    (then the saved values are converted).
    key_map: {state dict key: checkpoint key} or a function of the key."""
    rt = runtime or default_runtime()
    return rt.load(state_dict, path, strict=strict, cast=cast, key_map=key_map,
                   allow_pickle=allow_pickle)
