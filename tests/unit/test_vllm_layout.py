"""Learning vLLM's paged-KV layout from the backend's own cache-write op.

The real CPU backend is exercised end to end in tests/vllm (block sizes 64 and 128 restoring
each other's segments); here the learning itself is checked against write ops for layouts
vLLM backends use — CPU (K transposed inside a block), FlashAttention ([2, blocks, ...]) and a
padded one — with known answers, and scatter is checked to write exactly the bytes the
backend's own op writes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from kvcloud.errors import LayoutError  # noqa: E402
from kvcloud.integrations.vllm.layout import block_index, learn_layout  # noqa: E402

H, D = 3, 8


def cpu_write(key, value, cache, slots):  # cache [blocks, H, N, 2D]
    nb, h, n, two_d = cache.shape
    view = cache.view(nb, h, 2 * n, -1)
    kc, vc = view[:, :, :n], view[:, :, n:]
    for t, s in enumerate(slots.tolist()):
        b, o = divmod(s, n)
        for hh in range(h):
            # K transposed inside the block: element (o, d) at flat d * n + o
            kc[b, hh].reshape(-1)[torch.arange(two_d // 2) * n + o] = key[t, hh]
            vc[b, hh, o] = value[t, hh]


def flash_write(key, value, cache, slots):  # cache [2, blocks, N, H, D]
    n = cache.shape[2]
    for t, s in enumerate(slots.tolist()):
        b, o = divmod(s, n)
        cache[0, b, o] = key[t]
        cache[1, b, o] = value[t]


# a permutation no strides describe: token order reversed inside each block's K, every other
# head swapped in V (a layout vLLM does not ship, to exercise the general indexed path)
def scrambled_write(key, value, cache, slots):  # cache [blocks, N, 2, H, D]
    n = cache.shape[1]
    heads = [h ^ 1 if h ^ 1 < H else h for h in range(H)]
    for t, s in enumerate(slots.tolist()):
        b, o = divmod(s, n)
        cache[b, (o * 7) % n if n % 7 else o, 0] = key[t]
        cache[b, o, 1] = value[t, heads]


def padded_write(key, value, cache, slots):  # cache [blocks, N, 2, H, D + 2], padding unused
    n = cache.shape[1]
    for t, s in enumerate(slots.tolist()):
        b, o = divmod(s, n)
        cache[b, o, 0, :, :D] = key[t]
        cache[b, o, 1, :, :D] = value[t]


LAYOUTS: dict[str, tuple[Callable, Callable[[int, int], tuple[int, ...]]]] = {
    "cpu": (cpu_write, lambda nb, n: (nb, H, n, 2 * D)),
    "flash": (flash_write, lambda nb, n: (2, nb, n, H, D)),
    "padded": (padded_write, lambda nb, n: (nb, n, 2, H, D + 2)),
    "scrambled": (scrambled_write, lambda nb, n: (nb, n, 2, H, D)),
}


def layer_for(write: Callable) -> SimpleNamespace:
    impl = SimpleNamespace(
        do_kv_cache_update=lambda layer, k, v, cache, slots: write(k, v, cache, slots)
    )
    return SimpleNamespace(impl=impl)


def filled(name: str, n: int, nb: int, tokens: int, dtype, seed: int = 0):
    """A cache written by the backend's op with ``tokens`` random tokens, and those tokens."""
    write, shape = LAYOUTS[name]
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(tokens, H, D, generator=g).to(dtype)
    v = torch.randn(tokens, H, D, generator=g).to(dtype)
    cache = torch.zeros(shape(nb, n), dtype=dtype)
    write(k, v, cache, torch.arange(tokens))
    return cache, k, v


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_learned_gather_returns_what_was_written(name: str, dtype) -> None:
    n, nb = 32, 6
    cache, k, v = filled(name, n, nb, 4 * n, dtype)
    layout = learn_layout(layer_for(LAYOUTS[name][0]), cache, nb, n, H, D)
    # a FlashAttention block, taken along its block axis, already is [2, N, H, D]
    assert layout.natural == (name == "flash")
    assert layout.covers_block == (name != "padded")
    # every layout vLLM ships is a strided view; only the scrambled one needs the index path
    assert (layout.halves is None) == (name == "scrambled")
    kv = layout.gather(cache, [0, 1, 2, 3])
    assert torch.equal(kv[0], k) and torch.equal(kv[1], v)
    # blocks out of order come back in the order asked for
    assert torch.equal(layout.gather(cache, [2, 0])[0], torch.cat([k[64:96], k[:32]]))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_scatter_across_block_sizes_writes_the_backends_own_bytes(name: str) -> None:
    """KV read from 32-token blocks and written into 64-token blocks is bit-identical to
    what the backend's op writes for the same tokens."""
    dtype = torch.bfloat16
    small, k, v = filled(name, 32, 8, 128, dtype)
    src = learn_layout(layer_for(LAYOUTS[name][0]), small, 8, 32, H, D)
    canon = src.gather(small, [0, 1, 2, 3])
    write, shape = LAYOUTS[name]
    big = torch.zeros(shape(5, 64), dtype=dtype)
    dst = learn_layout(layer_for(write), big, 5, 64, H, D)
    dst.scatter(big, [3, 1], canon)  # tokens 0..63 into block 3, 64..127 into block 1
    expected = torch.zeros(shape(5, 64), dtype=dtype)
    slots = torch.cat([torch.arange(3 * 64, 4 * 64), torch.arange(64, 128)])
    write(k, v, expected, slots)
    assert torch.equal(big.view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize("name", ["cpu", "flash", "padded"])
def test_strided_and_indexed_paths_write_and_read_the_same_bytes(name: str) -> None:
    write, shape = LAYOUTS[name]
    cache, _, _ = filled(name, 32, 9, 0, torch.float32)
    strided = learn_layout(layer_for(write), cache, 9, 32, H, D)
    indexed = dataclasses.replace(strided, halves=None)
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(2, 5 * 32, H, D, generator=g)
    ids = [6, 7, 8, 2, 0]  # a run, a gap, out of order
    a = torch.randn(shape(9, 32), generator=g)  # untouched blocks keep what they held
    b = a.clone()
    strided.scatter(a, ids, kv)
    indexed.scatter(b, ids, kv)
    assert torch.equal(a, b)
    assert torch.equal(strided.gather(a, ids), kv)
    assert torch.equal(indexed.gather(a, ids), kv)
    # a cache with other strides than the one learned on takes the indexed path, correctly
    wide = torch.zeros(*shape(9, 32)[:-1], shape(9, 32)[-1] * 2)[..., : shape(9, 32)[-1]]
    strided.scatter(wide, ids, kv)
    assert torch.equal(strided.gather(wide, ids), kv)


def test_a_cache_too_small_for_its_kv_is_refused() -> None:
    # an fp8-style packed block holding half the elements K and V need
    cache = torch.zeros(4, H, 32, D)
    with pytest.raises(LayoutError, match="quantized or packed"):
        learn_layout(layer_for(cpu_write), cache, 4, 32, H, D)


def test_a_write_op_that_loses_elements_is_refused() -> None:
    def lossy(key, value, cache, slots):
        flash_write(key, value, cache, slots)
        cache[1, :, :, 0, 0] = 0  # drops one V element per token

    cache = torch.zeros(2, 4, 32, H, D)
    with pytest.raises(LayoutError, match="could not learn"):
        learn_layout(layer_for(lossy), cache, 4, 32, H, D)


# -- vLLM 0.32: every layer a strided view of one buffer, in the backend's physical order ---
#
# The logical per-layer shape is [blocks, heads, block_size, 2·head_dim] (K the first
# head_dim of the last axis, V the second); ``v1/kv_cache_layout.py`` picks the physical
# order per backend: LBHNC for the CPU backend (whose op also transposes K inside a block),
# LBNHC for FlashAttention and FlashInfer (LBHNC for FlashInfer's trtllm kernels), and
# block-outermost orders where a block's layers sit together.

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
L = 3


def split_write(key, value, cache, slots):
    """FlashAttention's and FlashInfer's update: (B, H, N, 2D) -> (B, N, H, D) K and V."""
    k_cache, v_cache = cache.transpose(1, 2).split(key.shape[-1], dim=-1)
    n = cache.shape[2]
    for t, s in enumerate(slots.tolist()):
        b, o = divmod(s, n)
        k_cache[b, o] = key[t]
        v_cache[b, o] = value[t]


def cpu_split_write(key, value, cache, slots):
    """The CPU backend's update: (B, H, 2N, D), K in the first N rows stored transposed."""
    nb, h, n, _ = cache.shape
    view = cache.view(nb, h, 2 * n, -1)
    kc, vc = view.chunk(2, dim=2)
    d = key.shape[-1]
    for t, s in enumerate(slots.tolist()):
        b, o = divmod(s, n)
        for hh in range(h):
            kc[b, hh].reshape(-1)[torch.arange(d, device=cache.device) * n + o] = key[t, hh]
            vc[b, hh, o] = value[t, hh]


# physical axis order of the buffer (L, B, H, N, C), and the backend's write op
PHYSICAL: dict[str, tuple[tuple[int, ...], Callable]] = {
    "cpu-LBHNC": ((0, 1, 2, 3, 4), cpu_split_write),
    "flash-LBNHC": ((0, 1, 3, 2, 4), split_write),
    "flashinfer-LBHNC": ((0, 1, 2, 3, 4), split_write),
    "BLNHC": ((1, 0, 3, 2, 4), split_write),
    "BLHNC": ((1, 0, 2, 3, 4), split_write),
}


def layer_views(name: str, nb: int, n: int, dtype, device: str, fill: bool = False):
    """One buffer for L layers in the named physical order; each layer's logical
    [B, H, N, 2D] view of it (as vLLM hands ``register_kv_caches``)."""
    order, _ = PHYSICAL[name]
    logical = (L, nb, H, n, 2 * D)
    physical = tuple(logical[i] for i in order)
    g = torch.Generator().manual_seed(11)
    raw = torch.randn(physical, generator=g) if fill else torch.zeros(physical)
    buf = raw.to(dtype).to(device)
    inverse = [order.index(i) for i in range(5)]
    views = buf.permute(*inverse)
    return buf, [views[layer] for layer in range(L)]


def kv_tokens(tokens: int, dtype, device: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(tokens, H, D, generator=g).to(dtype).to(device)
    v = torch.randn(tokens, H, D, generator=g).to(dtype).to(device)
    return k, v


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(PHYSICAL))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_per_layer_views_of_one_buffer_gather_what_the_op_wrote(name, dtype, device) -> None:
    nb, n = 9, 16
    _, views = layer_views(name, nb, n, dtype, device)
    write = PHYSICAL[name][1]
    layout = learn_layout(layer_for(write), views[1], nb, n, H, D)
    # every one of these orders is a strided view: no element-wise fallback
    assert layout.halves is not None and layout.cache_strides == views[1].stride()
    # K and V travel together where they differ only by an offset
    assert (layout._pair_view(views[1]) is None) == name.startswith("cpu")
    written = {}
    for layer, view in enumerate(views):
        k, v = kv_tokens(4 * n, dtype, device, seed=layer)
        # tokens land in blocks 7, 2, 5, 0 (a fragmented, out-of-order allocation)
        slots = torch.cat([torch.arange(b * n, (b + 1) * n) for b in (7, 2, 5, 0)])
        write(k, v, view, slots)
        written[layer] = (k, v)
    for layer, view in enumerate(views):
        k, v = written[layer]
        kv = layout.gather(view, [7, 2, 5, 0])
        assert kv.device == view.device
        assert torch.equal(kv[0], k) and torch.equal(kv[1], v), layer
        ids = block_index([5, 7], torch.device(device))  # made ready once, reused per layer
        assert torch.equal(layout.gather(view, ids)[1], torch.cat([v[2 * n : 3 * n], v[:n]]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(PHYSICAL))
# two runs of consecutive blocks (slice copies), four (one indexed copy)
@pytest.mark.parametrize("ids", [[8, 3, 4], [8, 3, 6, 1]])
def test_scatter_into_one_layer_writes_the_ops_bytes_and_nothing_else(name, device, ids) -> None:
    """KV scattered into one layer's blocks is bit-identical to the backend's op writing the
    same tokens there; every other layer and block of the shared buffer keeps its bytes."""
    nb, n, dtype = 9, 16, torch.bfloat16
    write = PHYSICAL[name][1]
    got, got_views = layer_views(name, nb, n, dtype, device, fill=True)
    want, want_views = layer_views(name, nb, n, dtype, device, fill=True)
    layout = learn_layout(layer_for(write), got_views[2], nb, n, H, D)
    blocks = block_index(ids, torch.device(device))
    assert (blocks.runs is None) == (len(ids) == 4)
    k, v = kv_tokens(len(ids) * n, dtype, device, seed=5)
    # the KV comes from host memory, as restores stage it
    kv = torch.stack([k, v]).cpu()
    layout.scatter(got_views[2], blocks, kv)
    slots = torch.cat([torch.arange(b * n, (b + 1) * n) for b in ids])
    write(k, v, want_views[2], slots)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["cpu-LBHNC", "flash-LBNHC"])
def test_gather_into_host_room_and_a_strided_room(name, device) -> None:
    """A save gathers into a host buffer (a chunk's layer slice), a restore may read into a
    room that is not contiguous: both take the copy path and agree with ``gather``."""
    nb, n, dtype = 6, 16, torch.float32
    write = PHYSICAL[name][1]
    _, views = layer_views(name, nb, n, dtype, device, fill=True)
    layout = learn_layout(layer_for(write), views[0], nb, n, H, D)
    ids = [4, 1, 2]
    want = layout.gather(views[0], ids).cpu()
    host = torch.empty(2, 3 * n, H, D)
    layout.gather_into(views[0], ids, host)
    assert torch.equal(host, want)
    wide = torch.zeros(2, 3 * n, H, 2 * D, device=device)
    room = wide[..., :D]
    layout.gather_into(views[0], ids, room)
    assert torch.equal(room.cpu(), want)
    assert not wide[..., D:].any()  # nothing written beside the room


def test_empty_block_lists_are_no_ops() -> None:
    _, views = layer_views("flash-LBNHC", 4, 16, torch.float32, "cpu", fill=True)
    layout = learn_layout(layer_for(split_write), views[0], 4, 16, H, D)
    before = views[0].clone()
    layout.scatter(views[0], [], torch.empty(2, 0, H, D))
    assert layout.gather(views[0], []).shape == (2, 0, H, D)
    assert torch.equal(views[0], before)


# --- MLA: one latent row per token, written by the MLA op's own signature ------------------

LATENT, ROPE = 10, 6  # a row of 16: stored as one head of 8, K its first half, V its second


def mla_write(kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale):
    """vLLM 0.32's CPU MLA ``do_kv_cache_update``: rows of [latent | rope] per slot into a
    ``[blocks, block_size, latent + rope]`` cache (viewed flat), padding slots (-1) skipped."""
    assert kv_cache_dtype == "auto" and k_scale.numel() == 1
    flat = kv_cache.view(-1, kv_c_normed.shape[-1] + k_pe.shape[-1])
    keep = slot_mapping >= 0
    flat[slot_mapping[keep], : kv_c_normed.shape[-1]] = kv_c_normed[keep]
    flat[slot_mapping[keep], kv_c_normed.shape[-1] :] = k_pe.squeeze(1)[keep]


def mla_layer() -> SimpleNamespace:
    return SimpleNamespace(
        kv_lora_rank=LATENT,
        _k_scale=torch.ones(()),
        impl=SimpleNamespace(do_kv_cache_update=mla_write),
    )


@pytest.mark.parametrize("shape", ["cpu [blocks, 1, N, W]", "flashmla [blocks, N, W]"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_an_mla_latent_cache_is_learned_as_one_head_of_two_halves(shape: str, dtype) -> None:
    """The probe goes through the MLA op's signature; what a gather returns is each token's
    latent row split in two, and a scatter writes exactly the bytes the op writes."""
    n, nb, w = 16, 5, LATENT + ROPE
    dims = (nb, 1, n, w) if shape.startswith("cpu") else (nb, n, w)
    g = torch.Generator().manual_seed(4)
    c = torch.randn(3 * n, LATENT, generator=g).to(dtype)
    pe = torch.randn(3 * n, 1, ROPE, generator=g).to(dtype)
    scale = torch.ones(())
    cache = torch.zeros(dims, dtype=dtype)
    mla_write(c, pe, cache, torch.arange(3 * n), "auto", scale)
    layout = learn_layout(mla_layer(), cache, nb, n, 1, w // 2)
    # K and V are two strided views (a token every row, V half a row on): copied as one
    assert [(h.offset, h.token, h.dim) for h in layout.halves or ()] == [(0, w, 1), (w // 2, w, 1)]
    kv = layout.gather(cache, [2, 0])  # [2, 2n, 1, w/2]
    rows = torch.cat([kv[0, :, 0], kv[1, :, 0]], dim=1)
    expected = torch.cat([c, pe.squeeze(1)], dim=1)
    assert torch.equal(rows, torch.cat([expected[2 * n : 3 * n], expected[:n]]))
    # into other blocks of another cache: the same bytes the op writes there
    other = torch.zeros(dims, dtype=dtype)
    layout.scatter(other, [4, 1], kv)
    want = torch.zeros(dims, dtype=dtype)
    slots = torch.cat([torch.arange(4 * n, 5 * n), torch.arange(n, 2 * n)])
    mla_write(torch.cat([c[2 * n :], c[:n]]), torch.cat([pe[2 * n :], pe[:n]]), want, slots,
              "auto", scale)  # fmt: skip
    assert torch.equal(other, want)


# -- fp8 caches: uint8 bytes a quantizing op writes ----------------------------------------------


def fp8_layer(fmt, k_scale: float, v_scale: float) -> SimpleNamespace:
    """A layer whose op quantizes as vLLM's fp8 caches do: K / k_scale and V / v_scale cast
    to ``fmt``, their bytes written into a uint8 cache in the CPU backend's layout."""

    def write(layer, key, value, cache, slots):  # type: ignore[no-untyped-def]
        wide = cache.view(fmt).to(torch.float32)
        cpu_write(
            (key.float() / layer._k_scale).to(fmt).float(),
            (value.float() / layer._v_scale).to(fmt).float(),
            wide,
            slots,
        )
        cache.copy_(wide.to(fmt).view(torch.uint8))

    return SimpleNamespace(
        impl=SimpleNamespace(do_kv_cache_update=write),
        _k_scale=torch.tensor(k_scale),
        _v_scale=torch.tensor(v_scale),
        _k_scale_float=k_scale,
        _v_scale_float=v_scale,
    )


@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_an_fp8_cache_is_learned_and_moved_as_its_bytes(fmt) -> None:  # type: ignore[no-untyped-def]
    """vLLM allocates an fp8 cache as uint8 and its op quantizes with the layer's scales:
    the layout is learned with the scales at 1 (and the checkpoint's put back), and a
    chunk's bytes come out and go back exactly as the op wrote them."""
    n, nb = 16, 6
    layer = fp8_layer(fmt, 0.5, 2.0)
    cache = torch.zeros(nb, H, n, 2 * D, dtype=torch.uint8)
    with pytest.raises(LayoutError):  # read as plain values, the quantized probe is lost
        learn_layout(layer, cache, nb, n, H, D)
    layout = learn_layout(layer, cache, nb, n, H, D, fp8=fmt, probe_dtype=torch.float32)
    assert float(layer._k_scale) == 0.5 and layer._v_scale_float == 2.0  # put back
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(2 * n, H, D, generator=g), torch.randn(2 * n, H, D, generator=g)
    layer.impl.do_kv_cache_update(layer, k, v, cache, torch.arange(2 * n) + 3 * n)
    got = layout.gather(cache, [3, 4])  # [2, tokens, heads, dim] of uint8
    assert got.dtype == torch.uint8
    # the bytes are the quantized values, independently computed
    assert torch.equal(got[0].view(fmt).float(), (k / 0.5).to(fmt).float())
    assert torch.equal(got[1].view(fmt).float(), (v / 2.0).to(fmt).float())
    other = torch.zeros_like(cache)
    layout.scatter(other, [0, 5], got)
    assert torch.equal(layout.gather(other, [0, 5]), got)
    assert torch.equal(other[0], cache[3]) and torch.equal(other[5], cache[4])
