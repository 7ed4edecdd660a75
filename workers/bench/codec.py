"""`kvcloud-worker bench codec`: what the int8 KV codec costs in accuracy and saves in bytes
and restore time, on a real checkpoint.

For each prompt (slices of the repository's own English documentation, tokenized by the
model's tokenizer) one worker pushes the prompt's KV, another restores it and generates
greedily; the reference is a worker that recomputes everything. Done once with the lossless
codec (the control: it must agree exactly, logits and all) and once with int8. Reported:
greedy-token agreement (whole continuations and per token), the largest logit difference at
the first generated position (the one that reads the restored KV), bytes stored per chunk,
and the restore time of a long prefix through a store shaped to ``--rate`` bytes/s (moto_server
behind a shaping proxy; the cost model off so both codecs pull).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvcloud import KVCloud

from ..config import WorkerOptions
from ..engine import CompletionRequest, Engine

ROOT = Path(__file__).resolve().parents[2]


class _FirstLogits:
    """Wraps the engine's model and keeps the logits of the first call of each request."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.first: torch.Tensor | None = None

    def __call__(self, *args: Any) -> torch.Tensor:
        out = self.model(*args)
        if self.first is None:
            self.first = out.detach().float().reshape(-1, out.shape[-1])[-1].clone()
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def _engine(model_path: str, store: str | None, index: str | None, **kw: Any) -> Engine:
    return Engine(
        WorkerOptions(
            model_path=model_path,
            store=store,
            index=index,
            cache_pages=64,
            worker_id="bench-codec",
            **kw,
        )
    )


def doc_prompts(eng: Engine, n: int, length: int) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens cut from the docs (real English text, no download)."""
    text = "\n\n".join(
        p.read_text(encoding="utf-8") for p in sorted([ROOT / "README.md", *ROOT.glob("docs/*.md")])
    )
    ids = eng.tokenizer.encode(text)
    step = max(1, (len(ids) - length) // n)
    out = [ids[i * step : i * step + length] for i in range(n)]
    if len(out[-1]) < length:
        raise RuntimeError(f"the docs give {len(ids)} tokens, too few for {n} prompts")
    return out


def _greedy(eng: Engine, p: list[int], gen: int) -> tuple[list[int], torch.Tensor, int]:
    rec = _FirstLogits(eng.model)
    eng.model = rec
    try:
        r = eng.complete(
            CompletionRequest(prompt_tokens=p, max_tokens=gen, stop_at_eos=False, add_bos=False)
        )
    finally:
        eng.model = rec.model
    assert rec.first is not None
    return r.tokens, rec.first, r.tokens_remote


def run_codec_bench(
    model_path: str,
    prompts: int = 50,
    prompt_tokens: int = 600,
    gen: int = 16,
    restore_tokens: int = 2048,
    rate: float = 10e6,
    chunk_tokens: int = 256,
    log: Any = print,
) -> dict[str, Any]:
    from .backends import local_servers
    from .netem import ShapingProxy

    wd = Path(tempfile.mkdtemp(prefix="kvcloud-bench-codec-"))
    ref = _engine(model_path, None, None, chunk_tokens=chunk_tokens, write_policy="off")
    ps = doc_prompts(ref, prompts, prompt_tokens)
    report: dict[str, Any] = {
        "model_path": model_path,
        "prompts": prompts,
        "prompt_tokens": prompt_tokens,
        "generated_tokens": gen,
        "rate_Bps": rate,
        "restore_tokens": restore_tokens,
        "codecs": {},
    }
    log(f"reference: {prompts} prompts of {prompt_tokens} tokens, {gen} greedy tokens each …")
    reference = [_greedy(ref, p, gen) for p in ps]
    for codec in ("lossless", "int8"):
        store, index = f"file://{wd / codec / 'o'}", f"sqlite://{wd / codec / 'i.db'}"
        kw = dict(chunk_tokens=chunk_tokens, kv_codec=codec)
        pusher = _engine(model_path, store, index, write_policy="write-through", **kw)
        receiver = _engine(model_path, store, index, write_policy="off", cost_model=False, **kw)
        same_runs = same_tokens = 0
        diffs: list[float] = []
        restored = 0
        for p, (want, want_logits, _) in zip(ps, reference, strict=True):
            pusher.complete(CompletionRequest(prompt_tokens=p, max_tokens=1, stop_at_eos=False))
            assert pusher.uploader is not None and pusher.uploader.drain(60)
            got, logits, remote = _greedy(receiver, p, gen)
            restored += remote
            same_runs += got == want
            pairs = enumerate(zip(got, want, strict=True))
            same_tokens += next((i for i, (a, b) in pairs if a != b), gen)
            diffs.append(float((logits - want_logits).abs().max()))
        with KVCloud.open(store=store, index=index) as kv:
            sizes = [i.size for i in kv.store.list()]
        row = {
            "restored_tokens_per_prompt": restored / prompts,
            "same_continuation": same_runs,
            "tokens_before_first_difference_mean": same_tokens / prompts,
            "first_position_max_logit_diff": max(diffs),
            "first_position_median_logit_diff": statistics.median(diffs),
            "objects": len(sizes),
            "bytes_per_chunk": statistics.median(sizes),
            "chunk_bytes_16bit": ref.ns.chunk_bytes,
        }
        report["codecs"][codec] = row
        log(f"{codec}: {json.dumps(row)}")
        pusher.close()
        receiver.close()

    log(f"restore of a {restore_tokens}-token prefix through a store at {rate / 1e6:g} MB/s …")
    long = doc_prompts(ref, 1, restore_tokens + 1)[0]
    with (
        local_servers(wd / "servers") as srv,
        ShapingProxy("127.0.0.1", int(srv.s3_endpoint.rsplit(":", 1)[1])) as proxy,
    ):
        for codec in ("lossless", "int8"):
            base = f"s3://kvbench/{codec}?region=us-east-1"
            direct = base + f"&endpoint_url={srv.s3_endpoint}&create_bucket=true"
            shaped = base + f"&endpoint_url={proxy.endpoint}"
            kw = dict(chunk_tokens=chunk_tokens, kv_codec=codec)
            pusher = _engine(model_path, direct, srv.redis_url, write_policy="write-through", **kw)
            pusher.complete(CompletionRequest(prompt_tokens=long, max_tokens=1))
            assert pusher.uploader is not None and pusher.uploader.drain(120)
            receiver = _engine(
                model_path,
                shaped,
                srv.redis_url,
                write_policy="off",
                cost_model=False,
                remote_timeout=120.0,
                **kw,
            )
            proxy.set_rate(rate)
            t = time.perf_counter()
            r = receiver.complete(CompletionRequest(prompt_tokens=long, max_tokens=1))
            elapsed = time.perf_counter() - t
            proxy.set_rate(None)
            report["codecs"][codec]["shaped_restore"] = {
                "ttft_ms": r.ttft_ms,
                "wall_ms": elapsed * 1e3,
                "restored_tokens": r.tokens_remote,
            }
            log(f"{codec}: TTFT {r.ttft_ms:,.0f} ms, restored {r.tokens_remote} tokens")
            pusher.close()
            receiver.close()
    ref.close()
    return report


def codec_markdown(rep: dict[str, Any]) -> str:
    lo, q = rep["codecs"]["lossless"], rep["codecs"]["int8"]
    n = rep["prompts"]

    def restore(r: dict[str, Any]) -> str:
        s = r.get("shaped_restore")
        return f"{s['ttft_ms']:,.0f} ms" if s else "—"

    rows = [
        "| | lossless (16-bit) | int8 |",
        "|---|---:|---:|",
        f"| bytes per {rep.get('chunk_tokens', 256)}-token chunk object | "
        f"{lo['bytes_per_chunk']:,.0f} | {q['bytes_per_chunk']:,.0f} "
        f"({q['bytes_per_chunk'] / lo['bytes_per_chunk']:.2f}×) |",
        f"| greedy continuations identical to recompute ({rep['generated_tokens']} tokens) | "
        f"{lo['same_continuation']} of {n} | {q['same_continuation']} of {n} |",
        f"| tokens before the first difference (mean) | "
        f"{lo['tokens_before_first_difference_mean']:.1f} | "
        f"{q['tokens_before_first_difference_mean']:.1f} |",
        f"| largest logit difference, first generated position | "
        f"{lo['first_position_max_logit_diff']:.4g} | {q['first_position_max_logit_diff']:.4g} |",
        f"| median logit difference, first generated position | "
        f"{lo['first_position_median_logit_diff']:.4g} | "
        f"{q['first_position_median_logit_diff']:.4g} |",
        f"| TTFT restoring {rep['restore_tokens']:,} tokens through a "
        f"{rep['rate_Bps'] / 1e6:g} MB/s store | {restore(lo)} | {restore(q)} |",
    ]
    return "\n".join(rows)


def add_codec_parser(bsub: Any) -> None:
    c = bsub.add_parser("codec", help="the int8 KV codec vs lossless on a real checkpoint")
    c.add_argument(
        "--model-path",
        default=str(ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"),
        help="a local Hugging Face checkpoint (default: SmolLM2 built by make install-vllm)",
    )
    c.add_argument("--prompts", type=int, default=50)
    c.add_argument("--prompt-tokens", type=int, default=600)
    c.add_argument("--gen", type=int, default=16)
    c.add_argument("--restore-tokens", type=int, default=2048)
    c.add_argument("--rate", type=float, default=10e6, help="bytes/s of the shaped store")
    c.add_argument("--json-out", type=Path)
    c.set_defaults(func=cmd_bench_codec)


def cmd_bench_codec(args: argparse.Namespace) -> int:
    rep = run_codec_bench(
        args.model_path,
        prompts=args.prompts,
        prompt_tokens=args.prompt_tokens,
        gen=args.gen,
        restore_tokens=args.restore_tokens,
        rate=args.rate,
    )
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(rep, indent=2) + "\n")
        args.json_out.with_suffix(".md").write_text(codec_markdown(rep) + "\n")
    print(codec_markdown(rep))
    return 0
