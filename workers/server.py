"""The worker's HTTP API: FastAPI, OpenAI-compatible where an OpenAI endpoint exists.

Endpoints::

    POST /v1/completions          prompt (text or token ids) -> text_completion
    POST /v1/chat/completions     messages -> chat.completion
    GET  /v1/models               the one model this worker serves
    POST /v1/sessions             -> 201 {"id": session_id}
    GET  /v1/sessions/{id}        tokens, kv_tokens, resident, stored
    POST /v1/sessions/{id}/flush  push the session's KV and write its record
    GET  /healthz                 engine.health()
    GET  /metrics                 Prometheus text exposition

Generation parameters (both completion endpoints): ``max_tokens`` (1..context, default 16),
``temperature`` (0..2, default 0 = greedy), ``seed`` (with temperature > 0, the same seed gives
the same tokens), ``session_id``, ``return_token_ids`` (adds ``choices[0].token_ids``, the
generated ids), ``ignore_eos`` (vLLM's extension: keep generating past EOS), ``model`` (echoed,
not used to route). Other OpenAI fields are accepted and ignored, except ``stream`` and ``n``,
which only take their non-streaming, single-choice values.

Prompts: a text prompt is encoded with the model's tokenizer and BOS is put in front when it
would start the model input (a request without a session, or a session's first turn). A prompt
given as token ids is used exactly as given, BOS included or not.

Sessions: with ``session_id`` the model input is the session's history followed by this
request's prompt, and the completion is appended to the history. For chat requests this means
``messages`` holds only the NEW messages of this turn (typically one user message): they are
rendered with the chat template and appended. Do not resend earlier turns; they are already in
the history. Without a session, ``messages`` is the whole conversation, as in OpenAI's API.

Responses add a ``kvcloud`` object: ``ttft_ms``, ``total_ms``, ``tokens_local`` (prompt tokens
whose KV was in this worker's pages), ``tokens_remote`` (pulled from kvcloud),
``tokens_computed`` (prefilled), ``session_tokens``, ``session_id``, ``worker_id``.
``usage.prompt_tokens`` counts the whole model input, session history included, and
``usage.prompt_tokens_details.cached_tokens`` is tokens_local + tokens_remote.

Authentication (see ``workers.auth``): with API keys configured, every ``/v1/`` request must
send ``Authorization: Bearer <key>``; the key decides the tenant (fingerprint key and sessions).
A missing or unknown key is answered 401 before the body is read. ``/healthz``, ``/metrics``
and the OpenAPI document stay open for probes and scrapers; they hold no tenant data. Without
keys every request is tenant ``options.tenant`` (one warning at startup). No header or body
field names a tenant: unknown body fields are ignored like any other.

Errors are ``{"error": {"message", "type", "param", "code"}}``: 400 for an invalid request
(validation, malformed JSON, a prompt that does not fit the context or this worker's KV cache),
401 for a missing or unknown API key, 404 for an unknown session (another tenant's included)
or path, 413 for an oversized body, 503 when every KV page is pinned, 500 for anything
unexpected (the details go to the log, never to the client).

Shutdown (uvicorn's, which SIGTERM triggers): after in-flight requests finish, every session is
flushed (``engine.flush_all()``) and the engine closed.
"""

import contextvars
import json
import logging
import os
import re
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import FastAPI, Path, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .auth import ApiKeys, redact_credentials_in_logs
from .errors import BadRequestError, ContextLengthError, WorkerError
from .types import CompletionRequest, CompletionResult

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger("kvcloud.worker.http")
# At import, not in create_app: `kvcloud-worker serve` imports this module before it builds the
# engine, whose store already talks to S3 (and botocore, at DEBUG, prints credentials).
redact_credentials_in_logs()

# -- request ids and structured logs -----------------------------------------------------------

REQUEST_ID_HEADER = "X-Request-Id"
# A client's id is echoed into logs and headers: accept only what cannot inject a log line or
# a header, and not so long that it bloats every record.
_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
# Set by _RequestIdMiddleware for the duration of a request. Sync routes run in a thread pool
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


class _RequestIdMiddleware:
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


DEFAULT_MAX_TOKENS = 16
MAX_TEMPERATURE = 2.0  # OpenAI's bound; beyond it sampling is noise anyway
MAX_SEED = 2**53 - 1  # the largest integer JSON parsers and the spec's float bounds hold exactly
SESSION_ID_PATTERN = r"^[A-Za-z0-9_-]{1,128}$"  # ids end up in index keys: no separators
# Sized for a long text prompt; anything larger is a mistake or an attack, not a prompt.
MAX_BODY_BYTES = 16 * 2**20

# -- response bodies (also what the OpenAPI spec promises) ------------------------------------


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class KVCloudStats(BaseModel):
    ttft_ms: float
    total_ms: float
    tokens_local: int
    tokens_remote: int
    tokens_computed: int
    session_tokens: int
    session_id: str | None
    worker_id: str


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length"]
    logprobs: None
    token_ids: list[int] | None = Field(None, description="generated ids (return_token_ids)")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    kvcloud: KVCloudStats


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length"]
    logprobs: None
    token_ids: list[int] | None = Field(None, description="generated ids (return_token_ids)")


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    kvcloud: KVCloudStats


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class SessionCreated(BaseModel):
    id: str


class FlushResponse(BaseModel):
    session_id: str
    tokens: int
    kv_tokens: int
    chunks_pushed: int
    bytes_pushed: int
    stored: bool


class SessionInfoResponse(BaseModel):
    session_id: str
    tokens: int
    kv_tokens: int
    resident: bool
    stored: bool
    updated: float | None
    extra: dict[str, Any]


# -- request bodies ---------------------------------------------------------------------------


class _Body(BaseModel):
    # Strict: "16" is not a number and 1.0 is not a token id; clients that send them have a
    # bug worth surfacing. Unknown fields are ignored so OpenAI clients work unchanged.
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]


def _request_models(max_context: int, vocab_size: int) -> tuple[type[_Body], type[_Body]]:
    """Body models whose bounds come from the model served, so the OpenAPI spec states them."""
    TokenId = Annotated[int, Field(ge=0, lt=vocab_size)]
    MaxTokens = Annotated[
        int | None,
        Field(
            ge=1, le=max_context, description=f"tokens to generate (default {DEFAULT_MAX_TOKENS})"
        ),
    ]

    class GenerationParams(_Body):
        max_tokens: MaxTokens = DEFAULT_MAX_TOKENS
        temperature: float | None = Field(0.0, ge=0.0, le=MAX_TEMPERATURE)
        seed: int | None = Field(None, ge=0, le=MAX_SEED)
        session_id: str | None = Field(None, pattern=SESSION_ID_PATTERN)
        return_token_ids: bool = False
        ignore_eos: bool = False
        model: str | None = None
        stream: Literal[False] = Field(False, description="streaming is not supported")
        n: int = Field(1, ge=1, le=1, description="only one choice is supported")

    class CompletionBody(GenerationParams):
        # a text prompt may be empty (BOS still opens it); a token prompt may not (no input)
        prompt: str | Annotated[list[TokenId], Field(min_length=1, max_length=max_context)]

    class ChatCompletionBody(GenerationParams):
        messages: list[ChatMessage] = Field(min_length=1)
        # OpenAI's newer name for max_tokens; wins when both are given
        max_completion_tokens: MaxTokens = None

    return CompletionBody, ChatCompletionBody


# -- errors -----------------------------------------------------------------------------------


def _error(status: int, message: str, code: str | None, param: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


_LOC_SOURCES = ("body", "path", "query", "header", "cookie")
_SCALAR_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _is_union_tag(part: object) -> bool:
    # pydantic names the union member an error came from in the location ("str",
    # "list[constrained-int]"); field names never look like that.
    return isinstance(part, str) and (part in _SCALAR_TAGS or "[" in part or "-" in part)


def _validation_message(errors: Sequence[Any]) -> tuple[str, str | None, str]:
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


class _InternalErrorMiddleware:
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
            response = _error(500, "internal error; see the worker's log", "internal_error")
            await response(scope, receive, send)


class _BodyLimitMiddleware:
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
        too_large = _error(
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


_TENANT_STATE = "kvcloud_tenant"  # where _AuthMiddleware leaves the tenant in scope["state"]
_AUTH_SCHEME = "apiKey"  # the OpenAPI security scheme's name


def _is_protected(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


def _unauthorized(missing: bool) -> JSONResponse:
    # OpenAI's shape and code; the key itself is never echoed (OpenAI echoes a masked one).
    if missing:
        message = "missing API key: send it as 'Authorization: Bearer <key>'"
        challenge = 'Bearer realm="kvcloud"'
    else:
        message = "invalid API key"
        challenge = 'Bearer realm="kvcloud", error="invalid_token"'
    response = _error(401, message, "invalid_api_key")
    response.headers["WWW-Authenticate"] = challenge  # RFC 6750
    return response


class _AuthMiddleware:
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
        if scope["type"] != "http" or not _is_protected(scope["path"]):
            await self.app(scope, receive, send)
            return
        header = Headers(scope=scope).get("authorization")
        tenant = self.keys.tenant_for_authorization(header)
        if tenant is None:
            await _unauthorized(missing=not header)(scope, receive, send)
            return
        scope.setdefault("state", {})[_TENANT_STATE] = tenant
        await self.app(scope, receive, send)


class _AuthRequired(Exception):
    """Raised by _tenant_for when no authenticated tenant is present; answered 401."""


# -- the app ----------------------------------------------------------------------------------


def _tenant_for(request: Request) -> str:
    """The tenant a request acts for: whose fingerprint key and sessions it uses.

    With API keys, the tenant _AuthMiddleware found for the request's key; without, the
    configured tenant. Nothing the caller sends besides the key can change it.
    """
    engine = request.app.state.engine
    if engine.options.api_key_map is None:
        return engine.options.tenant
    tenant = request.scope.get("state", {}).get(_TENANT_STATE)
    if tenant is None:
        # fail closed: a route that needs a tenant but was not authenticated is a bug here
        raise _AuthRequired()
    return str(tenant)


def _flush_and_close(engine: "Engine") -> None:
    try:
        results = engine.flush_all()
        log.info(
            "shutdown: flushed %d session(s), %d chunk(s), %d bytes",
            len(results),
            sum(r.chunks_pushed for r in results),
            sum(r.bytes_pushed for r in results),
        )
    except Exception:
        log.exception("shutdown: flushing sessions failed")
    finally:
        try:
            engine.close()
        except Exception:
            log.exception("shutdown: closing the engine failed")


def create_app(engine: "Engine") -> FastAPI:
    """The HTTP app over ``engine`` (see ``workers.engine.Engine`` for the interface used).

    The app owns the engine's shutdown: when the server stops, sessions are flushed and the
    engine closed.
    """
    tokenizer = engine.tokenizer
    max_context = int(engine.max_context)
    # Positions 0 .. prompt + max_tokens - 2 hold KV (the last token is never fed back), so
    # prompt + max_tokens <= pages x chunk always fits an idle pool, BOS included.
    cache_tokens = engine.options.cache_pages * engine.options.chunk_tokens
    CompletionBody, ChatCompletionBody = _request_models(max_context, tokenizer.vocab_size)
    started_at = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        # Off the event loop: a flush pushes to the store and may wait for a running request.
        await run_in_threadpool(_flush_and_close, engine)

    error_responses: dict[int | str, dict[str, Any]] = {
        400: {"model": ErrorBody, "description": "invalid request"},
        404: {"model": ErrorBody, "description": "unknown session"},
        413: {"model": ErrorBody, "description": "request body too large"},
        500: {"model": ErrorBody, "description": "internal error"},
    }
    app = FastAPI(
        title="kvcloud worker",
        summary="LLM inference whose KV cache outlives the process (OpenAI-compatible subset)",
        lifespan=lifespan,
        responses=error_responses,
    )
    app.state.engine = engine
    api_keys: ApiKeys | None = engine.options.api_key_map
    if api_keys is None:
        log.warning(
            "no API keys configured (--api-keys-file, KVCLOUD_API_KEYS): every request acts "
            "as tenant %r, unauthenticated",
            engine.options.tenant,
        )
    else:
        log.info(
            "API keys: %d key(s) for %d tenant(s) from %s",
            len(api_keys),
            len(api_keys.tenants),
            ", ".join(api_keys.sources),
        )
        for warning in api_keys.warnings:
            log.warning("%s", warning)
    app.add_middleware(_InternalErrorMiddleware)
    app.add_middleware(_BodyLimitMiddleware, limit=MAX_BODY_BYTES)
    if api_keys is not None:
        # added last = outermost: rejects before a body is buffered or parsed
        app.add_middleware(_AuthMiddleware, keys=api_keys)
    # outermost of all: 401s and 413s get a request id too
    app.add_middleware(_RequestIdMiddleware)

    @app.exception_handler(_AuthRequired)
    async def auth_required(request: Request, exc: _AuthRequired) -> JSONResponse:
        return _unauthorized(missing=True)

    @app.exception_handler(WorkerError)
    async def worker_error(request: Request, exc: WorkerError) -> JSONResponse:
        response = _error(exc.status, exc.message, exc.code)
        if exc.status == 503:
            response.headers["Retry-After"] = "1"  # pages free up as running requests end
        return response

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param, code = _validation_message(exc.errors())
        return _error(400, message, code, param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        codes = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
        response = _error(exc.status_code, str(exc.detail), codes.get(exc.status_code))
        for k, v in (exc.headers or {}).items():
            response.headers[k] = v
        return response

    def generate(
        request: Request,
        body: Any,
        prompt_tokens: list[int],
        add_bos: bool,
        max_tokens: int | None,
    ) -> CompletionResult:
        n = max_tokens if max_tokens is not None else DEFAULT_MAX_TOKENS
        # The engine checks this too (with the session's history); failing here spares the
        # request a wait for the engine's lock.
        if len(prompt_tokens) + n > max_context:
            raise ContextLengthError(
                f"{len(prompt_tokens)} prompt tokens + {n} max_tokens exceed the context of "
                f"{max_context}"
            )
        # A request holds pages for all its KV at once, so one that needs more than the whole
        # pool can never run here: a 400, where the engine's "every page in use" 503 would
        # tell the client to retry forever (found by the schemathesis fuzz test).
        if len(prompt_tokens) + n > cache_tokens:
            raise ContextLengthError(
                f"{len(prompt_tokens)} prompt tokens + {n} max_tokens exceed this worker's KV "
                f"cache of {cache_tokens} tokens ({engine.options.cache_pages} pages of "
                f"{engine.options.chunk_tokens}; see --cache-pages)"
            )
        req = CompletionRequest(
            prompt_tokens=prompt_tokens,
            max_tokens=n,
            temperature=body.temperature or 0.0,
            seed=body.seed,
            session_id=body.session_id,
            tenant=_tenant_for(request),
            stop_at_eos=not body.ignore_eos,
            add_bos=add_bos,
        )
        return engine.complete(req)

    def usage_and_stats(res: CompletionResult) -> dict[str, Any]:
        cached = res.tokens_local + res.tokens_remote
        return {
            "usage": Usage(
                prompt_tokens=res.prompt_tokens,
                completion_tokens=len(res.tokens),
                total_tokens=res.prompt_tokens + len(res.tokens),
                prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
            ),
            "kvcloud": KVCloudStats(
                ttft_ms=res.ttft_ms,
                total_ms=res.total_ms,
                tokens_local=res.tokens_local,
                tokens_remote=res.tokens_remote,
                tokens_computed=res.tokens_computed,
                session_tokens=res.session_tokens,
                session_id=res.session_id,
                worker_id=engine.options.worker_id,
            ),
        }

    def choice_extras(body: Any, res: CompletionResult) -> dict[str, Any]:
        # token_ids stays unset unless asked for, so exclude_unset leaves it out
        return {"token_ids": list(res.tokens)} if body.return_token_ids else {}

    @app.post(
        "/v1/completions",
        response_model=CompletionResponse,
        response_model_exclude_unset=True,
        responses={503: {"model": ErrorBody, "description": "every KV page is in use"}},
    )
    def completions(request: Request, body: CompletionBody) -> Any:
        if isinstance(body.prompt, str):
            tokens, add_bos = tokenizer.encode(body.prompt), True
        else:
            tokens, add_bos = list(body.prompt), False
        res = generate(request, body, tokens, add_bos, body.max_tokens)
        return CompletionResponse(
            id=f"cmpl-{uuid.uuid4().hex}",
            object="text_completion",
            created=int(time.time()),
            model=body.model or engine.model_name,
            choices=[
                CompletionChoice(
                    index=0,
                    text=tokenizer.decode(res.tokens),
                    finish_reason=res.finish_reason,
                    logprobs=None,
                    **choice_extras(body, res),
                )
            ],
            **usage_and_stats(res),
        )

    @app.post(
        "/v1/chat/completions",
        response_model=ChatCompletionResponse,
        response_model_exclude_unset=True,
        responses={503: {"model": ErrorBody, "description": "every KV page is in use"}},
    )
    def chat_completions(request: Request, body: ChatCompletionBody) -> Any:
        messages = [
            {
                "role": m.role,
                "content": m.content
                if isinstance(m.content, str)
                else "".join(p.text for p in m.content),
            }
            for m in body.messages
        ]
        try:
            rendered = tokenizer.apply_chat_template(messages)
        except ValueError as exc:  # no template, or the template's raise_exception()
            raise BadRequestError(str(exc)) from None
        tokens = tokenizer.encode(rendered)
        max_tokens = (
            body.max_completion_tokens
            if body.max_completion_tokens is not None
            else body.max_tokens
        )
        res = generate(request, body, tokens, tokenizer.chat_adds_bos, max_tokens)
        return ChatCompletionResponse(
            id=f"chatcmpl-{uuid.uuid4().hex}",
            object="chat.completion",
            created=int(time.time()),
            model=body.model or engine.model_name,
            choices=[
                ChatChoice(
                    index=0,
                    message=AssistantMessage(
                        role="assistant", content=tokenizer.decode(res.tokens)
                    ),
                    finish_reason=res.finish_reason,
                    logprobs=None,
                    **choice_extras(body, res),
                )
            ],
            **usage_and_stats(res),
        )

    @app.get("/v1/models", response_model=ModelList)
    def models() -> ModelList:
        card = ModelCard(
            id=engine.model_name, object="model", created=started_at, owned_by="kvcloud"
        )
        return ModelList(object="list", data=[card])

    SessionId = Annotated[str, Path(pattern=SESSION_ID_PATTERN)]

    @app.post("/v1/sessions", status_code=201, response_model=SessionCreated)
    def create_session(request: Request) -> SessionCreated:
        return SessionCreated(id=engine.create_session(_tenant_for(request)))

    @app.get("/v1/sessions/{session_id}", response_model=SessionInfoResponse)
    def get_session(request: Request, session_id: SessionId) -> SessionInfoResponse:
        info = engine.session_info(session_id, _tenant_for(request))
        return SessionInfoResponse(**asdict(info))

    @app.post(
        "/v1/sessions/{session_id}/flush",
        response_model=FlushResponse,
        responses={503: {"model": ErrorBody, "description": "the store is unavailable"}},
    )
    def flush_session(request: Request, session_id: SessionId) -> FlushResponse:
        return FlushResponse(**asdict(engine.flush_session(session_id, _tenant_for(request))))

    @app.get("/healthz", response_model=dict[str, Any])
    def healthz() -> dict[str, Any]:
        return engine.health()

    @app.get(
        "/metrics",
        response_class=Response,
        responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
    )
    def metrics() -> Response:
        return Response(generate_latest(engine.registry), media_type=CONTENT_TYPE_LATEST)

    def openapi() -> dict[str, Any]:
        # FastAPI documents 422 for every route with parameters; this app answers 400 instead.
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title,
                version=app.version,
                summary=app.summary,
                routes=app.routes,
            )
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            if api_keys is not None:
                _document_auth(schema)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    return app


def _document_auth(schema: dict[str, Any]) -> None:
    """Declare the bearer scheme and its 401 on every /v1/ operation (keys configured)."""
    components = schema.setdefault("components", {})
    components.setdefault("securitySchemes", {})[_AUTH_SCHEME] = {
        "type": "http",
        "scheme": "bearer",
        "description": "an API key; it decides the tenant",
    }
    for path, item in schema.get("paths", {}).items():
        if not _is_protected(path):
            continue
        for operation in item.values():
            operation["security"] = [{_AUTH_SCHEME: []}]
            operation.setdefault("responses", {})["401"] = {
                "description": "missing or unknown API key",
                "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}
                },
            }
