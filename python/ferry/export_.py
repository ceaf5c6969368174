"""ferry.export: a consolidated copy of a checkpoint, one entry per tensor
with its full global shape, as safetensors files and a Hugging Face style
model.safetensors.index.json. The work is the library's: `ferry export` on
the command line is the same code and writes the same files."""

from __future__ import annotations

import ctypes
import os
from typing import Optional

from . import _core
from ._shards import PathLike


def export(checkpoint: PathLike, out_dir: PathLike, max_shard_bytes: int = 5 << 30,
           block_bytes: int = 256 << 20, runtime: Optional[_core.Runtime] = None) -> str:
    """Writes `checkpoint` (a step directory, or a root: its latest) into
    out_dir as model-0000i-of-0000N.safetensors files of at most
    max_shard_bytes each (a larger tensor gets a file of its own) and
    model.safetensors.index.json, reading about block_bytes at a time.
    The state's non-tensor values travel in every file's __metadata__:
    "ferry.leaves" (JSON values), "ferry.values" (the typed encoding of
    tuples, sets, bytes and pickled objects, copied as stored: nothing is
    unpickled), "ferry.pickled" (its keys that hold pickle) and
    "ferry.per_rank"; per-rank values are the tensors "<key>@rank<r>".
    Returns the index's path."""
    man = _core.Manifest(checkpoint)
    meta = {}  # the library carries the values ("ferry.leaves", "ferry.values", ...) itself
    keys = (ctypes.c_char_p * max(1, len(meta)))(*[k.encode() for k in meta])
    values = (ctypes.c_char_p * max(1, len(meta)))(*[v.encode() for v in meta.values()])
    # A runtime of its own, one process: the load streams through a small pool.
    rt = runtime or _core.Runtime(dict(_core._default_options) or {"pool_bytes": "64MiB"},
                                  rank=0, world_size=1)
    try:
        out = ctypes.c_char_p()
        _core.check(_core.lib().ferry_export(rt._alive(), man.path.encode(),
                                             os.fspath(out_dir).encode(), max_shard_bytes,
                                             block_bytes, keys, values, len(meta),
                                             ctypes.byref(out)))
        return out.value.decode()
    finally:
        if runtime is None:
            rt.close()
