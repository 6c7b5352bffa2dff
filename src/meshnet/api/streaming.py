"""A streamed answer (``"stream": true``): its first choice started before the response, then server-sent
events of its choices as they come (side by side: :mod:`meshnet.api.choices`).

The response starts with the first choice's first token: until then the request can still get its own
status (503 ``server_busy`` with Retry-After when no generation slot or no room on the stages freed in
time, which clients retry; 499 when the client went away), where a 200 whose stream holds only an error
event could not be told from an answer. Once the stream has started, a failing choice ends it with an
error event, as OpenAI's API does, and the request is counted under that error's status (see
:class:`~meshnet.api.middleware.BodyLimitAndMetrics`).
"""

from __future__ import annotations

import asyncio
import logging
from functools import partial
from typing import AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import Response

from meshnet.api.choices import Turns, client_closed, disconnected, parallelism
from meshnet.api.errors import ApiError, internal_error
from meshnet.api.middleware import stream_failed
from meshnet.api.runner import ChoiceRun, ClientGone, GenJob, Piece
from meshnet.api.schemas import Usage
from meshnet.api import sse as sse_events
from meshnet.api.sse import DONE, event, sse

log = logging.getLogger("meshnet.api")

# new_run(job, t_request, observe_ttft) -> a ChoiceRun holding the server's limiter and metrics
NewRun = Callable[[GenJob, float, bool], ChoiceRun]


async def stream_choices(new_run: NewRun, jobs: list[GenJob], t0: float, prompt_tokens: int, include_usage: bool,
                         on_start: Callable[[int], list[str]], on_piece: Callable[[int, Piece], list[str]],
                         usage_event: Callable[[Usage], str], request: Request, done: str | None = DONE,
                         error_event: Callable[[ApiError], str] | None = None) -> Response:
    """The response of a streamed request: events of each choice's generation (``on_start`` once
    its first piece is ready, ``on_piece`` per piece of text), an error event that ends the stream if a
    choice fails (``error_event(error)``; by default chat's ``{"error": ...}``), the usage event when asked
    for, then ``done`` (``[DONE]``; None: nothing, as the Responses API's streams end). ``t0``: when the
    request arrived (``time.perf_counter()``), for TTFT.

    Raises:
        ApiError: the first choice could not start, or the client went away meanwhile (499)."""
    first = new_run(jobs[0], t0, True)
    try:
        piece = await unless_gone(request, first.start, first.next_piece)
    except BaseException as e:
        await first.aclose()
        if isinstance(e, ClientGone):
            raise client_closed() from None
        raise
    # The first run is closed with the response even if its body never starts (a client gone at once).
    return sse(_events(new_run, jobs, first, piece, t0, prompt_tokens, include_usage, on_start, on_piece,
                       usage_event, partial(stream_failed, request.scope), done, error_event or _error_event),
               on_close=first.aclose)


def _error_event(e: ApiError) -> str:
    """Chat's and completions' error event: the error's body, as OpenAI's API ends such a stream."""
    return event(e.body())


async def unless_gone(request: Request, start: Callable[[], Awaitable[None]],
                       first: Callable[[], Awaitable[Piece | None]]) -> Piece | None:
    """``await start()`` then ``first()``, unless the client goes away meanwhile: then both are cancelled
    and ClientGone raised. The response, once it starts, watches for the disconnect itself (one reader of
    the request's messages at a time)."""
    async def opened() -> Piece | None:
        await start()
        return await first()

    opening, watching = asyncio.ensure_future(opened()), asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({opening, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (watching, opening):
            if not task.done():
                task.cancel()
        await asyncio.gather(watching, opening, return_exceptions=True)
    if opening.cancelled():
        raise ClientGone()
    return opening.result()


async def _keeping_alive(waited: Awaitable, out: list) -> AsyncIterator[str]:
    """Await ``waited``, yielding a keep-alive comment after each ``KEEPALIVE_S`` seconds it takes (a
    failover replaying the session held a stream silent for seconds, past httpx's 5 s read timeout); its
    result is appended to ``out``, what it raises raised. Cancelled with the stream, it cancels ``waited``."""
    task = asyncio.ensure_future(waited)
    try:
        while not (await asyncio.wait({task}, timeout=sse_events.KEEPALIVE_S))[0]:
            yield sse_events.KEEPALIVE
        out.append(task.result())
    finally:
        if not task.done():
            task.cancel()


async def _events(new_run: NewRun, jobs: list[GenJob], first: ChoiceRun, first_piece: Piece | None, t0: float,
                  prompt_tokens: int, include_usage: bool, on_start: Callable[[int], list[str]],
                  on_piece: Callable[[int, Piece], list[str]],
                  usage_event: Callable[[Usage], str], failed: Callable[[ApiError], None],
                  done: str | None, error_event: Callable[[ApiError], str]) -> AsyncIterator[str]:
    """The events of :func:`stream_choices`, its first choice started already (``first``, whose first
    piece is ``first_piece``); ``failed(error)`` is told the error that ends the stream.

    The choices run side by side (each in its :class:`~meshnet.api.choices.Turns`), each in a task
    that puts its pieces in one queue; its bound holds the runs back when the client reads slowly, as
    a single run is held :data:`~meshnet.api.driver.RUN_AHEAD` tokens ahead of its reader."""
    turns = Turns(jobs, first.backend.max_concurrency)
    pieces: asyncio.Queue = asyncio.Queue(maxsize=2 * parallelism(first.backend.max_concurrency))

    async def choice(i: int) -> None:  # puts (i, "start" | "piece" | "end" | "error", value)
        run = None
        try:
            async with turns.turn(i):
                run = first if i == 0 else new_run(jobs[i], t0, False)
                piece = first_piece
                if i > 0:
                    await run.start()
                    piece = await run.next_piece()
                await pieces.put((i, "start", None))
                while piece is not None:
                    await pieces.put((i, "piece", piece))
                    piece = await run.next_piece()
                await pieces.put((i, "end", (run.completion_tokens, run.cached_tokens)))
        except Exception as e:  # noqa: BLE001 - the reader ends the stream with it
            await pieces.put((i, "error", e))
        finally:
            if run is not None:
                await run.aclose()

    tasks = [asyncio.ensure_future(choice(i)) for i in range(len(jobs))]
    completion_tokens, cached_tokens, ended, i = 0, 0, 0, 0
    try:
        while ended < len(jobs):
            got: list = []
            async for ev in _keeping_alive(pieces.get(), got):
                yield ev
            i, kind, value = got.pop()
            if kind == "error":
                raise value
            events = on_start(i) if kind == "start" else on_piece(i, value) if kind == "piece" else []
            for ev in events:
                yield ev
            if kind == "end":
                completion_tokens += value[0]
                cached_tokens += value[1]
                ended += 1
    except Exception as e:  # noqa: BLE001 - an ApiError, or a bug: an error event ends the stream either way
        if not isinstance(e, ApiError):  # a bug cut the stream mid-body, without an end a client could read
            log.error("streamed choice %d failed", i, exc_info=e)
            e = internal_error(e)
        first.metrics.errors.labels(kind=e.code or str(e.status)).inc()
        failed(e)
        yield error_event(e)
        return
    finally:  # the stream ended, failed, or its client went away: the other choices stop
        for task in tasks:
            if not task.done():
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if include_usage:
        yield usage_event(Usage.of(prompt_tokens, completion_tokens, cached_tokens))
    if done is not None:
        yield done
