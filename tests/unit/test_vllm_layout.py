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
from kvcloud.integrations.vllm.layout import learn_layout  # noqa: E402

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
