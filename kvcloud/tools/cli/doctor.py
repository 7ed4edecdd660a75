"""``kvcloud doctor``: check the store and index end to end and say what to fix; with
``--vllm-config``, exactly the configuration a vLLM with the kvcloud connector would use.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from rich.console import Console

from ...config import KVCloudConfig
from ...errors import ConfigError
from ...probe import key_id
from ...urls import redact_url
from ..doctor import FAIL, INFO, OK, WARN, Check, check_client, run_doctor
from .common import add_backend_args, announce, backend_config, emit_json, used_backends

CONNECTOR = "KVCloudConnector"
# vLLM imports the module and takes KVCloudConnector from it: the package exports it too
MODULE_PATHS = ("kvcloud.integrations.vllm", "kvcloud.integrations.vllm.connector")
KV_ROLES = ("kv_both", "kv_producer", "kv_consumer")


def read_transfer_config(value: str) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` JSON, given as the string or as ``@FILE``."""
    text = value
    if value.startswith("@"):
        try:
            text = Path(value[1:]).read_text()
        except OSError as exc:
            raise ConfigError(f"--vllm-config {value}: cannot read it ({exc.strerror})") from None
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--vllm-config: not JSON ({exc})") from None
    if not isinstance(parsed, dict):
        raise ConfigError("--vllm-config: expected a JSON object, as --kv-transfer-config takes")
    return parsed


def _connector_check(transfer: dict[str, Any]) -> Check:
    name = transfer.get("kv_connector")
    module = transfer.get("kv_connector_module_path")
    role = transfer.get("kv_role")
    fix_module = f'"kv_connector_module_path": "{MODULE_PATHS[0]}"'
    if name != CONNECTOR:
        return Check(
            "vllm",
            "connector",
            FAIL,
            f"kv_connector is {name!r}: vLLM would load another connector, or none",
            f'set "kv_connector": "{CONNECTOR}" and {fix_module}',
        )
    if module not in MODULE_PATHS:
        what = "missing" if module is None else f"{module!r}"
        return Check(
            "vllm",
            "connector",
            FAIL,
            f"kv_connector_module_path is {what}: vLLM cannot find {CONNECTOR} there",
            f"set {fix_module}",
        )
    if role not in KV_ROLES:
        return Check(
            "vllm",
            "connector",
            FAIL,
            f"kv_role is {role!r}: vLLM refuses a connector without a role",
            'set "kv_role": "kv_both" (kvcloud loads and saves)',
        )
    return Check("vllm", "connector", OK, f"{CONNECTOR} from {module}, kv_role {role}")


def _sources(extra: dict[str, Any]) -> dict[str, str]:
    out = {}
    for role, var in (("store", "KVCLOUD_STORE"), ("index", "KVCLOUD_INDEX")):
        if extra.get(role):
            out[role] = f"kv_connector_extra_config.{role}"
        elif role in extra:  # an empty one wins over the variable
            out[role] = f"default: kv_connector_extra_config.{role} empty"
        elif os.environ.get(var):
            out[role] = var
        else:
            out[role] = f"default: {var} unset"
    return out


def vllm_doctor(value: str) -> tuple[list[Check], dict[str, Any], KVCloudConfig]:
    """The checks for a vLLM started with ``--kv-transfer-config VALUE`` in this environment,
    a summary of its settings, and the client configuration it builds. ConfigError for what
    vLLM itself would refuse to start with (bad JSON, an unknown extra key, a bad value)."""
    # the settings module imports neither vLLM nor torch (nor does its package's __init__)
    from ...integrations.vllm.config import VLLMConnectorConfig

    transfer = read_transfer_config(value)
    extra = transfer.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise ConfigError("kv_connector_extra_config must be a JSON object")
    vcfg = VLLMConnectorConfig.load(extra)
    cfg = vcfg.client_config()  # KVCLOUD_SECRET etc. from this environment, as in vLLM
    sources = _sources(extra)
    connect, read = vcfg.connect_timeout, vcfg.read_timeout
    bound = float(getattr(vcfg, "probe_timeout", 2 * (connect + read)))
    summary: dict[str, Any] = {
        "store": redact_url(cfg.store),
        "index": redact_url(cfg.index),
        "sources": sources,
        "tenant": cfg.tenant,
        "load_mode": vcfg.load_mode,
        "write_policy": vcfg.write_policy,
        "chunk_tokens": vcfg.chunk_tokens,
        "connect_timeout": connect,
        "read_timeout": read,
        "probe_timeout": bound,
        "key_id": key_id(cfg.secret, cfg.tenant),
    }
    checks = [_connector_check(transfer), *check_client(cfg)]
    require = getattr(vcfg, "require", None)
    checks.append(
        Check(
            "vllm",
            "settings",
            INFO,
            f"tenant {cfg.tenant}, load mode {vcfg.load_mode}, write policy "
            f"{vcfg.write_policy}, chunk {vcfg.chunk_tokens} tokens, timeouts connect "
            f"{connect:g} s / read {read:g} s"
            + ("" if require is None else f", require {str(require).lower()}"),
        )
    )
    embedded = {role for role in ("store", "index") if not getattr(vcfg, role)}
    for role in [r for r in ("store", "index") if r in embedded]:
        var = f"KVCLOUD_{role.upper()}"
        checks.append(
            Check(
                "vllm",
                role,
                FAIL,
                f"{var} is unset: the embedded default {redact_url(getattr(cfg, role))}, "
                "private to this machine; no other vLLM shares its KV",
                "set KVCLOUD_STORE and KVCLOUD_INDEX (an S3 store and a Redis index every "
                "vLLM reaches), in the environment or kv_connector_extra_config",
            )
        )
    store_url = None if "store" in embedded else cfg.store
    index_url = None if "index" in embedded else cfg.index
    probes = run_doctor(store_url, index_url, cfg, client=False)
    checks.extend(probes)
    timed = {(c.target, c.name): c.seconds for c in probes if c.status != FAIL}
    took = [timed.get(("store", "probe")), timed.get(("index", "round trip"))]
    if not embedded and all(t is not None for t in took):
        total = sum(t for t in took if t is not None)
        detail = (
            f"store probe and index round trip took {total * 1000:.0f} ms; the connector's "
            f"start probe gives up after {bound:g} s"
        )
        if total > bound / 2:
            checks.append(
                Check(
                    "vllm",
                    "start probe",
                    WARN,
                    detail,
                    "the backends are slow from here: raise KVCLOUD_CONNECT_TIMEOUT and "
                    "KVCLOUD_READ_TIMEOUT, or bring them closer",
                )
            )
        else:
            checks.append(Check("vllm", "start probe", OK, detail, seconds=total))
    return checks, summary, cfg


def cmd_doctor(args: argparse.Namespace) -> int:
    summary: dict[str, Any]
    if args.vllm_config is not None:
        if args.store is not None or args.index is not None:
            raise ConfigError(
                "--vllm-config checks the store and index vLLM would use (its "
                "kv_connector_extra_config and KVCLOUD_* variables): drop --store/--index"
            )
        checks, summary, client = vllm_doctor(args.vllm_config)
        announce(args, client, sources=summary["sources"])
    else:
        cfg = backend_config(args)
        # Neither flag given: check both configured backends. One given: only that side.
        both = args.store is None and args.index is None
        store_url = cfg.store if both or args.store is not None else None
        index_url = cfg.index if both or args.index is not None else None
        announce(args, cfg, store=store_url is not None, index=index_url is not None)
        checks = run_doctor(store_url, index_url, cfg)
        summary = used_backends(args, cfg, store=store_url is not None, index=index_url is not None)
    failed = any(c.status == FAIL for c in checks)
    if args.json:
        emit_json({**summary, "ok": not failed, "checks": [c.to_dict() for c in checks]})
    else:
        colors = {FAIL: "red", WARN: "yellow", INFO: "blue"}
        console = Console(highlight=False, soft_wrap=True)
        for c in checks:
            color = colors.get(c.status, "green")
            console.print(f"[{color}]{c.status:4}[/{color}] " + c.line()[5:], markup=True)
    return 1 if failed else 0


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    doc = sub.add_parser(
        "doctor",
        help="check the store and index end to end and say what to fix (exit 1 on FAIL)",
        description="Write, read and delete a probe object in the store and a probe record "
        "in the index, check the bucket, Redis settings and clocks, and print one line per "
        "check: ok (a real request succeeded), warn, FAIL (with the fix) or info. Exit "
        "status: 0 no FAIL (warnings allowed), 1 a FAIL, 2 a usage or configuration error.",
    )
    add_backend_args(doc)
    doc.add_argument(
        "--vllm-config",
        metavar="JSON|@FILE",
        help="check what a vLLM started with --kv-transfer-config JSON in this environment "
        "would use: the connector's name and module, its kv_connector_extra_config, the "
        "KVCLOUD_* variables and secret (key id), and the store and index it names (a FAIL "
        "when they are the embedded private default)",
    )
    doc.set_defaults(func=cmd_doctor)
