"""make demo-vllm: a conversation moves between two vLLM servers through kvcloud.

Three vLLM OpenAI servers serve SmolLM2-135M-Instruct on this machine: A and B with the
kvcloud connector on the embedded default store (file:// + sqlite://, in .kvcloud-demo-vllm/),
C with no connector. A long conversation runs on A; its next turn goes to B, which has never
seen it, and to C. The table shows the prompt, the tokens B restored from kvcloud (vLLM's own
``usage.prompt_tokens_details.cached_tokens``), TTFT on B vs C (first streamed token), and
whether the greedy answers agree.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.fleet.vllm_fleet import ROOT, VLLMServer, kvcloud_transfer_config

console = Console()

TOPICS = [
    "how a paged KV cache stores attention keys and values",
    "why prefill costs grow with prompt length",
    "what a content-addressed object store guarantees",
    "how a prefix fingerprint chain identifies a prompt prefix",
]


def chat(server: VLLMServer, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """Streamed greedy chat: the reply, TTFT (first content token) and usage."""
    body = {
        "model": "smollm2",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft = None
    parts: list[str] = []
    usage: dict[str, Any] = {}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                text = (choice.get("delta") or {}).get("content")
                if text:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    parts.append(text)
            if chunk.get("usage"):
                usage = chunk["usage"]
    return {"reply": "".join(parts), "ttft_s": ttft or time.perf_counter() - t0, "usage": usage}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=4, help="turns on A before the move")
    ap.add_argument("--dir", type=Path, default=ROOT / ".kvcloud-demo-vllm")
    args = ap.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    env = {
        "KVCLOUD_STORE": f"file://{args.dir}/objects",
        "KVCLOUD_INDEX": f"sqlite://{args.dir}/index.db",
        "KVCLOUD_SECRET": "demo-secret",
    }
    cfg = kvcloud_transfer_config()
    a = VLLMServer("A", args.dir / "A.log", transfer=cfg, env=env)
    b = VLLMServer("B", args.dir / "B.log", transfer=cfg, env=env)
    c = VLLMServer("C", args.dir / "C.log")
    servers = [a, b, c]
    console.print("starting three vLLM servers (about a minute on 2 cores) …")
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready(600)
        console.print(
            f"A {a.url} (kvcloud), B {b.url} (kvcloud), C {c.url} (no connector); "
            f"store {env['KVCLOUD_STORE']}"
        )
        # a long system prompt, as chat applications send with every request
        system = "You are a patient teacher of systems engineering. " + " ".join(
            f"Guideline {i}: explain step by step, define every term, and give a short "
            f"example from an inference server."
            for i in range(60)
        )
        messages = [{"role": "system", "content": system}]
        for t in range(args.turns):
            messages.append({"role": "user", "content": f"Explain {TOPICS[t % len(TOPICS)]}."})
            out = chat(a, messages, max_tokens=64)
            messages.append({"role": "assistant", "content": out["reply"]})
            console.print(
                f"turn {t + 1} on A: {out['usage'].get('prompt_tokens')} prompt tokens, "
                f"{len(out['reply'])} characters of answer"
            )
        time.sleep(2)  # A's uploader pushes in the background
        messages.append({"role": "user", "content": "Summarise our conversation in one line."})
        on_b = chat(b, messages, max_tokens=48)
        on_c = chat(c, messages, max_tokens=48)
    finally:
        for s in servers:
            s.stop()
    prompt_tokens = on_b["usage"]["prompt_tokens"]
    restored = (on_b["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    table = Table(title="the conversation's next turn, on a vLLM that never saw it")
    for col in ("", "B (kvcloud)", "C (recompute)"):
        table.add_column(col, justify="right")
    table.add_row("prompt tokens", f"{prompt_tokens:,}", f"{on_c['usage']['prompt_tokens']:,}")
    table.add_row("restored from kvcloud", f"{restored:,}", "0")
    table.add_row("computed", f"{prompt_tokens - restored:,}", f"{prompt_tokens:,}")
    table.add_row("TTFT", f"{on_b['ttft_s'] * 1000:,.0f} ms", f"{on_c['ttft_s'] * 1000:,.0f} ms")
    console.print(table)
    same = on_b["reply"] == on_c["reply"]
    console.print(f"B is {on_c['ttft_s'] / on_b['ttft_s']:.1f}× faster to the first token")
    console.print(f"B's greedy answer equals C's: {'yes' if same else 'NO'}")
    console.print(f"  B: {on_b['reply']!r}")
    if not same:
        console.print(f"  C: {on_c['reply']!r}")
        sys.exit(1)


if __name__ == "__main__":
    main()
