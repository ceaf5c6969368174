"""The save planner in the shape PyTorch's distributed checkpoint users know
(C++: ferry/planner.hpp). Every rank runs:

    planner = ferry.SavePlanner(model.state_dict(), "rank", root="/ckpt")
    global_plan = planner.create_global_plan()   # collective; every rank's plan
    for rank, plan in enumerate(global_plan):
        if rank == ferry.rank():
            ferry.save_on_this_process(plan)      # async: .wait() for durable files
    path = ferry.barrier()                        # collective; rank 0 commits

This is save_async's own save, stopped between its steps: the same plan,
files, commit and timeouts. A rank that does not reach barrier() within
write-timeout fails the checkpoint on every rank.

checkpoint_fn(state_dict, filename): writes this rank's file itself (once
per file of its plan), as a safetensors file holding exactly `state_dict`
(the planned tensors, keyed by the entry names the checkpoint records), e.g.
safetensors.torch.save_file(state_dict, filename). Ferry reads it back,
checksums and commits it; an exception, no file, or another format
(torch.save output) fails the checkpoint on every rank. Its files are plain
.safetensors even when compress is asked.

With no root configured, the directory part of filename_prefix is the root
(the working directory for a bare name) and its last part the file prefix:
SavePlanner(sd, "ckpt/my_checkpoint") commits ckpt/step-<n>/my_checkpoint-*.

transform_local_plan(plan): changes this rank's local plan before it is sent
to rank 0. It gets a LocalPlan and returns the plan to send: `plan` itself,
`plan.with_items(items)`, or just the list of items. Items may be dropped
(they are not saved) and renamed (their "key" changed); nothing else about
an item may change. An exception fails the checkpoint on every rank with its
message:

    def transform(plan):
        keep = [it for it in plan.items if not it["key"].startswith("cache.")]
        for it in keep:
            it["key"] = it["key"].replace("module.", "")
        return keep

owner_policy: who writes a tensor several ranks hold alike: "balanced"
(spread so every rank writes about as much) or "lowest_rank" (the lowest
rank holding it, as DCP does); None: the configured owner-policy. Every rank
must pass the same.
"""

from __future__ import annotations

import copy
import ctypes
import json
import threading
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from . import _core, _lib
from ._lib import FerryError, check, lib, wait_sliced

_declared = False
_declare_lock = threading.Lock()

# int fn(void* user, const ferry_tensor*, size_t, const char* filename, char* error, size_t)
_CHECKPOINT_FN = ctypes.CFUNCTYPE(
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.POINTER(_lib.Tensor),
    ctypes.c_size_t,
    ctypes.c_char_p,
    ctypes.c_void_p,
    ctypes.c_size_t,
)

# int fn(void* user, const char* plan, size_t len, const char** out, size_t* out_len,
#        char* error, size_t error_len)
_TRANSFORM_FN = ctypes.CFUNCTYPE(
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.POINTER(ctypes.c_void_p),
    ctypes.POINTER(ctypes.c_size_t),
    ctypes.c_void_p,
    ctypes.c_size_t,
)


class _PlannerRequest(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("tensors", ctypes.POINTER(_lib.Tensor)),
        ("num_tensors", ctypes.c_size_t),
        ("filename_prefix", ctypes.c_char_p),
        ("root", ctypes.c_char_p),
        ("has_step", ctypes.c_int32),
        ("step", ctypes.c_uint64),
        ("overwrite", ctypes.c_int32),
        ("metadata", ctypes.POINTER(_lib.KV)),
        ("num_metadata", ctypes.c_size_t),
        ("files", _lib.SaveOptions),
        ("owner_policy", ctypes.c_int32),
        ("transform_local_plan", _TRANSFORM_FN),
        ("transform_user", ctypes.c_void_p),
        ("snapshot_check", _lib.SnapshotCheckFn),
        ("snapshot_check_user", ctypes.c_void_p),
        ("checkpoint_fn", _CHECKPOINT_FN),
        ("checkpoint_user", ctypes.c_void_p),
    ]


_OWNER_POLICIES = {None: 0, "balanced": 1, "lowest_rank": 2}


def _L():
    global _declared
    L = lib()
    if not _declared:
        with _declare_lock:
            vp, sz, st = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
            cpp, szp = ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t)
            sig = {
                "ferry_planner_open": (st, [vp, ctypes.POINTER(_PlannerRequest), ctypes.POINTER(vp)]),
                "ferry_local_plan_edit": (
                    st, [ctypes.c_char_p, sz, ctypes.POINTER(ctypes.c_uint32),
                         ctypes.POINTER(ctypes.c_char_p), sz, cpp, szp]
                ),
                "ferry_planner_destroy": (None, [vp]),
                "ferry_planner_step": (ctypes.c_uint64, [vp]),
                "ferry_planner_local_plan": (st, [vp, cpp, szp]),
                "ferry_planner_global_plan": (st, [vp, ctypes.POINTER(vp)]),
                "ferry_planner_save": (st, [vp, ctypes.c_char_p, sz]),
                "ferry_planner_wait_written": (st, [vp]),
                "ferry_planner_wait_written_for": (st, [vp, ctypes.c_int64]),
                "ferry_planner_barrier": (st, [vp, ctypes.POINTER(ctypes.c_char_p)]),
                "ferry_planner_barrier_for": (
                    st, [vp, ctypes.c_int64, ctypes.POINTER(ctypes.c_char_p)]
                ),
                "ferry_plan_global": (
                    st, [ctypes.POINTER(ctypes.c_char_p), szp, sz, st, ctypes.POINTER(_lib.SaveOptions),
                         ctypes.POINTER(vp)]
                ),
                "ferry_plans_count": (sz, [vp]),
                "ferry_plans_get": (st, [vp, sz, cpp, szp]),
                "ferry_plans_release": (None, [vp]),
                "ferry_plan_json": (st, [ctypes.c_char_p, sz, ctypes.POINTER(ctypes.c_char_p)]),
                "ferry_plan_text": (st, [ctypes.c_char_p, sz, ctypes.POINTER(ctypes.c_char_p)]),
            }
            for name, (res, args) in sig.items():
                f = getattr(L, name)
                f.restype = res
                f.argtypes = args
            _declared = True
    return L


def _plans_list(handle):
    L = _L()
    try:
        out = []
        for r in range(L.ferry_plans_count(handle)):
            b, n = ctypes.c_void_p(), ctypes.c_size_t()
            check(L.ferry_plans_get(handle, r, ctypes.byref(b), ctypes.byref(n)))
            out.append(SavePlan.from_bytes(ctypes.string_at(b, n.value)))
        return out
    finally:
        L.ferry_plans_release(handle)


class _Plan:
    """A plan held as its bytes (what travels), read through JSON."""

    def __init__(self, data):
        self._bytes = bytes(data)
        out = ctypes.c_char_p()
        check(_L().ferry_plan_json(self._bytes, len(self._bytes), ctypes.byref(out)))
        self._json = json.loads(out.value.decode("utf-8"))

    @classmethod
    def from_bytes(cls, data):
        return cls(data)

    def to_bytes(self) -> bytes:
        return self._bytes

    @property
    def rank(self) -> int:
        return self._json["rank"]

    @property
    def items(self) -> List[Dict[str, Any]]:
        """[{key, dtype, global_shape, offsets, sizes, nbytes, entry[, owners]}]
        (a copy: changing it leaves the plan as it is)"""
        return copy.deepcopy(self._json["items"])

    def __str__(self):
        out = ctypes.c_char_p()
        check(_L().ferry_plan_text(self._bytes, len(self._bytes), ctypes.byref(out)))
        return out.value.decode("utf-8")

    def __eq__(self, other):
        return isinstance(other, _Plan) and self._bytes == other._bytes

    def __hash__(self):
        return hash(self._bytes)


class LocalPlan(_Plan):
    """What one rank holds, before the ranks agree who writes what."""

    def with_items(self, items: Sequence[Any]) -> LocalPlan:
        """A local plan of some of this plan's items, in the order given, each
        an item of self.items whose "key" may differ (the item is found by
        its "entry": the index of its tensor in the state dict)."""
        own = self._json["items"]
        by_entry = dict((it["entry"], i) for i, it in enumerate(own))
        index, keys = [], []
        for k, it in enumerate(items):
            if not isinstance(it, dict) or it.get("entry") not in by_entry:
                raise FerryError("local plan item %d (%r) is not an item of this plan: items may "
                                 "be dropped or renamed, not added" % (k, it))
            orig = own[by_entry[it["entry"]]]
            changed = sorted(f for f in set(orig) | set(it) if f != "key"
                             and orig.get(f) != it.get(f))
            if changed:
                raise FerryError("local plan item %d %r: %s changed (only the key may change)"
                                 % (k, it.get("key"), ", ".join(changed)))
            if not isinstance(it.get("key"), str) or not it["key"]:
                raise FerryError("local plan item %d: key %r is not a non-empty str"
                                 % (k, it.get("key")))
            index.append(by_entry[it["entry"]])
            keys.append(it["key"].encode("utf-8"))
        n = len(index)
        idx = (ctypes.c_uint32 * max(n, 1))(*index)
        ks = (ctypes.c_char_p * max(n, 1))(*keys)
        b, blen = ctypes.c_void_p(), ctypes.c_size_t()
        check(_L().ferry_local_plan_edit(self._bytes, len(self._bytes), idx, ks, n,
                                         ctypes.byref(b), ctypes.byref(blen)))
        return LocalPlan(ctypes.string_at(b, blen.value))


class SavePlan(_Plan):
    """One rank's part of the global plan: its items with their owners (the
    ranks that write them), its writes, files and bytes."""

    @property
    def writes(self) -> List[Dict[str, Any]]:
        return self._json["writes"]

    @property
    def files(self) -> List[str]:
        return self._json["files"]

    @property
    def bytes(self) -> int:
        return self._json["bytes"]


def _fail(e, error, error_len):
    """A callback's failure for Ferry: "Type: message" into the caller's
    error buffer (cut to fit, NUL-terminated), and 1."""
    msg = ("%s: %s" % (type(e).__name__, e)).encode("utf-8")[: max(error_len - 1, 0)]
    ctypes.memmove(error, msg + b"\0", len(msg) + 1)
    return 1


# checkpoint_fn calls running now -> (their ctypes callback, the planner's
# tensors): a call abandoned at the write deadline keeps both alive until it
# returns, even if its SavePlanner is gone.
_fn_calls = {}


def _wrap_checkpoint_fn(fn, keep):
    box = []

    def call(_user, tensors, n, filename, error, error_len):
        token = object()
        _fn_calls[id(token)] = (box[0] if box else None, keep)
        try:
            import torch

            sd = {}
            for i in range(n):
                t = tensors[i]
                dtype = _core.torch_dtype(t.dtype)
                shape = tuple(t.shape[d] for d in range(t.ndim))
                numel = 1
                for d in shape:
                    numel *= d
                nbytes = numel * torch.empty((), dtype=dtype).element_size()
                if nbytes:
                    raw = (ctypes.c_uint8 * nbytes).from_address(t.data)
                    flat = torch.frombuffer(raw, dtype=torch.uint8)
                else:
                    flat = torch.empty(0, dtype=torch.uint8)
                sd[t.key.decode("utf-8")] = flat.view(dtype).reshape(shape)
            fn(sd, filename.decode("utf-8"))
            return 0
        except BaseException as e:  # noqa: BLE001 - anything it raises fails the save
            return _fail(e, error, error_len)
        finally:
            _fn_calls.pop(id(token), None)

    box.append(_CHECKPOINT_FN(call))
    return box[0]


def _wrap_transform(fn, keep):
    """`keep` holds the bytes handed back until the next call: Ferry copies
    them as soon as the function returns."""

    def call(_user, data, n, out, out_len, error, error_len):
        try:
            plan = LocalPlan(ctypes.string_at(data, n))
            got = fn(plan)
            if got is None:
                raise FerryError("transform_local_plan returned None: return the plan, "
                                 "plan.with_items(items) or the items")
            if not isinstance(got, LocalPlan):
                got = plan.with_items(got)
            keep[0] = ctypes.create_string_buffer(got.to_bytes(), len(got.to_bytes()))
            out[0] = ctypes.addressof(keep[0])
            out_len[0] = len(got.to_bytes())
            return 0
        except BaseException as e:  # noqa: BLE001 - anything it raises fails the save
            return _fail(e, error, error_len)

    return _TRANSFORM_FN(call)


_current = None  # the SavePlanner ferry.save_on_this_process / ferry.barrier act on


class WriteHandle:
    """save_on_this_process's answer: wait() returns once this rank's files
    are durable; raises FerryError if the checkpoint failed."""

    def __init__(self, planner):
        self._planner = planner

    def wait(self):
        p = self._planner._p()
        wait_sliced(lambda ms: _L().ferry_planner_wait_written_for(p, ms))


class SavePlanner:
    """One checkpoint, driven in steps (see the module docstring).

    filename_prefix: data files are <prefix>-<rank>-<k> (None: the options'
    or the configured one); with no root anywhere, "dir/name" means root
    dir, prefix name. options: None, a ferry.CheckpointOptions
    (compress, shard_size, filename_prefix), or a dict with "overwrite",
    "metadata" and "file_options" (a CheckpointOptions). root: None = the configured
    root. step: None = one more than the latest committed step under root
    (0 in an empty root). checkpoint_fn(state_dict, filename),
    transform_local_plan(plan) and owner_policy ("balanced", "lowest_rank"
    or None): see the module docstring. on_mutation: as save_async's, from
    here until this rank's snapshot ends (a tensor changed in place fails
    the checkpoint naming it; "warn": planner.warnings() lists it)."""

    _check = None
    _check_id = None

    def __init__(self, state_dict: Mapping[str, Any], filename_prefix: Optional[str] = None,
                 options: Optional[_core.CheckpointOptions] = None,
                 checkpoint_fn: Optional[Callable[..., Any]] = None, root: Optional[str] = None,
                 step: Optional[int] = None, runtime: Optional[_core.Runtime] = None,
                 transform_local_plan: Optional[Callable[[LocalPlan], LocalPlan]] = None,
                 owner_policy: Optional[str] = None, on_mutation: str = "error") -> None:
        global _current
        self._ptr = None
        self._calls = set()  # an interrupted create_global_plan still running
        _core._check_on_mutation("SavePlanner", on_mutation)
        if owner_policy not in _OWNER_POLICIES:
            raise FerryError("SavePlanner owner_policy %r: expected 'balanced', 'lowest_rank' or "
                             "None" % (owner_policy,))
        if transform_local_plan is not None and not callable(transform_local_plan):
            raise FerryError("SavePlanner transform_local_plan must be callable, not %s"
                             % type(transform_local_plan).__name__)
        self._rt = runtime or _core.default_runtime()
        if isinstance(options, _core.CheckpointOptions):
            options = {"file_options": options}
        opts = dict(options or {})
        unknown = set(opts) - {"overwrite", "metadata", "file_options"}
        if unknown:
            raise FerryError("SavePlanner options: unknown %s" % ", ".join(sorted(unknown)))
        fo = opts.get("file_options")
        if fo is not None and not isinstance(fo, _core.CheckpointOptions):
            raise FerryError("SavePlanner file_options must be a ferry.CheckpointOptions, not %s"
                             % type(fo).__name__)
        copts = fo._c() if fo is not None else None
        items, self.staged, self._entries, pairs = _core._save_entries(
            state_dict, opts.get("metadata"))
        self._tensors = [t for _, t, _, _ in items]
        kv, kv_keep = _core._kvs(pairs)
        self._fn = (_wrap_checkpoint_fn(checkpoint_fn, (self._tensors, self._entries))
                    if checkpoint_fn else _CHECKPOINT_FN())
        self._transform_out = [None]
        self._transform = (_wrap_transform(transform_local_plan, self._transform_out)
                           if transform_local_plan else _TRANSFORM_FN())
        req = _lib.sized(_PlannerRequest)
        req.tensors, req.num_tensors = self._entries.array, len(items)
        req.filename_prefix = (filename_prefix or "").encode("utf-8")
        req.root = str(root).encode("utf-8") if root else None
        req.has_step, req.step = 0 if step is None else 1, int(step or 0)
        req.overwrite = 1 if opts.get("overwrite") else 0
        req.metadata, req.num_metadata = kv, len(pairs)
        if copts is not None:
            req.files = copts
        req.owner_policy = _OWNER_POLICIES[owner_policy]
        req.transform_local_plan = self._transform
        req.checkpoint_fn = self._fn
        self._check, self._check_id = _core._version_check(items, self.staged, on_mutation)
        if self._check is not None:
            req.snapshot_check = _core._SNAPSHOT_CHECK_FN
            req.snapshot_check_user = self._check_id
        out = ctypes.c_void_p()
        try:
            check(_L().ferry_planner_open(self._rt._alive(), ctypes.byref(req), ctypes.byref(out)))
        except BaseException:
            _core._checks.pop(self._check_id, None)
            raise
        del kv_keep
        self._ptr = out
        self.step = _L().ferry_planner_step(out)
        self.global_plan = None
        _current = self

    def _p(self):
        if self._ptr is None:
            raise FerryError("this SavePlanner is closed")
        return self._ptr

    def create_local_plan(self) -> LocalPlan:
        b, n = ctypes.c_void_p(), ctypes.c_size_t()
        check(_L().ferry_planner_local_plan(self._p(), ctypes.byref(b), ctypes.byref(n)))
        return LocalPlan(ctypes.string_at(b, n.value))

    def create_global_plan(self) -> List[SavePlan]:
        """Collective: every rank's SavePlan (index r is rank r's)."""
        h = ctypes.c_void_p()
        # Ctrl-C is seen at once; the collective call goes on (close() waits for it).
        _lib.call_interruptibly(_L().ferry_planner_global_plan, (self._p(), ctypes.byref(h)),
                                keep=(self,), inflight=self._calls)
        self.global_plan = _plans_list(h)
        return self.global_plan

    def save_on_this_process(self, plan: SavePlan) -> WriteHandle:
        """Starts writing this rank's files; another rank's plan is refused."""
        b = plan.to_bytes()
        check(_L().ferry_planner_save(self._p(), b, len(b)))
        return WriteHandle(self)

    def barrier(self) -> str:
        """Collective: rank 0 commits; returns the checkpoint's path."""
        out = ctypes.c_char_p()
        p = self._p()
        wait_sliced(lambda ms: _L().ferry_planner_barrier_for(p, ms, ctypes.byref(out)))
        return out.value.decode("utf-8")

    def warnings(self) -> List[str]:
        """Tensors changed during the snapshot that on_mutation="warn" let
        the checkpoint commit despite."""
        return list(self._check.warnings) if self._check is not None else []

    def close(self) -> None:
        """Abandons an unfinished checkpoint (on every rank)."""
        # An interrupted create_global_plan still uses the planner: wait for
        # it (it ends by plan-timeout), else leave the planner to it.
        if not _lib.join_inflight(getattr(self, "_calls", ()), 60.0):
            self._ptr = None
            return
        _core._checks.pop(self._check_id, None)
        ptr, self._ptr = self._ptr, None
        if ptr is not None:
            _L().ferry_planner_destroy(ptr)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _planner():
    if _current is None or _current._ptr is None:
        raise FerryError("no SavePlanner: create one (ferry.SavePlanner) first")
    return _current


def save_on_this_process(plan: SavePlan) -> WriteHandle:
    """The latest SavePlanner's save_on_this_process."""
    return _planner().save_on_this_process(plan)


def barrier() -> str:
    """The latest SavePlanner's barrier: returns the committed path."""
    return _planner().barrier()


def rank() -> int:
    """This process's rank (of the default runtime)."""
    return _core.default_runtime().rank


def global_plan(local_plans: Sequence[LocalPlan], owner_policy: str = "balanced",
                options: Optional[_core.CheckpointOptions] = None) -> List[SavePlan]:
    """The global plan of local plans gathered by any means, with no job:
    every rank's SavePlan. owner_policy: "balanced" or "lowest_rank";
    options: a ferry.CheckpointOptions whose filename_prefix, shard_size and
    compress name and cut the files as a save with them would."""
    if owner_policy not in ("balanced", "lowest_rank"):
        raise FerryError("owner_policy %r: expected 'balanced' or 'lowest_rank'" % (owner_policy,))
    if options is not None and not isinstance(options, _core.CheckpointOptions):
        raise FerryError("global_plan: options = %r: expected a ferry.CheckpointOptions"
                         % (options,))
    files = ctypes.byref(options._c()) if options is not None else None
    blobs = [p.to_bytes() if isinstance(p, _Plan) else bytes(p) for p in local_plans]
    n = len(blobs)
    arr = (ctypes.c_char_p * max(n, 1))(*blobs)
    lens = (ctypes.c_size_t * max(n, 1))(*[len(b) for b in blobs])
    h = ctypes.c_void_p()
    check(_L().ferry_plan_global(arr, lens, n, 1 if owner_policy == "lowest_rank" else 0,
                                 files, ctypes.byref(h)))
    return _plans_list(h)


class _PlanNamespace:
    """ferry.plan: the pure planner."""

    global_plan = staticmethod(global_plan)
    LocalPlan = LocalPlan
    SavePlan = SavePlan


plan = _PlanNamespace()
