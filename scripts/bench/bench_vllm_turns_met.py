"""TTFT of each turn against the work it met on its server, from a `bench_vllm_load.py` run.

Fits, on the no-connector setups, TTFT = a + b·(tokens the turn computed) + c·(tokens of other
turns' prefills overlapping its wait) + d·(requests decoding meanwhile), then prints for every
setup the median TTFT the fit predicts from what its later turns met, and the median residual:
what the setup adds beyond the work its turns met (for a connector, its own cost).

Usage: .venv/bin/python scripts/bench/bench_vllm_turns_met.py docs/bench/vllm_load_1203.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

REFERENCES = ("sticky", "round-robin", "sticky-again")


def met(turns: list[dict]) -> np.ndarray:
    """Rows of (turn, own tokens, others' prefill tokens met, decoders met, TTFT ms)."""
    ok = [t for t in turns if not t.get("error")]
    rows = []
    for t in ok:
        a, b = t["start"], t["start"] + t["ttft"]
        pre = dec = 0.0
        for u in ok:
            if u is t or u["server"] != t["server"]:
                continue
            us, uf, ue = u["start"], u["start"] + u["ttft"], u["start"] + u["e2e"]
            if us < b and uf > a:  # its prefill overlaps our wait: the share that does
                share = (min(b, uf) - max(a, us)) / max(u["ttft"], 1e-3)
                pre += share * (u["prompt_tokens"] - u["cached_tokens"])
            if uf < b and ue > a:  # it decodes while we wait
                dec += (min(b, ue) - max(a, uf)) / max(t["ttft"], 1e-3)
        own = t["prompt_tokens"] - t["cached_tokens"]
        rows.append((t["turn"], own, pre, dec, t["ttft"] * 1000))
    return np.array(rows)


def design(rows: np.ndarray) -> np.ndarray:
    return np.column_stack([np.ones(len(rows)), rows[:, 1], rows[:, 2], rows[:, 3]])


def main() -> None:
    data = json.loads(Path(sys.argv[1]).read_text())
    setups = data.get("setups", data)
    rows = {n: met(s["turns"]) for n, s in setups.items() if isinstance(s, dict) and "turns" in s}
    refs = [n for n in REFERENCES if n in rows]
    ref = np.vstack([rows[n] for n in refs])
    coef, *_ = np.linalg.lstsq(design(ref), ref[:, 4], rcond=None)
    fit = design(ref) @ coef
    r2 = 1 - ((ref[:, 4] - fit) ** 2).sum() / ((ref[:, 4] - ref[:, 4].mean()) ** 2).sum()
    print(
        f"fit on {', '.join(refs)} ({len(ref)} turns, R² {r2:.2f}): TTFT ms = {coef[0]:.0f}"
        f" + {coef[1]:.2f}·own tokens + {coef[2]:.2f}·prefill tokens met"
        f" + {coef[3]:.0f}·decoders met"
    )
    print(
        "| setup | later turns | TTFT p50 | own tokens | prefill tokens met | decoders met"
        " | predicted p50 | residual (median) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        later = r[r[:, 0] > 0]
        pred = design(later) @ coef
        print(
            f"| {name} | {len(later)} | {np.median(later[:, 4]):.0f}"
            f" | {later[:, 1].mean():.0f} | {later[:, 2].mean():.0f} | {later[:, 3].mean():.2f}"
            f" | {np.median(pred):.0f} | {np.median(later[:, 4] - pred):+.0f} |"
        )


if __name__ == "__main__":
    main()
