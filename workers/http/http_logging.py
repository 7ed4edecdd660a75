"""Request ids and log records for the HTTP server: an id per request (the client's
``X-Request-Id`` when it is safe to echo), carried into every log line, optional JSON lines,
and secrets scrubbed from whatever is logged.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import re
import time
import uuid
from typing import Any

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# -- request ids and structured logs -----------------------------------------------------------

REQUEST_ID_HEADER = "X-Request-Id"
# A client's id is echoed into logs and headers: accept only what cannot inject a log line or
# a header, and not so long that it bloats every record.
_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
# Set by RequestIdMiddleware for the duration of a request. Sync routes run in a thread pool
# that copies the context, so the engine's log records carry the id too.
request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "kvcloud_request_id", default=None
)
# Environment variables whose values must never reach a log line, whatever logs them.
_SECRET_ENV_RE = re.compile(r"SECRET|PASSWORD|PASSWD|TOKEN|API_KEY|ACCESS_KEY|CREDENTIAL", re.I)
_MIN_SECRET_LEN = 6  # shorter values ("1", "true") would blank out ordinary words


def _secret_values(env: dict[str, str] | None = None) -> list[str]:
    env = dict(os.environ) if env is None else env
    values: set[str] = set()
    for name, value in env.items():
        if not _SECRET_ENV_RE.search(name) or len(value) < _MIN_SECRET_LEN:
            continue
        values.add(value)
        # KVCLOUD_API_KEYS is "key=tenant,…": each key on its own may be logged, not the list
        for item in value.split(","):
            key = item.rsplit("=", 1)[0].strip()
            if len(key) >= _MIN_SECRET_LEN:
                values.add(key)
    return sorted(values, key=len, reverse=True)  # longest first: no partial leftovers


class RequestIdFilter(logging.Filter):
    """Puts the current request id (or None) on every record as ``request_id``."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, request_id (inside a request), and
    exc (a traceback, as one string) when there is one. Values of secret-looking environment
    variables are replaced by ``***`` in every field, a last line of defence behind the code
    never logging them."""

    def __init__(self, secrets: list[str] | None = None) -> None:
        super().__init__()
        self._secrets = _secret_values() if secrets is None else secrets

    def _scrub(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": self._scrub(record.getMessage()),
        }
        rid = getattr(record, "request_id", None) or request_id_var.get()
        if rid:
            out["request_id"] = rid
        if record.exc_info:
            out["exc"] = self._scrub(self.formatException(record.exc_info))
        return json.dumps(out, ensure_ascii=False)


def configure_logging(level: str, fmt: str = "text") -> None:
    """The worker's root handler: ``text`` (human) or ``json`` (one object per line)."""
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())


class RequestIdMiddleware:
    """Gives every HTTP request an id: the client's ``X-Request-Id`` when it is well formed,
    else a new one; sets it for the request's log records and echoes it in the response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get(REQUEST_ID_HEADER)
        rid = given if given and _REQUEST_ID_RE.match(given) else uuid.uuid4().hex
        token = request_id_var.set(rid)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [
                    (k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"
                ]
                headers.append((b"x-request-id", rid.encode("ascii")))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            request_id_var.reset(token)
