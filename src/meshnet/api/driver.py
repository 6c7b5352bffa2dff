"""Runs one generation ahead of the API's event loop and hands it the token events.

The generation (:meth:`meshnet.generation.Generation.steps`) advances wherever its last step finished: a
decode of an in-process chain starts from the completion callback of the step before it, on the stage's
scheduler thread, as ``llama-server`` starts its next decode from its own loop; steps that block (the
first prefill, a mesh's steps, a step with a grammar) run on the driver's thread.
"""

from __future__ import annotations

import asyncio
import queue
import threading

from meshnet.contract import StepResult
from meshnet.generation import Generation, TokenEvent

# Token events a generation runs ahead of its reader: enough to hide a hand-off, few enough that a stop
# the reader finds (a stop sequence, a turn marker) wastes at most this many steps.
RUN_AHEAD = 2


class GenerationDriver:
    """Runs a Generation (:meth:`Generation.steps`) ahead of the event loop and hands each token event to
    it: the next step is already running while the loop streams this token.

    A step the client starts without blocking (``step_async``: the decodes of an in-process chain) is
    started by whoever advanced the generation to it, and its completion callback, on the stage's
    scheduler thread, advances the generation to the step after it: no thread hand-off between one
    token's iteration and the next step's. Any other step (the first prefill, a step over a mesh, a step
    with a grammar) blocks on the driver's own thread. One party at a time advances the generation:
    the thread that ran its last step, or that step's callback, or the driver's thread when the reader
    lets a generation that ran :data:`RUN_AHEAD` events ahead go on. :meth:`close` (cancel, then the
    generation's ``finally`` releases the session) waits until it ended, and happens once."""

    def __init__(self, gen: Generation, client, loop: asyncio.AbstractEventLoop) -> None:
        self.gen, self.client, self._loop = gen, client, loop
        self._core = gen.steps()
        self._events: asyncio.Queue = asyncio.Queue()
        # A draft model's decodes run inside the generation: keep them off the stages' scheduler threads.
        spec = gen.speculation
        self._start = None if spec is not None and spec.drafter is not None else getattr(client, "step_async", None)
        self._lock = threading.Lock()
        self._ahead = 0  # events handed to the loop and not read yet
        self._parked = False  # the generation waits for the reader: nobody advances it
        self._stop = False
        self._done = threading.Event()
        self.finished = False
        self._work: queue.SimpleQueue = queue.SimpleQueue()  # ("call", StepCall) | ("resume", None) | None
        self._thread = threading.Thread(target=self._serve, name="meshnet-api-generation", daemon=True)
        self._thread.start()
        self._work.put(("resume", None))

    def _put(self, item: tuple) -> None:
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody reads the events any more
            pass

    def _serve(self) -> None:
        """The driver's thread: runs the steps that block, and resumes a generation the reader let go on."""
        while (work := self._work.get()) is not None:
            kind, call = work
            if kind == "resume":
                self._advance(None)
                continue
            try:
                res = self.client.step(call.req, call.decode)
            except BaseException as e:  # noqa: BLE001 - raised inside the generation
                self._advance(e)
            else:
                self._advance(res)

    def _advance(self, value: StepResult | BaseException | None) -> None:
        """Send ``value`` (a step's result, the exception it raised, or None) into the generation and run
        it until it waits for a step started elsewhere, waits for the reader, or ends."""
        core = self._core
        while True:
            try:
                if self._stop:
                    core.close()  # GeneratorExit -> the generation's finally releases the session
                    raise StopIteration
                item = core.throw(value) if isinstance(value, BaseException) else core.send(value)
            except StopIteration:
                self._end(("end", None))
                return
            except BaseException as e:  # noqa: BLE001 - handed to the reader, raised there
                self._end(("error", e))
                return
            value = None
            if isinstance(item, TokenEvent):
                self._put(("event", item))
                with self._lock:
                    self._ahead += 1
                    if self._ahead >= RUN_AHEAD and not self._stop:
                        self._parked = True
                        return
                continue
            if self._stop:
                continue
            if self._start is not None:
                try:
                    if self._start(item.req, item.decode, self._advance):
                        return  # the callback goes on (it may have already)
                except BaseException as e:  # noqa: BLE001 - raised inside the generation
                    value = e
                    continue
            if threading.current_thread() is not self._thread:
                self._work.put(("call", item))  # never block a stage's scheduler thread
                return
            try:
                value = self.client.step(item.req, item.decode)
            except BaseException as e:  # noqa: BLE001 - raised inside the generation
                value = e

    def _end(self, item: tuple) -> None:
        self._put(item)
        self._done.set()
        self._work.put(None)

    async def next_event(self) -> TokenEvent | None:
        """The next token event; None when the generation has ended. Raises what the generation raised."""
        if self.finished:
            return None
        kind, value = await self._events.get()
        if kind == "event":
            with self._lock:
                self._ahead -= 1
                resume = self._parked and self._ahead < RUN_AHEAD
                self._parked = self._parked and not resume
            if resume:
                self._work.put(("resume", None))
            return value
        self.finished = True  # the generation is done and has released the session
        if kind == "error":
            raise value
        return None

    def close(self) -> None:
        """Stop the generation unless it ended (blocking: call it off the event loop)."""
        if not self.finished and not self._done.is_set():
            with self._lock:
                self._stop = True
                resume, self._parked = self._parked, False
            if resume:
                self._work.put(("resume", None))
            # Cancel first: a step still running on a stage stops at its next micro-batch.
            self.client.cancel(self.gen.session_id)
        self._done.wait()
        self.finished = True
