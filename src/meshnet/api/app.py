"""The OpenAI-compatible HTTP API in front of a mesh: ``create_app(backend)`` returns a FastAPI app.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (each streaming
as server-sent events ``data: {...}`` ... ``data: [DONE]``, or not), ``GET /health`` and ``GET /metrics``.

Every request is checked completely (JSON, types, ranges, prompt length against the context) before
any step runs, so a refused request never allocates a session on a node. Client errors answer 400 (413 for
a body over the limit) in OpenAI's error shape, a missing or failing mesh 503 with ``Retry-After``.

Generations run in worker threads one token per call, so the event loop keeps serving; at most
``backend.max_concurrency`` hold a mesh session at once and the rest wait. A client that goes away
mid-answer has its session cancelled and released on every node.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from meshnet.api.backend import ApiBackend
from meshnet.api.choices import whole_choices
from meshnet.api.errors import ApiError, bad_request, internal_error, model_not_found, no_such_endpoint
from meshnet.api.metrics import ApiMetrics
from meshnet.api.middleware import AUTHORIZED, ApiKeyOnly, BodyLimitAndMetrics, SameOriginOnly, log_failure
from meshnet.api.prompts import chat_prompt, completion_prompts
from meshnet.api.responses import create_response
from meshnet.api.runner import ChoiceRun, GenJob, Piece, queue_full
from meshnet.api.schemas import (
    MAX_CHOICES,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    Usage,
)
from meshnet.api.sse import ChatChunks, CompletionChunks
from meshnet.api.streaming import stream_choices
from meshnet.api.structured import response_grammar, tools_grammar
from meshnet.api.tool_stream import ChatEvents, finish_reason, whole_answer
from meshnet.api.tools import ToolPlan, plan_tools, repeats_a_call
from meshnet.api.logprobs import chat_logprobs, completion_logprobs
from meshnet.api.validation import (answer_stops, parse_body, sampling_params, stop_sequences, token_budget,
                                    validation_error)
from meshnet.sampling_params import Grammar
from meshnet.speculative import Speculation, speculation_from

log = logging.getLogger("meshnet.api")

# Largest request body accepted, bytes (2 MiB: far more than any context this runtime serves).
MAX_BODY_BYTES = 2 * 1024 * 1024
# Generations that may wait for a slot before new requests are turned away with 503.
MAX_QUEUED = 256
# Tokens a /v1/completions request without max_tokens generates at most: OpenAI's documented default (a
# chat's is what the context holds). Up to the context, a forgotten max_tokens held a slot for minutes.
COMPLETION_MAX_TOKENS = 16


def create_app(backend: ApiBackend, max_body_bytes: int = MAX_BODY_BYTES, max_queued: int = MAX_QUEUED,
               api_key: str | None = None) -> FastAPI:
    """Build the API app over ``backend``.

    Args:
        backend: the mesh access (clients, tokenizer, model name, context length, route check).
        max_body_bytes: larger request bodies are answered 413 (checked on Content-Length and on the
            bytes actually received).
        max_queued: generations allowed to wait for a free slot; beyond that requests get 503.
        api_key: when given, every request but ``/health`` must carry ``Authorization: Bearer api_key``
            (401 otherwise, see :class:`~meshnet.api.middleware.ApiKeyOnly`).
    """
    app = FastAPI(title="meshnet", description="OpenAI-compatible API over a meshnet mesh",
                  version="1", docs_url=None, redoc_url=None, openapi_url=None,
                  redirect_slashes=False)  # a trailing slash is a 404 in the API's shape, as OpenAI answers it
    line = getattr(backend, "admission", None)
    metrics = ApiMetrics(getattr(backend, "stage_metrics", None), line.waiting if line is not None else None,
                         getattr(backend, "mesh_figures", None))
    api = _Api(backend, metrics, max_queued)
    app.state.api = api
    app.state.metrics = metrics
    if api_key:
        app.add_middleware(ApiKeyOnly, api_key=api_key)
    app.add_middleware(SameOriginOnly)
    app.add_middleware(BodyLimitAndMetrics, metrics=metrics, max_body_bytes=max_body_bytes)  # the outer one

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        metrics.errors.labels(kind=exc.code or str(exc.status)).inc()
        log_failure(request.scope, exc)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        # FastAPI answers 422 by default; OpenAI answers 400 for every malformed request.
        err = validation_error(exc.errors())
        metrics.errors.labels(kind=err.code or "400").inc()
        return err.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        err = ApiError(exc.status_code, message)
        if exc.status_code == 404:
            err = no_such_endpoint(request.method, request.url.path)
        elif exc.status_code == 405:
            err = ApiError(405, f"method {request.method} is not allowed on {request.url.path}")
        metrics.errors.labels(kind=str(exc.status_code)).inc()
        return err.response()

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> Response:
        # What fails inside a request is answered by BodyLimitAndMetrics; this covers the middleware itself.
        log.exception("internal error on %s", request.url.path)
        metrics.errors.labels(kind="internal_error").inc()
        return internal_error(exc).response()

    @app.api_route("/v1/models", methods=["GET", "HEAD"])  # HEAD: what a load balancer probes with
    async def list_models() -> Response:
        return JSONResponse(ModelList(data=[api.model_card()]).model_dump())

    @app.get("/v1/models/{model_id}")
    async def get_model(model_id: str) -> Response:
        if model_id != backend.model_name:
            raise model_not_found(model_id, backend.model_name)
        return JSONResponse(api.model_card().model_dump())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await api.completions(request)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await create_response(api, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await api.chat_completions(request)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health(request: Request) -> Response:
        """The mesh's state; with ``--api-key``, only ``status`` to callers without the key (a load
        balancer's probe): the route names the mesh's nodes and their addresses."""
        from meshnet.client.mesh_client import MeshUnavailable

        detailed = request.scope.get(AUTHORIZED, True)
        body: dict[str, Any] = {"model": backend.model_name, "active_sessions": metrics.n_active,
                                "max_concurrency": backend.max_concurrency}
        try:
            hops = await anyio.to_thread.run_sync(backend.check_health)
        except MeshUnavailable as e:
            body.update(status="unavailable", route=None, error=str(e))
            return JSONResponse(body if detailed else {"status": "unavailable"}, status_code=503,
                                headers={"Retry-After": str(backend.retry_after_s)})
        body.update(status="ok", route=hops, n_ctx=backend.n_ctx)
        return JSONResponse(body if detailed else {"status": "ok"})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    return app


# ---- request handling ----------------------------------------------------------------------------


class _Api:
    def __init__(self, backend: ApiBackend, metrics: ApiMetrics, max_queued: int) -> None:
        self.backend, self.metrics, self.max_queued = backend, metrics, max_queued
        self.limiter = asyncio.Semaphore(backend.max_concurrency)
        self.created = int(time.time())

    def model_card(self) -> ModelCard:
        try:
            n_ctx = self.backend.n_ctx
        except Exception:  # the context of a mesh without a route is unknown
            n_ctx = None
        return ModelCard(id=self.backend.model_name, created=self.created, context_length=n_ctx)

    # ---- shared checks ----
    def _common_checks(self, req) -> None:
        if req.model is not None and req.model != self.backend.model_name:  # 404, as OpenAI answers it
            raise model_not_found(req.model, self.backend.model_name)
        stop_sequences(req.stop)  # refuses too many
        if req.stream_options is not None and not req.stream:  # as OpenAI answers it
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")

    async def _grammar(self, req) -> Grammar | None:
        """The grammar the request's ``response_format`` asks for (compiled off the event loop: a new
        schema takes milliseconds); 400 for a bad one, or one combined with ``ignore_eos`` (the grammar
        ends the answer with an end-of-generation token once the document is complete)."""
        grammar = None
        if req.response_format is not None:  # {} is refused (no type), not taken for text
            grammar = await anyio.to_thread.run_sync(
                lambda: response_grammar(req.response_format, self.backend.grammars))
        if grammar is not None and req.ignore_eos:
            raise bad_request("ignore_eos cannot be combined with a JSON response_format: the answer ends "
                              "when the JSON document is complete", "ignore_eos")
        return grammar

    async def tools_grammar(self, plan: ToolPlan, grammar: Grammar | None) -> Grammar | None:
        """:func:`~meshnet.api.structured.tools_grammar` off the event loop (a new schema takes milliseconds)."""
        return await anyio.to_thread.run_sync(tools_grammar, plan, grammar, self.backend.grammars) if plan.parts \
            else grammar

    def _speculation(self, req) -> Speculation | None:
        """How the request's generations draft: its ``speculative`` / ``draft_tokens``, else the server's."""
        try:
            return speculation_from(req.speculative, req.draft_tokens, self.backend.speculation,
                                    mtp_problem=self.backend.mtp_problem)
        except ValueError as e:
            raise bad_request(str(e), "speculative") from None

    async def _check_route(self) -> None:
        from meshnet.client.mesh_client import MeshUnavailable

        try:
            await anyio.to_thread.run_sync(self.backend.check_route)
        except MeshUnavailable as e:
            raise ApiError(503, f"no complete route through the mesh: {e}", code="mesh_unavailable",
                           retry_after_s=self.backend.retry_after_s) from None
        if self.metrics.n_queued >= self.max_queued:  # early, before the prompt's work (exact: ChoiceRun.start)
            raise queue_full(self.max_queued, self.backend.retry_after_s)

    # ---- completions ----
    async def completions(self, request: Request) -> Response:
        t0 = time.perf_counter()
        req = parse_body(CompletionRequest, await request.body())
        self._common_checks(req)
        if req.echo:
            raise bad_request("echo is not supported", "echo", "unsupported_parameter")
        if req.best_of is not None and req.best_of < (req.n or 1):
            raise bad_request(f"best_of must be at least n ({req.n or 1}), got {req.best_of}", "best_of")
        if req.best_of not in (None, req.n or 1):
            raise bad_request("best_of is not supported (only best_of == n)", "best_of", "unsupported_parameter")
        if req.suffix:
            raise bad_request("suffix is not supported", "suffix", "unsupported_parameter")
        prompts = await anyio.to_thread.run_sync(completion_prompts, self.backend.tokenizer, req.prompt,
                                                 self.backend.n_ctx)
        if len(prompts) * (req.n or 1) > MAX_CHOICES:  # every choice is a generation of its own
            raise bad_request(f"{len(prompts)} prompts x n {req.n or 1} ask for {len(prompts) * (req.n or 1)} "
                              f"choices, more than the {MAX_CHOICES} one request may", "prompt", "too_many_choices")
        grammar = await self._grammar(req)
        stops = answer_stops(req.stop, grammar)
        n_top = req.logprobs or 0
        want_logprobs = req.logprobs is not None
        jobs = []
        for p_ids in prompts:
            budget = token_budget(self.backend.n_ctx, p_ids, COMPLETION_MAX_TOKENS if req.max_tokens is None
                                  else req.max_tokens, "prompt")
            for choice in range(req.n or 1):
                sp = sampling_params(req, self.backend.tokenizer.n_vocab, n_top, len(jobs), grammar,
                                     logprobs=want_logprobs)
                jobs.append(GenJob(p_ids, budget, sp, stops,
                                   speculation=self._speculation(req), ignore_eos=bool(req.ignore_eos),
                                   counts_prompt=choice == 0))
        await self._check_route()
        prompt_tokens = sum(len(p) for p in prompts)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return await self._stream_completion(jobs, rid, created, prompt_tokens, want_logprobs, include_usage, t0,
                                                 request)
        choices, completion_tokens, cached_tokens = [], 0, 0
        for i, (pieces, run) in enumerate(await self.whole_choices(jobs, request, t0)):
            completion_tokens += run.completion_tokens
            cached_tokens += run.cached_tokens
            text = "".join(p.text for p in pieces)
            choices.append(CompletionChoice(index=i, text=text, finish_reason=run.finish_reason,
                                            logprobs=completion_logprobs(self.backend.tokenizer, pieces) if want_logprobs else None))
        usage = Usage.of(prompt_tokens, completion_tokens, cached_tokens)
        body = CompletionResponse(id=rid, created=created, model=self.backend.model_name, choices=choices,
                                  usage=usage)
        return JSONResponse(body.model_dump())

    async def _stream_completion(self, jobs: list[GenJob], rid: str, created: int, prompt_tokens: int,
                                 want_logprobs: bool, include_usage: bool, t0: float, request: Request) -> Response:
        chunks = CompletionChunks(rid, created, self.backend.model_name)

        def on_piece(i: int, piece: Piece) -> list[str]:
            lp = completion_logprobs(self.backend.tokenizer, [piece]) if want_logprobs and piece.tokens else None
            return [chunks.text(i, piece.text, lp, piece.finish_reason)]

        return await stream_choices(self._runs, jobs, t0, prompt_tokens, include_usage, lambda i: [], on_piece,
                                    chunks.usage, request)

    def _runs(self, job: GenJob, t0: float, first: bool, is_disconnected=None) -> ChoiceRun:
        """A choice's run, streamed (see :mod:`meshnet.api.streaming`) or whole (``is_disconnected`` given);
        ``first``: the request's first choice, whose TTFT is observed, to which the queue's bound applies (a
        later one, refused, would lose those before) and whose wait for a slot is bounded."""
        return ChoiceRun(self.backend, job, self.limiter, self.metrics, t0, is_disconnected, observe_ttft=first,
                         max_queued=self.max_queued if first else None, wait_bound=first)

    # ---- chat ----
    async def chat_completions(self, request: Request) -> Response:
        t0 = time.perf_counter()
        req = parse_body(ChatCompletionRequest, await request.body())
        if req.max_tokens is not None and req.max_completion_tokens is not None \
                and req.max_tokens != req.max_completion_tokens:
            raise bad_request("max_tokens and max_completion_tokens differ; give one", "max_tokens")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        self._common_checks(req)
        if req.functions or req.function_call not in (None, "none"):
            raise bad_request("functions and function_call are not supported; use tools", "functions",
                              "unsupported_parameter")
        plan = plan_tools(req.tools, req.tool_choice, parallel=req.parallel_tool_calls is not False)
        if plan.schema is not None and req.response_format and req.response_format.get("type") != "text":
            raise bad_request("response_format cannot be combined with a required or named tool_choice (both "
                              "constrain the answer)", "response_format")
        if plan.schema is not None and req.ignore_eos:
            raise bad_request("ignore_eos cannot be combined with a required or named tool_choice: the answer "
                              "ends when the tool call is complete", "ignore_eos")
        if req.modalities and req.modalities != ["text"]:
            raise bad_request("only the text modality is supported", "modalities", "unsupported_parameter")
        if req.audio is not None:
            raise bad_request("audio output is not supported", "audio", "unsupported_parameter")
        if req.prediction is not None:
            raise bad_request("predicted outputs (prediction) are not supported", "prediction", "unsupported_parameter")
        if req.web_search_options is not None:
            raise bad_request("web search is not supported", "web_search_options", "unsupported_parameter")
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        if not req.messages:
            raise bad_request("messages is empty: a chat needs at least one message", "messages", "empty_messages")
        prompt_ids = await anyio.to_thread.run_sync(chat_prompt, self.backend.tokenizer, req, plan,
                                                 self.backend.n_ctx)
        grammar = await self.tools_grammar(plan, await self._grammar(req))
        budget = token_budget(self.backend.n_ctx, prompt_ids, max_tokens, "messages")
        n_top = req.top_logprobs or 0
        want_logprobs = bool(req.logprobs)
        stops = answer_stops(req.stop, grammar)
        ignore_eos = bool(req.ignore_eos)
        jobs = [GenJob(prompt_ids, budget, sampling_params(req, self.backend.tokenizer.n_vocab, n_top, i, grammar,
                                                           logprobs=want_logprobs), stops,
                       stop_at_control=not ignore_eos, speculation=self._speculation(req), ignore_eos=ignore_eos,
                       counts_prompt=i == 0, ends_early=repeats_a_call if plan.mode == "required" else None)
                for i in range(req.n or 1)]
        await self._check_route()
        prompt_tokens = len(prompt_ids)  # counted once, however many choices, as OpenAI does
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return await self._stream_chat(jobs, rid, created, prompt_tokens, want_logprobs, include_usage, t0,
                                           request, plan)
        choices, completion_tokens, cached_tokens = [], 0, 0
        for i, (pieces, run) in enumerate(await self.whole_choices(jobs, request, t0)):
            completion_tokens += run.completion_tokens
            cached_tokens += run.cached_tokens
            text = "".join(p.text for p in pieces)
            content, calls = whole_answer(plan, text, run.finish_reason)
            message = ChatResponseMessage(content=content, tool_calls=calls)
            choices.append(ChatChoice(index=i, message=message,
                                      finish_reason=finish_reason(run.finish_reason, calls),
                                      logprobs=chat_logprobs(self.backend.tokenizer, pieces) if want_logprobs else None))
        usage = Usage.of(prompt_tokens, completion_tokens, cached_tokens)
        body = ChatCompletionResponse(id=rid, created=created, model=self.backend.model_name, choices=choices,
                                      usage=usage)
        return JSONResponse(body.model_dump())

    async def _stream_chat(self, jobs: list[GenJob], rid: str, created: int, prompt_tokens: int,
                           want_logprobs: bool, include_usage: bool, t0: float, request: Request,
                           plan: ToolPlan) -> Response:
        chunks = ChatChunks(rid, created, self.backend.model_name)
        events = ChatEvents(chunks, plan, len(jobs),
                            (lambda pieces: chat_logprobs(self.backend.tokenizer, pieces)) if want_logprobs else None)

        return await stream_choices(self._runs, jobs, t0, prompt_tokens, include_usage,
                                    events.start, events.piece, chunks.usage, request)

    # ---- non-streaming driver ----
    async def whole_choices(self, jobs: list[GenJob], request: Request,
                            t0: float) -> list[tuple[list[Piece], ChoiceRun]]:
        """Every job's pieces and finished run, side by side (:func:`~meshnet.api.choices.whole_choices`),
        each run made by :meth:`_runs`."""
        return await whole_choices(lambda job, i, is_disconnected: self._runs(job, t0, i == 0, is_disconnected),
                                   jobs, request, self.backend.max_concurrency)
