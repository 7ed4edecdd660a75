"""Multi-turn conversations replayed on vLLM servers with the connector, no pause between
turns (as an agent sends them), at the token level: turn k's prompt is turn k-1's prompt, its
answer's token ids and the next user message, so "the history" is exact."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from scripts.fleet.vllm_fleet import VLLMServer, completion_ids
from tests.vllm.conftest import prompt_tokens

ANSWER = 40  # tokens per answer (ignore_eos: always this many)


@dataclass
class Turn:
    conv: int
    k: int
    server: int
    prompt: list[int]
    resp: dict[str, Any] = field(default_factory=dict)
    prev_server: int = -1
    prev_computed: int = 0  # tokens the previous turn computed (its prompt, answer but last)

    @property
    def moved(self) -> bool:
        return self.prev_server >= 0 and self.prev_server != self.server


def replay(servers: list[VLLMServer], convs: int, turns: int, seed: int) -> list[Turn]:
    """``convs`` conversations at once, each turn sent as soon as the previous answered,
    moving to the other server every other turn: turns 1 and 3 move, turn 2 stays (the same
    for every run, unlike a least-loaded balancer's choices)."""
    lock = threading.Lock()
    done: list[Turn] = []

    def pick(conv: int, k: int, prev: int) -> int:
        return (conv + (k + 1) // 2) % len(servers)

    def conversation(conv: int) -> None:
        history: list[int] = []
        prev, prev_computed = -1, 0
        for k in range(turns):
            user = prompt_tokens(150 + (conv * 97 + k * 61) % 250, seed=seed + 100 * conv + k)
            prompt = history + user
            s = pick(conv, k, prev)
            t = Turn(conv, k, s, prompt, prev_server=prev, prev_computed=prev_computed)
            t.resp = servers[s].complete(prompt, max_tokens=ANSWER, ignore_eos=True)
            answer = completion_ids(t.resp)
            with lock:
                done.append(t)
            history = prompt + answer
            prev, prev_computed = s, len(prompt) + len(answer) - 1

    threads = [threading.Thread(target=conversation, args=(c,)) for c in range(convs)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return sorted(done, key=lambda t: (t.conv, t.k))
