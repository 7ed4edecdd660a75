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
not used to route). Other OpenAI fields are accepted and ignored, except ``n``, which only
takes its single-choice value. ``stream: true`` answers as Server-Sent Events in OpenAI's chunk
format (``workers.http.streaming``), with ``stream_options.include_usage``.

Prompts: a text prompt is encoded with the model's tokenizer and BOS is put in front when it
would start the model input (a request without a session, or a session's first turn). A prompt
given as token ids is used exactly as given, BOS included or not.

Sessions: with ``session_id``, a chat request's ``messages`` holds only the NEW messages of
this turn (typically one user message); the session keeps the conversation (earlier messages
and the replies as generated), and the model input is the chat template rendered over all of
it, exactly what a stateless request with the whole conversation gets. The session's KV is
reused up to the longest common token prefix with that input; the rest is computed. A
``/v1/completions`` request with a session appends its prompt to the session's token history
(plain concatenation) and the completion after it. Without a session, ``messages`` is the whole
conversation, as in OpenAI's API. With ``session_write_through`` (the default) a session turn's
record is in the index before its response completes (the JSON body, or ``data: [DONE]``), so
the next turn may go to any worker (``workers.engine.sessions``).

Responses add a ``kvcloud`` object: ``ttft_ms``, ``total_ms``, ``tokens_local`` (prompt tokens
whose KV was in this worker's pages), ``tokens_remote`` (pulled from kvcloud),
``tokens_computed`` (prefilled), ``session_tokens``, ``session_id``, ``worker_id``.
``usage.prompt_tokens`` counts the whole model input, session history included, and
``usage.prompt_tokens_details.cached_tokens`` is tokens_local + tokens_remote.

Authentication (see ``workers.http.auth``): with API keys configured, every ``/v1/`` request must
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

import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import FastAPI, Path, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import CompletionRequest, CompletionResult
from ..errors import BadRequestError, ContextLengthError, WorkerError
from .auth import ApiKeys, redact_credentials_in_logs
from .http_logging import JsonFormatter, RequestIdFilter, RequestIdMiddleware, configure_logging
from .middleware import (
    AUTH_SCHEME,
    MAX_BODY_BYTES,
    TENANT_STATE,
    AuthMiddleware,
    AuthRequired,
    BodyLimitMiddleware,
    InternalErrorMiddleware,
    error_response,
    is_protected,
    unauthorized,
    validation_message,
)
from .schemas import (
    DEFAULT_MAX_TOKENS,
    SESSION_ID_PATTERN,
    AssistantMessage,
    ChatChoice,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionResponse,
    ErrorBody,
    FlushResponse,
    KVCloudStats,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    SessionCreated,
    SessionInfoResponse,
    Usage,
    request_models,
)
from .streaming import stream_completion

if TYPE_CHECKING:
    from ..engine import Engine

log = logging.getLogger("kvcloud.worker.http")
# At import, not in create_app: `kvcloud-worker serve` imports this module before it builds the
# engine, whose store already talks to S3 (and botocore, at DEBUG, prints credentials).
redact_credentials_in_logs()

# with "stream": true the 200 is a stream of Server-Sent Events instead of one JSON body
STREAM_RESPONSE: dict[str, Any] = {
    "description": "the completion; with stream=true, Server-Sent Events (OpenAI chunks)",
    # one SSE event: its data is a JSON chunk (or an error object), or the final "[DONE]"
    "content": {
        "text/event-stream": {
            "schema": {
                "type": "object",
                "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
                "required": ["data"],
            }
        }
    },
}

__all__ = ["MAX_BODY_BYTES", "JsonFormatter", "RequestIdFilter", "configure_logging", "create_app"]

# -- the app ----------------------------------------------------------------------------------


def _tenant_for(request: Request) -> str:
    """The tenant a request acts for: whose fingerprint key and sessions it uses.

    With API keys, the tenant AuthMiddleware found for the request's key; without, the
    configured tenant. Nothing the caller sends besides the key can change it.
    """
    engine = request.app.state.engine
    if engine.options.api_key_map is None:
        return engine.options.tenant
    tenant = request.scope.get("state", {}).get(TENANT_STATE)
    if tenant is None:
        # fail closed: a route that needs a tenant but was not authenticated is a bug here
        raise AuthRequired()
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
    CompletionBody, ChatCompletionBody = request_models(max_context, tokenizer.vocab_size)
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
    app.add_middleware(InternalErrorMiddleware)
    app.add_middleware(BodyLimitMiddleware, limit=MAX_BODY_BYTES)
    if api_keys is not None:
        # added last = outermost: rejects before a body is buffered or parsed
        app.add_middleware(AuthMiddleware, keys=api_keys)
    # outermost of all: 401s and 413s get a request id too
    app.add_middleware(RequestIdMiddleware)

    @app.exception_handler(AuthRequired)
    async def auth_required(request: Request, exc: AuthRequired) -> JSONResponse:
        return unauthorized(missing=True)

    @app.exception_handler(WorkerError)
    async def worker_error(request: Request, exc: WorkerError) -> JSONResponse:
        response = error_response(exc.status, exc.message, exc.code)
        if exc.status == 503:
            response.headers["Retry-After"] = "1"  # pages free up as running requests end
        return response

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param, code = validation_message(exc.errors())
        return error_response(400, message, code, param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        codes = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
        response = error_response(exc.status_code, str(exc.detail), codes.get(exc.status_code))
        for k, v in (exc.headers or {}).items():
            response.headers[k] = v
        return response

    def build_request(
        request: Request,
        body: Any,
        prompt_tokens: list[int],
        add_bos: bool,
        max_tokens: int | None,
        messages: list[dict[str, str]] | None = None,
    ) -> CompletionRequest:
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
            messages=messages,
        )
        return req

    async def generate(body: Any, req: CompletionRequest, respond: Any, chat: bool) -> Any:
        """Run ``req``: the whole answer (``respond(result)``), or a stream of chunks."""
        if not body.stream:
            return respond(await run_in_threadpool(engine.complete, req))
        return await stream_completion(
            engine.complete,
            req,
            tokenizer,
            chat=chat,
            model=body.model or engine.model_name,
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            return_token_ids=body.return_token_ids,
            usage=lambda res: {k: v.model_dump() for k, v in usage_and_stats(res).items()},
        )

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
        responses={
            200: STREAM_RESPONSE,
            503: {"model": ErrorBody, "description": "every KV page is in use"},
        },
    )
    async def completions(request: Request, body: CompletionBody) -> Any:
        if isinstance(body.prompt, str):
            tokens, add_bos = tokenizer.encode(body.prompt), True
        else:
            tokens, add_bos = list(body.prompt), False
        req = build_request(request, body, tokens, add_bos, body.max_tokens)
        return await generate(body, req, lambda res: completion_response(body, res), chat=False)

    def completion_response(body: Any, res: CompletionResult) -> CompletionResponse:
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
        responses={
            200: STREAM_RESPONSE,
            503: {"model": ErrorBody, "description": "every KV page is in use"},
        },
    )
    async def chat_completions(request: Request, body: ChatCompletionBody) -> Any:
        messages = [
            {
                "role": m.role,
                "content": m.content
                if isinstance(m.content, str)
                else "".join(p.text for p in m.content),
            }
            for m in body.messages
        ]
        max_tokens = (
            body.max_completion_tokens
            if body.max_completion_tokens is not None
            else body.max_tokens
        )
        if body.session_id is not None:
            # the engine renders the session's whole conversation plus these messages
            req = build_request(request, body, [], tokenizer.chat_adds_bos, max_tokens, messages)
        else:
            try:
                rendered = tokenizer.apply_chat_template(messages)
            except ValueError as exc:  # no template, or the template's raise_exception()
                raise BadRequestError(str(exc)) from None
            tokens = tokenizer.encode(rendered)
            req = build_request(request, body, tokens, tokenizer.chat_adds_bos, max_tokens)
        return await generate(body, req, lambda res: chat_response(body, res), chat=True)

    def chat_response(body: Any, res: CompletionResult) -> ChatCompletionResponse:
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
    components.setdefault("securitySchemes", {})[AUTH_SCHEME] = {
        "type": "http",
        "scheme": "bearer",
        "description": "an API key; it decides the tenant",
    }
    for path, item in schema.get("paths", {}).items():
        if not is_protected(path):
            continue
        for operation in item.values():
            operation["security"] = [{AUTH_SCHEME: []}]
            operation.setdefault("responses", {})["401"] = {
                "description": "missing or unknown API key",
                "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}
                },
            }
