"""vLLM under load, on the same clock: kvcloud moving every turn against the no-connector
references, interleaved.

The load benchmark (scripts/bench/bench_vllm_load.py) runs its setups one after another for about
50 minutes, and this shared VM drifts over that time (its no-connector reference, run again at
the end, was 1.57x slower on 2026-12-02): a 10 % target cannot be judged across it. Here the
compared setups are up together and take turns on short blocks of conversations:

- two vLLM servers without a connector and two per kvcloud setup (``--kv-setups``, by
  default ``kvcloud-file``; the Makefile adds ``kvcloud-least-loaded``), one of each pair per
  core (only the two of the phase running have work);
- the conversations (ShareGPT, sampled as the load benchmark does) are cut into blocks of
  ``--block-conversations``; each block is played once per setup, in a rotating order:
  sticky and round-robin on the no-connector pair (its prefix cache reset before each,
  through vLLM's ``/reset_prefix_cache``), each kvcloud pair with its setup's routing
  (round-robin; sticky for ``kvcloud-sticky``, least-loaded for ``kvcloud-least-loaded``:
  the fewest turns in flight, moving among equals). The orders form a Williams design (every setup
  in every position, each following each other alike), so a drift of the machine falls on
  each setup alike;
- ``vllm bench serve``'s prefix_repetition, seeded rounds alternating between one
  no-connector server and one server of the first kvcloud setup (ABBA), each round with
  new prefixes.

Reported: each setup pooled over the blocks (TTFT p50/p99, ITL p50/p99, output tokens/s),
each block's ratios (so their spread is seen), the median over the same turns of kvcloud's
TTFT minus sticky's, the CPU the idle pair took meanwhile, greedy answers against sticky's.

    python scripts/bench/bench_vllm_load_paired.py --out docs/bench/vllm_load_paired.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.bench.bench_vllm_load import (
    Bench,
    Turn,
    _diff_metrics,
    _sum_metrics,
    log,
    pct,
    prefix_repetition,
    replay,
    resolve,
    summarize,
)
from scripts.fleet.vllm_fleet import ROOT, VLLMServer, settled

REFS = ("sticky", "round-robin")
KV = "kvcloud-file"


def orders(phases: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Orders in which every phase runs once per block and, over the list, each phase
    precedes each other alike (a Williams design: n orders for even n, 2n for odd; for
    three phases that is all six)."""
    n = len(phases)
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    rows = [[(x + i) % n for x in first] for i in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return [tuple(phases[x] for x in row) for row in rows]


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by ``pid`` and every process under it."""
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        parents[int(d.name)] = int(fields[1])
        ticks[int(d.name)] = int(fields[11]) + int(fields[12])
    tree, frontier = {pid}, [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p and c not in tree]
        tree.update(kids)
        frontier.extend(kids)
    return sum(ticks.get(p, 0) for p in tree) / os.sysconf("SC_CLK_TCK")


def servers_cpu_s(servers: list[VLLMServer]) -> float:
    return sum(tree_cpu_s(s.proc.pid) for s in servers if s.proc is not None)


class Paired:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        # the load benchmark's sampling and server setups; its conversations are ours
        self.bench = Bench(args)
        per = args.block_conversations
        self.blocks = [self.bench.convs[i : i + per] for i in range(0, len(self.bench.convs), per)]
        extra = (
            "blocks", "block_conversations", "kv_setups", "prefix_rounds", "prefix_prompts",
            "prefix_len",
        )  # fmt: skip
        self.results: dict[str, Any] = {
            "config": {**self.bench.results["config"], **{k: getattr(args, k) for k in extra}},
            "blocks": [],
            "prefix_rounds": [],
        }

    def phase(
        self, servers: list[VLLMServer], idle: list[VLLMServer], convs: list[list[str]],
        routing: str, first: int,
    ) -> tuple[list[Turn], dict[str, Any]]:  # fmt: skip
        """One replay of ``convs`` on ``servers``; what the connector did and the CPU the
        idle pair took meanwhile."""
        a = self.args
        kv0 = _sum_metrics([s.metrics() for s in servers])
        t0 = _sum_metrics([s.timings() for s in servers])
        idle0, c0 = servers_cpu_s(idle), time.perf_counter()
        turns, wall = asyncio.run(
            replay([s.url for s in servers], convs, routing, a.concurrency, a.max_tokens)
        )
        idle_pct = 100 * (servers_cpu_s(idle) - idle0) / (time.perf_counter() - c0)
        stored = None
        if all(s.transfer for s in servers):
            # the last steps' uploads reach /metrics only with a later engine step: poke
            # the servers until every chunk queued is pushed (or dropped, or failed), so
            # the phase's counters hold all of its own saves and none leak into the next
            settled(servers, timeout=60.0)
            try:
                stored = self.prompts_stored(servers, convs, turns)
            except Exception as exc:  # a check of the run, not the run: say so and go on
                log(f"  could not check the stored chunks: {type(exc).__name__}: {exc}")
        for t in turns:  # the block's conversation numbers, as the whole sample's
            t.conv += first
        res = summarize(turns, wall)
        res["idle_pair_cpu_pct"] = idle_pct
        res["kvcloud"] = _diff_metrics(_sum_metrics([s.metrics() for s in servers]), kv0)
        res["vllm_timings"] = _diff_metrics(_sum_metrics([s.timings() for s in servers]), t0)
        if stored is not None:
            res["last_prompt_chunks"], res["last_prompt_chunks_stored"] = stored
        return turns, res

    def prompts_stored(
        self, servers: list[VLLMServer], convs: list[list[str]], turns: list[Turn]
    ) -> tuple[int, int] | None:
        """Exactly, in the store the servers share: of the full chunks of each
        conversation's last prompt (its whole history but the last answer, tokenized by
        vLLM's own chat template), how many have an index entry. Every one was computed by
        some turn of the replay, so each must have been saved; (chunks, with an entry), or
        None where the setup's index is not a local file."""
        env = servers[0].env
        index, store = env.get("KVCLOUD_INDEX", ""), env.get("KVCLOUD_STORE", "")
        if not index.startswith("sqlite://"):
            return None
        from kvcloud import KVCloud
        from scripts.fleet.vllm_fleet import connector_namespace

        chunk = self.args.chunk_tokens
        ns = connector_namespace(chunk=chunk)
        last: dict[int, Turn] = {}
        for t in turns:
            if not t.error and t.turn >= last.get(t.conv, t).turn:
                last[t.conv] = t
        total = found = 0
        kvc = KVCloud.open(store=store, index=index, secret=env["KVCLOUD_SECRET"])
        answers = {(x.conv, x.turn): x.text for x in turns}
        try:
            for conv, t in last.items():
                messages: list[dict[str, str]] = []
                for k in range(t.turn + 1):
                    messages.append({"role": "user", "content": convs[conv][k]})
                    if k < t.turn:
                        messages.append({"role": "assistant", "content": answers[(conv, k)]})
                r = httpx.post(
                    servers[0].url + "/tokenize",
                    json={"model": "smollm2", "messages": messages, "add_generation_prompt": True},
                    timeout=60,
                )
                r.raise_for_status()
                tokens = r.json()["tokens"]
                if len(tokens) != t.prompt_tokens:
                    log(f"  conversation {conv}: /tokenize gave {len(tokens)} tokens, the turn "
                        f"{t.prompt_tokens}: not checked")  # fmt: skip
                    continue
                fps = kvc.fingerprints(ns, tokens[: len(tokens) // chunk * chunk])
                hits = kvc.index.lookup(ns.id, [fp.hex() for fp in fps], renew=False)
                total += len(fps)
                found += sum(e is not None for e in hits)
        finally:
            kvc.close()
        return total, found

    def run(self) -> None:
        a = self.args
        # /reset_prefix_cache is served in vLLM's dev mode only
        os.environ["VLLM_SERVER_DEV_MODE"] = "1"
        plain, _ = self.bench.servers_for("sticky")
        kvs = {name: self.bench.servers_for(name)[0] for name in a.kv_setups}
        everything = [*plain, *(s for pair in kvs.values() for s in pair)]
        phases = (*REFS, *a.kv_setups)
        plan = orders(phases)
        t_start = time.perf_counter()
        pooled: dict[str, list[Turn]] = {p: [] for p in phases}
        walls: dict[str, float] = dict.fromkeys(phases, 0.0)
        try:
            log(f"starting {len(everything)} vLLM servers (no connector, then kvcloud's)")
            for s in everything:
                s.start()
            for s in everything:
                s.wait_ready(900)
            for s in everything:  # the first request pays one-off costs
                httpx.post(
                    s.url + "/v1/chat/completions",
                    json={"model": "smollm2", "messages": [{"role": "user", "content": "hi"}],
                          "max_tokens": 2},
                    timeout=300,
                ).raise_for_status()  # fmt: skip
            first = 0
            for b, convs in enumerate(self.blocks):
                order = plan[b % len(plan)]
                block: dict[str, Any] = {"order": list(order), "phases": {}}
                for name in order:
                    # a vLLM that just finished takes about a fifth of a core for some 5 s
                    # more (measured idle: 21 % in the first 5 s, 1.5 % after), and a
                    # connector's last uploads finish: the next phase starts on a quiet pair
                    time.sleep(a.settle)
                    if name in kvs:
                        servers, routing = kvs[name], resolve(name)[1]
                    else:
                        servers, routing = plain, name
                    idle = [s for s in everything if s not in servers]
                    if name in REFS:
                        for s in plain:  # as if the no-connector servers were fresh
                            httpx.post(s.url + "/reset_prefix_cache", timeout=60).raise_for_status()
                    turns, res = self.phase(servers, idle, convs, routing, first)
                    res["started_s"] = round(time.perf_counter() - t_start - res["wall_s"], 1)
                    pooled[name] += turns
                    walls[name] += res["wall_s"]
                    res["turns"] = [
                        {k: v for k, v in asdict(t).items() if k not in ("gaps", "text")}
                        for t in turns
                    ]
                    block["phases"][name] = res
                    log(
                        f"block {b + 1}/{len(self.blocks)} {name}: {res['requests']} turns in "
                        f"{res['wall_s']:.0f} s, TTFT p50 {res['ttft_p50_ms']:.0f} ms p99 "
                        f"{res['ttft_p99_ms']:.0f} ms, ITL p99 {res['itl_p99_ms']:.0f} ms; idle "
                        f"pair {res['idle_pair_cpu_pct']:.1f} % CPU"
                    )
                self.results["blocks"].append(block)
                first += len(convs)
                self.finish(pooled, walls)
            self.prefix_rounds(plain[0], kvs[a.kv_setups[0]][0], a.kv_setups[0])
        finally:
            for s in everything:
                s.stop()
            shutil.rmtree(self.bench.work, ignore_errors=True)
        self.results["total_s"] = time.perf_counter() - t_start
        self.finish(pooled, walls)
        print(report(self.results))
        log(f"done in {self.results['total_s'] / 60:.1f} min")

    def prefix_rounds(self, plain: VLLMServer, kv: VLLMServer, kv_name: str) -> None:
        """prefix_repetition, ABBA: round r runs seed + r on both servers, the first of
        them alternating; each round's prefixes are new to both."""
        a = self.args
        work = self.bench.work
        for r in range(a.prefix_rounds):
            pair = [("sticky", plain), (kv_name, kv)]
            if r % 2:
                pair.reverse()
            rnd: dict[str, Any] = {"seed": a.seed + r, "order": [n for n, _ in pair]}
            for name, server in pair:
                time.sleep(a.settle)
                keep = prefix_repetition(
                    server, a, a.seed + r, work / f"prefix-{name}-{r}.json", detailed=True
                )
                if keep is None:
                    raise SystemExit(f"vllm bench serve failed on {name}, round {r}")
                rnd[name] = keep
                log(
                    f"prefix_repetition round {r + 1}/{a.prefix_rounds} {name}: TTFT p50 "
                    f"{keep['p50_ttft_ms']:.0f} ms p99 {keep['p99_ttft_ms']:.0f} ms"
                )
            self.results["prefix_rounds"].append(rnd)
            self.save()

    def finish(self, pooled: dict[str, list[Turn]], walls: dict[str, float]) -> None:
        """Pooled figures per setup and the answers against sticky's."""
        ref = {(t.conv, t.turn): t.text for t in pooled["sticky"] if not t.error}
        out: dict[str, Any] = {}
        for name, turns in pooled.items():
            if not turns:
                continue
            res = summarize(turns, walls[name])
            res["answers_compared"] = sum((t.conv, t.turn) in ref for t in turns)
            res["answers_differing"] = sum(
                (t.conv, t.turn) in ref and ref[(t.conv, t.turn)] != t.text for t in turns
            )
            out[name] = res
        self.results["pooled"] = out
        self.save()

    def save(self) -> None:
        out = Path(self.args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(self.results, indent=1, default=str) + "\n")
        out.with_suffix(".md").write_text(report(self.results))


# -- report --------------------------------------------------------------------------------


def _turn_extra_ms(blocks: list[dict[str, Any]], name: str, ref: str) -> list[float]:
    """TTFT of ``name`` minus ``ref``'s on the same turn (turns after the first), ms."""
    diffs = []
    for b in blocks:
        p = b["phases"]
        if name not in p or ref not in p:
            continue
        base = {(t["conv"], t["turn"]): t["ttft"] for t in p[ref]["turns"] if not t["error"]}
        diffs += [
            1e3 * (t["ttft"] - base[(t["conv"], t["turn"])])
            for t in p[name]["turns"]
            if not t["error"] and t["turn"] > 0 and (t["conv"], t["turn"]) in base
        ]
    return diffs


def _kvcloud_costs(blocks: list[dict[str, Any]], name: str, chunk: int) -> dict[str, str]:
    """The connector's counters summed over a kvcloud setup's phases, per restore and per
    lookup; and the full chunks the conversations computed (each one's last turn: prompt
    and answer but its last token), against the chunks the connector queued for upload."""
    c: dict[str, float] = {}
    full = 0
    checked = in_index = 0
    for b in blocks:
        phase = b["phases"].get(name, {})
        checked += phase.get("last_prompt_chunks", 0)
        in_index += phase.get("last_prompt_chunks_stored", 0)
        for k, v in phase.get("kvcloud", {}).items():
            c[k] = c.get(k, 0) + v
        last: dict[int, dict[str, Any]] = {}
        for t in phase.get("turns", []):
            if not t["error"] and t["turn"] >= last.get(t["conv"], {}).get("turn", -1):
                last[t["conv"]] = t
        full += sum(
            max(0, t["prompt_tokens"] + t["completion_tokens"] - 1) // chunk for t in last.values()
        )
    if not c.get("lookups"):
        return {}
    loads = max(c.get("loads", 0), 1)
    return {
        "lookups": f"{c['lookups']:.0f}",
        "lookup ms each (arrival to answer)": f"{c.get('lookup_us', 0) / 1e3 / c['lookups']:.1f}",
        "restores": f"{c.get('loads', 0):.0f}",
        "of them in the step": f"{c.get('loads_in_step', 0):.0f}",
        "restore ms each": f"{c.get('load_us', 0) / 1e3 / loads:.1f}",
        "of it writing blocks": f"{c.get('load_write_us', 0) / 1e3 / loads:.1f}",
        "waiting to be reported": f"{c.get('load_report_us', 0) / 1e3 / loads:.1f}",
        "tokens restored": f"{c.get('loaded_tokens', 0):.0f}",
        "forward-thread save copies, s": f"{c.get('save_us', 0) / 1e6:.2f}",
        "full chunks the histories hold (at least)": f"{full}",
        "chunks queued": f"{c.get('chunks_queued', 0):.0f}",
        "chunks pushed": f"{c.get('chunks_pushed', 0):.0f}",
        "found already stored": f"{c.get('chunks_already_stored', 0):.0f}",
        "backfilled": f"{c.get('chunks_backfilled', 0):.0f}",
        "lookups not waited": f"{c.get('lookups_not_waited', 0):.0f}",
        "dropped": f"{c.get('upload_dropped', 0):.0f}",
        "full chunks of the last prompts with an index entry": f"{in_index} of {checked}",
    }


def _pooled_prefix(rounds: list[dict[str, Any]], name: str) -> dict[str, float]:
    ttfts = [1e3 * x for r in rounds if name in r for x in r[name].get("ttfts", [])]
    itls = [1e3 * x for r in rounds if name in r for i in r[name].get("itls", []) for x in i]
    return {
        **{f"ttft_p{q}_ms": pct(ttfts, q) for q in (50, 90, 99)},
        **{f"itl_p{q}_ms": pct(itls, q) for q in (50, 90, 99)},
        "requests": len(ttfts),
    }


def report(res: dict[str, Any]) -> str:
    c = res["config"]
    kv_setups = c.get("kv_setups") or [KV]
    lines = [
        f"# vLLM under load, paired: {len(res['blocks'])} blocks of {c['block_conversations']} "
        f"ShareGPT conversations ({c['turns']} turns, messages cut at {c['max_chars']} "
        f"characters, {c['max_tokens']}-token answers, {c['concurrency']} at a time)",
        "",
        "Every setup played every block, in a rotating order, the servers of all setups up "
        "together (scripts/bench/bench_vllm_load_paired.py).",
        "",
    ]
    pooled = res.get("pooled", {})
    if pooled:
        lines += [
            "| setup | turns | output tok/s | TTFT p50 ms | TTFT p99 ms | later turns p50 ms | "
            "ITL p50 ms | ITL p99 ms | ITL max ms | gaps > 1 s | cached / prompt tokens | "
            "turns moved | answers ≠ sticky |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, r in pooled.items():
            lines.append(
                f"| {name} | {r['requests']} | {r['output_tokens_per_s']:.1f} | "
                f"{r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | "
                f"{r['ttft_later_p50_ms']:.0f} | {r['itl_p50_ms']:.0f} | "
                f"{r['itl_p99_ms']:.0f} | {r.get('itl_max_ms', float('nan')):.0f} | "
                f"{r.get('gaps_over_1s', '?')} | {r['cached_tokens']}/{r['prompt_tokens']} | "
                f"{r.get('moved_fraction', float('nan')):.0%} | "
                f"{r['answers_differing']} of {r['answers_compared']} |"
            )
    blocks = res["blocks"]
    if blocks:
        lines += [
            "",
            "Each block (in the order run; ratios kvcloud / the no-connector setup of the "
            "same block; the idle servers' CPU is the most they took in any phase of the block):",
            "",
            "| block | order | setup | sticky TTFT p50 ms | kvcloud/sticky p50 | p99 | "
            "round-robin/kvcloud p50 | kvcloud/sticky ITL p99 | kvcloud/round-robin ITL p99 "
            "| kvcloud/sticky output tok/s | idle servers CPU % |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for i, b in enumerate(blocks):
            p = b["phases"]
            if any(n not in p for n in (*REFS, *kv_setups)):
                continue
            s, rr = p["sticky"], p["round-robin"]
            idle = max(x["idle_pair_cpu_pct"] for x in p.values())
            for name in kv_setups:
                k = p[name]
                lines.append(
                    f"| {i + 1} | {' → '.join(b['order'])} | {name} | {s['ttft_p50_ms']:.0f} | "
                    f"{k['ttft_p50_ms'] / s['ttft_p50_ms']:.2f} | "
                    f"{k['ttft_p99_ms'] / s['ttft_p99_ms']:.2f} | "
                    f"{rr['ttft_p50_ms'] / k['ttft_p50_ms']:.2f} | "
                    f"{k['itl_p99_ms'] / s['itl_p99_ms']:.2f} | "
                    f"{k['itl_p99_ms'] / rr['itl_p99_ms']:.2f} | "
                    f"{k['output_tokens_per_s'] / s['output_tokens_per_s']:.2f} | {idle:.1f} |"
                )
        for name in kv_setups:
            for ref in REFS:
                d = _turn_extra_ms(blocks, name, ref)
                if d:
                    q1, q3 = np.percentile(d, [25, 75])
                    lines.append(
                        f"\n{name}'s TTFT minus {ref}'s on the same turn (turns after the "
                        f"first, {len(d)} pairs): median {np.median(d):+.0f} ms, quartiles "
                        f"{q1:+.0f} / {q3:+.0f} ms."
                    )
            costs = _kvcloud_costs(blocks, name, c["chunk_tokens"])
            if costs:
                lines.append(
                    f"\nWhat {name}'s connector did, over its phases: "
                    + "; ".join(f"{k} {v}" for k, v in costs.items())
                    + "."
                )

    def verdict(ok: bool) -> str:
        return "met" if ok else "**not met**"

    if pooled.get("sticky") and pooled.get("round-robin"):
        s, rr = pooled["sticky"], pooled["round-robin"]
        rows = []
        for name in kv_setups:
            k = pooled.get(name)
            if not k:
                continue
            p50, p99 = k["ttft_p50_ms"] / s["ttft_p50_ms"], k["ttft_p99_ms"] / s["ttft_p99_ms"]
            better = rr["ttft_p50_ms"] / k["ttft_p50_ms"]
            itl = k["itl_p99_ms"] / max(s["itl_p99_ms"], rr["itl_p99_ms"])
            out = k["output_tokens_per_s"] / max(
                s["output_tokens_per_s"], rr["output_tokens_per_s"]
            )
            rows += [
                f"| {name} | TTFT p50 ≤ 1.1× sticky | {p50:.2f}× | {verdict(p50 <= 1.1)} |",
                f"| {name} | TTFT p99 ≤ 1.3× sticky | {p99:.2f}× | {verdict(p99 <= 1.3)} |",
                f"| {name} | ≥ 2× better than round-robin (TTFT p50) | {better:.2f}× | "
                f"{verdict(better >= 2)} |",
                f"| {name} | ITL p99 ≤ 1.15× no connector (the worse of sticky and "
                f"round-robin) | {itl:.2f}× | {verdict(itl <= 1.15)} |",
                f"| {name} | output tok/s ≥ no connector (the better of the two) | "
                f"{out:.2f}× | {verdict(out >= 1.0)} |",
                f"| {name} | zero wrong answers | {k['answers_differing']} of "
                f"{k['answers_compared']} | {verdict(k['answers_differing'] == 0)} |",
            ]
        lines += [
            "",
            "The load targets on the pooled figures:",
            "",
            "| setup | target | measured | verdict |",
            "|---|---|---|---|",
            *rows,
        ]
    rounds = res.get("prefix_rounds") or []
    if rounds:
        kv_name = next((n for n in rounds[0] if n not in ("seed", "order", "sticky")), KV)
        lines += [
            "",
            f"prefix_repetition (vllm bench serve, {len(rounds)} rounds of "
            f"{c['prefix_prompts']} prompts, 4 prefixes of {c['prefix_len']} tokens; the "
            "first server of each round alternates), pooled over the rounds:",
            "",
            "| server | requests | TTFT p50 ms | p90 | p99 | ITL p50 ms | p90 | p99 |",
            "|---|---|---|---|---|---|---|---|",
        ]
        both = {n: _pooled_prefix(rounds, n) for n in ("sticky", kv_name)}
        for name, r in both.items():
            label = "no connector" if name == "sticky" else name
            lines.append(
                f"| {label} | {r['requests']} | {r['ttft_p50_ms']:.0f} | "
                f"{r['ttft_p90_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {r['itl_p50_ms']:.0f} | "
                f"{r['itl_p90_ms']:.0f} | {r['itl_p99_ms']:.0f} |"
            )
        ratios = [
            f"{both[kv_name][f'ttft_p{q}_ms'] / both['sticky'][f'ttft_p{q}_ms']:.2f}×"
            for q in (50, 90, 99)
        ]
        per_round = [
            f"{r[kv_name]['p50_ttft_ms'] / r['sticky']['p50_ttft_ms']:.2f}"
            for r in rounds
            if kv_name in r and "sticky" in r
        ]
        lines += [
            "",
            f"{kv_name} / no connector, TTFT p50/p90/p99: {' / '.join(ratios)}; each round's "
            f"p50 ratio: {', '.join(per_round)}.",
        ]
    if "total_s" in res:
        lines.append(f"\nRun took {res['total_s'] / 60:.1f} min.")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench" / "vllm_load_paired.json"))
    ap.add_argument(
        "--kv-setups",
        default=KV,
        help="kvcloud setups of the load benchmark, comma-separated (e.g. kvcloud-file,"
        "kvcloud-least-loaded,kvcloud-file-sync; kvcloud-sticky keeps each conversation on "
        "one server: the connector on, nothing moving), each on a pair of servers of its own; "
        "the first "
        "also runs prefix_repetition",
    )
    ap.add_argument(
        "--blocks",
        type=int,
        default=0,
        help="blocks of conversations (default: the orders of a Williams design, doubled when "
        "it has fewer than 6: 6 for three setups, 8 for four)",
    )
    ap.add_argument("--block-conversations", type=int, default=3)
    # 18 conversations: the sequential run's 10 turns of 5,000+ characters has only 10 in
    # the pool; 8 turns of 4,000+ has 33 (median 4,968 characters, histories ~2,000 tokens)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--max-chars", type=int, default=3000)
    ap.add_argument("--min-chars", type=int, default=4000)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--chunk-tokens", type=int, default=128)
    ap.add_argument("--settle", type=float, default=6.0, help="seconds idle before each phase")
    ap.add_argument("--prefix-rounds", type=int, default=4)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--prefix-prompts", type=int, default=32)
    args = ap.parse_args()
    args.kv_setups = [x.strip() for x in args.kv_setups.split(",") if x.strip()]
    for name in args.kv_setups:
        if not name.startswith("kvcloud"):
            raise SystemExit(f"{name}: not a kvcloud setup of the load benchmark")
    if not args.blocks:
        n = len(orders((*REFS, *args.kv_setups)))
        args.blocks = n if n >= 6 else 2 * n
    args.conversations = args.blocks * args.block_conversations
    args.resume = False
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    Paired(args).run()


if __name__ == "__main__":
    main()
