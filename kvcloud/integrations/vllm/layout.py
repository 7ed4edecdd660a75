"""The one place that knows how vLLM lays out its paged KV: learned, not assumed.

kvcloud stores a chunk as ``[layers, 2 (K, V), tokens, kv_heads, head_dim]``, whatever the
engine's block size. vLLM's per-layer cache tensor differs by attention backend and CPU ISA:
the CPU backend allocates ``[blocks, heads, block_size, 2 × head_dim]`` and stores K
transposed inside each block (``[head_dim, block_size]``, for its dot products) but V
row-major; FlashAttention uses ``[2, blocks, block_size, heads, head_dim]``; others differ
again. Rather than hard-code those shapes, ``learn_layout`` writes numbered probe values
through the backend's own cache-write op (``impl.do_kv_cache_update``, the op the forward
pass uses) into a one-block scratch tensor and reads back where each (K/V, token, head, dim)
landed. The result is a permutation of one block's elements, for any backend whose block
holds a permutation of its KV (every unquantized one).

Every layout vLLM ships places K and V each at an affine position (an offset plus a stride per
token, head and dim): the CPU backend's transposed K is just a different set of strides. When
the learned permutation is affine, gather and scatter are strided copies through an
``as_strided`` view of the cache (a few ms per layer); otherwise they fall back to an indexed
copy of every element, which is correct for any permutation but several times slower.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import LayoutError

# probe digits run 1..BASE so a zero in the scratch block means "not written"; every integer
# up to 256 is exact in float16 and bfloat16
_BASE = 64


@dataclass(frozen=True)
class HalfStrides:
    """Where K (or V) of one block sits, in elements of the cache's storage."""

    offset: int  # from the block's first element
    token: int
    head: int
    dim: int


@dataclass(frozen=True)
class BlockLayout:
    """Where one block's K/V elements sit in a layer's cache tensor."""

    block_dim: int  # the axis of the cache tensor that counts blocks
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    # positions[i]: offset, within one block's elements (``cache.select(block_dim, b)``
    # flattened), of canonical element i of [2, block_size, heads, head_dim]
    positions: torch.Tensor
    covers_block: bool  # every element of a block is KV (a scatter needs no read first)
    natural: bool  # positions == arange: a block already is [2, block_size, heads, dim]
    # K and V as strided views (and the cache strides they were learned on), when affine
    halves: tuple[HalfStrides, HalfStrides] | None = None
    cache_strides: tuple[int, ...] = ()

    @property
    def block_elems(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_dim

    def gather(self, cache: torch.Tensor, block_ids: Sequence[int]) -> torch.Tensor:
        """KV of ``block_ids`` (in token order) as ``[2, n·block_size, heads, head_dim]``."""
        nb = len(block_ids)
        n, h, d = self.block_size, self.num_kv_heads, self.head_dim
        if self._strided(cache):
            out = torch.empty(2, nb * n, h, d, dtype=cache.dtype, device=cache.device)
            self.gather_into(cache, block_ids, out)
            return out
        return self._gather_indexed(cache, block_ids)

    def gather_into(self, cache: torch.Tensor, block_ids: Sequence[int], out: torch.Tensor) -> None:
        """Like ``gather``, into ``out`` (``[2, n·block_size, heads, head_dim]``): with an
        affine layout one strided copy per run of consecutive blocks and no temporary."""
        nb = len(block_ids)
        n, h, d = self.block_size, self.num_kv_heads, self.head_dim
        if tuple(out.shape) != (2, nb * n, h, d):
            raise LayoutError(f"expected room of shape {[2, nb * n, h, d]}, got {list(out.shape)}")
        if not self._strided(cache):
            out.copy_(self._gather_indexed(cache, block_ids))
            return
        dst = out.view(2, nb, n, h, d)
        runs = _runs(block_ids)
        for half in (0, 1):
            view = self._half_view(cache, half)
            for start, lo, hi in runs:
                dst[half, start : start + hi - lo].copy_(view[lo:hi])

    def _gather_indexed(self, cache: torch.Tensor, block_ids: Sequence[int]) -> torch.Tensor:
        nb = len(block_ids)
        n, h, d = self.block_size, self.num_kv_heads, self.head_dim
        ids = torch.as_tensor(block_ids, dtype=torch.long, device=cache.device)
        flat = cache.index_select(self.block_dim, ids).movedim(self.block_dim, 0).reshape(nb, -1)
        canon = flat if self.natural else flat[:, self.positions]
        return canon.view(nb, 2, n, h, d).transpose(0, 1).reshape(2, nb * n, h, d)

    def scatter(self, cache: torch.Tensor, block_ids: Sequence[int], kv: torch.Tensor) -> None:
        """Write ``kv`` (``[2, n·block_size, heads, head_dim]``) into ``block_ids``."""
        nb = len(block_ids)
        n, h, d = self.block_size, self.num_kv_heads, self.head_dim
        if tuple(kv.shape) != (2, nb * n, h, d):
            raise LayoutError(f"expected KV of shape {[2, nb * n, h, d]}, got {list(kv.shape)}")
        if self._strided(cache):
            src = kv.reshape(2, nb, n, h, d)
            runs = _runs(block_ids)
            for half in (0, 1):
                view = self._half_view(cache, half)
                for start, lo, hi in runs:
                    view[lo:hi].copy_(src[half, start : start + hi - lo])
            return
        ids = torch.as_tensor(block_ids, dtype=torch.long, device=cache.device)
        canon = kv.to(cache.dtype).reshape(2, nb, n * h * d).transpose(0, 1).reshape(nb, -1)
        block_shape = [s for i, s in enumerate(cache.shape) if i != self.block_dim]
        if self.natural and self.covers_block:
            flat = canon
        else:
            if self.covers_block:
                flat = torch.empty(nb, math.prod(block_shape), dtype=cache.dtype)
            else:
                sel = cache.index_select(self.block_dim, ids).movedim(self.block_dim, 0)
                flat = sel.reshape(nb, -1).clone()
            flat[:, self.positions] = canon
        blocks = flat.view(nb, *block_shape).movedim(0, self.block_dim)
        cache.index_copy_(self.block_dim, ids, blocks)

    def _strided(self, cache: torch.Tensor) -> bool:
        return self.halves is not None and cache.stride() == self.cache_strides

    def _half_view(self, cache: torch.Tensor, half: int) -> torch.Tensor:
        """K (half 0) or V (half 1) of every block as ``[blocks, block_size, heads, dim]``."""
        assert self.halves is not None
        s = self.halves[half]
        return cache.as_strided(
            (cache.shape[self.block_dim], self.block_size, self.num_kv_heads, self.head_dim),
            (cache.stride(self.block_dim), s.token, s.head, s.dim),
            cache.storage_offset() + s.offset,
        )


def _runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """``block_ids`` as runs of consecutive ids: (index of the run's first, first id, end id)."""
    runs: list[tuple[int, int, int]] = []
    for i, b in enumerate(block_ids):
        if runs and runs[-1][2] == b:
            start, lo, _ = runs[-1]
            runs[-1] = (start, lo, b + 1)
        else:
            runs.append((i, b, b + 1))
    return runs


def _affine_halves(
    positions: torch.Tensor, cache: torch.Tensor, block_dim: int, shape: tuple[int, int, int]
) -> tuple[HalfStrides, HalfStrides] | None:
    """K and V's storage strides, if the learned positions are affine in (token, head, dim)."""
    block_shape = [s for i, s in enumerate(cache.shape) if i != block_dim]
    block_strides = [s for i, s in enumerate(cache.stride()) if i != block_dim]
    # logical offset within a block -> offset in the cache's storage
    storage = torch.zeros_like(positions)
    rest = positions.clone()
    for size, stride in zip(reversed(block_shape), reversed(block_strides), strict=True):
        storage += (rest % size) * stride
        rest //= size
    n, h, d = shape
    t_idx = torch.arange(n).view(n, 1, 1)
    h_idx = torch.arange(h).view(1, h, 1)
    d_idx = torch.arange(d).view(1, 1, d)
    halves = []
    for half in storage.view(2, n, h, d):
        off = int(half[0, 0, 0])
        st = int(half[1, 0, 0]) - off if n > 1 else 0
        sh = int(half[0, 1, 0]) - off if h > 1 else 0
        sd = int(half[0, 0, 1]) - off if d > 1 else 0
        if not torch.equal(half, off + t_idx * st + h_idx * sh + d_idx * sd):
            return None
        halves.append(HalfStrides(off, st, sh, sd))
    return halves[0], halves[1]


def find_block_dim(cache: torch.Tensor, num_blocks: int) -> int:
    dims = [i for i, s in enumerate(cache.shape) if s == num_blocks]
    if not dims:
        raise LayoutError(
            f"no axis of the KV cache tensor {list(cache.shape)} has the {num_blocks} blocks "
            "vLLM allocated"
        )
    # vLLM puts the block axis first, or second after a K/V axis of 2
    return dims[0]


def learn_layout(
    layer: Any,
    cache: torch.Tensor,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
) -> BlockLayout:
    """Learn one layer's block layout by writing probes through ``layer.impl``."""
    block_dim = find_block_dim(cache, num_blocks)
    scratch_shape = list(cache.shape)
    scratch_shape[block_dim] = 1
    scratch = torch.zeros(scratch_shape, dtype=cache.dtype, device=cache.device)
    n_elems = 2 * block_size * num_kv_heads * head_dim
    block_numel = scratch.numel()
    if block_numel < n_elems:
        raise LayoutError(
            f"a block of {list(cache.shape)} holds {block_numel} elements, fewer than the "
            f"{n_elems} of its K and V: a quantized or packed cache kvcloud cannot read"
        )
    index = torch.arange(n_elems, dtype=torch.long)
    passes = max(1, math.ceil(math.log(n_elems, _BASE)))
    found = torch.zeros(block_numel, dtype=torch.long)
    written = torch.ones(block_numel, dtype=torch.bool)
    slots = torch.arange(block_size, dtype=torch.long, device=cache.device)
    for p in range(passes):
        digits = (index // _BASE**p) % _BASE + 1
        kv = digits.view(2, block_size, num_kv_heads, head_dim).to(cache.dtype)
        scratch.zero_()
        layer.impl.do_kv_cache_update(layer, kv[0].contiguous(), kv[1].contiguous(), scratch, slots)
        seen = scratch.select(block_dim, 0).reshape(-1).to(torch.float64).round().long()
        written &= seen > 0
        found += (seen - 1).clamp(min=0) * _BASE**p
    positions = torch.full((n_elems,), -1, dtype=torch.long)
    where = torch.nonzero(written).flatten()
    targets = found[where]
    if targets.numel() != n_elems or targets.min() < 0 or targets.max() >= n_elems:
        raise LayoutError(
            f"could not learn vLLM's KV layout for a cache of {list(cache.shape)} "
            f"({cache.dtype}): {targets.numel()} of {n_elems} elements were written where "
            "the probe could find them"
        )
    positions[targets] = where
    if (positions < 0).any():
        raise LayoutError("vLLM's cache-write op wrote some K/V elements twice")
    return BlockLayout(
        block_dim=block_dim,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=cache.dtype,
        positions=positions,
        covers_block=block_numel == n_elems,
        natural=bool(torch.equal(positions, torch.arange(n_elems))),
        halves=_affine_halves(positions, cache, block_dim, (block_size, num_kv_heads, head_dim)),
        cache_strides=tuple(cache.stride()),
    )
