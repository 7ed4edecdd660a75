"""Resume Hugging Face transformers generate() from a KV prefix stored in kvcloud.

Two runs of the same prompt, each with a model loaded fresh from the checkpoint (as two
processes or two machines would): on a fresh store the first finds nothing, computes the whole
prompt and saves its KV; the second restores the stored prefix, computes only the rest, and
must emit exactly the tokens of the first.

    python docs/examples/transformers_resume.py                       # a tiny random model
    python docs/examples/transformers_resume.py --model-path ~/models/Qwen2.5-0.5B-Instruct
    python docs/examples/transformers_resume.py --store s3://bucket/kv?endpoint_url=... \\
        --index redis://localhost:6379/0

Without --model-path it builds a tiny random Llama with tests/hf_models.py (present in a
clone of the repository). Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvcloud import KVCloud
from kvcloud.integrations.transformers import KVCloudCache

REPO = Path(__file__).resolve().parents[2]
PROMPT = (
    "You are a support assistant for kvcloud, a store that keeps the KV cache of a language "
    "model in object storage so that another process can continue where the first stopped. "
    "Answer briefly and cite the relevant section of the manual. "
) * 3 + "Question: how does a worker resume a session?"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-path", type=Path, help="a local Hugging Face causal LM checkpoint")
    p.add_argument("--store", help="object store URL (default: a temporary file:// directory)")
    p.add_argument("--index", help="index URL (default: a temporary sqlite:// file)")
    p.add_argument("--chunk-tokens", type=int, default=64, help="tokens per stored chunk")
    p.add_argument("--max-new-tokens", type=int, default=16)
    return p.parse_args(argv)


def tiny_checkpoint(workdir: Path) -> Path:
    """A tiny random Llama from the repository's test helpers (no download)."""
    sys.path.insert(0, str(REPO))
    try:
        from tests.hf_models import build_checkpoint
    except ImportError as exc:
        raise SystemExit(
            f"no --model-path given and tests/hf_models.py is not importable: {exc}"
        ) from exc
    return build_checkpoint("llama", workdir / "tiny-llama")


class ForwardCounter:
    """Counts the tokens the model's forward actually processes (prefill + decode steps)."""

    def __init__(self, model: Any) -> None:
        self.tokens = 0
        model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, _module: Any, _args: Any, kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids")
        self.tokens += int(ids.shape[1]) if ids is not None else 0


def run(kv: KVCloud, path: Path, args: argparse.Namespace, label: str) -> tuple[torch.Tensor, str]:
    """One process's worth: load the model, restore, generate, save."""
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    counter = ForwardCounter(model)
    enc = tokenizer(PROMPT, return_tensors="pt")
    prompt_len = enc["input_ids"].shape[1]

    # --- the lines kvcloud adds to a generation loop --------------------------------------
    kvc = KVCloudCache(kv, model, chunk_tokens=args.chunk_tokens)
    cache, restored = kvc.restore(enc["input_ids"])
    with torch.no_grad():
        out = model.generate(
            **enc,
            **kvc.generate_kwargs(cache),
            max_new_tokens=args.max_new_tokens,
            do_sample=False,
            pad_token_id=(
                tokenizer.pad_token_id
                if tokenizer.pad_token_id is not None
                else tokenizer.eos_token_id
            ),
        )
    saved = kvc.save(out, cache)
    # ----------------------------------------------------------------------------------------

    computed = prompt_len - restored
    print(
        f"{label}: prompt {prompt_len} tokens, restored {restored} from kvcloud, prefilled "
        f"{computed}; forward processed {counter.tokens} tokens; saved {saved.chunks} chunks "
        f"({saved.pushed} new, {saved.already_indexed} already stored)"
    )
    print(f"{label}: new tokens {out[0, prompt_len:].tolist()}")
    return out, repr(kvc)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvcloud-example-") as tmp:
        work = Path(tmp)
        path = args.model_path or tiny_checkpoint(work)
        store = args.store or f"file://{work / 'objects'}"
        index = args.index or f"sqlite://{work / 'index.db'}"
        with KVCloud.open(store=store, index=index) as kv:
            print(f"store {store}\nindex {index}")
            first, helper = run(kv, path, args, "run 1")
            second, _ = run(kv, path, args, "run 2")
            print(helper)
        same = torch.equal(first, second)
        print(f"restored run matched the uninterrupted run: {'yes' if same else 'NO'}")
        return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
