"""ferry_tensor records for the C ABI, packed in a few C-speed passes.

One ctypes assignment per field per tensor costs microseconds each: at tens
of thousands of tensors that was most of a save's Python time. Here the
fields are gathered column by column with map() and packed by one
struct.pack into a buffer the ctypes array is laid over.
"""

import ctypes
import struct
from array import array
from itertools import accumulate, chain
from operator import attrgetter, itemgetter

from . import _lib
from ._lib import FerryError
from ._shards import _dtype_code, _dtype_tables

# ferry_tensor: key, data, dtype, ndim, shape, strides, device_type,
# device_index, global_shape, offsets, flags, reserved (native layout).
_RECORD = struct.Struct("@PPiiPPiiPPII")
assert _RECORD.size == ctypes.sizeof(_lib.Tensor), "ferry_tensor's layout changed: update _RECORD"

_shape = attrgetter("shape")
_dtype = attrgetter("dtype")
_device = attrgetter("device")
_first = itemgetter(0)
_second = itemgetter(1)
_device_codes = {}


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


def pack_items(items, flags=None):
    """The ferry_tensor array of (key, tensor, global shape or None, offsets
    or None) items, and what must stay alive while C reads it. flags: {item
    index: ferry_tensor.flags} for the few items that have any."""
    import torch

    n = len(items)
    if n == 0:
        return (_lib.Tensor * 1)(), None
    keys = [it[0] for it in items]
    tensors = [it[1] for it in items]
    keys_b = [k.encode("utf-8") for k in keys]
    blob = b"\0".join(keys_b) + b"\0"
    base = ctypes.cast(ctypes.c_char_p(blob), ctypes.c_void_p).value
    kptrs = [base]
    kptrs += [base + at for at in accumulate(len(k) + 1 for k in keys_b[:-1])]
    shapes = list(map(_shape, tensors))
    nds = list(map(len, shapes))
    # Every shape, then each shard's global shape and offsets, then each
    # strided tensor's strides, in one int64 buffer.
    dims = array("q", chain.from_iterable(shapes))
    gptrs = [0] * n
    optrs = [0] * n
    shard_at = {}
    for i, it in enumerate(items):
        if it[2] is not None:
            shard_at[i] = len(dims)
            dims.extend(int(x) for x in it[2])
            dims.extend(int(x) for x in it[3])
    strides_at = {}
    for i, t in enumerate(tensors):
        if not t.is_contiguous():
            strides_at[i] = len(dims)
            dims.extend(t.stride())
    dims.append(0)  # never empty: its address is every scalar's shape
    dbase = dims.buffer_info()[0]
    sptrs = [dbase]
    sptrs += [dbase + 8 * at for at in accumulate(nds[:-1])]
    for i, at in shard_at.items():
        gptrs[i] = dbase + 8 * at
        optrs[i] = dbase + 8 * (at + nds[i])
    stptrs = [0] * n
    for i, at in strides_at.items():
        stptrs[i] = dbase + 8 * at
    codes, _ = _dtype_tables()
    dtypes = list(map(_dtype, tensors))
    dcodes = [codes.get(d, -1) for d in dtypes]
    if -1 in dcodes:
        i = dcodes.index(-1)
        _dtype_code(keys[i], dtypes[i])  # raises, naming the key
    devs = [_device_code(k, d) for k, d in zip(keys, map(_device, tensors))]
    data = [p if m else 0 for p, m in zip(map(torch.Tensor.data_ptr, tensors),
                                           map(torch.Tensor.numel, tensors))]
    fl = [0] * n
    for i, f in (flags or {}).items():
        fl[i] = f
    flat = list(chain.from_iterable(zip(kptrs, data, dcodes, nds, sptrs, stptrs,
                                        map(_first, devs), map(_second, devs), gptrs, optrs,
                                        fl, [0] * n)))
    buf = bytearray(struct.pack("@" + _RECORD.format[1:] * n, *flat))
    arr = (_lib.Tensor * n).from_buffer(buf)
    return arr, (blob, dims, buf)
