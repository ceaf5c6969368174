"""What a save hands the C ABI, kept for the next save of a state dict of the
same shape.

A training loop saves the same state again and again: the same keys, the
same tensors (changed in place), the same plain values. The first save walks
the tree (_core._save_entries: ferry._tree.flatten, typed values, shards) and
prepares a C state dict (ferry_state_dict_create). A later save of a tree of
the same shape reuses both: it re-reads, column by column at C speed, only
what can change between saves (each tensor's address, shape, dtype, device,
contiguity; the plain values; the metadata) and replaces in the C state dict
only the entries whose tensor changed.

The shape is checked only for trees of plain containers: dicts with str keys
whose values are torch tensors, such dicts, or JSON scalars. Anything else
(optimizers and other stateful objects, lists, shards, typed or per-rank
values, non-contiguous tensors) is walked by flatten on every save, as
before: its output may depend on more than the shape, so it is never reused.
"""

import ctypes
from collections import OrderedDict
from operator import attrgetter

from . import _pack
from ._lib import check, lib

_SCALARS = frozenset((type(None), bool, int, float, str))
_DICTS = frozenset((dict, OrderedDict))
_shape = attrgetter("shape")
_dtype = attrgetter("dtype")
_version = attrgetter("_version")
_tensor_types = None


def _tensor_type_set():
    global _tensor_types
    if _tensor_types is None:
        import torch

        _tensor_types = frozenset((torch.Tensor, torch.nn.Parameter))
    return _tensor_types


class _NotPlain(Exception):
    pass


def _shape_of(d, tensors, leaves, tensor_types):
    """The shape of dict `d` (nested tuples of its keys), appending its
    tensors and plain values in flatten's order; _NotPlain for anything the
    shape does not decide."""
    keys = tuple(d)
    if set(map(type, keys)) - {str}:
        raise _NotPlain()
    vals = list(d.values())
    kinds = set(map(type, vals))
    if kinds <= tensor_types:  # the usual module state dict: one C-speed pass
        tensors.extend(vals)
        return keys
    parts = []
    for k, v in zip(keys, vals):
        tv = type(v)
        if tv in tensor_types:
            tensors.append(v)
            parts.append((k, 0))
        elif tv in _DICTS:
            if not v:  # an empty dict is a leaf to flatten
                raise _NotPlain()
            parts.append((k, _shape_of(v, tensors, leaves, tensor_types)))
        elif tv in _SCALARS:
            leaves.append(v)
            parts.append((k, 1))
        else:
            raise _NotPlain()
    return tuple(parts)


def plain_shape(state_dict, last=None):
    """(shape, tensors, plain values) of a tree of plain containers, or None.
    `last`: the shape of the previous save; a flat dict of tensors with the
    same keys (the same str objects, compared by address) skips the key
    checks."""
    if type(state_dict) not in _DICTS:
        return None
    if last is not None and type(last) is tuple and last and type(last[0]) is str:
        keys = tuple(state_dict)
        if keys == last:
            vals = list(state_dict.values())
            if set(map(type, vals)) <= _tensor_type_set():
                return keys, vals, []
    tensors, leaves = [], []
    try:
        shape = _shape_of(state_dict, tensors, leaves, _tensor_type_set())
    except _NotPlain:
        return None
    return shape, tensors, leaves


class Prepared:
    """One save's inputs: items (key, tensor, global shape, offsets; None
    when `sd` is prepared and the cache answered), staged
    keys, metadata pairs, the C state dict (or None: the caller packs
    `entries`), what keeps its buffers alive, and the tensor version records
    of the mutation check."""

    __slots__ = ("items", "staged", "pairs", "sd", "entries", "keys", "tensors", "ptrs",
                 "devices")


class SaveCache:
    """One runtime's cache of its last save's inputs (see the module)."""

    # Beyond this share of changed entries the C state dict is built anew.
    _REBUILD_SHARE = 4

    def __init__(self):
        self._sd = None  # ctypes handle of the prepared C state dict
        self._shape = None
        self._leaf_types = None
        self._leaves = None
        self._metadata = None
        self._pairs = None
        self._keys = None
        self._columns = None  # (ptrs, shapes, dtypes, devices) of the cached tensors
        self.hits = 0  # saves served from the cache (tests read it)

    def close(self):
        sd, self._sd = self._sd, None
        self._shape = None
        if sd is not None:
            lib().ferry_state_dict_release(sd)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def prepare(self, state_dict, metadata, save_entries):
        """The inputs of a save of `state_dict`; `save_entries` is the full
        walk (_core._save_entries), run when the cache cannot answer."""
        plain = plain_shape(state_dict, self._shape if self._sd is not None else None)
        if plain is not None and self._sd is not None:
            p = self._reuse(plain, metadata)
            if p is not None:
                self.hits += 1
                return p
        items, staged, entries, pairs = save_entries(state_dict, metadata)
        p = Prepared()
        p.items, p.staged, p.pairs, p.sd, p.entries = items, staged, pairs, None, entries
        p.keys = [it[0] for it in items]
        p.tensors = [it[1] for it in items]
        p.ptrs = list(map(_data_ptr(), p.tensors))
        p.devices = None
        # Per-rank entries (keys like "rng" are per-rank by name) carry flags
        # a replaced entry would lose: such trees take the walk every time.
        if (plain is None or staged or entries.flags
                or any(it[2] is not None for it in items)):
            self.close()
            return p
        shape, tensors, leaves = plain
        cols = _columns(tensors)
        self.close()
        # The walk met the tensors in flatten's order (it keeps its own).
        if len(tensors) != len(items) or cols != _columns(p.tensors):
            return p
        sd = ctypes.c_void_p()
        check(lib().ferry_state_dict_create(entries.array, len(items), ctypes.byref(sd)))
        self._sd = sd
        self._shape = shape
        self._leaves = leaves
        self._leaf_types = list(map(type, leaves))
        self._metadata = dict(metadata) if metadata else {}
        self._pairs = pairs
        self._keys = p.keys
        self._columns = cols
        p.sd = sd
        return p

    def _reuse(self, plain, metadata):
        shape, tensors, leaves = plain
        if (shape != self._shape or list(map(type, leaves)) != self._leaf_types
                or leaves != self._leaves or (dict(metadata) if metadata else {}) != self._metadata):
            return None
        if not all(map(_is_contiguous(), tensors)):
            return None  # staged copies: the full walk decides
        cols = _columns(tensors)
        if cols != self._columns:
            changed = [i for i, row in enumerate(zip(*cols)) if row != self._row(i)]
            if len(changed) * self._REBUILD_SHARE > len(tensors):
                return None
            keys = self._keys
            for i in changed:
                rec, keep = _pack.pack_items([(keys[i], tensors[i], None, None)])
                check(lib().ferry_state_dict_set(self._sd, i, rec))
                del keep
            self._columns = cols
        p = Prepared()
        keys = self._keys
        p.items = None  # the prepared state dict stands for them
        p.staged = []
        p.pairs = self._pairs
        p.sd = self._sd
        p.entries = None
        p.keys = keys
        p.tensors = tensors
        p.ptrs = cols[0]
        p.devices = cols[3]
        return p

    def _row(self, i):
        return tuple(c[i] for c in self._columns)


def _data_ptr():
    import torch

    return torch.Tensor.data_ptr


def _is_contiguous():
    import torch

    return torch.Tensor.is_contiguous


def _get_device():
    import torch

    return torch.Tensor.get_device


def _columns(tensors):
    """What the C state dict holds of each tensor, column by column (the
    device as its index, -1 for the CPU: an int is cheaper than a device)."""
    return (list(map(_data_ptr(), tensors)), list(map(_shape, tensors)),
            list(map(_dtype, tensors)), list(map(_get_device(), tensors)))


def version_records(p, skip):
    """(key, tensor, version, data_ptr) of the save's tensors not in `skip`,
    for the mutation check."""
    recs = zip(p.keys, p.tensors, map(_version, p.tensors), p.ptrs)
    if not skip:
        return list(recs)
    return [r for r in recs if r[0] not in skip]
