"""The one place that knows how vLLM lays out its paged KV: learned, not assumed.

kvcloud stores a chunk as ``[layers, 2 (K, V), tokens, kv_heads, head_dim]``, whatever the
engine's block size. vLLM 0.32 gives each layer a ``[blocks, kv_heads, block_size,
2 × head_dim]`` view (K in the first ``head_dim`` of the last axis, V in the second) of one
buffer shared by all layers, whose physical order is the attention backend's choice
(``v1/kv_cache_layout.py``): ``LBHNC`` on the CPU backend, ``LBNHC`` (token-major inside a
block) for FlashAttention and FlashInfer, ``BLHNC``/``BLNHC`` where a block's layers sit
together. The CPU backend's op further stores K transposed inside each block
(``[head_dim, block_size]``, for its dot products) but V row-major. Rather than hard-code any
of that, ``learn_layout`` writes numbered probe values through the backend's own cache-write
op (``impl.do_kv_cache_update``, the op the forward pass uses) into a one-block scratch tensor
on the engine's device and reads back where each (K/V, token, head, dim) landed. The result is
a permutation of one block's elements, for any backend whose block holds a permutation of its
KV (every unquantized one).

Every layout vLLM ships places K and V each at an affine position (an offset plus a stride per
token, head and dim, in the real cache's storage): the CPU backend's transposed K is just a
different set of strides. When the learned permutation is affine, a layer's K and V of every
block are ``as_strided`` views of the cache, and a gather or scatter of any set of blocks is
one ``index_select`` / ``index_copy_`` per view over the block ids (one for K and V together
when they differ only by an offset), on the cache's device: no Python loop over blocks, one
kernel per layer on a GPU. Otherwise it falls back to an indexed copy of every element,
correct for any permutation but several times slower.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import LayoutError

# probe digits run 1..BASE so a zero in the scratch block means "not written"; every integer
# up to 256 is exact in float16 and bfloat16, up to 8 in both fp8 formats (e5m2 has two
# mantissa bits), so an fp8 cache is probed in base 8 (more passes, the same positions)
_BASE = 64
_FP8_BASE = 8


# a write into at most this many runs of consecutive blocks is done as slice copies: on CPU
# ``copy_`` of a slice is two to four times faster than ``index_copy_`` of the same blocks,
# and a chunk's blocks are one run unless the server's free list is fragmented
# (scripts/bench/bench_vllm_block_copy.py)
_MAX_SLICES = 2


@dataclass(frozen=True)
class Blocks:
    """Block ids made ready once (and reused for every layer): an index tensor on the cache's
    device and, when they form at most ``_MAX_SLICES`` runs of consecutive ids, those runs
    (index of the run's first, first id, end id), copied as slices."""

    ids: torch.Tensor
    runs: tuple[tuple[int, int, int], ...] | None

    @property
    def run(self) -> tuple[int, int] | None:
        """The ids' range when they are all consecutive."""
        if self.runs is not None and len(self.runs) == 1:
            return self.runs[0][1], self.runs[0][2]
        return None

    def __len__(self) -> int:
        return int(self.ids.numel())


# a list of vLLM block ids, or the same made ready by ``block_index``
BlockIds = Sequence[int] | Blocks


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

    def gather(self, cache: torch.Tensor, block_ids: BlockIds) -> torch.Tensor:
        """KV of ``block_ids`` (in token order) as ``[2, n·block_size, heads, head_dim]``, on
        the cache's device."""
        nb = len(block_ids)
        n, h, d = self.block_size, self.num_kv_heads, self.head_dim
        out = torch.empty(2, nb * n, h, d, dtype=cache.dtype, device=cache.device)
        self.gather_into(cache, block_ids, out)
        return out

    def gather_into(self, cache: torch.Tensor, block_ids: BlockIds, out: torch.Tensor) -> None:
        """Like ``gather``, into ``out`` (``[2, n·block_size, heads, head_dim]``, on the
        cache's device or in host memory). With an affine layout: one ``index_select`` per
        layer (or one per K and V), straight into ``out`` when it is on the cache's device,
        else into device scratch and then one copy to ``out`` (asynchronous from pinned
        memory: the caller orders it with a stream, see ``device.Streams``)."""
        nb = len(block_ids)
        n, h, d = self.block_size, self.num_kv_heads, self.head_dim
        if tuple(out.shape) != (2, nb * n, h, d):
            raise LayoutError(f"expected room of shape {[2, nb * n, h, d]}, got {list(out.shape)}")
        if nb == 0:
            return
        blocks = block_index(block_ids, cache.device)
        dst = out.view(2, nb, n, h, d)
        if not self._strided(cache):
            dst.copy_(self._gather_indexed(cache, blocks.ids), non_blocking=True)
            return
        pair = self._pair_view(cache)
        same = out.device == cache.device and out.is_contiguous()
        if pair is not None and (blocks.run is not None or not same):
            dst.copy_(_select(pair, blocks).transpose(0, 1), non_blocking=True)
            return
        for half in (0, 1):
            view = self._half_view(cache, half)
            if same and blocks.run is None:
                # select straight into ``out``, no temporary
                torch.index_select(view, 0, blocks.ids, out=dst[half])
            else:
                dst[half].copy_(_select(view, blocks), non_blocking=True)

    def scatter(self, cache: torch.Tensor, block_ids: BlockIds, kv: torch.Tensor) -> None:
        """Write ``kv`` (``[2, n·block_size, heads, head_dim]``, on any device) into
        ``block_ids``: one ``index_copy_`` per layer (or one per K and V) with an affine
        layout; KV in host memory is moved to the cache's device first, in one copy."""
        nb = len(block_ids)
        n, h, d = self.block_size, self.num_kv_heads, self.head_dim
        if tuple(kv.shape) != (2, nb * n, h, d):
            raise LayoutError(f"expected KV of shape {[2, nb * n, h, d]}, got {list(kv.shape)}")
        if nb == 0:
            return
        blocks = block_index(block_ids, cache.device)
        src = kv.to(device=cache.device, dtype=cache.dtype, non_blocking=True).view(2, nb, n, h, d)
        if not self._strided(cache):
            self._scatter_indexed(cache, blocks.ids, src)
            return
        pair = self._pair_view(cache)
        if pair is not None:
            _assign(pair, blocks, src.transpose(0, 1))
            return
        for half in (0, 1):
            _assign(self._half_view(cache, half), blocks, src[half])

    def _gather_indexed(self, cache: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Any permutation: every element through ``positions`` (``[2, nb, n, h, d]``)."""
        nb = ids.numel()
        n, h, d = self.block_size, self.num_kv_heads, self.head_dim
        flat = cache.index_select(self.block_dim, ids).movedim(self.block_dim, 0).reshape(nb, -1)
        canon = flat if self.natural else flat[:, self._positions_on(cache.device)]
        return canon.view(nb, 2, n, h, d).transpose(0, 1)

    def _scatter_indexed(self, cache: torch.Tensor, ids: torch.Tensor, src: torch.Tensor) -> None:
        nb = ids.numel()
        canon = src.reshape(2, nb, -1).transpose(0, 1).reshape(nb, -1)
        block_shape = [s for i, s in enumerate(cache.shape) if i != self.block_dim]
        if self.natural and self.covers_block:
            flat = canon
        else:
            if self.covers_block:
                flat = torch.empty(
                    nb, math.prod(block_shape), dtype=cache.dtype, device=cache.device
                )
            else:  # padding inside a block keeps what it held
                sel = cache.index_select(self.block_dim, ids).movedim(self.block_dim, 0)
                flat = sel.reshape(nb, -1).clone()
            flat[:, self._positions_on(cache.device)] = canon
        blocks = flat.view(nb, *block_shape).movedim(0, self.block_dim)
        cache.index_copy_(self.block_dim, ids, blocks)

    def _positions_on(self, device: torch.device) -> torch.Tensor:
        if self.positions.device == device:
            return self.positions
        return self.positions.to(device)

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

    def _pair_view(self, cache: torch.Tensor) -> torch.Tensor | None:
        """K and V of every block as one ``[blocks, 2, block_size, heads, dim]`` view, when
        they differ only by an offset (FlashAttention's and FlashInfer's layouts: one copy
        per layer instead of two); None when K is laid out otherwise than V (the CPU
        backend's transposed K)."""
        assert self.halves is not None
        k, v = self.halves
        if (k.token, k.head, k.dim) != (v.token, v.head, v.dim) or v.offset <= k.offset:
            return None
        return cache.as_strided(
            (cache.shape[self.block_dim], 2, self.block_size, self.num_kv_heads, self.head_dim),
            (cache.stride(self.block_dim), v.offset - k.offset, k.token, k.head, k.dim),
            cache.storage_offset() + k.offset,
        )


def block_index(block_ids: BlockIds, device: torch.device) -> Blocks:
    """Block ids ready for copies on the cache's device (one small host-to-device copy)."""
    if isinstance(block_ids, Blocks):
        return block_ids
    ids = [int(b) for b in block_ids]
    found = runs(ids)
    few = tuple(found) if 0 < len(found) <= _MAX_SLICES else None
    return Blocks(torch.tensor(ids, dtype=torch.long, device=device), few)


def runs(ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """``ids`` as runs of consecutive ids: (index of the run's first, first id, end id)."""
    out: list[tuple[int, int, int]] = []
    for i, b in enumerate(ids):
        if out and out[-1][2] == b:
            out[-1] = (out[-1][0], out[-1][1], b + 1)
        else:
            out.append((i, b, b + 1))
    return out


def _select(view: torch.Tensor, blocks: Blocks) -> torch.Tensor:
    """``view``'s entries for ``blocks`` along its first axis: a slice when consecutive."""
    if blocks.run is not None:
        return view[blocks.run[0] : blocks.run[1]]
    return view.index_select(0, blocks.ids)


def _assign(view: torch.Tensor, blocks: Blocks, src: torch.Tensor) -> None:
    """``src`` into ``view``'s entries for ``blocks``: one indexed copy, or a slice copy per
    run when there are few."""
    if blocks.runs is None:
        view.index_copy_(0, blocks.ids, src)
        return
    for start, lo, hi in blocks.runs:
        view[lo:hi].copy_(src[start : start + hi - lo])


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


def write_probe(
    layer: Any, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """Write ``key`` and ``value`` (``[tokens, heads, dim]``) for ``slots`` through the layer's
    own cache-write op.

    An MLA layer (one with a ``kv_lora_rank``) caches one latent row per token, the compressed
    KV (``kv_lora_rank`` wide) then the rotary key, and its op takes those two
    (``do_kv_cache_update(kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype,
    k_scale)``). kvcloud stores that row as one KV head whose K is the row's first half and V
    its second (``keys.mla_dims``): canonical K ‖ V of a token is the row."""
    latent = getattr(layer, "kv_lora_rank", None)
    if latent is None:
        layer.impl.do_kv_cache_update(layer, key, value, cache, slots)
        return
    n = key.shape[0]
    row = torch.cat([key.reshape(n, -1), value.reshape(n, -1)], dim=1)
    scale = getattr(layer, "_k_scale", None)
    if scale is None:
        scale = torch.ones((), dtype=torch.float32, device=cache.device)
    layer.impl.do_kv_cache_update(
        row[:, :latent].contiguous(),
        row[:, latent:].reshape(n, 1, -1).contiguous(),
        cache,
        slots,
        "auto",  # an unquantized cache: the only kind the connector stores
        scale,
    )


@contextlib.contextmanager
def _unit_scales(layer: Any) -> Iterator[None]:
    """An fp8 cache's write op divides by the layer's K and V scales (the checkpoint's):
    the probe's digits must land as themselves, so the scales are 1 while it runs."""
    saved: dict[str, Any] = {}
    for name in ("_k_scale", "_v_scale", "_k_scale_float", "_v_scale_float"):
        value = getattr(layer, name, None)
        if isinstance(value, torch.Tensor):
            saved[name] = value.clone()
            value.fill_(1.0)
        elif isinstance(value, float):
            saved[name] = value
            setattr(layer, name, 1.0)
    try:
        yield
    finally:
        for name, value in saved.items():
            if isinstance(value, torch.Tensor):
                getattr(layer, name).copy_(value)
            else:
                setattr(layer, name, value)


def learn_layout(
    layer: Any,
    cache: torch.Tensor,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    fp8: torch.dtype | None = None,
    probe_dtype: torch.dtype = torch.float32,
) -> BlockLayout:
    """Learn one layer's block layout by writing probes through ``layer.impl``
    (``write_probe``). ``fp8``: the cache holds fp8 bytes of that format (vLLM allocates
    fp8 caches as uint8); the probe is then written in ``probe_dtype`` (the model's, which
    the op quantizes) and read back as fp8."""
    if fp8 is not None:
        with _unit_scales(layer):
            return _learn(layer, cache, num_blocks, block_size, num_kv_heads, head_dim,
                          fp8, probe_dtype)  # fmt: skip
    return _learn(layer, cache, num_blocks, block_size, num_kv_heads, head_dim, None, cache.dtype)


def _learn(
    layer: Any,
    cache: torch.Tensor,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    fp8: torch.dtype | None,
    probe_dtype: torch.dtype,
) -> BlockLayout:
    base = _FP8_BASE if fp8 is not None else _BASE
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
    # the probe is written on the engine's device by the engine's own op; only what it
    # wrote comes back to the host, to be decoded
    device = cache.device
    index = torch.arange(n_elems, dtype=torch.long, device=device)
    passes = max(1, math.ceil(math.log(n_elems, base)))
    found = torch.zeros(block_numel, dtype=torch.long)
    written = torch.ones(block_numel, dtype=torch.bool)
    slots = torch.arange(block_size, dtype=torch.long, device=device)
    for p in range(passes):
        digits = (index // base**p) % base + 1
        kv = digits.view(2, block_size, num_kv_heads, head_dim).to(probe_dtype)
        scratch.zero_()
        write_probe(layer, kv[0].contiguous(), kv[1].contiguous(), scratch, slots)
        block = scratch.select(block_dim, 0).reshape(-1)
        if fp8 is not None:
            block = block.view(fp8)
        seen = block.to(torch.float64).cpu().round().long()
        written &= seen > 0
        found += (seen - 1).clamp(min=0) * base**p
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
