"""The ``kvcloud-worker`` command line.

``kvcloud-worker serve`` runs the HTTP inference server (see ``workers.http.server``). Each engine
flag defaults to its environment variable (KVCLOUD_STORE, KVCLOUD_INDEX, KVCLOUD_WORKER_ID, ...,
listed in ``workers.config``), then to the built-in default. The fingerprint secret is read from
KVCLOUD_SECRET only: a flag would show it in every process listing.

SIGTERM (or Ctrl-C) stops the server gracefully: requests in flight finish, then every session
is flushed to the store before the process exits. Configuration errors print one line and exit
with status 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Any

import uvicorn

from kvcloud.errors import KVCloudError
from kvcloud.urls import redact_url

from .config import WRITE_POLICIES, WorkerOptions
from .errors import WorkerError

log = logging.getLogger("kvcloud.worker.cli")

PROG = "kvcloud-worker"
GRACEFUL_SHUTDOWN_S = 5  # in-flight requests get this long after SIGTERM before the flush
LOG_LEVELS = ("debug", "info", "warning", "error")


class UsageError(Exception):
    """Bad configuration: reported as one line, exit status 2."""


# -- engine options shared by every subcommand that builds an engine --------------------------

# (flag, WorkerOptions field, type, metavar, help); defaults stay None so the environment applies
_ENGINE_FLAGS: list[tuple[str, str, type, str, str]] = [
    ("--model", "model", str, "NAME", "preset: tiny (tests) or small [$KVCLOUD_WORKER_MODEL]"),
    (
        "--seed",
        "seed",
        int,
        "N",
        "seed of the preset's weights; workers must agree to share KV [$KVCLOUD_WORKER_SEED]",
    ),
    (
        "--model-path",
        "model_path",
        str,
        "DIR",
        "local Hugging Face checkpoint (Llama, Qwen2, Mistral; safetensors, tokenizer.json); "
        "replaces --model [$KVCLOUD_WORKER_MODEL_PATH]",
    ),
    (
        "--model-dtype",
        "model_dtype",
        str,
        "DTYPE",
        "with --model-path: auto | float32 | bfloat16 | float16 [$KVCLOUD_MODEL_DTYPE]",
    ),
    ("--store", "store", str, "URL", "kvcloud object store URL, or none [$KVCLOUD_STORE]"),
    ("--index", "index", str, "URL", "kvcloud index URL [$KVCLOUD_INDEX]"),
    ("--worker-id", "worker_id", str, "ID", "name in logs, metrics, /healthz [$KVCLOUD_WORKER_ID]"),
    ("--cache-pages", "cache_pages", int, "N", "KV pages in memory [$KVCLOUD_CACHE_PAGES]"),
    (
        "--write-policy",
        "write_policy",
        str,
        "POLICY",
        f"{' | '.join(WRITE_POLICIES)}: when pages are pushed [$KVCLOUD_WRITE_POLICY]",
    ),
    (
        "--chunk-tokens",
        "chunk_tokens",
        int,
        "N",
        "tokens per page and stored segment [$KVCLOUD_CHUNK_TOKENS]",
    ),
    ("--kv-dtype", "kv_dtype", str, "DTYPE", "float16 | bfloat16 | float32 [$KVCLOUD_KV_DTYPE]"),
    (
        "--kv-codec",
        "kv_codec",
        str,
        "CODEC",
        "stored KV: lossless | int8 (half the bytes, approximate) [$KVCLOUD_KV_CODEC]",
    ),
    ("--device", "device", str, "DEVICE", "cpu | cuda | auto [$KVCLOUD_DEVICE]"),
    ("--threads", "threads", int, "N", "torch threads, 0 = torch's default [$KVCLOUD_THREADS]"),
    (
        "--upload-queue",
        "upload_queue",
        int,
        "N",
        "pages waiting to upload; beyond it uploads are dropped [$KVCLOUD_UPLOAD_QUEUE]",
    ),
    ("--max-sessions", "max_sessions", int, "N", "sessions held in memory [$KVCLOUD_MAX_SESSIONS]"),
    (
        "--remote-timeout",
        "remote_timeout",
        float,
        "SECONDS",
        "longest store/index call on the request path [$KVCLOUD_REMOTE_TIMEOUT]",
    ),
    (
        "--tenant",
        "tenant",
        str,
        "NAME",
        "tenant of every request when no API keys are configured [$KVCLOUD_TENANT]",
    ),
    (
        "--api-keys-file",
        "api_keys_file",
        str,
        "PATH",
        "'<key> <tenant>' lines; requests must then send 'Authorization: Bearer <key>' "
        "(keys also from $KVCLOUD_API_KEYS='key=tenant,...') [$KVCLOUD_API_KEYS_FILE]",
    ),
]


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("engine (flag > environment > default)")
    for flag, dest, typ, metavar, help_ in _ENGINE_FLAGS:
        group.add_argument(flag, dest=dest, type=typ, metavar=metavar, default=None, help=help_)


def options_from_args(args: argparse.Namespace) -> WorkerOptions:
    flags = {entry[1]: getattr(args, entry[1]) for entry in _ENGINE_FLAGS}
    try:
        return WorkerOptions.from_env(**flags)
    except (ValueError, TypeError) as exc:
        raise UsageError(_bad_env_number() or f"invalid configuration: {exc}") from None


def _bad_env_number() -> str | None:
    """from_env's int()/float() errors do not say which variable held the bad value."""
    for f in fields(WorkerOptions):
        name = f.metadata.get("env")
        raw = os.environ.get(name or "")
        if not raw or f.type not in ("int", int, "float", float):
            continue
        try:
            int(raw) if f.type in ("int", int) else float(raw)
        except ValueError:
            return f"{name}={raw!r} is not a number"
    return None


def build_engine(options: WorkerOptions) -> Any:
    from .engine import Engine  # torch: only for the commands that need it

    try:
        return Engine(options)
    except (ValueError, KVCloudError, WorkerError, OSError) as exc:
        # a bad preset, store URL or directory; anything else is a bug and keeps its traceback
        raise UsageError(str(exc)) from None


# -- serve ------------------------------------------------------------------------------------


def _listen(host: str, port: int) -> socket.socket:
    """Bind before the model is built, so a taken port fails fast and port 0 can be used."""
    if not 0 <= port <= 65535:
        raise UsageError(f"--port must be in 0..65535, not {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family = infos[0][0]
        return socket.create_server((host, port), family=family, backlog=2048)
    except OSError as exc:
        raise UsageError(f"cannot listen on {_url(host, port)}: {exc.strerror or exc}") from None


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class _Server(uvicorn.Server):
    """uvicorn logs no address for sockets it is handed; this says when it really serves."""

    def __init__(self, config: uvicorn.Config, on_ready: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_ready = on_ready

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            self._on_ready()


def cmd_serve(args: argparse.Namespace) -> int:
    from .http.server import configure_logging, create_app

    options = options_from_args(args)
    configure_logging(args.log_level, args.log_format)
    sock = _listen(args.host, args.port)
    try:
        engine = build_engine(options)
    except BaseException:
        sock.close()
        raise
    host, port = sock.getsockname()[:2]
    address = _url(host, port)

    def ready() -> None:
        store = redact_url(options.store) if options.store else "none"
        log.info(
            "%s %s ready on %s (model %s, store %s)",
            PROG,
            options.worker_id,
            address,
            engine.model_name,
            store,
        )

    config = uvicorn.Config(
        create_app(engine),
        # None: uvicorn installs no handlers of its own, so its records (access log too)
        # reach the root handler and share the chosen format.
        log_config=None,
        log_level=args.log_level,
        access_log=not args.no_access_log,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        lifespan="on",
    )
    # The app's lifespan flushes and closes the engine on shutdown; uvicorn re-raises a
    # captured SIGTERM after that, so the process ends "killed by SIGTERM", flushed.
    _Server(config, ready).run(sockets=[sock])
    return 0


# -- entry point ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the HTTP inference server")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8001, help="0 picks a free port (default 8001)")
    s.add_argument("--log-level", choices=LOG_LEVELS, default="info")
    s.add_argument("--no-access-log", action="store_true", help="do not log every request")
    s.add_argument(
        "--log-format",
        choices=("text", "json"),
        default=os.environ.get("KVCLOUD_LOG_FORMAT", "text"),
        help="text, or json: one object per line with ts, level, logger, msg, request_id "
        "(default $KVCLOUD_LOG_FORMAT or text)",
    )
    add_engine_flags(s)
    s.set_defaults(func=cmd_serve)

    from .bench.cli import add_bench_parser

    add_bench_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except UsageError as exc:
        print(f"{PROG} {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
