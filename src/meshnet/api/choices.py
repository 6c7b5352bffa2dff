"""A request's choices (``n`` above 1, or several completion prompts) run side by side.

Up to :func:`parallelism` choices of one request hold generation slots at once, so their decodes share
the stages' iterations: a request of ``n`` = 4 takes about the time of one choice where it took four
(llama-server likewise gives each of a request's ``n`` completions a slot of its own). Each choice's
tokens equal its run alone (a batched iteration keeps every row exact, and a seeded choice's seed is its
own), and a request leaves at least half the server's slots to other requests. A prompt longer than its
answer may be is computed once: its later choices wait for its first to end (:func:`leaders`).

:func:`whole_choices` runs them for a non-streaming answer; :func:`meshnet.api.streaming.stream_choices`
streams their pieces as they come, interleaved by choice index as OpenAI's API interleaves them.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import AsyncIterator, Awaitable, Callable

from fastapi import Request

from meshnet.api.errors import ApiError
from meshnet.api.runner import ChoiceRun, ClientGone, GenJob, Piece

# make_run(job, index, is_disconnected) -> a ChoiceRun holding the server's limiter and metrics
MakeRun = Callable[[GenJob, int, Callable[[], Awaitable[bool]]], ChoiceRun]


def parallelism(max_concurrency: int) -> int:
    """Choices of one request that hold generation slots at once: half the server's ``max_concurrency``
    slots, at least 1 (the rest wait for one of them to end)."""
    return max(1, max_concurrency // 2)


def leaders(jobs: list[GenJob]) -> list[int | None]:
    """For each job, the earlier job it waits for, or None: the first job of the same prompt, when the
    prompt holds more tokens than the job's ``max_tokens``. Such a choice then starts from the prompt's
    cells in the stages' prefix caches (kept when the first one ends) where side by side every choice
    computed the whole prompt: a 1229-token prompt, n = 4 of 32 tokens took 19 s side by side and 6.8 s
    one after another on 2 cores, while its answer takes about what one choice's prefill does."""
    first: dict[tuple[int, ...], int] = {}
    out: list[int | None] = []
    for i, job in enumerate(jobs):
        lead = first.setdefault(tuple(job.prompt_ids), i)
        out.append(lead if lead != i and len(job.prompt_ids) > job.max_tokens else None)
    return out


class Turns:
    """When each of a request's choices may run: after its leader (:func:`leaders`) ended, and while it
    holds one of :func:`parallelism` places."""

    def __init__(self, jobs: list[GenJob], max_concurrency: int) -> None:
        self.room = asyncio.Semaphore(parallelism(max_concurrency))
        self.lead = leaders(jobs)
        self.ended = [asyncio.Event() for _ in jobs]

    @asynccontextmanager
    async def turn(self, i: int) -> AsyncIterator[None]:
        """Choice ``i`` runs inside; it counts as ended when it leaves, however it leaves."""
        try:
            if self.lead[i] is not None:
                await self.ended[self.lead[i]].wait()
            async with self.room:
                yield
        finally:
            self.ended[i].set()


async def disconnected(request: Request) -> None:
    """Returns when ``request``'s client has gone away. The request's body has been read, so its next
    message is the disconnect; one reader of the messages at a time."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def client_closed() -> ApiError:
    """The 499 of a request whose client went away: nobody reads the answer (what proxies log for it)."""
    return ApiError(499, "the client closed the connection", code="client_closed")


async def whole_choices(make_run: MakeRun, jobs: list[GenJob], request: Request,
                        max_concurrency: int) -> list[tuple[list[Piece], ChoiceRun]]:
    """Every choice's pieces and its finished run, in the order of ``jobs``, each in its :class:`Turns`.
    One watcher reads the request's messages for the client's disconnect (one reader at a
    time: every run asking ``request.is_disconnected`` would read them side by side); each run is
    charged once its answer is read in full.

    Raises:
        ApiError: the first failure of a choice (the others are cancelled, their sessions released), or
            499 when the client went away before the answer was complete."""
    gone = asyncio.Event()
    turns = Turns(jobs, max_concurrency)

    async def is_gone() -> bool:
        return gone.is_set()

    async def one(i: int, job: GenJob) -> tuple[list[Piece], ChoiceRun]:
        async with turns.turn(i):
            run = make_run(job, i, is_gone)
            try:
                await run.start()
                pieces = await run.collect()
                run.charge_read()  # before the session ends with aclose: its whole answer is read
                return pieces, run
            finally:
                await run.aclose()

    async def watch() -> None:
        await disconnected(request)
        gone.set()

    tasks = [asyncio.ensure_future(one(i, job)) for i, job in enumerate(jobs)]
    watching = asyncio.ensure_future(watch())
    pending: set[asyncio.Future] = {*tasks, watching}
    try:
        while pending != {watching}:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if watching in done:
                raise client_closed()
            for task in done:
                if isinstance(task.exception(), ClientGone):
                    raise client_closed() from None
                if task.exception() is not None:
                    raise task.exception()
        return [task.result() for task in tasks]
    finally:
        for task in (*tasks, watching):
            if not task.done():
                task.cancel()
        await asyncio.gather(*tasks, watching, return_exceptions=True)
