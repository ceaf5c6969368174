"""What a save hands the C ABI, kept for the next save of a state dict of the
same shape.

A training loop saves the same state again and again: the same keys, the
same tensors (changed in place), the same plain values. The first save of a
plain tree (below) takes its flat keys from its shape, without the walk
(_core._save_entries: ferry._tree.flatten, typed values, shards), and
prepares a C state dict (ferry_state_dict_create). A later save of a tree of
the same shape reuses both: it re-reads, column by column at C speed, only
what can change between saves (each tensor's address, shape, dtype,
contiguity; the plain values; the metadata) and replaces in the C state dict
only the entries whose tensor changed.

The shape is checked only for trees of plain containers: dicts with str keys
whose values are torch tensors, such dicts, or JSON scalars. Anything else
(optimizers and other stateful objects, lists, shards, typed or per-rank
values, non-contiguous tensors) is walked by flatten on every save, as
before: its output may depend on more than the shape, so it is never reused.
"""

import ctypes
import json
import threading
from array import array
from collections import OrderedDict
from itertools import chain, compress, count, repeat, tee
from operator import add, attrgetter, eq, is_, methodcaller, ne

from . import _pack, _tree
from ._lib import check, lib

_SCALARS = frozenset((type(None), bool, int, float, str))
_DICTS = frozenset((dict, OrderedDict))
_shape = attrgetter("shape")
_dtype = attrgetter("dtype")
_device = attrgetter("device")
_is_cpu = attrgetter("is_cpu")
_version = attrgetter("_version")
# What _reuse's pass reads of a tensor that is as at the last save: (the
# address and version appended to their columns, contiguous, the same shape,
# the same dtype, its held storage where it was).
_AS_BEFORE = (None, None, True, True, True, True)
# What _first's pass reads of a contiguous CPU tensor: (contiguous, on the
# CPU, then six values appended to their columns).
_FIRST_AS_USUAL = (True, True, None, None, None, None, None, None)
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
                return last, vals, []  # `last` itself: the caller compares it by identity
    tensors, leaves = [], []
    try:
        shape = _shape_of(state_dict, tensors, leaves, _tensor_type_set())
    except _NotPlain:
        return None
    return shape, tensors, leaves


class Prepared:
    """One save's inputs: items (key, tensor, global shape, offsets; None
    when `sd` is prepared), staged keys, metadata pairs, the C state dict
    (or None: the caller packs `entries`), and the columns of the mutation
    check and the stream: keys, tensors, their addresses (None: read from
    `items`), whether any tensor is on a GPU (None: unknown)."""

    __slots__ = ("items", "staged", "pairs", "sd", "entries", "keys", "tensors", "ptrs",
                 "versions", "any_cuda", "storages")


def _flat_keys(shape, path, tkeys, lkeys, paths):
    """The flat keys of the tensors (tkeys) and plain values (lkeys) of a
    shape, and each one's path, in flatten's order; a dict of tensors alone
    (the usual module state dict) at C speed."""
    if type(shape[0]) is str:
        if path:
            ks = list(map(add, repeat(".".join(path) + "."), shape))
            paths.update(zip(ks, [path + [k] for k in shape]))
        else:
            ks = list(shape)
            paths.update(zip(ks, zip(ks)))  # 1-tuples: JSON writes them as the paths' lists
        tkeys.extend(ks)
        return
    for k, sub in shape:
        p = path + [k]
        if type(sub) is int:
            key = ".".join(p)
            paths[key] = p
            (lkeys if sub == 1 else tkeys).append(key)
        else:
            _flat_keys(sub, p, tkeys, lkeys, paths)


def _any_rng_name(paths):
    """Whether a path component is an RNG state's name (flatten makes such
    entries per-rank: the walk decides); every such name holds "rng", so
    one C-speed scan clears the usual tree."""
    if "rng" not in "\0".join(paths).lower():
        return False
    return any(_tree.rng_name(c) for p in paths.values() for c in p)


# JSON's own spelling of a str (json.dumps's default, ensure_ascii): a
# printable ASCII str without " or \ is spelled as itself in quotes.
_quote = json.encoder.encode_basestring_ascii
_PRINTABLE_OR_NUL = bytes(range(0x20, 0x7F)) + b"\0"
_item = "%s: [%s%s]".__mod__  # one entry of the tree's JSON: "flat key": [path]
_nested_item = '"%s": [%s"%s"]'.__mod__  # the same, of a key spelled as itself


def _names(shape, out):
    """Every dict key of a shape (each path component)."""
    if type(shape[0]) is str:
        out.extend(shape)
        return
    for k, sub in shape:
        out.append(k)
        if type(sub) is not int:
            _names(sub, out)


def _tree_json(shape, key_prefix, path_json, tkeys, lkeys, items, plain):
    """Like _flat_keys, but each key's path goes straight into `items` as
    its entry of json.dumps(paths) (the same text); a dict of tensors alone
    at C speed. `plain`: no key needs escaping in JSON."""
    if type(shape[0]) is str:
        if not key_prefix:  # the keys are the flat keys
            tkeys.extend(shape)
            qs = list(map(_quote, shape))
            items.extend(map(_item, zip(qs, repeat(""), qs)))
            return
        ks = list(map(add, repeat(key_prefix), shape))
        tkeys.extend(ks)
        if plain:
            items.extend(map(_nested_item, zip(ks, repeat(path_json), shape)))
        else:
            items.extend(map(_item, zip(map(_quote, ks), repeat(path_json), map(_quote, shape))))
        return
    for k, sub in shape:
        key = key_prefix + k
        if type(sub) is int:
            (lkeys if sub == 1 else tkeys).append(key)
            items.append(_item((_quote(key), path_json, _quote(k))))
        else:
            _tree_json(sub, key + ".", path_json + _quote(k) + ", ", tkeys, lkeys, items, plain)


def _plain_names(shape):
    """(every dict key of a plain tree's shape, them joined by NULs), or None
    when the walk must decide: no key at all, or a key an RNG state's name
    makes per-rank."""
    if not shape:
        return None
    if type(shape[0]) is str:  # a dict of tensors alone: its keys, as they are
        names = shape
    else:
        names = []
        _names(shape, names)
    joined = "\0".join(names)
    # Every RNG state's name holds "rng" in some case (no other character
    # lowers to r, n or g): one C-speed scan clears the usual tree.
    if "rng" in joined.lower() and any(map(_tree.rng_name, names)):
        return None
    return names, joined


def _plain_entries(plain, metadata, names, joined):
    """(tensor keys, metadata pairs, the keys joined by NULs or None) of a
    plain tree as flatten and encode_meta give them, or None when the walk
    must decide (keys flattening to the same key, a value over the JSON
    limit); `names`, `joined`: _plain_names'."""
    shape, tensors, leaves = plain
    tkeys, lkeys, items = [], [], []
    # ASCII is printable from space to "~": nothing else but the NULs between names.
    plain_names = (joined.isascii() and '"' not in joined and "\\" not in joined
                   and not joined.encode("ascii").translate(None, _PRINTABLE_OR_NUL))
    flat = type(shape[0]) is str  # a dict of tensors alone: its keys are the flat keys
    if flat and plain_names:
        # {"k": ["k"], ...} joined from the keys and two constants: no str per key.
        tkeys = list(shape)
        items = ['{"']
        items.extend(chain.from_iterable(zip(shape, repeat('": ["'), shape, repeat('"], "'))))
        items[-1] = '"]}'
        tree = "".join(items)
    else:
        _tree_json(shape, "", "", tkeys, lkeys, items, plain_names)
        # A dict's own keys are distinct: only nested dicts can flatten two
        # paths to one key ({"a.b": x, "a": {"b": y}}).
        if not flat and len(set(tkeys).union(lkeys)) != len(tkeys) + len(lkeys):
            return None
        # The braces go on the first and last items: the text is copied once.
        items[0] = "{" + items[0]
        items[-1] += "}"
        tree = ", ".join(items)
    del items
    limit = _tree.MAX_LEAF_JSON_BYTES
    for v in leaves:  # only a long str or a huge int can pass the limit
        if ((type(v) is str and len(v) * 6 + 2 > limit)
                or (type(v) is int and v.bit_length() > 64)) and len(
                    json.dumps(v, allow_nan=True)) > limit:
            return None
    pairs = [(k, v) for k, v in (metadata or {}).items()]
    pairs.append((_tree.TREE_META_KEY, tree))
    pairs.append((_tree.LEAVES_META_KEY, json.dumps(dict(zip(lkeys, leaves)), allow_nan=True)))
    return tkeys, pairs, joined if flat else None


def plain_flat(state_dict):
    """flatten's answer for a plain tree of tensors alone (no plain values:
    a load puts those back through the walk's slots), from its shape; None
    for any other tree."""
    plain = plain_shape(state_dict)
    if plain is None or plain[2] or not plain[0]:
        return None
    tkeys, lkeys, paths = [], [], {}
    _flat_keys(plain[0], [], tkeys, lkeys, paths)
    if len(paths) != len(tkeys) or _any_rng_name(paths):
        return None
    flat = _tree.Flat()
    flat.root = state_dict
    flat.tensors = dict(zip(tkeys, plain[1]))
    flat.paths = dict(zip(paths, map(list, paths.values())))
    return flat


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
        self._columns = None  # (ptrs, shapes, dtypes) of the cached tensors
        # The last save's storage of each CPU tensor (held from one save to
        # the next) and the address each had when taken (see _storages_for).
        # A GPU tensor's is held by its save's handle alone, until that
        # snapshot is done: GPU memory the job drops after a save is freed
        # then, not at its next save; here it has a placeholder (address 0).
        self._storages = None
        self._storage_ptrs = None
        self._any_cuda = False
        self._gpu = ()  # indices of the entries not on the CPU, ascending
        self.hits = 0  # saves served from the cache (tests read it)

    def close(self):
        sd, self._sd = self._sd, None
        self._shape = None
        self._columns = None
        self._storages = self._storage_ptrs = None
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
        if plain is not None:
            if self._sd is not None:
                p = self._reuse(plain, metadata)
                if p is not None:
                    self.hits += 1
                    return p
            p = self._first(plain, metadata)
            if p is not None:
                return p
        self.close()
        items, staged, entries, pairs = save_entries(state_dict, metadata)
        p = Prepared()
        p.items, p.staged, p.pairs, p.sd, p.entries = items, staged, pairs, None, entries
        p.keys = [it[0] for it in items]
        p.tensors = [it[1] for it in items]
        p.ptrs = p.versions = p.any_cuda = p.storages = None
        return p

    def _first(self, plain, metadata):
        """A plain tree's save without the walk: its entries from the shape,
        packed once into the C state dict the next saves reuse."""
        named = _plain_names(plain[0])
        if named is None:
            return None
        tensors = plain[1]
        ptrs, versions, sptrs = array("Q"), array("Q"), array("Q")
        shapes, dtypes, storages = [], [], []
        s1, s2 = tee(map(_pack.storage_fn(), tensors))
        # One pass, tensor by tensor, as _reuse's (see there): every column
        # this save and the next ones read, each tensor's objects in cache.
        odd = list(compress(count(), map(ne, zip(
            map(_is_contiguous(), tensors),
            map(_is_cpu, tensors),
            map(ptrs.append, map(_data_ptr(), tensors)),
            map(shapes.append, map(_shape, tensors)),
            map(dtypes.append, map(_dtype, tensors)),
            map(versions.append, map(_version, tensors)),
            map(storages.append, s1),
            map(sptrs.append, map(_storage_data_ptr(), s2))), repeat(_FIRST_AS_USUAL))))
        del s1, s2
        if not _all_contiguous(tensors, odd):
            return None
        # A dict of tensors alone: its flat keys are its keys, known before
        # its tree's JSON, which is then written while C builds the state
        # dict (below).
        flat = type(plain[0][0]) is str
        if flat:
            keys, joined = list(plain[0]), named[1]
        else:
            got = _plain_entries(plain, metadata, *named)
            if got is None:
                return None
            keys, pairs, joined = got
        cols = (ptrs, shapes, dtypes)
        # A device object per tensor only when some are not on the CPU.
        devices = list(map(_device, tensors)) if odd else "cpu"
        req, keep = _pack.columns(keys, shapes, dtypes, ptrs, devices, joined)
        self.close()
        creating = _Apart(_create_columns, req, len(keys) >= _APART_TENSORS)
        try:
            if flat:
                got = _plain_entries(plain, metadata, *named)
        except BaseException:
            sd = creating.result(quiet=True)
            if sd is not None:
                lib().ferry_state_dict_release(sd)
            raise
        sd = creating.result()
        if flat:
            if got is None:  # only plain values can call for the walk: a flat dict has none
                lib().ferry_state_dict_release(sd)
                return None
            pairs = got[1]
        del req, keep
        self._sd = sd
        self._shape = plain[0]
        self._leaves = plain[2]
        self._leaf_types = list(map(type, plain[2]))
        self._metadata = dict(metadata) if metadata else {}
        self._pairs = pairs
        self._keys = keys
        self._columns = cols
        self._gpu = [i for i in odd if devices[i].type != "cpu"]
        self._any_cuda = bool(self._gpu)
        held = storages
        if self._gpu:
            held = list(storages)  # this save's own keeps its GPU storages
            _hold_placeholders(held, sptrs, self._gpu)
        self._storages = held
        self._storage_ptrs = sptrs
        return self._prepared(tensors, ptrs, versions, storages)

    def _prepared(self, tensors, ptrs, versions, storages=None):
        """`versions`: the tensors' _version, read with the rest; `storages`:
        this save's, when the caller has them; else the held ones, with fresh
        ones for the entries not on the CPU."""
        if storages is None:
            storages = self._storages
            if self._gpu:
                storages = list(storages)
                storage = _pack.storage_fn()
                for i in self._gpu:
                    storages[i] = storage(tensors[i])
        p = Prepared()
        p.items = None  # the prepared state dict stands for them
        p.staged = []
        p.pairs = self._pairs
        p.sd = self._sd
        p.entries = None
        p.keys = self._keys
        p.tensors = tensors
        p.ptrs = ptrs
        p.versions = versions
        p.any_cuda = self._any_cuda
        p.storages = storages
        return p

    def _reuse(self, plain, metadata):
        shape, tensors, leaves = plain
        if ((shape is not self._shape and shape != self._shape)
                or list(map(type, leaves)) != self._leaf_types
                or leaves != self._leaves or (dict(metadata) if metadata else {}) != self._metadata):
            return None
        old_ptrs, shapes, dtypes = self._columns
        held, held_ptrs = self._storages, self._storage_ptrs
        if not len(tensors) == len(shapes) == len(held):
            return None  # zip below would stop at the shortest column, unchecked
        if _mostly_moved(tensors, old_ptrs):
            return None  # a new state (a reload): the pass below would end there
        # A tensor's device is not read again: under CUDA's unified
        # addressing another device means another address.
        ptrs, versions = array("Q"), array("Q")
        # One pass, tensor by tensor (zip pulls each column's next value in
        # turn): a tensor's objects are read while they are in the cache. A
        # pass per column misses it again for each (at 100,000 tensors, most
        # of the time). Shapes are compared as read, each dropped at once: no
        # column of new torch.Size objects (objects the cyclic collector then
        # walks); dtypes are shared objects, compared by identity.
        odd = list(compress(count(), map(ne, zip(
            map(ptrs.append, map(_data_ptr(), tensors)),
            map(versions.append, map(_version, tensors)),
            map(_is_contiguous(), tensors),
            map(eq, map(_shape, tensors), shapes),
            map(is_, map(_dtype, tensors), dtypes),
            # The held storage usually is the tensor's: its memory was just read.
            map(eq, map(_storage_data_ptr(), held), held_ptrs)), repeat(_AS_BEFORE))))
        changed = set(_differ(ptrs, old_ptrs))
        moved = ()  # held storages that moved (see _storages_for)
        if odd:
            if not _all_contiguous(tensors, odd):
                return None
            changed.update(i for i in odd if _shape(tensors[i]) != shapes[i]
                           or _dtype(tensors[i]) is not dtypes[i])
            sdata = _storage_data_ptr()
            moved = [i for i in odd if sdata(held[i]) != held_ptrs[i]]
        if changed:
            if len(changed) * self._REBUILD_SHARE > len(tensors):
                return None
            changed = sorted(changed)
            keys = self._keys
            # New columns, kept only once every changed entry is in: an error
            # half way leaves the rest to be found changed again next time.
            shapes, dtypes = list(shapes), list(dtypes)
            gpu = set(self._gpu)
            for i in changed:
                t = tensors[i]
                rec, keep = _pack.pack([keys[i]], [t])
                check(lib().ferry_state_dict_set(self._sd, i, rec))
                (gpu.add if rec[0].device_type != 0 else gpu.discard)(i)
                del keep
                shapes[i], dtypes[i] = _shape(t), _dtype(t)
            self._columns = (ptrs, shapes, dtypes)
            if gpu or self._gpu:
                self._gpu = sorted(gpu)
                self._any_cuda = bool(gpu)
        self._storages_for(tensors, changed, moved)
        return self._prepared(tensors, ptrs, versions)

    def _storages_for(self, tensors, changed, moved):
        """The storages this save holds until its snapshot is done (so that
        t.set_(...) or the caller dropping its tensors cannot free what the
        snapshot copies from): the last save's, but a fresh one for each tensor
        that changed (`changed`) and for each held storage that moved
        (`moved`).

        A tensor at the address, shape and dtype it had at the last save
        reads the same bytes as then, which lay in the storage taken then;
        that storage, held since and still at its address, owns those bytes,
        so no other allocation can hold them: it keeps them alive. A held
        storage that moved (storage.resize_, share_memory_ reallocate in
        place) freed its old bytes, where another tensor may now lie: _reuse
        reads each held storage's address again to catch that."""
        if moved:
            changed = set(changed).union(moved)
        if not changed:
            return
        # New columns: the previous save's handle keeps its own until its snapshot is done.
        held = list(self._storages)
        sptrs = array("Q", self._storage_ptrs)
        storage = _pack.storage_fn()
        sdata = _storage_data_ptr()
        for i in changed:
            s = held[i] = storage(tensors[i])
            sptrs[i] = sdata(s)
        _hold_placeholders(held, sptrs, self._gpu)
        self._storages = held
        self._storage_ptrs = sptrs


# From this many tensors a first save's C state dict is built on a thread
# of its own (_Apart), beside the tree's JSON: starting one costs about 0.1
# ms, building the state dict 0.2 us per tensor, the JSON as much again.
_APART_TENSORS = 4096


def _create_columns(req):
    """ferry_state_dict_create_columns' state dict (its error raised)."""
    sd = ctypes.c_void_p()
    check(lib().ferry_state_dict_create_columns(ctypes.byref(req), ctypes.byref(sd)))
    return sd


class _Apart:
    """f(arg), on a thread of its own when `apart` (ctypes lets go of the GIL
    during the C call: this thread goes on meanwhile), else here; result()
    waits for it. The C call's error is read on the thread that made it
    (ferry_last_error is per thread)."""

    def __init__(self, f, arg, apart):
        self._out = self._err = None
        self._thread = None
        if apart:
            try:
                self._thread = threading.Thread(target=self._run, args=(f, arg), daemon=True)
                self._thread.start()
                return
            except RuntimeError:  # no thread to be had: here, as before
                self._thread = None
        self._run(f, arg)

    def _run(self, f, arg):
        try:
            self._out = f(arg)
        except BaseException as e:  # handed to result()'s caller
            self._err = e

    def result(self, quiet=False):
        """f's answer, or its exception raised (None instead when `quiet`)."""
        if self._thread is not None:
            self._thread.join()
        if self._err is not None and not quiet:
            raise self._err
        return self._out


_empty_storage = None


def _placeholder():
    """What the held storages list has for an entry not on the CPU: an
    empty CPU storage (no bytes, its address never moves)."""
    global _empty_storage
    if _empty_storage is None:
        import torch

        _empty_storage = _pack.storage_fn()(torch.empty(0))
    return _empty_storage


def _hold_placeholders(held, sptrs, gpu):
    """GPU storages are never held past a save: the empty placeholder and its
    address stand in `held` and `sptrs` at the indices `gpu`."""
    if not gpu:
        return
    empty = _placeholder()
    eptr = _storage_data_ptr()(empty)
    for i in gpu:
        held[i] = empty
        sptrs[i] = eptr


def _all_contiguous(tensors, odd):
    """Whether the tensors at `odd` (those a pass found unusual) are all
    contiguous: a tensor that is not is saved from a staged copy, which the
    full walk decides."""
    contiguous = _is_contiguous()
    return all(contiguous(tensors[i]) for i in odd)


# _mostly_moved reads this many tensors' addresses, spread over the state.
_PROBES = 64


def _mostly_moved(tensors, old_ptrs):
    """Whether most of a large state's tensors are not where the last save
    saw them (a new state dict of the same keys: a model reloaded), read
    from a few of them: _reuse would read every tensor to then build the
    state dict anew (past its share of changed entries). Half of the probes
    moved, not a quarter (_REBUILD_SHARE): a state it misjudges only costs
    that pass, as before."""
    n = len(tensors)
    if n < 16 * _PROBES:
        return False
    at = range(0, n, n // _PROBES)
    moved = sum(map(ne, map(_data_ptr(), map(tensors.__getitem__, at)),
                    map(old_ptrs.__getitem__, at)))
    return moved * 2 > len(at)


def _differ(a, b):
    """The indices where two columns of the same length differ, at C speed."""
    if a == b:
        return ()
    return compress(count(), map(ne, a, b))


def _is_contiguous():
    import torch

    return torch.Tensor.is_contiguous


def _data_ptr():
    import torch

    return torch.Tensor.data_ptr


def _storage_data_ptr():
    import torch

    base = getattr(torch._C, "StorageBase", None)  # what _pack.storage_fn's storages derive from
    return base.data_ptr if base is not None else methodcaller("data_ptr")
