"""Drive one step through a chain of stages in this process: head -> ... -> tail.

This is the in-process data path: the hidden states of stage i become the input of stage i+1. The gRPC
mesh moves the same :class:`~meshnet.contract.StepRequest` objects between processes instead.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Callable, Protocol, Sequence

from meshnet.contract import Outcome, StepRequest, StepResult


class Stage(Protocol):
    """Anything that serves one layer range under the engine contract (an engine or a remote stub)."""

    def prefill(self, req: StepRequest) -> StepResult: ...

    def decode(self, req: StepRequest) -> StepResult: ...

    def cancel(self, session_id: str) -> Outcome: ...

    def release(self, session_id: str) -> Outcome: ...


def run_step(stages: Sequence[Stage], req: StepRequest, decode: bool,
             upstream_reused: int | None = None) -> tuple[StepResult, int]:
    """Run ``req`` through ``stages`` in order; return the tail's result and the index of the stage
    that produced it (``len(stages) - 1`` on success, the failing stage's index otherwise). The result's
    ``reused`` is the least of the stages' (and of ``upstream_reused``, stages run before these).

    ``req.hidden`` must be None (the first stage is the head). A non-OK result stops the chain.
    """
    result = StepResult(status=None)  # type: ignore[arg-type]
    cur = req
    for i, stage in enumerate(stages):
        result = stage.decode(cur) if decode else stage.prefill(cur)
        if not result.ok:
            return result, i
        if upstream_reused is not None:
            result = result.reused_after(upstream_reused)
        upstream_reused = result.reused
        if i + 1 < len(stages):
            cur = replace(req, hidden=result.hidden)
    return result, len(stages) - 1


def release_all(stages: Sequence[Stage], session_id: str) -> None:
    """Release the session on every stage (idempotent)."""
    for stage in stages:
        stage.release(session_id)


class LocalChain:
    """An in-process mesh: a fixed route of stages in this process (tests, ``generate`` without a
    tracker, benchmarks). Implements the same client-side interface the gRPC mesh client does."""

    def __init__(self, stages: Sequence[Stage]) -> None:
        if not stages:
            raise ValueError("a chain needs at least one stage")
        self.stages = list(stages)

    def step(self, req: StepRequest, decode: bool) -> StepResult:
        """One prefill or decode step through every stage; the tail's result."""
        return run_step(self.stages, req, decode)[0]

    def step_async(self, req: StepRequest, decode: bool,
                   on_done: Callable[[StepResult | BaseException], None]) -> bool:
        """Start one step through every stage without blocking: each stage's completion callback (on
        that stage's scheduler thread) starts the next stage, and the tail's result, a failing stage's
        result, or the exception a stage raised reaches ``on_done`` once. Returns False, having started
        nothing, when a stage cannot start steps this way (a remote stub; a step with a grammar; the
        first stage would have to wait, see :meth:`ShardEngine.step_async`); the caller then runs
        :meth:`step`. A later stage that would have to wait runs the rest of the route on a thread of
        its own."""
        starts = [getattr(stage, "step_async", None) for stage in self.stages]
        if any(start is None for start in starts) or req.sampling.grammar is not None:
            return False  # (the tail follows a grammar on the thread that calls it)

        def after(i: int, upstream_reused: int | None) -> Callable[[StepResult | BaseException], None]:
            def done(res: StepResult | BaseException) -> None:
                if not isinstance(res, BaseException) and res.ok and upstream_reused is not None:
                    res = res.reused_after(upstream_reused)  # as run_step counts it
                if isinstance(res, BaseException) or not res.ok or i + 1 == len(self.stages):
                    on_done(res)
                    return
                nxt = replace(req, hidden=res.hidden)
                try:
                    if starts[i + 1](nxt, decode, after(i + 1, res.reused)):
                        return
                except BaseException as e:  # noqa: BLE001 - the step's outcome, handed to its caller
                    on_done(e)
                    return
                threading.Thread(target=self._finish_step, args=(i + 1, nxt, decode, on_done, res.reused),
                                 name="meshnet-chain-step", daemon=True).start()
            return done

        return starts[0](req, decode, after(0, None))

    def _finish_step(self, first: int, req: StepRequest, decode: bool,
                     on_done: Callable[[StepResult | BaseException], None], upstream_reused: int) -> None:
        try:
            res = run_step(self.stages[first:], req, decode, upstream_reused)[0]
        except BaseException as e:  # noqa: BLE001 - the step's outcome, handed to its caller
            on_done(e)
            return
        on_done(res)

    def cancel(self, session_id: str) -> None:
        for stage in self.stages:
            stage.cancel(session_id)

    def release(self, session_id: str) -> None:
        release_all(self.stages, session_id)
