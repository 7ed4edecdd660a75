"""What every worker benchmark shares: its prompts, its engine, the machine it ran on and its
progress log."""

from __future__ import annotations

import os
import platform
import sys
from typing import Any

import numpy as np
import torch

from kvcloud import __version__

from ..config import WorkerOptions
from ..engine import Engine


def prompt_for(length: int, rep: int) -> list[int]:
    rng = np.random.default_rng(1_000_003 * length + rep)
    return [int(t) for t in rng.integers(0, 256, length)]


def bench_engine(model: str, store: str | None, index: str | None, pages: int, **kw: Any) -> Engine:
    return Engine(
        WorkerOptions(
            model=model,
            store=store,
            index=index,
            cache_pages=pages,
            write_policy="off",
            worker_id="bench",
            **kw,
        )
    )


def machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "kvcloud": __version__,
    }


def progress_log(quiet: bool) -> Any:
    return (lambda *_: None) if quiet else (lambda m: print(m, file=sys.stderr))
