"""HTTP errors in OpenAI's shape, and the ASGI layers every request passes: API-key
authentication, the body size limit, and a last-resort 500 that logs instead of leaking.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .auth import ApiKeys

log = logging.getLogger("kvcloud.worker.http")

MAX_BODY_BYTES = 16 * 2**20

# -- errors -----------------------------------------------------------------------------------


def error_response(
    status: int, message: str, code: str | None, param: str | None = None
) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


_LOC_SOURCES = ("body", "path", "query", "header", "cookie")
_SCALAR_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _is_union_tag(part: object) -> bool:
    # pydantic names the union member an error came from in the location ("str",
    # "list[constrained-int]"); field names never look like that.
    return isinstance(part, str) and (part in _SCALAR_TAGS or "[" in part or "-" in part)


def validation_message(errors: Sequence[Any]) -> tuple[str, str | None, str]:
    """A readable one-liner for pydantic's errors: (message, param, code)."""
    if not errors:
        return "invalid request", None, "invalid_value"
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        pos = first["loc"][-1] if first.get("loc") else "?"
        return f"malformed JSON body: {detail} (at character {pos})", None, "invalid_json"
    if tuple(first.get("loc", ())) == ("body",):
        if first.get("type") == "missing":
            return "a JSON request body is required", None, "invalid_value"
        return (
            "the request body must be a JSON object (send Content-Type: application/json)",
            None,
            "invalid_value",
        )

    # A union's errors name the member in their location ("prompt.str",
    # "prompt.list[constrained-int].3"). An error below a member means that member's type
    # matched, so the other members' type errors are noise; when no member matched, say which
    # types would have.
    entries: list[tuple[str, str, str | None]] = []  # (path, message, union it failed at)
    matched_unions: set[str] = set()
    for err in errors:
        loc = list(err.get("loc", ()))
        if loc and loc[0] in _LOC_SOURCES:
            loc = loc[1:]
        path = ".".join(str(p) for p in loc if not _is_union_tag(p)) or "body"
        tag_at = next((i for i, p in enumerate(loc) if _is_union_tag(p)), None)
        union = None
        if tag_at is not None:
            union = ".".join(str(p) for p in loc[:tag_at]) or "body"
            if tag_at < len(loc) - 1:
                matched_unions.add(union)
                union = None
        entries.append((path, str(err.get("msg", "invalid value")), union))
    by_path: dict[str, list[str]] = {}
    for path, msg, union in entries:
        if union is None or union not in matched_unions:
            by_path.setdefault(path, []).append(msg)
    parts = [f"{path}: {_either(msgs)}" for path, msgs in by_path.items()]
    more = f" (and {len(parts) - 5} more)" if len(parts) > 5 else ""
    return "; ".join(parts[:5]) + more, next(iter(by_path), None), "invalid_value"


def _either(msgs: list[str]) -> str:
    msgs = list(dict.fromkeys(msgs))
    prefix = "Input should be "
    if len(msgs) > 1 and all(m.startswith(prefix) for m in msgs):
        return prefix + " or ".join(m.removeprefix(prefix) for m in msgs)
    return "; ".join(msgs)


class InternalErrorMiddleware:
    """Turns an unexpected exception into a 500 JSON error and one log record.

    Starlette's own handling for ``Exception`` re-raises after responding (so the server logs
    it a second time and test clients raise); this answers and stops there.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            if started:
                raise  # too late for a clean error response; the server logs it and drops it
            log.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            response = error_response(500, "internal error; see the worker's log", "internal_error")
            await response(scope, receive, send)


class BodyLimitMiddleware:
    """Answers 413, as JSON like every other error, for a request body over ``limit`` bytes.

    FastAPI's own limit answers in plain text. Bodies here are small JSON that the app reads
    whole anyway, so buffering one before the app runs costs nothing.
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = error_response(
            413, f"the request body is larger than {self.limit} bytes", "request_too_large"
        )
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.limit:
            await too_large(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                await too_large(scope, receive, send)
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body: Message | None = {"type": "http.request", "body": b"".join(chunks)}

        async def replay() -> Message:
            nonlocal body
            if body is not None:
                message, body = body, None
                return message
            return await receive()  # after the body only a disconnect comes

        await self.app(scope, replay, send)


TENANT_STATE = "kvcloud_tenant"  # where AuthMiddleware leaves the tenant in scope["state"]
AUTH_SCHEME = "apiKey"  # the OpenAPI security scheme's name


def is_protected(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


def unauthorized(missing: bool) -> JSONResponse:
    # OpenAI's shape and code; the key itself is never echoed (OpenAI echoes a masked one).
    if missing:
        message = "missing API key: send it as 'Authorization: Bearer <key>'"
        challenge = 'Bearer realm="kvcloud"'
    else:
        message = "invalid API key"
        challenge = 'Bearer realm="kvcloud", error="invalid_token"'
    response = error_response(401, message, "invalid_api_key")
    response.headers["WWW-Authenticate"] = challenge  # RFC 6750
    return response


class AuthMiddleware:
    """Maps the request's API key to its tenant, or answers 401 for ``/v1/`` paths.

    A middleware rather than a route dependency so that it runs before anything else reads
    the request: an unauthenticated caller gets 401 for a malformed or oversized body too, and
    learns nothing about validation. Keys are never logged (uvicorn's access log has no
    headers).
    """

    def __init__(self, app: ASGIApp, keys: ApiKeys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_protected(scope["path"]):
            await self.app(scope, receive, send)
            return
        header = Headers(scope=scope).get("authorization")
        tenant = self.keys.tenant_for_authorization(header)
        if tenant is None:
            await unauthorized(missing=not header)(scope, receive, send)
            return
        scope.setdefault("state", {})[TENANT_STATE] = tenant
        await self.app(scope, receive, send)


class AuthRequired(Exception):
    """Raised by _tenant_for when no authenticated tenant is present; answered 401."""
