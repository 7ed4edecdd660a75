"""``kvcloud-worker --model-path``: tiny random Llama, Qwen2 and Mistral checkpoints built by
transformers and loaded by the worker give transformers' logits (within 1e-4) and greedy
tokens, and their sessions move between workers bit for bit, as with the presets."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.hf_models import build_checkpoint, to_v4_config
from workers.config import WorkerOptions
from workers.engine import CompletionRequest, Engine
from workers.engine.hf import CheckpointError, HFTokenizer, inspect_checkpoint
from workers.engine.pages import SeqPages

C = 16

# name -> build_checkpoint arguments (+ "v4": rewrite config.json the transformers 4.x way)
VARIANTS: dict[str, dict[str, Any]] = {
    "llama": dict(kind="llama"),
    "llama-llama3-rope-sharded-bf16": dict(
        kind="llama",
        dtype="bfloat16",
        max_shard_size="60KB",
        rope=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
            rope_theta=500000.0,
        ),
    ),
    "llama-linear-rope-tied-v4": dict(
        kind="llama", tie=True, rope=dict(rope_type="linear", factor=4.0), v4=True
    ),
    "qwen2": dict(kind="qwen2"),
    "qwen2-yarn-v4": dict(
        kind="qwen2",
        rope=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=256),
        v4=True,
    ),
    "qwen2-sliding": dict(kind="qwen2", sliding_window=12),
    "mistral-sliding-fp16": dict(kind="mistral", sliding_window=12, dtype="float16"),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name, spec in VARIANTS.items():
        spec = dict(spec)
        v4 = spec.pop("v4", False)
        path = build_checkpoint(spec.pop("kind"), root / name, **spec)
        if v4:
            to_v4_config(path)
        out[name] = path
    return out


def _reference(path: Path) -> Any:
    """transformers' model of the checkpoint, in float32 (bf16/fp16 weights upcast exactly)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def _ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(0, vocab, n)]


def _engine(path: Path, tmp: Path | None = None, **kw: Any) -> Engine:
    base: dict[str, Any] = dict(
        model_path=str(path), cache_pages=32, chunk_tokens=C, kv_dtype="float32"
    )
    if tmp is not None:
        base.update(store=f"file://{tmp / 'objects'}", index=f"sqlite://{tmp / 'index.db'}")
    base.update(kw)
    return Engine(WorkerOptions(**base))


def _req(tokens: list[int], n: int = 10, **kw: Any) -> CompletionRequest:
    return CompletionRequest(prompt_tokens=tokens, max_tokens=n, stop_at_eos=False, **kw)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(variant: str, checkpoints: dict[str, Path]) -> None:
    path = checkpoints[variant]
    ref = _reference(path)
    engine = _engine(path)
    cfg = engine.cfg
    ids = _ids(48, cfg.vocab_size, seed=1)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]

    class Pool:  # float32 pages: the comparison is about the model, not the cache dtype
        data = torch.zeros(4, cfg.n_layers, 2, C, cfg.n_kv_heads, cfg.head_dim)
        chunk_tokens = C
        device = torch.device("cpu")

    # in two steps over pages, as a served request runs (prefill, then the rest)
    seq = SeqPages(Pool, [0, 1, 2])  # type: ignore[arg-type]
    toks = torch.tensor(ids)
    got = torch.cat(
        [
            engine.model(toks[:30], 0, seq, last_only=False),
            engine.model(toks[30:], 30, seq, last_only=False),
        ]
    )
    err = (got - want).abs().max().item()
    assert err < 1e-4, f"{variant}: max |logit difference| {err:.2e}"
    # the comparison is not vacuous: the logits vary across positions and vocabulary
    assert want.std().item() > 0.1


@pytest.mark.parametrize("variant", ["llama", "qwen2-yarn-v4", "mistral-sliding-fp16"])
def test_greedy_generation_matches_transformers(variant: str, checkpoints: dict[str, Path]) -> None:
    path = checkpoints[variant]
    ref = _reference(path)
    engine = _engine(path)
    ids = _ids(40, engine.cfg.vocab_size, seed=2)
    n = 12
    with torch.no_grad():
        out = ref.generate(
            torch.tensor([ids]),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    want = out[0, len(ids) :].tolist()
    got = engine.complete(_req(ids, n)).tokens
    assert got == want


@pytest.mark.parametrize("variant", ["llama", "qwen2", "mistral-sliding-fp16"])
def test_session_moves_between_workers_bit_identical(
    variant: str, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    path = checkpoints[variant]
    vocab = inspect_checkpoint(path).cfg.vocab_size
    turns = [_ids(41, vocab, 1), _ids(23, vocab, 2), _ids(37, vocab, 3)]

    def talk(e: Engine, sid: str, ts: list[list[int]]) -> list[list[int]]:
        return [e.complete(_req(t, 9, session_id=sid)).tokens for t in ts]

    # float16 pages, the default: what is stored is exactly the page, so still bit-identical
    reference = _engine(path, kv_dtype="float16")
    ref = talk(reference, reference.create_session("default"), turns)
    a = _engine(path, tmp_path, kv_dtype="float16")
    sid = a.create_session("default")
    got = talk(a, sid, turns[:2])
    flushed = a.flush_session(sid, "default")
    assert flushed.stored and flushed.kv_tokens > 0
    a.close()
    b = _engine(path, tmp_path, kv_dtype="float16")
    r = b.complete(_req(turns[2], 9, session_id=sid))
    assert [*got, r.tokens] == ref
    assert r.tokens_remote == flushed.kv_tokens
    assert r.tokens_computed == r.prompt_tokens - flushed.kv_tokens


def test_namespace_pins_the_weights(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """Same config, different weights: different namespaces, so no KV is shared; the same
    files in another directory: the same namespace."""
    other = build_checkpoint("llama", tmp_path / "other-seed", seed=7)
    copy = tmp_path / "copy"
    shutil.copytree(checkpoints["llama"], copy)
    base = _engine(checkpoints["llama"]).ns
    assert _engine(other).ns.id != base.id
    assert _engine(copy).ns.id == base.id
    assert _engine(checkpoints["qwen2"]).ns.id != base.id
    assert base.model == "hf-llama" and base.revision.startswith("sha256-")


def test_chat_template_matches_transformers(checkpoints: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello, world! How are you today?"},
        {"role": "assistant", "content": "I am fine, thank you."},
        {"role": "user", "content": "Numbers: 1 2 3."},
    ]
    for variant in ("llama", "qwen2"):
        path = checkpoints[variant]
        ref = AutoTokenizer.from_pretrained(path)
        want = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        want_ids = ref(want, add_special_tokens=False)["input_ids"]
        ours = HFTokenizer(path, vocab_size=len(ref))
        text = ours.apply_chat_template(messages)
        assert text == want
        assert ours.encode(text) == want_ids
        assert ours.decode(ours.encode("Hello, world!")) == "Hello, world!"
        # Llama's tokenizer adds BOS to a plain prompt; Qwen2's adds none
        assert ours.bos_id == (ref.bos_token_id if variant == "llama" else None)
        assert ref.eos_token_id in ours.eos_ids


@contextlib.contextmanager
def _serve(tmp: Path, name: str, args: list[str]) -> Iterator[Any]:
    import os
    import sys

    from tests.servers import WorkerProcess, free_port

    port = free_port()
    argv = [sys.executable, "-m", "workers.cli", "serve", "--port", str(port), *args]
    w = WorkerProcess(
        name, argv, dict(os.environ), tmp / f"{name}.log", port, f"http://127.0.0.1:{port}"
    )
    w.start(timeout=120)
    try:

        def post(path: str, body: dict[str, Any]) -> Any:
            r = w.post(path, body)
            assert r.status_code in (200, 201), (r.status_code, r.text, w.log_tail())
            return r.json()

        yield post
    finally:
        w.stop()


def test_worker_serves_a_checkpoint_over_http(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """`kvcloud-worker serve --model-path`: chat completions apply the checkpoint's template
    (the prompt has exactly transformers' token count) and a session moves between two
    worker processes, output identical to an uninterrupted one."""
    from transformers import AutoTokenizer

    path = checkpoints["qwen2"]
    store = f"file://{tmp_path / 'objects'}"
    index = f"sqlite://{tmp_path / 'index.db'}"
    args = ["--model-path", str(path), "--chunk-tokens", str(C), "--store", store]
    args += ["--index", index]
    messages = [{"role": "user", "content": "Hello, world! How are you today?"}]
    ref_tok = AutoTokenizer.from_pretrained(path)
    want = len(ref_tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])
    body = {"messages": messages, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    turns = ["The quick brown fox. " * 4, "Jumps over the lazy dog. " * 3, "Hello!"]
    gen = {"max_tokens": 5, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    with _serve(tmp_path, "w1", args) as post:
        r = post("/v1/chat/completions", body)
        assert r["usage"]["prompt_tokens"] == want
        sid = post("/v1/sessions", {})["id"]
        first = [
            post("/v1/completions", {"prompt": t, "session_id": sid, **gen}) for t in turns[:2]
        ]
        post(f"/v1/sessions/{sid}/flush", {})
    with _serve(tmp_path, "w2", args) as post:
        last = post("/v1/completions", {"prompt": turns[2], "session_id": sid, **gen})
        assert last["kvcloud"]["tokens_remote"] > 0
    with _serve(tmp_path, "ref", [*args[:4], "--store", "none"]) as post:
        rsid = post("/v1/sessions", {})["id"]
        ref = [post("/v1/completions", {"prompt": t, "session_id": rsid, **gen}) for t in turns]
    got = [x["choices"][0]["token_ids"] for x in [*first, last]]
    assert got == [x["choices"][0]["token_ids"] for x in ref]


@pytest.mark.parametrize(
    "damage, message",
    [
        ("no-config", "config.json is missing"),
        ("no-tokenizer", "tokenizer.json is missing"),
        ("missing-shard", "is missing"),
        ("bad-type", "model_type 'gpt2' is not supported"),
        ("dynamic-rope", "RoPE type 'dynamic' is not supported"),
        ("wrong-shape", "shape"),
    ],
)
def test_broken_checkpoints_are_clear_errors(
    damage: str, message: str, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    src = checkpoints["llama-llama3-rope-sharded-bf16"]
    path = tmp_path / "ckpt"
    shutil.copytree(src, path)
    cfg_file = path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    if damage == "no-config":
        cfg_file.unlink()
    elif damage == "no-tokenizer":
        (path / "tokenizer.json").unlink()
    elif damage == "missing-shard":
        sorted(path.glob("model-*.safetensors"))[0].unlink()
    elif damage == "bad-type":
        cfg_file.write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    elif damage == "dynamic-rope":
        rp = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
        cfg_file.write_text(json.dumps({**cfg, "rope_parameters": rp}))
    elif damage == "wrong-shape":
        cfg_file.write_text(json.dumps({**cfg, "intermediate_size": 96}))
    with pytest.raises(CheckpointError, match=message):
        _engine(path)


def test_cli_reports_a_bad_model_path_in_one_line(tmp_path: Path) -> None:
    import subprocess
    import sys

    argv = [sys.executable, "-m", "workers.cli", "serve", "--port", "0", "--store", "none"]
    r = subprocess.run(
        [*argv, "--model-path", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert "is not a directory" in r.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("form", ["string", "named-list"])
def test_chat_template_from_tokenizer_config(
    form: str, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """Checkpoints saved by transformers 4.x keep the template in tokenizer_config.json (a
    string, or a list of named templates of which "default" serves chat), not in
    chat_template.jinja."""
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoints["llama"], path)
    jinja = path / "chat_template.jinja"
    template = jinja.read_text()
    jinja.unlink()
    tc_file = path / "tokenizer_config.json"
    tc = json.loads(tc_file.read_text())
    if form == "string":
        tc["chat_template"] = template
    else:
        tc["chat_template"] = [
            {"name": "tool_use", "template": "{{ raise_exception('not this one') }}"},
            {"name": "default", "template": template},
        ]
    tc_file.write_text(json.dumps(tc))
    messages = [{"role": "user", "content": "Hello!"}]
    ours = HFTokenizer(path, vocab_size=400)
    want = HFTokenizer(checkpoints["llama"], vocab_size=400).apply_chat_template(messages)
    assert ours.apply_chat_template(messages) == want
    assert want.startswith("<s><|start_header_id|>user")
    # without any template, chat is refused with a clear message (HTTP 400 in the server)
    del tc["chat_template"]
    tc_file.write_text(json.dumps(tc))
    with pytest.raises(ValueError, match="no chat template"):
        HFTokenizer(path, vocab_size=400).apply_chat_template(messages)


def test_broken_or_hostile_chat_templates_are_clear_errors(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """A template that does not parse stops the worker at start (CheckpointError); one the
    sandbox stops at render time is the request's error (ValueError, a 400 in the server),
    never an unhandled exception."""
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoints["llama"], path)
    jinja = path / "chat_template.jinja"
    jinja.write_text("{% for message in messages %}{{ message['content'] }")
    with pytest.raises(CheckpointError, match="chat template does not parse"):
        HFTokenizer(path, vocab_size=400)
    # reaching into Python internals is refused by the sandbox
    jinja.write_text("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    tok = HFTokenizer(path, vocab_size=400)
    with pytest.raises(ValueError, match="chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    jinja.write_text("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ValueError, match="roles must alternate"):
        HFTokenizer(path, vocab_size=400).apply_chat_template([{"role": "user", "content": "x"}])
