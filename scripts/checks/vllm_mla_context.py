"""Does a restored prefix change an MLA model's answer on vLLM's CPU backend?

vLLM 0.32 turns prefix caching off for MLA on CPU, so a prefix restored by a KV connector is
the only way its MLA "context" path (attention over cached latents, merged with the new
tokens') runs there. This serves a seeded random tiny DeepSeek-V2
(scripts/models/build_tiny_deepseek.py) with vLLM's own ExampleConnector and with no
connector, prefills each prompt once, asks again and prints the top two logprobs of the first
answer tokens: the restored answer differs from the no-connector one by far more than rounding
(the kvcloud connector, which restores the very same latent bytes, did the same before it
refused this setup). That is why the connector refuses MLA where vLLM's prefix caching is off
(docs/VLLM.md).

    .venv/bin/python scripts/checks/vllm_mla_context.py      # ~3 min: two servers start
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.fleet.vllm_fleet import VLLMServer, example_transfer_config
from scripts.models.build_tiny_deepseek import build
from tests.vllm.conftest import prompt_tokens


def _top(resp: dict) -> list[list[tuple[str, float]]]:
    tops = resp["choices"][0]["logprobs"]["top_logprobs"][:3]
    return [
        [(t, round(p, 4)) for t, p in sorted(d.items(), key=lambda kv: -kv[1])[:2]] for d in tops
    ]


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = build(root / "tiny-deepseek")
        servers = {
            "example": VLLMServer("example", root / "example.log", model=model,
                                  transfer=example_transfer_config(root / "ex")),
            "none": VLLMServer("none", root / "none.log", model=model),
        }  # fmt: skip
        for s in servers.values():
            s.start()
        for s in servers.values():
            s.wait_ready()
        try:
            for n in (300, 808):
                p = prompt_tokens(n, seed=n)
                servers["example"].complete(p, max_tokens=1)  # stores the prefix
                time.sleep(2)
                for name, s in servers.items():
                    print(n, f"{name:>8}", _top(s.complete(p, max_tokens=3, logprobs=2)))
        finally:
            for s in servers.values():
                s.stop()


if __name__ == "__main__":
    main()
