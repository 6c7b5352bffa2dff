"""The API's generation driver over an in-process chain: decode steps start from the completion callback of
the step before them (on a stage's scheduler thread, no driver thread between tokens), with the same tokens
as the blocking loop; a reader that stops reading holds the generation :data:`RUN_AHEAD` events ahead;
closing it mid-run, or a stage failing, ends it with the session released on every stage. Also the chain's
own ``step_async``: the tail's result through every stage, and the cases that start nothing."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from meshnet.api.backend import AdmissionRetry
from meshnet.api.driver import RUN_AHEAD, GenerationDriver
from meshnet.chain import LocalChain
from meshnet.contract import GREEDY, LayerRange, SamplingParams, Status, StepRequest
from meshnet.engine.fake_faults import FakeCrash, FakeFaults
from meshnet.generation import Generation, GenerationError, generate
from meshnet.sampling_params import Grammar
from test_step_async import Outcome, _engine

PROMPT = [11, 22, 33, 44, 55]
RANGES = (LayerRange(0, 10), LayerRange(10, 20), LayerRange(20, 30))


def _chain(faults: FakeFaults | None = None) -> LocalChain:
    return LocalChain([_engine(r, faults) for r in RANGES])


class Counting:
    """The chain, counting the steps run blocking and those started without a thread, and the threads
    that started them."""

    def __init__(self, chain: LocalChain) -> None:
        self.chain = chain
        self.blocking, self.started, self.threads = 0, 0, []

    def step(self, req, decode):
        self.blocking += 1
        return self.chain.step(req, decode)

    def step_async(self, req, decode, on_done) -> bool:
        self.threads.append(threading.current_thread().name)
        ok = self.chain.step_async(req, decode, on_done)
        self.started += ok
        return ok

    def cancel(self, session_id):
        self.chain.cancel(session_id)

    def release(self, session_id):
        self.chain.release(session_id)


def _sessions(chain: LocalChain) -> int:
    return sum(e.health().active_sessions for e in chain.stages)


def _wait_released(chain: LocalChain, timeout_s: float = 10.0) -> int:
    deadline = time.monotonic() + timeout_s
    while _sessions(chain) and time.monotonic() < deadline:
        time.sleep(0.01)
    return _sessions(chain)


async def _read_all(gen: Generation, client) -> list[int]:
    driver = GenerationDriver(gen, client, asyncio.get_running_loop())
    ids = []
    try:
        while (ev := await driver.next_event()) is not None:
            ids.append(ev.token.token_id)
    finally:
        await asyncio.to_thread(driver.close)
    return ids


def test_decodes_start_from_the_callbacks_and_give_the_blocking_loops_tokens(tok):
    chain = _chain()
    want = generate(chain, tok, PROMPT, 24, GREEDY, stop_at_eog=False).generated_token_ids
    client = Counting(chain)
    wrapped = AdmissionRetry(client)  # as the API wraps every client: a first prefill runs blocking
    gen = Generation(wrapped, tok, PROMPT, 24, GREEDY, stop_at_eog=False)
    got = asyncio.run(_read_all(gen, wrapped))
    assert got == want and len(got) == 24
    assert client.blocking == 1  # the first prefill, which may be retried while a stage is full
    assert client.started == 23  # every decode
    # the first decode starts on the driver's thread, a later one where the step before it finished (or
    # on the driver's thread again when the reader had let the generation wait), never on another thread
    assert client.threads[0] == "meshnet-api-generation"
    assert set(client.threads[1:]) <= {"stage-scheduler", "meshnet-api-generation"}
    assert client.threads.count("stage-scheduler") > 0
    assert _wait_released(chain) == 0


def test_a_reader_that_stops_reading_holds_the_generation_run_ahead(tok):
    chain = _chain()
    client = Counting(chain)
    gen = Generation(client, tok, PROMPT, 50, GREEDY, stop_at_eog=False)

    async def read_one_then_wait():
        driver = GenerationDriver(gen, client, asyncio.get_running_loop())
        first = await driver.next_event()
        await asyncio.sleep(0.3)  # long enough for dozens of fake steps
        steps = client.blocking + client.started
        await asyncio.to_thread(driver.close)
        return first, steps

    first, steps = asyncio.run(read_one_then_wait())
    assert first is not None
    # one event read, RUN_AHEAD waiting: the prefill and RUN_AHEAD decodes ran, no more
    assert steps == 1 + RUN_AHEAD
    assert len(gen.result.generated_token_ids) == 1 + RUN_AHEAD
    assert _wait_released(chain) == 0


def test_closing_mid_step_cancels_it_and_releases_the_session(tok):
    chain = _chain(FakeFaults(delay_s=0.05))  # each stage's step takes 50 ms: the close finds one running
    gen = Generation(chain, tok, PROMPT, 200, GREEDY, stop_at_eog=False)

    async def read_then_close():
        driver = GenerationDriver(gen, chain, asyncio.get_running_loop())
        for _ in range(2):
            assert await driver.next_event() is not None
        t0 = time.perf_counter()
        await asyncio.to_thread(driver.close)
        return time.perf_counter() - t0

    closed_in = asyncio.run(read_then_close())
    assert closed_in < 2.0  # a cancelled fake step stops sleeping at once
    assert _wait_released(chain) == 0
    assert len(gen.result.generated_token_ids) < 200


def test_a_stage_that_fails_mid_run_raises_in_the_reader_and_the_session_is_released(tok):
    chain = _chain()
    tail = chain.stages[-1]
    tail.set_faults(FakeFaults(crash_after_calls=5))  # the tail's sixth step raises
    gen = Generation(chain, tok, PROMPT, 40, GREEDY, stop_at_eog=False)
    with pytest.raises(FakeCrash):
        asyncio.run(_read_all(gen, chain))
    assert len(gen.result.generated_token_ids) == 5
    tail.set_faults(FakeFaults())
    assert _wait_released(chain) == 0


def test_a_refused_decode_raises_the_stages_status(tok):
    chain = _chain()
    gen = Generation(chain, tok, PROMPT, 40, GREEDY, stop_at_eog=False)

    async def run():
        driver = GenerationDriver(gen, chain, asyncio.get_running_loop())
        try:
            assert await driver.next_event() is not None
            chain.stages[1].cancel(gen.session_id)  # the middle stage refuses the session's next steps
            while await driver.next_event() is not None:
                pass
        finally:
            await asyncio.to_thread(driver.close)

    with pytest.raises(GenerationError) as e:
        asyncio.run(run())
    assert e.value.status is Status.CANCELLED
    assert _wait_released(chain) == 0


def test_the_chains_step_async_gives_the_tails_result_once():
    blocking, chain = _chain(), _chain()
    prefill = StepRequest("s", 0, 0, tuple(PROMPT), sampling=GREEDY)
    want = blocking.step(prefill, False)
    out = Outcome()
    assert chain.step_async(prefill, False, out) is True
    assert out.done.wait(10) and out.calls == 1
    assert out.value.ok and out.value.token.token_id == want.token.token_id
    decode = StepRequest("s", 0, len(PROMPT), (want.token.token_id,), sampling=GREEDY)
    want2, out2 = blocking.step(decode, True), Outcome()
    assert chain.step_async(decode, True, out2) is True
    assert out2.done.wait(10) and out2.value.token.token_id == want2.token.token_id
    # a decode at the wrong position: the head's refusal, once, and nothing started further on
    out3 = Outcome()
    assert chain.step_async(StepRequest("s", 0, 3, (1,), sampling=GREEDY), True, out3) is True
    assert out3.done.wait(10) and out3.calls == 1 and out3.value.status is Status.FAILED_PRECONDITION


def test_the_chains_step_async_starts_nothing_where_a_stage_cannot():
    chain = _chain()
    grammar = SamplingParams(grammar=Grammar("{\"type\": \"object\"}"))
    out = Outcome()
    assert chain.step_async(StepRequest("g", 0, 0, tuple(PROMPT), sampling=grammar), False, out) is False

    class Remote:  # a stage that only blocks
        def prefill(self, req):
            raise AssertionError("not called")

    mixed = LocalChain([chain.stages[0], Remote()])
    assert mixed.step_async(StepRequest("r", 0, 0, tuple(PROMPT), sampling=GREEDY), False, out) is False
    time.sleep(0.05)
    assert out.calls == 0 and _sessions(chain) == 0
