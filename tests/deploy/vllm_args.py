"""vLLM's own argument parser (the OpenAI server's, from ``.venv-vllm``) applied to the
arguments a deployment file gives vLLM, so a misspelt flag or a kv-transfer-config vLLM
rejects fails here rather than in a pod's first start."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"

_PARSE = r"""
import json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

out = []
for argv in json.loads(sys.stdin.read()):
    a = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    kv = a.kv_transfer_config
    out.append({
        "model": a.model,
        "host": a.host,
        "port": a.port,
        "shutdown_timeout": a.shutdown_timeout,
        "enable_prompt_tokens_details": a.enable_prompt_tokens_details,
        "kv_connector": kv.kv_connector if kv else None,
        "kv_connector_module_path": kv.kv_connector_module_path if kv else None,
        "kv_role": kv.kv_role if kv else None,
        "kv_connector_extra_config": kv.kv_connector_extra_config if kv else None,
    })
print("\n" + json.dumps(out))
"""


def parse_vllm_args(argvs: list[list[str]]) -> list[dict[str, Any]]:
    """What vLLM's server makes of each argument list (one process for all: importing vLLM
    takes about 10 s here). A rejected argument list raises with vLLM's message."""
    if not VLLM_PYTHON.exists():
        raise RuntimeError(f"{VLLM_PYTHON} is missing: run `make install-vllm` (make test does)")
    r = subprocess.run(
        [str(VLLM_PYTHON), "-c", _PARSE],
        input=json.dumps(argvs),
        capture_output=True,
        text=True,
        timeout=180,
        env={"PATH": "/usr/bin:/bin", "VLLM_NO_USAGE_STATS": "1", "HOME": str(ROOT / ".cache")},
    )
    if r.returncode != 0:
        raise AssertionError(f"vLLM rejected the arguments:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])
