"""Drive vLLM's own v1 ``Scheduler`` in-process with the kvcloud connector's scheduler side
attached, through preemptions, and check every chunk the connector names for saving.

No model runs and no server starts: each step's ``ModelRunnerOutput`` is made up (one
sampled token per request whose prefill is done), which is all the scheduler reads. What is
real is vLLM's scheduling, its KV cache manager (a deliberately small cache, so requests
decoding side by side run out of blocks and vLLM preempts and later resumes them) and the
connector, built by vLLM's own factory from a ``KVTransferConfig``.

The V2 model runner's resumed requests: vLLM sends a resumed request as a *new* request
(``scheduled_new_reqs``; ``resumed_req_ids`` stays empty). The scheduler side kept the block
ids it knew from before the preemption and appended the new ones to them, so a chunk saved
after the resume named blocks of other requests, or its own at other positions: the worker
would have saved the wrong KV under this request's fingerprints.

After each ``schedule()`` (when the step's blocks are what the worker's forward pass
writes and saves from) every ``SaveChunk`` is checked against vLLM's own state:

- its block ids are the request's blocks ``[j * per_chunk, (j + 1) * per_chunk)``;
- its tokens' KV is computed by the end of this step;
- its fingerprint (and parent) are those of the request's tokens up to the chunk's end.

Asynchronous loads that do not end the ordinary way (a prompt whose
chunks were pushed to the store first, ``load_mode=async``, so vLLM parks the request in
WAITING_FOR_REMOTE_KVS while the worker restores; the worker's report is fabricated too):

- ``--failed-first-chunk``: the worker reports the load finished with every one of its blocks
  invalid (a restore that failed from its first chunk). vLLM frees the blocks and asks the
  connector for the hit again: offering the same load again would fail the same way, every
  step, forever (the run stops after ``--loop-cap`` offers and says so). Counted: the hits the
  connector offered for the request, the load specs naming it, and the chunks named for
  saving once it recomputes. Run twice: the worker's report without, then with the first
  chunk's object named bad (``failed-first-chunk-bad-object``: the worker remembers a missing,
  unverifiable or timed-out object so; a restore that only waited too long on the worker's
  threads is not blamed on its object). The object named bad keeps the load from being
  offered again whatever the scheduler side does, so this run checks the saves.
- ``--abort-while-loading``: the request is aborted while it waits for its load. vLLM keeps its
  blocks (the worker may still be writing into them) until the worker reports the load
  finished; then frees them. Checked: the blocks stay held until that report, nothing raises,
  the connector forgets the request, and a later request for the same prompt is offered the
  load again and completes.

Prints one JSON line per model runner asked for (``--v2``, ``--v1``, or both: one process
pays vLLM's import once), then one per scenario asked for. Run with the vLLM venv::

    .venv-vllm/bin/python scripts/checks/vllm_scheduler_inprocess.py --v2 --v1 \
        --failed-first-chunk --abort-while-loading
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

# Nothing is imported from this checkout by path: kvcloud comes from the vLLM venv's editable
# install, or from ``PYTHONPATH`` when another checkout (an older commit in a git worktree) is
# the code under test. So scripts.fleet.vllm_fleet is not imported either (it would come from that
# other checkout too); its model path and offline settings are repeated here.
ROOT = Path(__file__).resolve().parents[2]
SMOLLM2 = Path(
    os.environ.get("KVCLOUD_SMOLLM2", ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct")
)


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--v2", action="store_true", help="run with the V2 model runner semantics")
    p.add_argument("--v1", action="store_true", help="run with the V1 model runner semantics")
    p.add_argument("--blocks", type=int, default=48, help="KV cache blocks (block 0 is null)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk-tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=300)
    p.add_argument("--max-tokens", type=int, default=260)
    p.add_argument("--batch-tokens", type=int, default=256, help="max_num_batched_tokens")
    p.add_argument("--max-steps", type=int, default=20_000)
    p.add_argument("--seed", type=int, default=40)
    p.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="vLLM's prefix cache off: a resumed request gets no block of its own back",
    )
    p.add_argument("--model", type=Path, default=SMOLLM2)
    p.add_argument(
        "--failed-first-chunk",
        action="store_true",
        help="an asynchronous load the worker reports failed from its first chunk",
    )
    p.add_argument(
        "--abort-while-loading",
        action="store_true",
        help="a request aborted while it waits for its asynchronous load",
    )
    p.add_argument(
        "--loop-cap",
        type=int,
        default=8,
        help="--failed-first-chunk: stop after this many offers of the failing load",
    )
    p.add_argument(
        "--load-max-tokens",
        type=int,
        default=40,
        help="max_tokens of the requests of the load scenarios",
    )
    p.add_argument(
        "--burst",
        nargs="+",
        metavar="LABEL=INDEX_URL",
        default=[],
        help="a burst of --burst-requests new requests while one decodes, once per index "
        "(e.g. healthy=redis://... slow=redis://<a proxy holding each reply>)",
    )
    p.add_argument("--burst-requests", type=int, default=48)
    p.add_argument(
        "--burst-step-ms",
        type=float,
        default=50.0,
        help="the forward pass each engine step stands for (slept): no model runs here",
    )
    a = p.parse_args(argv)
    if not (a.v2 or a.v1 or a.failed_first_chunk or a.abort_while_loading or a.burst):
        p.error("give --v2, --v1, --failed-first-chunk, --abort-while-loading and/or --burst")
    return a


def _setup_env() -> None:
    """Before vLLM is imported: the same offline/cache settings as the test servers. The
    config is built for the V1 model runner: ``VllmConfig`` refuses the V2 one without
    Triton, which this CPU build lacks (``VLLM_USE_V2_MODEL_RUNNER=1`` fails validation);
    the scheduler's V2 branch is chosen after construction instead (build_scheduler)."""
    os.environ.update(
        {
            "VLLM_USE_V2_MODEL_RUNNER": "0",
            "VLLM_CACHE_ROOT": str(ROOT / ".cache" / "vllm"),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
    )
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # the connector refuses to start without one; nothing is encrypted or pushed here
    os.environ.setdefault("KVCLOUD_SECRET", "inprocess-scheduler-secret")


def build_scheduler(
    a: argparse.Namespace, v2: bool, folder: Path, extra: dict[str, Any] | None = None
) -> Any:
    """vLLM's v1 Scheduler over a one-group full-attention cache of ``a.blocks`` blocks,
    the kvcloud connector attached the way the engine core attaches it (its factory, from
    the KVTransferConfig), built much as vLLM's own scheduler tests build theirs. ``extra``:
    more of the connector's settings (``kv_connector_extra_config``)."""
    import torch
    from vllm.config import (
        CacheConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    model = ModelConfig(
        model=str(a.model),
        tokenizer=str(a.model),
        dtype="float32",
        max_model_len=2048,
        seed=0,
        skip_tokenizer_init=True,
    )
    cache = CacheConfig(
        block_size=a.block_size,
        cache_dtype="auto",
        # on (the engine's default), a resumed request gets those of its freed blocks still
        # cached back (same ids) and new ones for the rest; off, every block is new, and
        # its old ids are more likely another request's by then
        enable_prefix_caching=a.prefix_caching,
    )
    cache.num_gpu_blocks = a.blocks
    sched = SchedulerConfig(
        max_num_seqs=16,
        max_num_batched_tokens=a.batch_tokens,
        max_model_len=model.max_model_len,
        is_encoder_decoder=False,
        enable_chunked_prefill=True,
        # the CPU platform turns it off too; Scheduler (not AsyncScheduler) is what runs
        async_scheduling=False,
    )
    transfer = KVTransferConfig(
        kv_connector="KVCloudConnector",
        kv_connector_module_path="kvcloud.integrations.vllm.connector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "store": f"file://{folder}/objects",
            "index": f"sqlite://{folder}/index.db",
            "chunk_tokens": a.chunk_tokens,
            # skips hashing the checkpoint's weights (nothing is shared with anyone here)
            "weights_digest": "inprocess-scheduler-test",
            # the first ask waits for the (local sqlite) lookup: the same plan every run
            "lookup_wait_ms": 5000.0,
            **(extra or {}),
        },
    )
    vllm_config = VllmConfig(
        model_config=model,
        cache_config=cache,
        scheduler_config=sched,
        kv_transfer_config=transfer,
    )
    hf = model.hf_config
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(hf.num_hidden_layers)]
    spec = FullAttentionSpec(
        block_size=a.block_size,
        num_kv_heads=model.get_total_num_kv_heads(),
        head_size=model.get_head_size(),
        dtype=torch.float32,
    )
    page = spec.page_size_bytes
    kv_cache_config = KVCacheConfig(
        num_blocks=a.blocks,
        # the scheduler never touches tensors: each layer's own region, layer-outermost,
        # only so the config is the shape the engine core would hand over
        kv_cache_tensors=[
            KVCacheTensor(
                size=page * a.blocks,
                layers=[name],
                layer_stride=page * a.blocks,
                block_stride=page,
            )
            for name in layers
        ],
        kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
    )
    scheduler = Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=a.block_size,
        log_stats=False,
    )
    # the scheduler copies vllm_config.use_v2_model_runner once, in its constructor, and
    # reads only its copy while scheduling (resumed requests sent as new ones, no
    # prev_step_scheduled_req_ids): setting the copy takes the V2 branch on this CPU build
    scheduler.use_v2_model_runner = v2
    return scheduler


def block_hasher(scheduler: Any) -> Any:
    """vLLM's prefix-cache block hasher, as the engine core makes it."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    hash_fn = get_hash_fn_by_name(scheduler.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    return get_request_block_hasher(scheduler.hash_block_size, hash_fn)


def make_request(
    hasher: Any, rid: str, prompt: list[int], max_tokens: int, arrival: float = 0.0
) -> Any:
    """One request decoding ``max_tokens`` whatever it samples, hashed for vLLM's prefix
    cache as the engine core hashes it."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    # what the engine's input processor does to every request (SmolLM2's eos is 2)
    params.update_from_generation_config({}, eos_token_id=2)
    return Request(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling_params=params,
        pooling_params=None,
        arrival_time=arrival,
        block_hasher=hasher,
    )


def make_requests(a: argparse.Namespace, scheduler: Any) -> list[Any]:
    """Distinct random prompts (no shared prefix: every chunk is the request's own)."""
    hasher = block_hasher(scheduler)
    rng = random.Random(a.seed)
    out = []
    for i in range(a.requests):
        prompt = [rng.randrange(200, 48_000) for _ in range(a.prompt_tokens)]
        out.append(make_request(hasher, f"req-{i}", prompt, a.max_tokens, float(i)))
    return out


def fake_runner_output(
    scheduler: Any, out: Any, rng: random.Random, kv_connector_output: Any = None
) -> Any:
    """What a model runner returns for ``out``: one sampled token for each request whose
    prompt (and, after a preemption, recomputed answer) is done, none for a prefill chunk
    (vLLM's runners discard those samples too); and the worker connector's report, if any."""
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in req_ids:
        req = scheduler.requests[rid]
        sampled.append([] if req.is_prefill_chunk else [rng.randrange(200, 48_000)])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=sampled,
        kv_connector_output=kv_connector_output,
    )


def _owners(scheduler: Any, block_ids: list[int], rid: str) -> dict[int, str]:
    """Who holds each misnamed block now: the request itself (at another position),
    another request (the worker would save that request's KV under this one's
    fingerprint), or nobody (a free block: stale or unwritten KV)."""
    held: dict[int, str] = {}
    for other in scheduler.requests:
        for b in scheduler.kv_cache_manager.get_block_ids(other)[0]:
            held.setdefault(b, "itself" if other == rid else other)
    return {b: held.get(b, "free") for b in block_ids}


def check_saves(
    step: int,
    scheduler: Any,
    out: Any,
    resumed: set[str],
    named: Counter[tuple[str, int]],
    details: list[dict[str, Any]],
) -> tuple[int, int, int]:
    """Check this step's save specs against vLLM's state right after ``schedule()``: the
    state the worker's forward pass saves from. Returns (chunks, wrong, after_resume)."""
    connector = scheduler.connector
    meta = out.kv_connector_metadata
    bs = scheduler.block_size
    c = connector.ns.chunk_tokens
    per_chunk = c // bs
    chunks = wrong = after_resume = 0
    for spec in getattr(meta, "saves", []):
        rid = spec.req_id
        req = scheduler.requests.get(rid)
        blocks = list(scheduler.kv_cache_manager.get_block_ids(rid)[0]) if req else []
        tokens = list(req.all_token_ids) if req else []
        for ch in spec.chunks:
            chunks += 1
            named[(rid, ch.position)] += 1
            after_resume += rid in resumed
            j = ch.position
            problems = []
            if req is None or rid not in out.num_scheduled_tokens:
                problems.append("request not scheduled this step")
            expected = blocks[j * per_chunk : (j + 1) * per_chunk]
            if ch.block_ids != expected:
                owners = _owners(scheduler, ch.block_ids, rid)
                problems.append(f"blocks {ch.block_ids} != its {expected}; held by {owners}")
            # num_computed_tokens is already advanced past this step's tokens here
            if req is not None and (j + 1) * c > req.num_computed_tokens:
                problems.append(f"chunk ends at {(j + 1) * c} > computed {req.num_computed_tokens}")
            if len(tokens) >= (j + 1) * c:
                fps = connector.client.fingerprints(
                    connector.ns, tokens[: (j + 1) * c], spec.tenant
                )
                parent = fps[j - 1] if j else connector.ns.digest
                if ch.fp != fps[j] or ch.parent != parent:
                    problems.append("fingerprint or parent not the request's tokens")
            if problems:
                wrong += 1
                details.append(
                    {
                        "step": step,
                        "req": rid,
                        "chunk": j,
                        "resumed": rid in resumed,
                        "preemptions": req.num_preemptions if req else None,
                        "problems": problems,
                    }
                )
    return chunks, wrong, after_resume


def run(a: argparse.Namespace, v2: bool) -> dict[str, Any]:
    _setup_env()
    from vllm.v1.request import RequestStatus

    import kvcloud

    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvcloud-inproc-") as tmp:
        scheduler = build_scheduler(a, v2, Path(tmp))
        requests = make_requests(a, scheduler)
        for req in requests:
            scheduler.add_request(req)
        rng = random.Random(a.seed + 1)
        named: Counter[tuple[str, int]] = Counter()
        details: list[dict[str, Any]] = []
        preempted: set[str] = set()  # preempted and not yet scheduled again
        resumed: set[str] = set()  # scheduled again after a preemption
        save_chunks = wrong = after_resume = steps = preempt_events = in_prefill = 0
        new_resumed = cached_resumed = 0  # how vLLM sent the resumed requests
        while scheduler.has_unfinished_requests():
            steps += 1
            if steps > a.max_steps:
                raise RuntimeError(f"not finished after {a.max_steps} steps")
            # before schedule() resets a preempted request's progress: was it mid-prompt?
            progress = {r.request_id: r.num_computed_tokens for r in scheduler.running}
            out = scheduler.schedule()
            for rid in out.preempted_req_ids:
                preempted.add(rid)
                preempt_events += 1
                if progress.get(rid, 0) < scheduler.requests[rid].num_prompt_tokens:
                    in_prefill += 1
            for new in out.scheduled_new_reqs:
                if new.req_id in preempted:
                    new_resumed += 1
                    preempted.discard(new.req_id)
                    resumed.add(new.req_id)
            for rid in out.scheduled_cached_reqs.resumed_req_ids:
                cached_resumed += 1
                preempted.discard(rid)
                resumed.add(rid)
            n, bad, after = check_saves(steps, scheduler, out, resumed, named, details)
            save_chunks += n
            wrong += bad
            after_resume += after
            scheduler.update_from_output(out, fake_runner_output(scheduler, out, rng))
        c = a.chunk_tokens
        prompt_chunks = a.prompt_tokens // c
        # the last sampled token's KV is never computed: only full chunks before it
        answer_chunks = (a.prompt_tokens + a.max_tokens - 1) // c
        never = [
            f"req-{i}:{j}"
            for i in range(a.requests)
            for j in range(prompt_chunks)
            if named[(f"req-{i}", j)] == 0
        ]
        twice = {f"{rid}:{j}": n for (rid, j), n in sorted(named.items()) if n > 1}
        decode_never = [
            f"req-{i}:{j}"
            for i in range(a.requests)
            for j in range(prompt_chunks, answer_chunks)
            if named[(f"req-{i}", j)] == 0
        ]
        finished = sum(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in requests)
        scheduler.shutdown()
    return {
        "v2": bool(scheduler.use_v2_model_runner),
        "prefix_caching": a.prefix_caching,
        "kvcloud": kvcloud.__file__,
        "steps": steps,
        "requests": a.requests,
        "finished": finished,
        "preemptions": sum(r.num_preemptions for r in requests),
        "preempt_events": preempt_events,
        "preempted_mid_prompt": in_prefill,
        "resumed_as_new": new_resumed,
        "resumed_as_cached": cached_resumed,
        "save_chunks": save_chunks,
        "save_chunks_after_resume": after_resume,
        "wrong": wrong,
        "prompt_chunks": prompt_chunks * a.requests,
        "prompt_chunks_never_named": never,
        "chunks_named_more_than_once": twice,
        "answer_chunks_never_named": decode_never,
        "seconds": round(time.monotonic() - t0, 2),
        "details": details,
    }


# -- asynchronous loads that do not end the ordinary way ----------------------------------

# what the scheduler side keeps per request (HEAD's has no _refused: getattr)
SIDE_STATE = ("_plans", "_pending", "_loads", "_refused", "_saving", "_requests")


def side_state(side: Any, rid: str) -> list[str]:
    """The scheduler side's dicts that still hold an entry for ``rid``."""
    return [name for name in SIDE_STATE if rid in getattr(side, name, {})]


class Watch(logging.Handler):
    """What the connector answers vLLM and what it catches, recorded by wrapping the
    connector object's own methods (vLLM calls them through ``scheduler.connector``, so the
    instance attributes are what it calls) and by listening to its logger."""

    def __init__(self, connector: Any) -> None:
        super().__init__(logging.WARNING)
        self.asks: Counter[str] = Counter()  # get_num_new_matched_tokens calls per request
        self.hits: Counter[str] = Counter()  # of those, the positive hits (load offered)
        self.stats: Counter[str] = Counter()  # the scheduler side's counters, every step's
        self.caught: list[str] = []  # exceptions the connector caught (``_failed``)
        self.warnings: list[str] = []  # its log lines at WARNING and above
        self.connector = connector
        matched, stats = connector.get_num_new_matched_tokens, connector.get_kv_connector_stats

        def get_num_new_matched_tokens(request: Any, num_computed_tokens: int) -> Any:
            n, load_async = matched(request, num_computed_tokens)
            self.asks[request.request_id] += 1
            if n:
                self.hits[request.request_id] += 1
            return n, load_async

        def get_kv_connector_stats() -> Any:
            got = stats()
            if got is not None:
                self.stats.update({k: v for k, v in got.data.items() if isinstance(v, int)})
            return got

        connector.get_num_new_matched_tokens = get_num_new_matched_tokens
        connector.get_kv_connector_stats = get_kv_connector_stats
        failed = getattr(connector, "_failed", None)  # HEAD's connector only logs
        if failed is not None:

            def _failed(where: str, exc: BaseException) -> None:
                self.caught.append(f"{where}: {type(exc).__name__}: {exc}")
                failed(where, exc)

            connector._failed = _failed
        logging.getLogger("vllm.kvcloud").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.warnings.append(record.getMessage())

    def close(self) -> None:
        logging.getLogger("vllm.kvcloud").removeHandler(self)
        super().close()

    def totals(self) -> Counter[str]:
        self.connector.get_kv_connector_stats()  # what the last step left
        return self.stats


class Loop:
    """Steps vLLM's scheduler with fabricated runner outputs, as the engine core steps it
    (``schedule``, the model runner, ``update_from_output``), also when nothing is scheduled
    (the engine core still runs the workers then: that is how finished restores come back).

    The worker's connector is fabricated too: each asynchronous load a step's metadata
    carries is reported finished (``finished_recving``) in the output of the step ``lag``
    steps later (the request waits in WAITING_FOR_REMOTE_KVS meanwhile), unless held; a
    load of a request in ``fail`` with all of its blocks invalid (``invalid_block_ids``),
    as kvcloud's worker reports a restore that failed from its first chunk; with
    ``bad_objects``, also naming that chunk's object as one not to offer again
    (``KVCloudWorkerMeta``), as it does when the object was missing, failed its
    verification or timed out (not when the restore only waited too long on its threads)."""

    def __init__(
        self, scheduler: Any, seed: int, fail: set[str], lag: int = 1, bad_objects: bool = False
    ) -> None:
        self.scheduler = scheduler
        self.rng = random.Random(seed)
        self.fail = fail
        self.lag = lag
        self.bad_objects = bad_objects
        self.steps = 0
        self.load_specs: Counter[str] = Counter()  # load specs naming each request
        self.failures: Counter[str] = Counter()  # loads reported failed, per request
        self.named: Counter[tuple[str, int]] = Counter()  # (request, chunk) named for saving
        self.details: list[dict[str, Any]] = []
        self.save_chunks = self.wrong = 0
        # request -> (the step whose output reports its load, the blocks reported invalid,
        # its first chunk's object)
        self.due: dict[str, tuple[int, set[int], str]] = {}

    def step(self, hold: frozenset[str] = frozenset()) -> Any:
        from vllm.v1.outputs import KVConnectorOutput

        from kvcloud.integrations.vllm.specs import KVCloudWorkerMeta

        s = self.scheduler
        self.steps += 1
        out = s.schedule()
        for spec in getattr(out.kv_connector_metadata, "loads", []):
            self.load_specs[spec.req_id] += 1
            if spec.sync:
                continue  # restored in the step: vLLM hears nothing of it (none here)
            blocks = {b for ch in spec.chunks for b in ch.block_ids if b > 0}
            invalid = blocks if spec.req_id in self.fail else set()
            key = spec.chunks[0].object_key if spec.chunks else ""
            self.due[spec.req_id] = (self.steps + self.lag, invalid, key)
        n, bad, _ = check_saves(self.steps, s, out, set(), self.named, self.details)
        self.save_chunks += n
        self.wrong += bad
        ready = sorted(r for r, (at, *_) in self.due.items() if at <= self.steps and r not in hold)
        report = None
        if ready:
            invalid: set[int] = set()
            bad: dict[str, float] = {}
            for r in ready:
                _, blocks, key = self.due.pop(r)
                self.failures[r] += bool(blocks)
                invalid |= blocks
                if blocks and key and self.bad_objects:
                    bad[key] = 60.0  # the worker's failure_memory
            report = KVConnectorOutput(
                finished_recving=set(ready),
                invalid_block_ids=invalid,
                kv_connector_worker_meta=KVCloudWorkerMeta(bad_objects=bad) if bad else None,
            )
        s.update_from_output(out, fake_runner_output(s, out, self.rng, report))
        return out


def store_prompt(connector: Any, request: Any) -> int:
    """Push random KV for every full chunk of the request's prompt under the fingerprints
    the connector makes for it (its namespace, the request's tenant scope, the same store,
    index and secret: the connector's own client). Returns the chunks the index then holds."""
    import numpy as np

    ns = connector.ns
    tenant = connector._scheduler.request_scope_of(request)
    prompt = list(request.prompt_token_ids)
    full = len(prompt) // ns.chunk_tokens * ns.chunk_tokens
    kv = np.random.default_rng(0).standard_normal(ns.kv_shape(full)).astype(ns.dtype)
    connector.client.push(ns, prompt[:full], kv, tenant)
    fps = connector.client.fingerprints(ns, prompt, tenant)
    return len(connector.client.lookup_fingerprints(ns, fps, tenant=tenant, strict=True).chunks)


def _prompt(a: argparse.Namespace) -> list[int]:
    rng = random.Random(a.seed + 7)
    return [rng.randrange(200, 48_000) for _ in range(a.prompt_tokens)]


def _chunks_named(loop: Loop, rid: str, n: int) -> list[int]:
    """How often each of the first ``n`` chunks of ``rid`` was named for saving."""
    return [loop.named[(rid, j)] for j in range(n)]


def run_failed_first_chunk(a: argparse.Namespace, bad_objects: bool = False) -> dict[str, Any]:
    """A stored prompt, loaded asynchronously; the worker reports the load finished with
    every block invalid (``bad_objects``: and its first chunk's object bad). The connector
    should offer it once, then let vLLM recompute, and save the chunks recomputed."""
    _setup_env()
    from vllm.v1.request import RequestStatus

    import kvcloud

    t0 = time.monotonic()
    rid = "failing-0"
    with tempfile.TemporaryDirectory(prefix="kvcloud-inproc-") as tmp:
        scheduler = build_scheduler(a, True, Path(tmp), {"load_mode": "async"})
        connector = scheduler.connector
        watch = Watch(connector)
        req = make_request(block_hasher(scheduler), rid, _prompt(a), a.load_max_tokens)
        stored = store_prompt(connector, req)
        loop = Loop(scheduler, a.seed + 2, fail={rid}, bad_objects=bad_objects)
        scheduler.add_request(req)
        statuses: list[str] = []  # the request's status after each step, run-length
        error = None
        try:
            while scheduler.has_unfinished_requests() and watch.hits[rid] < a.loop_cap:
                if loop.steps >= a.max_steps:
                    raise RuntimeError(f"not finished after {a.max_steps} steps")
                loop.step()
                status = req.status.name
                if not statuses or statuses[-1] != status:
                    statuses.append(status)
        except Exception:
            error = traceback.format_exc(limit=8)
        looped = watch.hits[rid] >= a.loop_cap
        state = side_state(connector._scheduler, rid)
        totals = watch.totals()
        watch.close()
        scheduler.shutdown()
    prompt_chunks = a.prompt_tokens // a.chunk_tokens
    answer_chunks = (a.prompt_tokens + a.load_max_tokens - 1) // a.chunk_tokens
    return {
        "scenario": "failed-first-chunk" + ("-bad-object" if bad_objects else ""),
        "kvcloud": kvcloud.__file__,
        "steps": loop.steps,
        "stored_chunks": stored,
        "prompt_chunks": prompt_chunks,
        # positive answers of get_num_new_matched_tokens: the load offered to vLLM
        "offers": watch.hits[rid],
        "asks": watch.asks[rid],
        "load_specs": loop.load_specs[rid],
        "failures_reported": loop.failures[rid],
        "loop_cap": a.loop_cap,
        "looped": looped,
        "statuses": statuses,
        "finished": req.status == RequestStatus.FINISHED_LENGTH_CAPPED,
        # each chunk's count of being named for saving (the request computes them all)
        "prompt_chunks_named": _chunks_named(loop, rid, prompt_chunks),
        "answer_chunks_named": _chunks_named(loop, rid, answer_chunks)[prompt_chunks:],
        "save_chunks": loop.save_chunks,
        "wrong": loop.wrong,
        "connector_state": state,
        "connector_errors": totals["connector_errors"],
        "loads_failed_recomputed": totals["loads_failed_recomputed"],
        "hit_tokens": totals["hit_tokens"],
        "caught": watch.caught,
        "warnings": watch.warnings[:10],
        "exception": error,
        "seconds": round(time.monotonic() - t0, 2),
        "details": loop.details,
    }


def run_abort_while_loading(a: argparse.Namespace) -> dict[str, Any]:
    """A stored prompt, loaded asynchronously, aborted while it waits for the load: vLLM
    keeps its blocks until the worker reports the load over, then frees them. The connector
    forgets the request at once, and a later request for the prompt loads it again."""
    _setup_env()
    from vllm.v1.request import RequestStatus

    import kvcloud

    t0 = time.monotonic()
    rid, again = "aborted-0", "again-0"
    out: dict[str, Any] = {"scenario": "abort-while-loading"}
    with tempfile.TemporaryDirectory(prefix="kvcloud-inproc-") as tmp:
        scheduler = build_scheduler(a, True, Path(tmp), {"load_mode": "async"})
        connector, kvm = scheduler.connector, scheduler.kv_cache_manager
        side = connector._scheduler
        watch = Watch(connector)
        hasher = block_hasher(scheduler)
        prompt = _prompt(a)
        req = make_request(hasher, rid, prompt, a.load_max_tokens)
        out["stored_chunks"] = store_prompt(connector, req)
        loop = Loop(scheduler, a.seed + 3, fail=set())
        held = frozenset({rid})  # its load's report waits until the abort is checked
        scheduler.add_request(req)
        error = None
        later = None
        try:
            for _ in range(5):
                if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                    break
                loop.step(hold=held)
            out["waiting_for_remote_kvs"] = req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            blocks = list(kvm.get_block_ids(rid)[0])
            free = kvm.block_pool.get_num_free_blocks()
            out["load_blocks"] = len(blocks)
            scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
            out["status_after_abort"] = req.status.name
            out["connector_state_after_abort"] = side_state(side, rid)
            # vLLM waits for the worker: the blocks stay the request's, none freed
            kept = []
            for _ in range(2):
                kept.append(
                    rid in scheduler.requests
                    and list(kvm.get_block_ids(rid)[0]) == blocks
                    and kvm.block_pool.get_num_free_blocks() == free
                )
                loop.step(hold=held)
            kept.append(rid in scheduler.requests and kvm.block_pool.get_num_free_blocks() == free)
            out["blocks_kept_until_report"] = all(kept)
            loop.step()  # the worker reports the aborted request's load finished
            out["reported"] = rid not in loop.due
            out["freed_after_report"] = rid not in scheduler.requests
            out["blocks_freed"] = kvm.block_pool.get_num_free_blocks() - free
            out["connector_state_after_report"] = side_state(side, rid)
            # the client tries again: the same prompt, a new request
            later = make_request(hasher, again, prompt, a.load_max_tokens, 1.0)
            scheduler.add_request(later)
            while scheduler.has_unfinished_requests():
                if loop.steps >= a.max_steps:
                    raise RuntimeError(f"not finished after {a.max_steps} steps")
                loop.step()
        except Exception:
            error = traceback.format_exc(limit=8)
        out["connector_state_at_end"] = side_state(side, rid) + side_state(side, again)
        totals = watch.totals()
        watch.close()
        scheduler.shutdown()
    prompt_chunks = a.prompt_tokens // a.chunk_tokens
    return {
        **out,
        "kvcloud": kvcloud.__file__,
        "steps": loop.steps,
        "prompt_chunks": prompt_chunks,
        "offers": watch.hits[rid],
        "load_specs": loop.load_specs[rid],
        "again_offers": watch.hits[again],
        "again_load_specs": loop.load_specs[again],
        "again_finished": later is not None
        and later.status == RequestStatus.FINISHED_LENGTH_CAPPED,
        # the later request loaded every prompt chunk: none of them is named again
        "again_prompt_chunks_named": _chunks_named(loop, again, prompt_chunks),
        "save_chunks": loop.save_chunks,
        "wrong": loop.wrong,
        "connector_errors": totals["connector_errors"],
        "hit_tokens": totals["hit_tokens"],
        "caught": watch.caught,
        "warnings": watch.warnings[:10],
        "exception": error,
        "seconds": round(time.monotonic() - t0, 2),
        "details": loop.details,
    }


# -- a burst of new requests against a slow index -----------------------------------------


def run_burst(a: argparse.Namespace, label: str, index: str) -> dict[str, Any]:
    """One request decodes; ``a.burst_requests`` new ones arrive at once. vLLM's scheduler
    asks the connector about every waiting request it has room for in one ``schedule()``
    pass: against a slow index, each pass may wait ``lookup_wait_ms`` once, not once per
    request (the code before waited per request: 16 requests a pass × 20 ms). Measured per
    engine step: its wall time (the decoding request's inter-token gap; the forward pass is
    ``--burst-step-ms`` slept, no model runs here) and the connector's own time on the
    scheduler's thread (``scheduler_us``)."""
    _setup_env()
    from vllm.v1.request import RequestStatus

    import kvcloud

    wait_ms = 20.0
    t0 = time.monotonic()
    sized = argparse.Namespace(**{**vars(a), "blocks": 1024})  # room for every request
    with tempfile.TemporaryDirectory(prefix="kvcloud-burst-") as tmp:
        scheduler = build_scheduler(
            sized,
            False,
            Path(tmp),
            {"index": index, "lookup_wait_ms": wait_ms, "lookup_timeout": 30.0},
        )
        watch = Watch(scheduler.connector)
        hasher = block_hasher(scheduler)
        rng = random.Random(a.seed + 11)

        def prompt() -> list[int]:  # a full chunk and some: every lookup asks the index
            return [rng.randrange(200, 48_000) for _ in range(a.chunk_tokens + 40)]

        stream = make_request(hasher, "stream", prompt(), 100_000)
        scheduler.add_request(stream)
        loop = Loop(scheduler, a.seed, set())
        while stream.num_output_tokens < 3:  # decoding
            loop.step()
        burst = [
            make_request(hasher, f"burst-{i}", prompt(), 4, float(i))
            for i in range(a.burst_requests)
        ]
        for req in burst:
            scheduler.add_request(req)
        gaps: list[float] = []
        connector_ms: list[float] = []
        deadline = time.monotonic() + 120
        while any(r.status != RequestStatus.FINISHED_LENGTH_CAPPED for r in burst):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the burst did not finish in 120 s ({len(gaps)} steps)")
            before = watch.totals()["scheduler_us"]
            step_t0 = time.perf_counter()
            loop.step()
            time.sleep(a.burst_step_ms / 1e3)
            gaps.append(time.perf_counter() - step_t0)
            connector_ms.append((watch.totals()["scheduler_us"] - before) / 1e3)
        stats = watch.totals()
        streamed = stream.num_output_tokens
        scheduler.finish_requests("stream", RequestStatus.FINISHED_ABORTED)
        watch.close()
        scheduler.shutdown()
    return {
        "scenario": f"burst-{label}",
        "kvcloud": kvcloud.__file__,
        "index": index,
        "requests": a.burst_requests,
        "lookup_wait_ms": wait_ms,
        "step_ms": a.burst_step_ms,
        "steps": len(gaps),
        "stream_tokens_meanwhile": streamed,
        "max_gap_ms": round(1e3 * max(gaps), 2),
        "p50_gap_ms": round(1e3 * sorted(gaps)[len(gaps) // 2], 2),
        "max_connector_ms_per_step": round(max(connector_ms), 2),
        "lookups": stats["lookups"],
        "lookup_deferrals": stats["lookup_deferrals"],
        "lookup_timeouts": stats["lookup_timeouts"],
        "lookup_queue_timeouts": stats["lookup_queue_timeouts"],
        "caught": watch.caught,
        "seconds": round(time.monotonic() - t0, 2),
    }


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    for v2 in [m for m, asked in ((True, a.v2), (False, a.v1)) if asked]:
        print(json.dumps(run(a, v2)), flush=True)
    if a.failed_first_chunk:
        for bad_objects in (False, True):
            print(json.dumps(run_failed_first_chunk(a, bad_objects)), flush=True)
    if a.abort_while_loading:
        print(json.dumps(run_abort_while_loading(a)), flush=True)
    for spec in a.burst:
        label, _, index = spec.partition("=")
        print(json.dumps(run_burst(a, label, index)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
