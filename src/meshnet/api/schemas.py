"""OpenAI request and response shapes (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``).

Requests are validated strictly: JSON types must match exactly (``"max_tokens": "5"`` or ``true`` is an
error, an integer is accepted where a number is expected) and unknown top-level fields are refused, as
OpenAI's own API does. Fields OpenAI defines that have no meaning here (``user``, ``store``, ...) are
accepted and ignored; fields whose behaviour we do not implement (``functions``, ``echo``, ...) are accepted by
the schema only so the application can refuse them with a message naming them.

Ranges follow OpenAI: ``temperature`` 0..2, ``top_p`` (0, 1], penalties -2..2, completions ``logprobs``
0..5, chat ``top_logprobs`` 0..20, at most 4 stop sequences, ``logit_bias`` token id (a decimal string) to
a bias in [-100, 100] (checked by :func:`meshnet.api.validation.logit_bias`). ``top_k``, ``min_p``,
``repetition_penalty`` (llama-server's name ``repeat_penalty`` too) and ``ignore_eos`` are llama.cpp-style
extensions (OpenAI clients send them through ``extra_body``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from meshnet.contract import MAX_DRAFT_TOKENS
from meshnet.sampling_params import MAX_INT32, REPETITION_PENALTY_MAX, REPETITION_PENALTY_MIN

# Largest ``n`` (choices per prompt) one request may ask for; each choice is a full generation.
MAX_N = 16
# Choices one completions request may ask for in all (prompts x n), run one after another.
MAX_CHOICES = 128
MAX_STOP = 4


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # accepted, ignored (no padding field is added to chunks)


class _SamplingFields(_Strict):
    """Fields shared by both generation endpoints."""

    # NaN and infinities (Python's JSON reader takes them) are refused as not finite, rather than as
    # outside a range they are not in.
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    # ``null`` means "the default" for every optional field, as in OpenAI's API.
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)  # default 1.0
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)  # default 1.0 (off)
    top_k: int | None = Field(default=None, ge=0, le=MAX_INT32)  # default 0 (off); int32 on the wire
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)  # default 0.0 (off)
    repetition_penalty: float | None = Field(default=None, ge=REPETITION_PENALTY_MIN,
                                             le=REPETITION_PENALTY_MAX)  # default 1.0 (off)
    repeat_penalty: float | None = Field(default=None, ge=REPETITION_PENALTY_MIN,
                                         le=REPETITION_PENALTY_MAX)  # llama-server's name for the same
    # true: end-of-generation tokens (and, in chat, turn markers) do not end the answer: it runs to max_tokens
    ignore_eos: bool | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)  # default 0.0
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)  # default 0.0
    seed: int | None = Field(default=None, ge=-(1 << 63), le=(1 << 63) - 1)  # int64, as OpenAI's
    # meshnet's own: speculative decoding ("none" / "ngram" / "model": the server's --draft-model / "mtp":
    # the model's next-token-prediction layers; null: the server's --speculative) and the draft tokens per
    # verification step (null: the server's --draft-tokens, else 10)
    speculative: Literal["none", "ngram", "model", "mtp"] | None = None
    draft_tokens: int | None = Field(default=None, ge=1, le=MAX_DRAFT_TOKENS)
    stop: str | list[str] | None = None
    n: int | None = Field(default=None, ge=1, le=MAX_N)  # default 1
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None  # token id (string) -> bias in [-100, 100]
    # {"type": "text" | "json_object" | "json_schema", ...}: checked by meshnet.api.structured
    response_format: dict[str, Any] | None = None
    user: str | None = None  # accepted, ignored
    safety_identifier: str | None = None  # accepted, ignored (OpenAI's successor to user)
    prompt_cache_key: str | None = None  # accepted, ignored (prefix reuse here needs no key)
    metadata: dict[str, Any] | None = None  # accepted, ignored
    store: bool | None = None  # accepted, ignored
    service_tier: str | None = None  # accepted, ignored


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt`` is a string, a list of strings, a list of token ids or a list
    of token-id lists; every prompt gets ``n`` choices, numbered prompt-major."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool | None = None  # refused when true
    best_of: int | None = None  # refused unless 1 or equal to n
    suffix: str | None = None  # refused unless empty


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    # Extra keys (``refusal``, ``annotations``, ...) appear when clients send back an earlier reply; they
    # carry nothing the prompt needs, so they are ignored rather than refused.
    model_config = ConfigDict(strict=True, extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(min_length=1)] | None = None  # [] is refused, as OpenAI does
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # OpenAI's newer name for max_tokens
    tools: list[Any] | None = None  # checked by meshnet.api.tools
    tool_choice: Any = None  # "none", "auto", "required" or {"type": "function", "function": {"name"}}
    functions: list[Any] | None = None  # refused unless empty
    function_call: Any = None  # refused unless "none"
    parallel_tool_calls: bool | None = None  # False: one call at most (tool_choice "required")
    modalities: list[str] | None = None  # only ["text"]
    reasoning_effort: str | None = None  # accepted, ignored
    verbosity: str | None = None  # accepted, ignored
    audio: Any = None  # refused unless null: no audio output
    prediction: Any = None  # refused unless null: no predicted outputs
    web_search_options: Any = None  # refused unless null: no web search


# ---- responses ---------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens every stage took from its prefix cache instead of computing them


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> "Usage":
        """A request's usage: its prompts' tokens (each prompt once, however many choices), its choices'
        tokens, and of the prompts' tokens those every stage of the route had in its prefix cache."""
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class CompletionLogprobs(BaseModel):
    """Legacy completions log-probs, one entry per generated token; offsets index the returned text."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # {"id", "type": "function", "function": {"name", "arguments"}}


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # each with its "index" among the choice's calls


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "meshnet"
    context_length: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
