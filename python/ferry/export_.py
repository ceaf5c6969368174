"""ferry.export: a consolidated copy of a checkpoint, one entry per tensor
with its full global shape, as safetensors files and a Hugging Face style
model.safetensors.index.json.

Memory stays bounded: tensors are loaded one at a time, and one larger than
`block_bytes` is loaded and written a block of rows at a time (a resharded
load of rows [a, b) is exactly what Ferry's load does)."""

import ctypes
import json
import os

from . import _core

_INDEX = "model.safetensors.index.json"


def _plan_files(man, max_shard_bytes):
    files, cur, cur_bytes = [], [], 0
    for key in sorted(man.tensors):
        n = man.tensors[key].nbytes
        if cur and cur_bytes + n > max_shard_bytes:
            files.append(cur)
            cur, cur_bytes = [], 0
        cur.append(key)
        cur_bytes += n
    if cur or not files:
        files.append(cur)
    return files


def _header(man, keys, extra_meta):
    off = 0
    h = {}
    for key in keys:
        info = man.tensors[key]
        h[key] = {
            "dtype": _core.lib().ferry_dtype_name(info.dtype).decode(),
            "shape": list(info.shape),
            "data_offsets": [off, off + info.nbytes],
        }
        off += info.nbytes
    if extra_meta:
        h["__metadata__"] = extra_meta
    raw = json.dumps(h, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # data starts 8-aligned
    return raw, off


def _write_tensor(f, man, key, rt, block_bytes):
    import torch

    info = man.tensors[key]
    dtype = _core.torch_dtype(info.dtype)
    shape = info.shape
    if info.nbytes == 0:
        return
    rows = shape[0] if shape else 1
    row_bytes = info.nbytes // rows if rows else info.nbytes
    step = max(1, block_bytes // max(row_bytes, 1)) if shape else 1
    for a in range(0, rows, step):
        b = min(rows, a + step)
        if not shape or (a == 0 and b == rows):
            t = torch.empty(shape, dtype=dtype)
            target = t
        else:
            t = torch.empty((b - a,) + tuple(shape[1:]), dtype=dtype)
            target = _core.Shard(t, shape, (a,) + (0,) * (len(shape) - 1))
        entries = _core._Entries([(key, t, None, None)] if target is t else
                                 [(key, t, target.global_shape, target.offsets)])
        _core.check(_core.lib().ferry_load(rt._alive(), entries.array, 1, man.path.encode()))
        n = t.numel() * t.element_size()
        f.write(memoryview((ctypes.c_char * n).from_address(t.data_ptr())))


def export(checkpoint, out_dir, max_shard_bytes=5 << 30, block_bytes=256 << 20, runtime=None):
    """Writes `checkpoint` (a step directory, or a root: its latest) into
    out_dir as model-0000i-of-0000N.safetensors files of at most
    max_shard_bytes each (a larger tensor gets a file of its own) and
    model.safetensors.index.json. Returns the index's path."""
    man = _core.Manifest(checkpoint)
    # A runtime of its own, one process: the export reads a tensor (or a
    # block of rows) at a time, so a small staging pool is enough.
    opts = dict(_core._default_options) or {"pool_bytes": "64MiB"}
    rt = runtime or _core.Runtime(opts, rank=0, world_size=1)
    try:
        os.makedirs(out_dir, exist_ok=True)
        groups = _plan_files(man, max_shard_bytes)
        n = len(groups)
        weight_map = {}
        total = 0
        meta = {"format": "pt", "ferry.step": str(man.step)}
        if man.leaves:
            meta["ferry.leaves"] = json.dumps(man.leaves)
        for i, keys in enumerate(groups):
            name = "model-%05d-of-%05d.safetensors" % (i + 1, n)
            header, size = _header(man, keys, meta)
            tmp = os.path.join(out_dir, name + ".tmp")
            with open(tmp, "wb") as f:
                f.write(len(header).to_bytes(8, "little"))
                f.write(header)
                for key in keys:
                    _write_tensor(f, man, key, rt, block_bytes)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, os.path.join(out_dir, name))
            for key in keys:
                weight_map[key] = name
            total += size
        index = {"metadata": {"total_size": total, "ferry_step": man.step}, "weight_map": weight_map}
        path = os.path.join(out_dir, _INDEX)
        with open(path + ".tmp", "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)
        return path
    finally:
        if runtime is None:
            rt.close()
