"""Shards and dtypes: what a tensor is to Ferry, shared by the tree walk, the
packer and the runtime without importing the runtime."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence, Tuple, Union

from ._lib import FerryError, lib

if TYPE_CHECKING:
    import torch

# What the public functions take: a state dict (nested containers of tensors,
# shards, values and objects with state_dict()) and a directory or s3:// root.
StateDict = Mapping[str, Any]
PathLike = Union[str, "os.PathLike[str]"]

# ferry_dtype codes (ferry.h) of the torch dtypes safetensors names.
_DTYPE_CODES = None
_CODE_DTYPES = None


def _dtype_tables():
    global _DTYPE_CODES, _CODE_DTYPES
    if _DTYPE_CODES is None:
        import torch

        codes = {
            torch.bool: 0,
            torch.uint8: 1,
            torch.int8: 2,
            torch.int16: 3,
            torch.int32: 5,
            torch.int64: 7,
            torch.float16: 9,
            torch.bfloat16: 10,
            torch.float32: 11,
            torch.float64: 12,
        }
        # Newer torch has more of what safetensors names.
        for name, code in (
            ("uint16", 4),
            ("uint32", 6),
            ("uint64", 8),
            ("float8_e4m3fn", 13),
            ("float8_e5m2", 14),
        ):
            dt = getattr(torch, name, None)
            if dt is not None:
                codes[dt] = code
        _DTYPE_CODES = codes
        _CODE_DTYPES = {c: d for d, c in codes.items()}
    return _DTYPE_CODES, _CODE_DTYPES


def _dtype_code(key, dtype):
    codes, _ = _dtype_tables()
    if dtype not in codes:
        raise FerryError("tensor '%s': dtype %s has no Ferry equivalent" % (key, dtype))
    return codes[dtype]


def torch_dtype(code: int) -> torch.dtype:
    _, back = _dtype_tables()
    if code not in back:
        raise FerryError("dtype %s is not available in this torch" % lib().ferry_dtype_name(code))
    return back[code]


class Shard:
    """A tensor that is one box of a larger global tensor: `tensor` holds the
    elements [offsets[d], offsets[d] + tensor.shape[d]) of every dimension d
    of a tensor of `global_shape`. Saved shards of one key from all ranks
    form the global tensor; a load fills any box from whatever was saved."""

    __slots__ = ("tensor", "global_shape", "offsets")

    def __init__(self, tensor: torch.Tensor, global_shape: Sequence[int],
                 offsets: Sequence[int]) -> None:
        self.tensor = tensor
        self.global_shape = tuple(int(x) for x in global_shape)
        self.offsets = tuple(int(x) for x in offsets)
        if len(self.global_shape) != tensor.dim() or len(self.offsets) != tensor.dim():
            raise ValueError(
                "ferry.Shard: tensor has %d dims, global_shape %s and offsets %s"
                % (tensor.dim(), self.global_shape, self.offsets)
            )

    def __repr__(self):
        return "Shard(%s %s of %s at %s)" % (
            self.tensor.dtype,
            tuple(self.tensor.shape),
            self.global_shape,
            self.offsets,
        )


def split_range(n: int, rank: int, world: int) -> Tuple[int, int]:
    """[start, stop) of `rank`'s part when n items are split over `world`
    ranks as evenly as possible (the first n % world ranks get one more)."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError("rank %d outside world size %d" % (rank, world))
    base, extra = divmod(int(n), world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def _dim_shard(full, rank, world, dim, dtype, device):
    import torch

    if isinstance(full, torch.Tensor):
        shape = tuple(full.shape)
    else:
        shape = tuple(int(x) for x in full)
    if not shape:
        raise ValueError("cannot split a scalar")
    start, stop = split_range(shape[dim], rank, world)
    offsets = [0] * len(shape)
    offsets[dim] = start
    if isinstance(full, torch.Tensor):
        local = full.narrow(dim, start, stop - start)
    else:
        local_shape = list(shape)
        local_shape[dim] = stop - start
        local = torch.empty(local_shape, dtype=dtype or torch.float32, device=device)
    return Shard(local, shape, offsets)


def row_shard(full: Union[torch.Tensor, Sequence[int]], rank: int, world: int,
              dtype: Optional[torch.dtype] = None, device: Any = "cpu") -> Shard:
    """`rank`'s rows of a tensor split along dim 0 over `world` ranks.
    `full` is the whole tensor (the shard is a view of it) or its shape (the
    shard is allocated with `dtype`, to be filled by a load)."""
    return _dim_shard(full, rank, world, 0, dtype, device)


def col_shard(full: Union[torch.Tensor, Sequence[int]], rank: int, world: int,
              dtype: Optional[torch.dtype] = None, device: Any = "cpu") -> Shard:
    """Like row_shard, split along the last dim (a column block of a matrix)."""
    import torch

    ndim = full.dim() if isinstance(full, torch.Tensor) else len(tuple(full))
    return _dim_shard(full, rank, world, ndim - 1, dtype, device)


def flat_shard(tensor: torch.Tensor, numel: int, offset: int) -> Shard:
    """A 1-D slice [offset, offset + tensor.numel()) of a flattened tensor of
    `numel` elements (ZeRO / FSDP flat parameters)."""
    return Shard(tensor.view(-1), (int(numel),), (int(offset),))


def _sharded_tensor_shard(key, v):
    """torch 1.13 ShardedTensor -> Shard: this rank's one local shard."""
    shards = v.local_shards()
    if len(shards) != 1:
        raise FerryError(
            "tensor '%s': ShardedTensor with %d local shards on this rank; Ferry takes one per key"
            % (key, len(shards))
        )
    s = shards[0]
    return Shard(s.tensor, tuple(v.size()), tuple(s.metadata.shard_offsets))


def _dtensor_shard(key, v):
    """torch 2.x DTensor -> Shard, from its mesh and placements."""
    # A Partial placement holds addends of the value, not a piece of it.
    partial = [p for p in v.placements if type(p).__name__.endswith("Partial")]
    if partial:
        raise FerryError("tensor '%s': DTensor with a Partial placement (%s); redistribute it to "
                         "Shard or Replicate before saving" % (key, partial[0]))
    local = v.to_local()
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:  # older 2.x
        from torch.distributed._tensor._utils import compute_local_shape_and_global_offset
    _, offsets = compute_local_shape_and_global_offset(v.shape, v.device_mesh, v.placements)
    return Shard(local, tuple(v.shape), tuple(offsets))


def _as_shard(key, v):
    if isinstance(v, Shard):
        return v
    name = type(v).__name__
    if name == "ShardedTensor":
        return _sharded_tensor_shard(key, v)
    if name == "DTensor":
        return _dtensor_shard(key, v)
    return None
