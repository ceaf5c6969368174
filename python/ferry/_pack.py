"""ferry_tensor records for the C ABI, packed in a few C-speed passes.

One ctypes assignment per field per tensor costs microseconds each: at tens
of thousands of tensors that was most of a save's Python time. Here the
fields are gathered column by column with map() and each column is copied
into its place in every record of one buffer by a strided memoryview
assignment; the ctypes array is laid over that buffer.
"""

import ctypes
from array import array
from itertools import accumulate, chain, compress, repeat
from operator import add, attrgetter, itemgetter, not_

from . import _lib
from ._lib import FerryError
from ._shards import _dtype_code, _dtype_tables

_shape = attrgetter("shape")
_dtype = attrgetter("dtype")
dtype_of = _dtype
_device = attrgetter("device")
_third = itemgetter(2)
_fourth = itemgetter(3)
_device_codes = {}


def _layout():
    """(record size, {field: index}) of ferry_tensor in 8-byte words for
    pointers and 4-byte words for the int32 fields (native layout)."""
    T = _lib.Tensor
    size = ctypes.sizeof(T)
    assert size % 8 == 0, "ferry_tensor's size is not a multiple of 8: update _pack"
    at = {}
    for name, ctype in T._fields_:
        off = getattr(T, name).offset
        width = ctypes.sizeof(ctype)
        assert off % width == 0, "ferry_tensor.%s is not aligned: update _pack" % name
        at[name] = off // width
    return size, at


_SIZE, _AT = _layout()
_Q = _SIZE // 8  # 8-byte words per record
_I = _SIZE // 4  # 4-byte words per record


def storage_fn():
    """The cheapest call giving the memory a tensor views. A pending save
    holds it, not only the tensor: t.set_(...) would otherwise free what the
    snapshot copies from."""
    import torch

    for name in ("untyped_storage", "_storage"):  # torch >= 2.0; 1.13
        f = getattr(torch.Tensor, name, None)
        if f is not None:
            return f
    return torch.Tensor.storage


def data_ptr_fn():
    import torch

    return torch.Tensor.data_ptr


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


def _joined_keys(keys, joined=None):
    """(the keys joined by NULs as UTF-8 bytes, the joined text); a key
    holding a NUL is refused, named. A bytes object's buffer always ends
    with a NUL past its length (the C API's promise): that NUL ends the last
    key. `joined`: "\\0".join(keys), when the caller has it."""
    if joined is None:
        joined = "\0".join(keys)
    if joined.count("\0") != len(keys) - 1:
        bad = next(k for k in keys if "\0" in k)
        raise FerryError("tensor key %r contains a NUL character, which Ferry cannot store"
                         % (bad,), "invalid_argument")
    return joined.encode("utf-8"), joined


def _key_blob(keys, joined=None):
    """(_joined_keys' buffer, the byte length of each key but the last with
    its NUL: the steps between their offsets)."""
    blob, joined = _joined_keys(keys, joined)
    head = keys[:-1]
    if len(blob) == len(joined):  # ASCII: bytes are characters
        lens = map(len, head)
    else:
        lens = map(len, [k.encode("utf-8") for k in head])
    return blob, map(add, lens, repeat(1))


def _device_codes_of(keys, devices):
    """{device: its (ferry_device_type, ordinal)} for each device in
    `devices`; an unsupported one is refused, naming its first key."""
    return {d: _device_code(keys[devices.index(d)], d) for d in set(devices)}


def _device_columns(devices, codes):
    """The ferry_device_type and ordinal columns of `devices`."""
    dc = list(map(codes.__getitem__, devices))
    return array("i", map(itemgetter(0), dc)), array("i", map(itemgetter(1), dc))


def _dtype_codes(keys, dtypes):
    """The ferry_dtype of each dtype; an unsupported one is refused, naming its key."""
    codes, _ = _dtype_tables()
    # Most states hold one dtype (dtypes are shared objects: count compares
    # by identity first): one lookup, not one per tensor.
    if dtypes and dtypes.count(dtypes[0]) == len(dtypes):
        code = codes.get(dtypes[0], -1)
        if code != -1:
            return array("i", (code,)) * len(dtypes)
    dcodes = array("i", map(codes.get, dtypes, repeat(-1)))
    if -1 in dcodes:
        i = dcodes.index(-1)
        _dtype_code(keys[i], dtypes[i])  # raises, naming the key
    return dcodes


def _zero_empty(data, shapes):
    """An empty tensor's address is no memory: C reads NULL (in place)."""
    for i, s in enumerate(shapes):
        if 0 in s:
            data[i] = 0


def pack_items(items, flags=None):
    """The ferry_tensor array of (key, tensor, global shape or None, offsets
    or None) items, and what must stay alive while C reads it. flags: {item
    index: ferry_tensor.flags} for the few items that have any."""
    if not items:
        return (_lib.Tensor * 1)(), None
    keys = [it[0] for it in items]
    tensors = [it[1] for it in items]
    gshapes = list(map(_third, items))
    shards = None
    if gshapes.count(None) != len(gshapes):
        shards = [(i, g, o) for i, (g, o) in enumerate(zip(gshapes, map(_fourth, items)))
                  if g is not None]
    return pack(keys, tensors, shards=shards, flags=flags)


def pack(keys, tensors, shapes=None, dtypes=None, ptrs=None, devices=None, shards=None,
         flags=None, contiguous=False, joined_keys=None):
    """pack_items of columns: keys, tensors, their shapes, dtypes, data_ptrs
    and devices when known ("cpu": every tensor is on the CPU), the shards
    as (index, global shape, offsets), flags as pack_items'; `contiguous`:
    every tensor is known to be; `joined_keys`: "\\0".join(keys) if known."""
    import torch

    n = len(keys)
    if n == 0:
        return (_lib.Tensor * 1)(), None
    blob, ksteps = _key_blob(keys, joined_keys)
    if shapes is None:
        shapes = list(map(_shape, tensors))
    nds = array("q", map(len, shapes))
    # Every shape, then each shard's global shape and offsets, then each
    # strided tensor's strides, in one int64 buffer.
    dims = array("q", chain.from_iterable(shapes))
    has_empty = 0 in dims
    shard_at = []
    for i, g, o in shards or ():
        shard_at.append((i, len(dims)))
        dims.extend(int(x) for x in g)
        dims.extend(int(x) for x in o)
    strides_at = []
    if not contiguous and not all(contig := list(map(torch.Tensor.is_contiguous, tensors))):
        for i in compress(range(n), map(not_, contig)):
            strides_at.append((i, len(dims)))
            dims.extend(tensors[i].stride())
    dims.append(0)  # never empty: its address is every scalar's shape
    dbase = dims.buffer_info()[0]
    dcodes = _dtype_codes(keys, dtypes if dtypes is not None else list(map(_dtype, tensors)))
    if devices == "cpu":
        devs, dev_codes = None, {None: (0, 0)}
    else:
        devs = devices if devices is not None else list(map(_device, tensors))
        dev_codes = _device_codes_of(keys, devs)
    data = array("Q", ptrs if ptrs is not None else map(torch.Tensor.data_ptr, tensors))
    if has_empty:
        _zero_empty(data, shapes)

    buf = bytearray(_SIZE * n)
    q = memoryview(buf).cast("Q")
    w = memoryview(buf).cast("i")
    kbase = ctypes.cast(ctypes.c_char_p(blob), ctypes.c_void_p).value
    q[_AT["key"]::_Q] = array("Q", accumulate(chain((kbase,), ksteps)))
    q[_AT["data"]::_Q] = data
    w[_AT["dtype"]::_I] = dcodes
    w[_AT["ndim"]::_I] = array("i", nds)
    # Each shape's address: dbase + 8 * (the dims before it).
    q[_AT["shape"]::_Q] = array("Q", map(add, map((8).__mul__, accumulate(chain((0,), nds[:-1]))),
                                         repeat(dbase)))
    if len(dev_codes) == 1:
        (dt, di), = dev_codes.values()
        if dt or di:
            w[_AT["device_type"]::_I] = array("i", repeat(dt, n))
            w[_AT["device_index"]::_I] = array("i", repeat(di, n))
    else:
        w[_AT["device_type"]::_I], w[_AT["device_index"]::_I] = _device_columns(devs, dev_codes)
    for i, at in strides_at:
        q[i * _Q + _AT["strides"]] = dbase + 8 * at
    for i, at in shard_at:
        q[i * _Q + _AT["global_shape"]] = dbase + 8 * at
        q[i * _Q + _AT["offsets"]] = dbase + 8 * (at + nds[i])
    for i, f in (flags or {}).items():
        w[i * _I + _AT["flags"]] = f
    q.release()
    w.release()
    arr = (_lib.Tensor * n).from_buffer(buf)
    return arr, (blob, dims, buf)


def columns(keys, shapes, dtypes, ptrs, devices="cpu", joined_keys=None):
    """ferry_state_dict_columns of whole contiguous tensors, given as
    columns (pack's), and what must stay alive while C reads it: no record
    per tensor to fill."""
    n = len(keys)
    blob, _ = _joined_keys(keys, joined_keys)
    ndims = array("i", map(len, shapes))
    # From a list: array() sizes itself once instead of growing per item.
    dims = array("q", list(chain.from_iterable(shapes)))
    dcodes = _dtype_codes(keys, dtypes)
    data = ptrs
    if 0 in dims:
        data = array("Q", ptrs)
        _zero_empty(data, shapes)
    keep = [blob, ndims, dims, dcodes, data]
    c = _lib.sized(_lib.StateDictColumns)
    c.num_tensors = n
    c.keys = ctypes.cast(ctypes.c_char_p(blob), ctypes.c_void_p).value
    c.keys_bytes = len(blob) + 1
    c.data = data.buffer_info()[0] if n else None
    c.dtypes = dcodes.buffer_info()[0] if n else None
    c.ndims = ndims.buffer_info()[0] if n else None
    c.shapes = dims.buffer_info()[0] if dims else None
    if devices != "cpu":  # a device per tensor
        types, indices = _device_columns(devices, _device_codes_of(keys, devices))
        keep += [types, indices]
        c.device_types, c.device_indices = types.buffer_info()[0], indices.buffer_info()[0]
    return c, keep
