"""What Runtime.save_async keeps between saves of a state dict it saw before.

A training loop saves the same state again and again: the same tree, the
same keys, mostly the same tensors at the same addresses. A cold save walks
the tree, encodes the tree metadata and hands every tensor to the C ABI,
which validates and copies each into a prepared C++ state dict
(ferry_state_dict). A repeated save re-checks only what can change, with
C-speed passes over the tree's nodes and the tensors (keys and value types
of each container, then each tensor's data pointer, shape, dtype, device and
contiguity); an entry that changed is replaced in the prepared state dict,
and anything else that differs (a key, a value type, a container that became
a leaf) falls back to the cold path. Nothing here holds a tensor or a
storage between saves: the cache keeps keys, types and numbers only.

The output is that of _tree.flatten and _core._save_entries: the same
tensors in the same order, the same metadata pairs.
"""

import ctypes
import json
import struct
from array import array
from itertools import accumulate, chain
from operator import attrgetter, itemgetter

from . import _lib, _tree
from ._lib import FerryError, check, lib

# Skeleton node kinds.
_TENSOR, _JSON, _DICT, _LIST, _STATEFUL = range(5)

# ferry_tensor as packed by _pack: key, data, dtype, ndim, shape, strides,
# device_type, device_index, global_shape, offsets (native layout).
_RECORD = struct.Struct("@PPiiPPiiPP")
assert _RECORD.size == ctypes.sizeof(_lib.Tensor), "ferry_tensor's layout changed: update _RECORD"


class _Fallback(Exception):
    """The fast walk met something only _tree.flatten handles (or names)."""


def _torch():
    import torch

    return torch


_kinds = {}  # value type -> _TENSOR / _DICT / _LIST / None (decided per value)


def _kind_of_type(tp):
    k = _kinds.get(tp, -1)
    if k != -1:
        return k
    from ._core import Shard

    torch = _torch()
    if tp is Shard or (issubclass(tp, torch.Tensor) and tp.__name__ != "DTensor") or \
            tp.__name__ in ("ShardedTensor", "DTensor"):
        k = _TENSOR
    elif issubclass(tp, dict):
        k = _DICT
    elif issubclass(tp, (list, tuple)):
        k = _LIST
    elif tp in (int, float, str, bool, type(None)):
        k = _JSON
    else:
        k = None  # stateful or not: _tree decides per value
    _kinds[tp] = k
    return k


def _kind(v, tp, root):
    k = _kind_of_type(tp)
    if k == _DICT:
        return _DICT if (v or root) else _JSON
    if k == _LIST:
        return _LIST if _tree._has_tensor(v) else _JSON
    if k is None:
        return _STATEFUL if _tree.is_stateful(v) else _JSON
    return k


class _Walk:
    """One cold walk: what flatten gives, plus the skeleton to replay."""

    def __init__(self):
        self.keys = []     # tensor keys, in order
        self.values = []   # tensor values, in order
        self.paths = {}    # every flat key -> path (tensors and leaves, in order)
        self.leaf_keys = []
        self.leaf_values = []


def _walk_dict(d, prefix, path, w, root):
    keys = list(d)
    ktypes = list(map(type, keys))
    for kt in set(ktypes):
        if kt is not str and kt is not int:
            raise _Fallback()
    values = list(d.values())
    vtypes = list(map(type, values))
    kinds = [_kind(v, tp, False) for v, tp in zip(values, vtypes)]
    if prefix:
        flat = [prefix + "." + str(k) for k in keys]
    else:
        flat = list(map(str, keys))
    children = None
    if all(k == _TENSOR for k in kinds):
        w.keys += flat
        w.values += values
        paths = w.paths
        for fk, k in zip(flat, keys):
            paths[fk] = path + [k]
        kinds = None
    else:
        children = [_walk_value(v, kind, fk, path + [k], w)
                    for v, kind, fk, k in zip(values, kinds, flat, keys)]
    return (_DICT, keys, ktypes, vtypes, kinds, children)


def _walk_list(v, prefix, path, w):
    vtypes = list(map(type, v))
    kinds = [_kind(x, tp, False) for x, tp in zip(v, vtypes)]
    children = [_walk_value(x, kind, prefix + "." + str(i), path + [[i]], w)
                for i, (x, kind) in enumerate(zip(v, kinds))]
    return (_LIST, len(v), vtypes, kinds, children)


def _walk_value(v, kind, key, path, w):
    if kind == _TENSOR:
        w.keys.append(key)
        w.values.append(v)
        w.paths[key] = path
        return None
    if kind == _DICT:
        return _walk_dict(v, key, path, w, False)
    if kind == _LIST:
        return _walk_list(v, key, path, w)
    if kind == _STATEFUL:
        sd = v.state_dict()
        if not isinstance(sd, dict) or not sd:
            raise _Fallback()  # flatten's cases: an empty one is a leaf
        return _walk_dict(sd, key, path, w, False)
    w.leaf_keys.append(key)
    w.leaf_values.append(v)
    w.paths[key] = path
    return None


def _replay(node, v, tv, lv):
    """Appends v's tensors to tv and leaves to lv as the cold walk would;
    False when v's structure differs from node's."""
    if node[0] == _DICT:
        _, keys, ktypes, vtypes, kinds, children = node
        if len(v) != len(keys) or list(v) != keys or list(map(type, v)) != ktypes:
            return False
        values = v.values()
        if list(map(type, values)) != vtypes:
            return False
        if kinds is None:
            tv.extend(values)
            return True
    else:
        _, n, vtypes, kinds, children = node
        if len(v) != n or list(map(type, v)) != vtypes:
            return False
        values = v
    for x, kind, child in zip(values, kinds, children):
        if kind == _TENSOR:
            tv.append(x)
        elif kind == _JSON:
            # A container leaf stays one only while it holds no tensor.
            if isinstance(x, dict):
                if x:
                    return False
            elif isinstance(x, (list, tuple)) and _tree._has_tensor(x):
                return False
            lv.append(x)
        elif kind == _STATEFUL:
            sd = x.state_dict()
            if not isinstance(sd, dict) or not sd or not _replay(child, sd, tv, lv):
                return False
        elif not _replay(child, x, tv, lv):
            return False
    return True


def _leaves_json(keys, values):
    """The leaves' metadata, or None when a leaf needs flatten's checks
    (not JSON, or possibly past the size limit)."""
    try:
        text = json.dumps(dict(zip(keys, values)), allow_nan=True)
    except (TypeError, ValueError):
        return None
    return text if len(text) <= _tree.MAX_LEAF_JSON_BYTES else None


def storage_fn():
    """The cheapest call giving the memory a tensor views. A pending save
    holds it, not only the tensor: t.set_(...) would otherwise free what the
    snapshot copies from."""
    torch = _torch()
    for name in ("untyped_storage", "_storage"):  # torch >= 2.0; 1.13
        f = getattr(torch.Tensor, name, None)
        if f is not None:
            return f
    return torch.Tensor.storage


_plain_types = {}  # type -> whether its values are saved as themselves when contiguous


def _is_plain(tp):
    r = _plain_types.get(tp)
    if r is None:
        torch = _torch()
        r = _plain_types[tp] = issubclass(tp, torch.Tensor) and \
            tp.__name__ not in ("DTensor", "ShardedTensor")
    return r


class _Columns:
    """A run of tensors as the C ABI gets them, column by column: what a
    repeated save compares (data pointer, shape, dtype, device, and the
    global shape and offsets of a shard) and what it hands on."""

    def __init__(self, keys, values):
        from ._core import _as_shard

        torch = _torch()
        T = torch.Tensor
        n = len(values)
        tensors = list(values)
        self.gshapes = [None] * n
        self.offsets = [None] * n
        self.plain = [True] * n
        self.staged = []
        for i, v in enumerate(tensors):
            if _is_plain(type(v)) and v.is_contiguous():
                continue  # saved as itself (a detach would only cost a new object)
            key = keys[i]
            self.plain[i] = False
            shard = _as_shard(key, v)
            t = shard.tensor if shard is not None else v
            if t.requires_grad:
                t = t.detach()
            if not t.is_contiguous():
                t = t.contiguous()  # Ferry reads the copy, which the handle keeps alive
                self.staged.append(key)
            tensors[i] = t
            if shard is not None:
                self.gshapes[i] = tuple(int(x) for x in shard.global_shape)
                self.offsets[i] = tuple(int(x) for x in shard.offsets)
        self.tensors = tensors
        self.ptrs = list(map(T.data_ptr, tensors))
        self.shapes = list(map(_shape, tensors))
        self.dtypes = list(map(_dtype, tensors))
        self.devices = list(map(_device, tensors))

    @classmethod
    def of_items(cls, items):
        """Columns of (key, tensor, global shape or None, offsets or None)
        items handed on as they are (a load's targets, a planner's entries)."""
        T = _torch().Tensor
        c = cls.__new__(cls)
        c.tensors = [it[1] for it in items]
        c.ptrs = list(map(T.data_ptr, c.tensors))
        c.shapes = list(map(_shape, c.tensors))
        c.dtypes = list(map(_dtype, c.tensors))
        c.devices = list(map(_device, c.tensors))
        c.gshapes = [tuple(it[2]) if it[2] is not None else None for it in items]
        c.offsets = [tuple(it[3]) if it[3] is not None else None for it in items]
        c.plain = [g is None for g in c.gshapes]
        c.staged = []
        c.strides = [None if t.is_contiguous() else tuple(t.stride()) for t in c.tensors]
        return c

    def subset(self, idx):
        sub = _Columns.__new__(_Columns)
        for name in ("tensors", "ptrs", "shapes", "dtypes", "devices", "gshapes", "offsets",
                     "plain"):
            col = getattr(self, name)
            setattr(sub, name, [col[i] for i in idx])
        sub.staged = []
        return sub

    def sig(self, i):
        return (self.ptrs[i], self.shapes[i], self.dtypes[i], self.devices[i], self.gshapes[i],
                self.offsets[i])


_device_codes = {}


def _device_code(key, dev):
    c = _device_codes.get(dev)
    if c is None:
        if dev.type == "cuda":
            c = (1, dev.index or 0)
        elif dev.type == "cpu":
            c = (0, 0)
        else:
            raise FerryError("tensor '%s': device %s is not supported" % (key, dev))
        _device_codes[dev] = c
    return c


def pack_items(items):
    """The ferry_tensor array of (key, tensor, global shape, offsets) items
    and what must stay alive while C reads it."""
    return _pack([it[0] for it in items], _Columns.of_items(items))


def _pack(keys, cols):
    """The ferry_tensor array of cols (keys: their str keys), packed in a few
    C-speed passes; returns it and what must stay alive while C reads it."""
    from ._core import _dtype_code, _dtype_tables

    torch = _torch()
    n = len(keys)
    if n == 0:
        return (_lib.Tensor * 1)(), None
    keys_b = [k.encode("utf-8") for k in keys]
    blob = b"\0".join(keys_b) + b"\0"
    base = ctypes.cast(ctypes.c_char_p(blob), ctypes.c_void_p).value
    kptrs = [base]
    kptrs += [base + at for at in accumulate(len(k) + 1 for k in keys_b[:-1])]
    shapes = cols.shapes
    nds = list(map(len, shapes))
    dims = array("q", chain.from_iterable(shapes))
    shard_at = {}
    for i, g in enumerate(cols.gshapes):
        if g is not None:
            shard_at[i] = len(dims)
            dims.extend(g)
            dims.extend(cols.offsets[i])
    strides_at = {}
    for i, st in enumerate(getattr(cols, "strides", None) or ()):
        if st is not None:
            strides_at[i] = len(dims)
            dims.extend(st)
    dims.append(0)  # never empty: its address is every scalar's shape
    dbase = dims.buffer_info()[0]
    sptrs = [dbase]
    sptrs += [dbase + 8 * at for at in accumulate(nds[:-1])]
    gptrs = [0] * n
    optrs = [0] * n
    for i, at in shard_at.items():
        gptrs[i] = dbase + 8 * at
        optrs[i] = dbase + 8 * (at + nds[i])
    stptrs = [0] * n
    for i, at in strides_at.items():
        stptrs[i] = dbase + 8 * at
    codes, _ = _dtype_tables()
    dcodes = [codes.get(d, -1) for d in cols.dtypes]
    if -1 in dcodes:
        i = dcodes.index(-1)
        _dtype_code(keys[i], cols.dtypes[i])  # raises, naming the key
    devs = [_device_code(k, d) for k, d in zip(keys, cols.devices)]
    data = [p if m else 0 for p, m in zip(cols.ptrs, map(torch.Tensor.numel, cols.tensors))]
    flat = list(chain.from_iterable(zip(kptrs, data, dcodes, nds, sptrs, stptrs,
                                        map(_first, devs), map(_second, devs), gptrs, optrs)))
    buf = bytearray(struct.pack("@" + _RECORD.format[1:] * n, *flat))
    arr = (_lib.Tensor * n).from_buffer(buf)
    return arr, (blob, dims, buf)


_first = itemgetter(0)
_second = itemgetter(1)


class Prepared:
    """One save's input for ferry_save_async_sd."""

    __slots__ = ("handle", "pairs", "tensors", "staged", "n")

    def __init__(self, handle, pairs, tensors, staged, n):
        self.handle = handle
        self.pairs = pairs
        self.tensors = tensors
        self.staged = staged
        self.n = n


class SaveCache:
    """The last state dict a Runtime saved, as keys, types and numbers, and
    its prepared C state dict. Not thread-safe: the Runtime's lock holds it.

    stats: "cold" / "warm" saves and entries "replaced" in warm ones (tests
    read them to know which path a save took)."""

    def __init__(self):
        self._skeleton = None
        self._keys = None
        self._cols = None  # _Columns of the last save, its tensors dropped
        self._all_plain = False
        self._tree_json = None
        self._leaf_keys = None
        self._handle = None
        self.stats = {"cold": 0, "warm": 0, "replaced": 0}

    def clear(self):
        h, self._handle = self._handle, None
        self._skeleton = None
        self._cols = None
        if h is not None:
            lib().ferry_state_dict_release(h)

    def __del__(self):
        try:
            self.clear()
        except Exception:
            pass

    def prepare(self, state_dict, metadata):
        if not isinstance(state_dict, dict):
            _tree.flatten(state_dict)  # raises its TypeError
        prepared = None
        if self._skeleton is not None:
            prepared = self._warm(state_dict)
        if prepared is None:
            prepared = self._cold(state_dict)
        user = [(k, v) for k, v in (metadata or {}).items()]
        prepared.pairs = user + prepared.pairs
        return prepared

    # --- cold: walk, pack, create -----------------------------------------------------

    def _cold(self, state_dict):
        self.clear()
        w = _Walk()
        try:
            skeleton = _walk_dict(state_dict, "", [], w, True)
            if len(w.paths) != len(w.keys) + len(w.leaf_keys):
                raise _Fallback()  # two entries flatten to one key
            leaves = _leaves_json(w.leaf_keys, w.leaf_values)
            if leaves is None:
                raise _Fallback()
        except _Fallback:
            skeleton = None
        if skeleton is None:
            # flatten raises what the fast walk cannot name; else its output,
            # uncached.
            flat = _tree.flatten(state_dict)
            w = _Walk()
            w.keys, w.values = list(flat.tensors), list(flat.tensors.values())
            w.paths = flat.paths
            leaves = json.dumps(flat.leaves, allow_nan=True)
        for k in w.keys:
            if "\0" in k:
                from ._core import _no_nul

                _no_nul("tensor key", k)
        cols = _Columns(w.keys, w.values)
        arr, keep = _pack(w.keys, cols)
        out = ctypes.c_void_p()
        check(lib().ferry_state_dict_create(arr, len(w.keys), ctypes.byref(out)))
        del keep
        tree_json = json.dumps(w.paths, allow_nan=True)
        pairs = [(_tree.TREE_META_KEY, tree_json), (_tree.LEAVES_META_KEY, leaves)]
        self.stats["cold"] += 1
        p = Prepared(out, pairs, cols.tensors, cols.staged, len(w.keys))
        if skeleton is None:
            p.handle = _OneShot(out)  # not cached: the handle lives for this save only
            return p
        self._handle = out
        self._skeleton = skeleton
        self._keys = w.keys
        self._leaf_keys = w.leaf_keys
        self._tree_json = tree_json
        self._remember(cols)
        return p

    def _remember(self, cols):
        cols.tensors = None  # the cache holds no tensor
        self._cols = cols
        self._all_plain = all(cols.plain)

    # --- warm: replay, compare, replace what changed ------------------------------------

    def _warm(self, state_dict):
        tv, lv = [], []
        if not _replay(self._skeleton, state_dict, tv, lv):
            return None
        leaves = _leaves_json(self._leaf_keys, lv)
        if leaves is None:
            return None
        T = _torch().Tensor
        c = self._cols
        changed = None
        if self._all_plain:
            try:
                if (list(map(T.data_ptr, tv)) == c.ptrs and list(map(_shape, tv)) == c.shapes
                        and list(map(_dtype, tv)) == c.dtypes
                        and list(map(_device, tv)) == c.devices
                        and all(map(T.is_contiguous, tv))):
                    changed = ()
            except TypeError:  # a value is no longer a plain tensor
                return None
        if changed is None:
            changed = [i for i, v in enumerate(tv)
                       if not (c.plain[i] and _is_plain(type(v)) and v.data_ptr() == c.ptrs[i]
                               and v.shape == c.shapes[i] and v.dtype == c.dtypes[i]
                               and v.device == c.devices[i] and v.is_contiguous())]
        tensors, staged = tv, []
        if changed:
            keys = [self._keys[i] for i in changed]
            fresh = _Columns(keys, [tv[i] for i in changed])
            tensors = list(tv)
            staged = fresh.staged
            replace = []
            for j, i in enumerate(changed):
                tensors[i] = fresh.tensors[j]
                if fresh.sig(j) != c.sig(i) or not fresh.plain[j]:
                    replace.append(j)
            if replace:
                arr, keep = _pack([keys[j] for j in replace], fresh.subset(replace))
                for r, j in enumerate(replace):
                    check(lib().ferry_state_dict_set(self._handle, changed[j],
                                                     ctypes.byref(arr[r])))
                del keep
                for r, j in enumerate(replace):
                    i = changed[j]
                    c.ptrs[i], c.shapes[i], c.dtypes[i], c.devices[i] = (
                        fresh.ptrs[j], fresh.shapes[j], fresh.dtypes[j], fresh.devices[j])
                    c.gshapes[i], c.offsets[i] = fresh.gshapes[j], fresh.offsets[j]
                    c.plain[i] = fresh.plain[j]
                self._all_plain = all(c.plain)
                self.stats["replaced"] += len(replace)
        self.stats["warm"] += 1
        pairs = [(_tree.TREE_META_KEY, self._tree_json), (_tree.LEAVES_META_KEY, leaves)]
        return Prepared(self._handle, pairs, tensors, staged, len(tv))


class _OneShot:
    """A prepared state dict for one uncached save: released when dropped."""

    def __init__(self, h):
        self.value = h

    @property
    def _as_parameter_(self):
        return self.value

    def __del__(self):
        try:
            lib().ferry_state_dict_release(self.value)
        except Exception:
            pass


_shape = attrgetter("shape")
_dtype = attrgetter("dtype")
_device = attrgetter("device")
