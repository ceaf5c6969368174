"""Ferry for PyTorch: asynchronous, resharding checkpoints of state dicts.

    import ferry
    h = ferry.save_async(model.state_dict(), "/ckpt", step)   # returns at once
    h.wait_snapshot()                                         # before optimizer.step()
    ferry.load(model.state_dict(), "/ckpt")                   # latest, in place

Pure Python over Ferry's C ABI (libferry_c.so, loaded with ctypes), so the
same package works on any CPython 3 and any torch version. See README.md.
"""

from ._lib import FerryError, library_path
from ._core import (
    CheckpointOptions,
    LoadResult,
    Manifest,
    Runtime,
    SaveHandle,
    apply_retention,
    configure,
    default_runtime,
    latest,
    list_steps,
    load,
    load_state_dict,
    read_manifest,
    save,
    save_async,
)
from ._shards import Shard, col_shard, flat_shard, row_shard, split_range
from ._tree import per_rank
from .manager import CheckpointManager
from .planner import SavePlanner, barrier, plan, rank, save_on_this_process

__version__ = "0.1.0"

__all__ = [
    "CheckpointManager",
    "CheckpointOptions",
    "FerryError",
    "LoadResult",
    "Manifest",
    "Runtime",
    "SaveHandle",
    "SavePlanner",
    "Shard",
    "apply_retention",
    "barrier",
    "col_shard",
    "configure",
    "default_runtime",
    "export",
    "flat_shard",
    "latest",
    "library_path",
    "list_steps",
    "per_rank",
    "plan",
    "rank",
    "load",
    "load_state_dict",
    "read_manifest",
    "row_shard",
    "save",
    "save_async",
    "save_on_this_process",
    "split_range",
]


from .export_ import export  # noqa: E402
