"""``kvcloud size`` (kvcloud/tools/sizing.py): each figure checked against something that does
not share its arithmetic: a real transformers KV cache, published model shapes, kvcloud's own
segment encoder, what the vLLM connector's uploader really stores, the staging ring vLLM's
ranks allocate, and the measured Redis figures it cites."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcloud import KVCloud
from kvcloud.config import KVCloudConfig
from kvcloud.errors import ConfigError
from kvcloud.integrations.vllm.shard import shard_of
from kvcloud.integrations.vllm.uploader import Uploader
from kvcloud.namespace import Namespace, chunk_fingerprints
from kvcloud.segment import encode_segment_parts
from kvcloud.tools.cli import main
from kvcloud.tools.sizing import (
    REDIS_BYTES_PER_CHUNK,
    FleetLoad,
    chunk_objects,
    model_kv,
    read_config,
    redis_bytes_per_chunk,
    size_fleet,
)
from tests.helpers import make_tokens

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2 = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"

# Llama-3.1-8B-Instruct's config.json as published (no head_dim: hidden_size ÷ heads)
LLAMA_8B = {
    "model_type": "llama",
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_size": 4096,
    "torch_dtype": "bfloat16",
}
LLAMA_70B = {**LLAMA_8B, "num_hidden_layers": 80, "hidden_size": 8192, "num_attention_heads": 64}
# DeepSeek-V3's MLA fields (config.json of deepseek-ai/DeepSeek-V3)
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3",
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "hidden_size": 7168,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "num_nextn_predict_layers": 1,
    "torch_dtype": "bfloat16",
}
TINY = {
    "model_type": "llama",
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "hidden_size": 128,
    "head_dim": 16,
    "torch_dtype": "float16",
}


def write_config(tmp_path: Path, config: dict[str, Any], name: str = "config.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return path


def sized(tmp_path: Path, config: dict[str, Any], **load: Any) -> dict[str, Any]:
    model = model_kv(read_config(write_config(tmp_path, config)))
    return size_fleet(model, FleetLoad(**{"requests_per_s": 1.0, "prompt_tokens": 256, **load}))


# -- bytes per token ---------------------------------------------------------------------------


def test_smollm2_bytes_per_token_equal_a_real_transformers_kv_cache() -> None:
    """The real SmolLM2-135M-Instruct config: a randomly initialised model built from it by
    transformers, in the dtype the sizing reads from it, runs 16 tokens; its DynamicCache's
    bytes per token are the sizing's."""
    if not (SMOLLM2 / "config.json").is_file():
        pytest.skip("SmolLM2-135M-Instruct not built (make install-vllm)")
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = model_kv(read_config(SMOLLM2))  # the directory, as vLLM is given it
    config = transformers.AutoConfig.from_pretrained(SMOLLM2)
    assert str(config.dtype).removeprefix("torch.") == model.dtype == "bfloat16"
    torch.manual_seed(0)
    lm = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, model.dtype))
    tokens = 16
    with torch.no_grad():
        out = lm(torch.arange(tokens).view(1, tokens), use_cache=True)
    cache = out.get("cache") or out.get("past_key_values")  # (transformers 5 renamed it)
    assert len(cache.layers) == model.num_layers
    kv = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    assert {t.dtype for t in kv} == {torch.bfloat16}
    assert all(t.shape[-2] == tokens for t in kv)  # [batch, kv_heads, tokens, head_dim]
    measured = sum(t.numel() * t.element_size() for t in kv) // tokens
    result = size_fleet(model, FleetLoad(requests_per_s=1.0, prompt_tokens=256))
    assert result["kv"]["bytes_per_token"] == measured == 23_040  # 30 × 3 × 64 × 2 B × 2


def test_llama_3_1_8b_and_70b_bytes_per_token(tmp_path: Path) -> None:
    assert sized(tmp_path, LLAMA_8B)["kv"]["bytes_per_token"] == 131_072
    assert sized(tmp_path, LLAMA_70B)["kv"]["bytes_per_token"] == 327_680
    # head_dim given explicitly wins over hidden_size ÷ heads (Gemma, Qwen3 set it apart)
    assert sized(tmp_path, {**LLAMA_8B, "head_dim": 64})["kv"]["bytes_per_token"] == 65_536
    # fp8 KV halves it; float32 doubles it
    assert sized(tmp_path, LLAMA_8B, kv_dtype="fp8")["kv"]["bytes_per_token"] == 65_536
    assert sized(tmp_path, LLAMA_8B, kv_dtype="float32")["kv"]["bytes_per_token"] == 262_144


def test_deepseek_v3_mla_stores_one_latent_row(tmp_path: Path) -> None:
    r = sized(tmp_path, DEEPSEEK_V3, tp=8)
    assert r["kv"]["bytes_per_token"] == 61 * 576 * 2 == 70_272  # not × 2 for K and V
    assert (r["model"]["num_kv_heads"], r["model"]["head_dim"]) == (1, 288)
    # one object per chunk, stored by rank 0, pulled whole by each of the 8 ranks
    assert r["objects"]["per_chunk"] == 1 and r["objects"]["gets_per_restored_chunk"] == 8
    assert [rank["writes"] for rank in r["host_memory"]["ranks"]] == [True] + [False] * 7
    assert any("MTP" in note for note in r["model"]["notes"])
    with pytest.raises(ConfigError, match="MLA model with an fp8"):
        sized(tmp_path, DEEPSEEK_V3, kv_dtype="fp8")


def test_a_multimodal_config_sizes_its_language_model(tmp_path: Path) -> None:
    text = {k: v for k, v in LLAMA_8B.items() if k != "torch_dtype"}
    config = {"model_type": "llava", "text_config": text, "torch_dtype": "bfloat16"}
    r = sized(tmp_path, config)
    assert r["kv"]["bytes_per_token"] == 131_072 and r["model"]["model_type"] == "llama"
    # a float32 checkpoint runs in bfloat16 under vLLM's --dtype auto (on a GPU)
    r = sized(tmp_path, {**LLAMA_8B, "torch_dtype": "float32"})
    assert r["model"]["dtype"] == "bfloat16" and r["kv"]["bytes_per_token"] == 131_072
    sliding = {**LLAMA_8B, "layer_types": ["sliding_attention", "full_attention"] * 16}
    r = sized(tmp_path, sliding)
    assert r["kv"]["bytes_per_token"] == 131_072  # a chunk object holds every layer
    assert any("16 of 32 layers slide" in note for note in r["model"]["notes"])
    with pytest.raises(ConfigError, match="text_config has no positive integer 'num_hidden"):
        sized(tmp_path, {"model_type": "llava", "text_config": {"model_type": "llama"}})


# -- objects: what the connector stores ---------------------------------------------------------


@pytest.mark.parametrize(("tp", "parts"), [(1, 1), (4, 4), (8, 8)])
def test_object_bytes_equal_kvclouds_own_encoder(tmp_path: Path, tp: int, parts: int) -> None:
    """Llama-3.1-8B chunks encoded by ``encode_segment_parts`` (what ``push_chunks`` and
    ``store_part`` write), in a namespace built as the connector builds one, with the
    client's default format: every object's length is the sizing's."""
    r = sized(tmp_path, LLAMA_8B, tp=tp)
    assert r["objects"]["per_chunk"] == parts
    ns = Namespace(
        model="vllm/llama",
        num_layers=32,
        num_kv_heads=8,
        head_dim=128,
        revision="sha256:" + "ab" * 32,
        dtype="bfloat16",
        extra='{"compute_dtype": "bfloat16", "layout": "vllm-kv-v1", "quantization": "None"}',
    )
    version = KVCloudConfig().segment_version
    fp = bytes(range(32))
    lengths = []
    for rank in range(tp):
        shard = shard_of(rank, tp, ns.num_kv_heads)
        kv = np.ones((32, 2, 256, shard.num_heads, 128), dtype="<u2")
        seg = encode_segment_parts(ns, fp, ns.digest, kv, "raw", version=version, heads=shard.heads)
        assert seg.size == sum(len(p) for p in seg.parts)
        lengths.append(seg.size)
    assert lengths == r["objects"]["bytes"]
    assert sum(lengths) == r["objects"]["bytes_per_chunk"]
    # the payload is the KV; the rest, a header of a few hundred bytes to a few KB
    assert 0 < r["objects"]["overhead"] < 2_000 * parts


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_what_the_connectors_uploader_stores(tmp_path: Path, tp: int) -> None:
    """Each rank's real ``Uploader`` (as ``WorkerSide`` makes it: its shard's part and
    ranges) saves one chunk into a file store and a SQLite index: the objects stored, their
    sizes and the index entries are the sizing's."""
    r = sized(tmp_path, TINY, tp=tp, chunk_tokens=16)
    ns = Namespace(model="vllm/llama", num_layers=4, num_kv_heads=4, head_dim=16, chunk_tokens=16)
    kvc = KVCloud.open(store=f"file://{tmp_path}/o", index=f"sqlite://{tmp_path}/i.db", secret="s")
    with kvc:
        fp = chunk_fingerprints(ns, make_tokens(16), kvc.tenant_key("default"))[0]
        kv = np.random.default_rng(0).standard_normal((4, 2, 16, 4, 16)).astype("<f2")
        counts: Counter[str] = Counter()
        for rank in range(tp):
            shard = shard_of(rank, tp, ns.num_kv_heads)
            up = Uploader(
                kvc, ns, 8, counts.update, part=shard.heads, parts=shard.chunk_parts,
                ranges=shard.write_ranges(),
            )  # fmt: skip
            assert up.offer(
                "default", fp, ns.digest, np.ascontiguousarray(kv[..., shard.lo : shard.hi, :])
            )
            assert up.close(30) == 0
        assert counts["push_failures"] == 0
        sizes = sorted(info.size for info in kvc.store.list())
        entries = sum(1 for _ in kvc.index.iter_entries())
        found = kvc.index.lookup(ns.id, [fp.hex()])[0]
    assert sizes == sorted(r["objects"]["bytes"]) and len(sizes) == r["objects"]["per_chunk"]
    assert entries == r["redis"]["entries_per_chunk"]
    assert found is not None and found.size == r["objects"]["bytes_per_chunk"]


def test_reads_per_chunk_follow_the_ranks_heads(tmp_path: Path) -> None:
    # 8 KV heads: each of 4 ranks GETs its own part; with head_parts 8 each GETs two
    assert chunk_objects(model_ns(), 4).gets == 4
    eight = chunk_objects(model_ns(), 4, head_parts=8)
    assert (eight.objects, eight.gets, eight.get_bytes) == (8, 8, eight.bytes)
    # more ranks than KV heads: 2 heads over 4 ranks, two replicas each; only the first of
    # each replica group writes, every rank reads its head's part
    two = chunk_objects(model_ns(num_kv_heads=2), 4)
    assert (two.objects, two.rank_writes, two.gets) == (2, (True, False, True, False), 4)
    with pytest.raises(ConfigError, match="do not split"):
        chunk_objects(model_ns(), 3)


def model_ns(**kw: Any) -> Namespace:
    params: dict[str, Any] = dict(model="m", num_layers=2, num_kv_heads=8, head_dim=8)
    return Namespace(**{**params, **kw})


# -- host memory and Redis ---------------------------------------------------------------------


def test_staging_is_the_ring_each_rank_allocates(tmp_path: Path) -> None:
    """The staging figure of every rank is what vLLM's ranks' StagingRing holds."""
    torch = pytest.importorskip("torch")
    from kvcloud.integrations.vllm.device import Streams
    from kvcloud.integrations.vllm.staging import StagingRing

    for config, tp in ((LLAMA_70B, 1), (LLAMA_8B, 4), (DEEPSEEK_V3, 8)):
        r = sized(tmp_path, config, tp=tp)
        m = r["model"]
        shard = shard_of(0, tp, m["num_kv_heads"])
        shape = (m["num_layers"], 2, 256, shard.num_heads, m["head_dim"])
        ring = StagingRing(Streams("cpu"), shape, torch.bfloat16, 512 << 20)
        chunk = int(np.prod(shape)) * 2
        assert r["host_memory"]["ranks"][0]["chunk_bytes"] == chunk
        assert r["host_memory"]["ranks"][0]["staging"] == ring.slots * chunk
    # 70B at TP 1: 80 MiB chunks, 6 fit in 512 MiB; upload buffers: 64 queued + 16 pushing
    r = sized(tmp_path, LLAMA_70B)
    assert r["host_memory"]["ranks"][0]["staging"] == 6 * 80 * 2**20
    assert r["host_memory"]["ranks"][0]["upload_buffers"] == 80 * 80 * 2**20


def test_redis_figures_are_the_measured_ones() -> None:
    """The table the sizing cites is the measurement's file, not numbers typed twice."""
    measured = json.loads((ROOT / "docs/bench/index_parts.json").read_text())["results"]
    table = {(m["server"], m["parts"]): m["bytes_per_chunk"] for m in measured}
    assert table == {
        (server, parts): v
        for server, row in REDIS_BYTES_PER_CHUNK.items()
        for parts, v in row.items()
    }
    # between measured part counts: on the line through its neighbours
    row = REDIS_BYTES_PER_CHUNK["redis8"]
    assert redis_bytes_per_chunk(5) == pytest.approx((row[4] + row[6]) / 2)
    assert redis_bytes_per_chunk(32) > row[16]


# -- the command -----------------------------------------------------------------------------


def run_size(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main(["size", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_command_figures_agree(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = str(write_config(tmp_path, LLAMA_8B))
    base = ["--config", config, "--prompt-tokens", "8192", "--hit-rate", "0.5"]
    r = run_size(capsys, *base, "--rps", "10")
    # 10 requests/s × 4,096 new tokens ÷ 256 per chunk × 1 object per chunk
    assert r["s3"]["put"]["fleet"] == pytest.approx(10 * 4096 / 256 * 1) == 160
    assert r["s3"]["get"]["fleet"] == pytest.approx(160)
    assert r["s3"]["head"]["fleet"] == 0
    obj = r["objects"]["bytes"][0]
    assert r["s3"]["put"]["bytes"] == pytest.approx(160 * obj)
    assert r["store"]["bytes_in_ttl"] == pytest.approx(160 * 7 * 86400 * obj)
    rd = r["redis"]
    assert rd["chunks_in_ttl"] == pytest.approx(160 * 7 * 86400)
    assert rd["bytes_in_ttl"] == pytest.approx(rd["chunks_in_ttl"] * rd["bytes_per_chunk"])
    assert rd["bytes_per_million_chunks"] == pytest.approx(1e6 * REDIS_BYTES_PER_CHUNK["redis8"][1])
    # --rpm is per minute; TP 4 stores 4 parts per chunk and every rank GETs its own
    tp4 = run_size(capsys, *base, "--rpm", "600", "--tp", "4", "--pods", "4")
    assert tp4["s3"]["put"]["fleet"] == pytest.approx(160 * 4)
    assert tp4["s3"]["get"]["per_pod"] == pytest.approx(160)
    assert tp4["s3"]["put"]["bytes"] == pytest.approx(160 * tp4["objects"]["bytes_per_chunk"])
    assert tp4["redis"]["entries_per_chunk"] == 5
    # answer tokens are saved too; a server that ignores If-None-Match costs a HEAD per PUT
    more = run_size(
        capsys, *base, "--rps", "10", "--answer-tokens", "512", "--conditional-put", "head"
    )
    assert more["s3"]["put"]["fleet"] == pytest.approx(10 * 4608 / 256)
    assert more["s3"]["head"]["fleet"] == more["s3"]["put"]["fleet"]
    # the table prints the same figures
    assert main(["size", *base, "--rps", "10"]) == 0
    out = capsys.readouterr().out
    assert "131,072" in out and "160.0" in out and "PUT/s" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rps", "1", "--rpm", "60"], "--rps or --rpm"),
        (["--rps", "1", "--hit-rate", "1.5"], "share of 0 to 1"),
        (["--rps", "1", "--tp", "3"], "do not split"),
        (["--rps", "1", "--kv-dtype", "int4"], "unknown KV dtype"),
        (["--rps", "1", "--upload-queue", "0"], "upload_queue"),
    ],
)
def test_the_command_errors_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    config = str(write_config(tmp_path, LLAMA_8B))
    assert main(["size", "--config", config, "--prompt-tokens", "8192", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err
    assert (
        main(["size", "--config", str(tmp_path / "nope"), "--prompt-tokens", "1", "--rps", "1"])
        == 2
    )
    assert "no model config" in capsys.readouterr().err
