"""kvcloud.integrations.transformers against real transformers models (tiny random Llama, Qwen2
and Mistral checkpoints from tests/hf_models.py, fp32 on CPU) and the embedded backends.

The central claim: model.generate() resumed from a restored prefix emits exactly the tokens of
an uninterrupted run, and the model's forward never sees the restored tokens again.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvcloud import BatchSizeError, KVCloud, KVCloudError, UnsupportedCacheError
from kvcloud.integrations.transformers import KVCloudCache
from tests.hf_models import build_checkpoint

REPO = Path(__file__).resolve().parents[2]
CHUNK = 16
PROMPT = 100
NEW = 12
TEXT = (
    "kvcloud stores KV-cache segments in S3 and an index in Redis. A session moves from one "
    "worker to another without recomputing its prefix. The quick brown fox jumps over the "
    "lazy dog. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Hello, world! How are you today? "
) * 4


class Counted:
    """A model loaded fresh from a checkpoint, counting the tokens its forward processes."""

    def __init__(self, path: Path) -> None:
        self.model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        self.model.eval()
        self.tokens = 0
        self.model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, _module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            self.tokens += int(ids.shape[1])
        elif kwargs.get("inputs_embeds") is not None:
            self.tokens += int(kwargs["inputs_embeds"].shape[1])

    def generate(self, ids: torch.Tensor, **kw: Any) -> Any:
        self.tokens = 0
        with torch.no_grad():
            return self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW,
                min_new_tokens=NEW,  # a random model may emit EOS; keep the count exact
                do_sample=False,
                pad_token_id=self.model.config.eos_token_id,
                **kw,
            )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """build_checkpoint(kind, ...) once per module and argument set."""
    built: dict[tuple[str, str], Path] = {}

    def get(kind: str, **kw: Any) -> Path:
        key = (kind, repr(sorted(kw.items())))
        if key not in built:
            built[key] = build_checkpoint(kind, tmp_path_factory.mktemp(kind), **kw)
        return built[key]

    return get


@pytest.fixture
def kv(tmp_path: Path) -> Iterator[KVCloud]:
    with KVCloud.open(
        store=f"file://{tmp_path / 'objects'}", index=f"sqlite://{tmp_path / 'index.db'}"
    ) as client:
        yield client


def prompt_ids(path: Path, n: int = PROMPT) -> torch.Tensor:
    ids = AutoTokenizer.from_pretrained(path)(TEXT, return_tensors="pt")["input_ids"]
    assert ids.shape[1] >= n
    return ids[:, :n]


def layer_kv(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


SPECS = [
    pytest.param("llama", {}, id="llama"),
    pytest.param("qwen2", {}, id="qwen2"),
    pytest.param("mistral", {}, id="mistral"),
    # sliding-window layers whose window the run never fills: restored as sliding layers
    pytest.param("mistral", {"sliding_window": 256}, id="mistral-sliding"),
]


@pytest.mark.parametrize(("kind", "options"), SPECS)
def test_generate_resumes_from_restored_prefix(
    checkpoint: Callable[..., Path], kv: KVCloud, kind: str, options: dict[str, Any]
) -> None:
    path = checkpoint(kind, **options)
    ids = prompt_ids(path)

    # an uninterrupted run with plain transformers, then its KV saved
    first = Counted(path)
    ref = first.generate(ids, return_dict_in_generate=True)
    new = ref.sequences.shape[1] - PROMPT
    assert new == NEW and first.tokens == PROMPT + NEW - 1  # the counter itself is right
    saver = KVCloudCache(kv, first.model, chunk_tokens=CHUNK)
    pushed = saver.save(ref)
    # the cache holds prompt + new - 1 tokens (the last one was never fed back)
    stored = (PROMPT + NEW - 1) // CHUNK
    assert (pushed.chunks, pushed.pushed, pushed.failed) == (stored, stored, 0)

    # another model instance from the same checkpoint (another process, another machine)
    second = Counted(path)
    kvc = KVCloudCache(kv, second.model, chunk_tokens=CHUNK)
    assert kvc.namespace == saver.namespace
    cache, restored = kvc.restore(ids)
    assert restored == PROMPT // CHUNK * CHUNK and restored > 0 and restored % CHUNK == 0
    assert cache.get_seq_length() == restored
    if options.get("sliding_window"):
        assert all(type(layer).__name__ == "DynamicSlidingWindowLayer" for layer in cache.layers)
    for (k, v), (k0, v0) in zip(layer_kv(cache), layer_kv(ref.cache), strict=True):
        assert torch.equal(k, k0[:, :, :restored]) and torch.equal(v, v0[:, :, :restored])

    out = second.generate(ids, **kvc.generate_kwargs(cache))
    assert torch.equal(out, ref.sequences)
    # only the unrestored prompt tokens and the fed-back new tokens went through the model
    assert second.tokens == PROMPT - restored + NEW - 1
    # generate extended the restored cache in place: saving it again writes nothing new
    again = kvc.save(out, cache)
    assert (again.chunks, again.already_indexed, again.pushed) == (stored, stored, 0)


def test_whole_prompt_stored_restores_all_but_the_last_token(
    checkpoint: Callable[..., Path], kv: KVCloud
) -> None:
    path = checkpoint("llama")
    ids = prompt_ids(path, 6 * CHUNK)  # a prompt of whole chunks, all of them stored
    first = Counted(path)
    ref = first.generate(ids, return_dict_in_generate=True)
    KVCloudCache(kv, first.model, chunk_tokens=CHUNK).save(ref)

    second = Counted(path)
    kvc = KVCloudCache(kv, second.model, chunk_tokens=CHUNK)
    cache, restored = kvc.restore(ids)
    assert restored == 6 * CHUNK - 1  # generate needs one prompt token to compute logits
    out = second.generate(ids, **kvc.generate_kwargs(cache))
    assert torch.equal(out, ref.sequences)
    assert second.tokens == 1 + NEW - 1


@pytest.mark.parametrize("damage", ["swap-k-v", "swap-layers", "other-prompt"])
def test_wrong_kv_changes_the_output(
    checkpoint: Callable[..., Path], kv: KVCloud, damage: str
) -> None:
    """The equality above means something: with these models, a restore that mixed up K and
    V, layers, or prompts would change the output. (Reordering past tokens would not:
    attention over cached keys, RoPE already applied, is order-free.)"""
    path = checkpoint("llama")
    ids = prompt_ids(path)
    first = Counted(path)
    ref = first.generate(ids, return_dict_in_generate=True)
    KVCloudCache(kv, first.model, chunk_tokens=CHUNK).save(ref)

    second = Counted(path)
    kvc = KVCloudCache(kv, second.model, chunk_tokens=CHUNK)
    cache, restored = kvc.restore(ids)
    layers = cache.layers
    if damage == "swap-k-v":
        for layer in layers:
            layer.keys, layer.values = layer.values, layer.keys
    elif damage == "swap-layers":
        (layers[0].keys, layers[0].values, layers[1].keys, layers[1].values) = (
            layers[1].keys,
            layers[1].values,
            layers[0].keys,
            layers[0].values,
        )
    else:  # the KV of the same positions of another prompt
        other = first.generate(ids.flip(1), return_dict_in_generate=True).cache
        for layer, (k, v) in zip(layers, layer_kv(other), strict=True):
            layer.keys, layer.values = k[:, :, :restored], v[:, :, :restored]
    out = second.generate(ids, **kvc.generate_kwargs(cache))
    assert not torch.equal(out, ref.sequences)


def test_missing_object_restores_the_chunks_before_it(
    checkpoint: Callable[..., Path], kv: KVCloud
) -> None:
    path = checkpoint("llama")
    ids = prompt_ids(path)
    first = Counted(path)
    ref = first.generate(ids, return_dict_in_generate=True)
    pushed = KVCloudCache(kv, first.model, chunk_tokens=CHUNK).save(ref)
    kv.store.delete(pushed.keys[2])  # the index is a hint: this chunk and those after it miss

    second = Counted(path)
    kvc = KVCloudCache(kv, second.model, chunk_tokens=CHUNK)
    cache, restored = kvc.restore(ids)
    assert restored == 2 * CHUNK
    assert torch.equal(second.generate(ids, **kvc.generate_kwargs(cache)), ref.sequences)
    assert second.tokens == PROMPT - 2 * CHUNK + NEW - 1


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_kv_round_trips_bit_exact(
    checkpoint: Callable[..., Path], kv: KVCloud, dtype: str
) -> None:
    """numpy has no bfloat16: kvcloud carries its bits as uint16, and they must come back."""
    path = checkpoint("llama")
    ids = prompt_ids(path)

    def load() -> Any:
        return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()

    first = load()
    with torch.no_grad():
        ref = first.generate(ids, max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    saver = KVCloudCache(kv, first, chunk_tokens=CHUNK)
    assert saver.namespace.dtype == dtype
    # the same checkpoint in another dtype holds other weight bytes: another namespace
    fp32 = KVCloudCache(kv, Counted(path).model, chunk_tokens=CHUNK).namespace
    assert saver.namespace.revision != fp32.revision
    assert saver.save(ref).pushed == PROMPT // CHUNK

    cache, restored = KVCloudCache(kv, load(), chunk_tokens=CHUNK).restore(ids)
    assert restored == PROMPT // CHUNK * CHUNK
    for (k, v), (k0, v0) in zip(layer_kv(cache), layer_kv(ref.cache), strict=True):
        assert k.dtype == getattr(torch, dtype)
        bits = torch.int16
        assert torch.equal(k.view(bits), k0[:, :, :restored].contiguous().view(bits))
        assert torch.equal(v.view(bits), v0[:, :, :restored].contiguous().view(bits))


def test_checkpoints_never_share_kv(checkpoint: Callable[..., Path], kv: KVCloud) -> None:
    path_a, path_b = checkpoint("llama"), checkpoint("llama", seed=1)
    ids = prompt_ids(path_a)
    a = Counted(path_a)
    kvc_a = KVCloudCache(kv, a.model, chunk_tokens=CHUNK)
    kvc_a.save(a.generate(ids, return_dict_in_generate=True))

    b = Counted(path_b)
    kvc_b = KVCloudCache(kv, b.model, chunk_tokens=CHUNK)
    ns_a, ns_b = kvc_a.namespace, kvc_b.namespace
    # same architecture and geometry: only the weights digest tells them apart
    assert (ns_a.model, ns_a.layout, ns_a.dtype, ns_a.extra) == (
        ns_b.model,
        ns_b.layout,
        ns_b.dtype,
        ns_b.extra,
    )
    assert ns_a.revision.startswith("sha256:") and ns_a.revision != ns_b.revision
    assert ns_a.id != ns_b.id
    assert not kv.lookup(ns_b, ids[0].numpy())
    cache, restored = kvc_b.restore(ids)
    assert restored == 0 and cache.get_seq_length() == 0
    # and A still restores its own
    assert kvc_a.restore(ids).tokens == PROMPT // CHUNK * CHUNK


def test_config_that_changes_kv_changes_the_namespace(
    checkpoint: Callable[..., Path], kv: KVCloud
) -> None:
    base = Counted(checkpoint("llama")).model
    rope = Counted(checkpoint("llama", rope={"rope_theta": 500000.0})).model
    ns_base = KVCloudCache(kv, base, chunk_tokens=CHUNK).namespace
    ns_rope = KVCloudCache(kv, rope, chunk_tokens=CHUNK).namespace
    assert ns_base.revision == ns_rope.revision  # the same seed: the same weights
    assert '"rope_theta":500000.0' in ns_rope.extra and ns_base.id != ns_rope.id
    assert KVCloudCache(kv, base, chunk_tokens=2 * CHUNK).namespace.id != ns_base.id


def test_batches_and_unusable_inputs_raise(checkpoint: Callable[..., Path], kv: KVCloud) -> None:
    path = checkpoint("qwen2")
    ids = prompt_ids(path, 40)
    model = Counted(path)
    kvc = KVCloudCache(kv, model.model, chunk_tokens=CHUNK)
    batch = ids.repeat(2, 1)
    with pytest.raises(BatchSizeError):
        kvc.restore(batch)
    out = model.generate(batch, return_dict_in_generate=True)
    with pytest.raises(BatchSizeError):
        kvc.save(out)
    with pytest.raises(BatchSizeError, match="batch of 2"):
        kvc.save(ids, out.cache)  # one row of ids, but the cache holds two
    assert issubclass(BatchSizeError, KVCloudError)
    with pytest.raises(TypeError, match="needs the cache"):
        kvc.save(ids)  # plain ids carry no cache
    # a model split across devices: one device for all restored layers would break generate
    model.model.hf_device_map = {"model.layers.0": "cpu", "model.layers.1": 0}
    with pytest.raises(UnsupportedCacheError, match="split across devices"):
        kvc.restore(ids)
    assert not list(kv.store.list())


def test_sliding_window_past_its_size_cannot_be_saved(
    checkpoint: Callable[..., Path], kv: KVCloud
) -> None:
    path = checkpoint("mistral", sliding_window=32)
    ids = prompt_ids(path)
    model = Counted(path)
    kvc = KVCloudCache(kv, model.model, chunk_tokens=CHUNK)
    out = model.generate(ids, return_dict_in_generate=True)
    with pytest.raises(UnsupportedCacheError, match="sliding-window"):
        kvc.save(out)
    assert not list(kv.store.list())


class LegacyCache:
    """What transformers 4.5x's DynamicCache exposes: key_cache/value_cache lists."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], seq: int) -> None:
        self.key_cache, self.value_cache, self._seq = keys, values, seq

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._seq


def test_legacy_static_and_foreign_caches(checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    path = checkpoint("llama")
    ids = prompt_ids(path)
    model = Counted(path)
    ref = model.generate(ids, return_dict_in_generate=True)
    pairs = layer_kv(ref.cache)
    seq = ref.cache.get_seq_length()

    def client(name: str) -> KVCloud:
        return KVCloud.open(
            store=f"file://{tmp_path / name / 'objects'}", index=f"sqlite://{tmp_path / name}.db"
        )

    with client("new") as kv_new, client("old") as kv_old:
        new = KVCloudCache(kv_new, model.model, chunk_tokens=CHUNK).save(ref)
        legacy = LegacyCache([k for k, _ in pairs], [v for _, v in pairs], seq)
        old_kvc = KVCloudCache(kv_old, model.model, chunk_tokens=CHUNK)
        old = old_kvc.save(ref.sequences, legacy)
        # content addressing: the same object keys mean the same bytes were stored
        assert old.keys == new.keys and len(old.keys) == seq // CHUNK

        # a 4.5x static cache: tensors preallocated past the tokens they hold
        padded = [torch.cat([k, torch.zeros_like(k)], dim=2) for k, _ in pairs]
        with pytest.raises(UnsupportedCacheError, match="static or sliding"):
            old_kvc.save(ref.sequences, LegacyCache(padded, padded, seq))
        with pytest.raises(UnsupportedCacheError, match="cannot read"):
            old_kvc.save(ref.sequences, object())  # type: ignore[arg-type]

    # a StaticCache: preallocated layers, of which save reads the positions filled so far
    static = model.generate(ids, cache_implementation="static", return_dict_in_generate=True)
    assert type(static.cache).__name__ == "StaticCache"
    with client("static") as kv_static:
        kvc = KVCloudCache(kv_static, model.model, chunk_tokens=CHUNK)
        assert kvc.save(static).pushed == seq // CHUNK
        cache, restored = kvc.restore(ids)
        assert restored == PROMPT // CHUNK * CHUNK
        for layer, static_layer in zip(cache.layers, static.cache.layers, strict=True):
            assert torch.equal(layer.keys, static_layer.keys[:, :, :restored])
            assert torch.equal(layer.values, static_layer.values[:, :, :restored])


def test_example_runs_and_matches(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "docs" / "examples" / "transformers_resume.py"),
            "--store",
            f"file://{tmp_path / 'objects'}",
            "--index",
            f"sqlite://{tmp_path / 'index.db'}",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "restored run matched the uninterrupted run: yes" in proc.stdout
    assert "restored 0 " in proc.stdout  # the first run found nothing stored
    assert list((tmp_path / "objects").rglob("*")), "the example stored nothing"
