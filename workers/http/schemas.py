"""The HTTP API's request and response bodies (what the OpenAPI document promises), with the
bounds that come from the model served.
"""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_MAX_TOKENS = 16
MAX_TEMPERATURE = 2.0  # OpenAI's bound; beyond it sampling is noise anyway
MAX_SEED = 2**53 - 1  # the largest integer JSON parsers and the spec's float bounds hold exactly
SESSION_ID_PATTERN = r"^[A-Za-z0-9_-]{1,128}$"  # ids end up in index keys: no separators
# Sized for a long text prompt; anything larger is a mistake or an attack, not a prompt.


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


class StreamOptions(_Body):
    include_usage: bool = Field(
        False, description="a last chunk (empty choices) with usage and kvcloud's stats"
    )


def request_models(max_context: int, vocab_size: int) -> tuple[type[_Body], type[_Body]]:
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
        stream: bool = Field(False, description="answer as Server-Sent Events (OpenAI chunks)")
        stream_options: StreamOptions | None = None
        n: int = Field(1, ge=1, le=1, description="only one choice is supported")

    class CompletionBody(GenerationParams):
        # a text prompt may be empty (BOS still opens it); a token prompt may not (no input)
        prompt: str | Annotated[list[TokenId], Field(min_length=1, max_length=max_context)]

    class ChatCompletionBody(GenerationParams):
        messages: list[ChatMessage] = Field(min_length=1)
        # OpenAI's newer name for max_tokens; wins when both are given
        max_completion_tokens: MaxTokens = None

    return CompletionBody, ChatCompletionBody
