"""The fake engine's own promises: fixture identity, replay determinism, and each fault knob's real effect."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from contract_suite import generate, step
from meshnet.chain import release_all
from meshnet.contract import ArtifactId, LayerRange, SamplingParams, Status, StepRequest
from meshnet.load_spec import LoadSpec
from meshnet.engine.fake import FakeEngine, FakeModel
from meshnet.engine.fake_faults import FakeCrash, FakeFaults

MODEL = FakeModel()
PROMPT = [11, 22, 33, 44, 55, 66, 77, 88]
BYTES_PER_TOKEN = 100


def load(layers: LayerRange, faults: FakeFaults | None = None, model: FakeModel = MODEL,
         **overrides) -> FakeEngine:
    engine = FakeEngine(model, faults)
    out = engine.load(LoadSpec(path="", artifact=ArtifactId("", layers), **overrides))
    assert out.ok, out.message
    return engine


def chain_of(*bounds: int, faults: FakeFaults | None = None) -> list[FakeEngine]:
    """Stages split at ``bounds``: ``chain_of(0, 7, 30)`` is ``[0, 7)`` and ``[7, 30)``."""
    return [load(LayerRange(a, b), faults) for a, b in zip(bounds, bounds[1:])]


# ---- identity and load ---------------------------------------------------------------------------
def test_capabilities_declare_a_fixture():
    caps = load(LayerRange(0, 30)).capabilities()
    assert caps.fixture is True and caps.engine == "fake" and caps.architecture == "fake"
    assert (caps.n_layer, caps.n_embd, caps.n_vocab, caps.n_ctx) == (30, 8, 1000, 4096)
    assert caps.artifact.sha256.startswith("fake-")


def test_load_refuses_a_range_outside_the_model_naming_it():
    out = FakeEngine(MODEL).load(LoadSpec("", ArtifactId("", LayerRange(20, 31))))
    assert out.status is Status.INVALID_ARGUMENT
    assert "20:31" in out.message and "n_layer=30" in out.message


def test_load_refuses_a_different_sha256_naming_both():
    out = FakeEngine(MODEL).load(LoadSpec("", ArtifactId("abc123", LayerRange(0, 30))))
    assert out.status is Status.INVALID_ARGUMENT
    assert "abc123" in out.message and MODEL.sha256 in out.message
    assert FakeEngine(MODEL).load(LoadSpec("", ArtifactId(MODEL.sha256, LayerRange(0, 30)))).ok


# ---- determinism ---------------------------------------------------------------------------------
def test_replay_is_identical_across_splits_and_prefill_chunkings():
    want = generate(chain_of(0, 30), "x", PROMPT, 6)
    for bounds in [(0, 7, 30), (0, 1, 2, 29, 30), (0, 10, 20, 30)]:
        stages = chain_of(*bounds)
        res, _ = step(stages, "y", 0, PROMPT[:3])
        assert res.ok
        res, _ = step(stages, "y", 3, PROMPT[3:5])
        assert res.ok
        res, _ = step(stages, "y", 5, PROMPT[5:])
        assert res.ok and res.n_past == len(PROMPT)
        got = [res.token.token_id]
        for i in range(6):
            res, _ = step(stages, "y", len(PROMPT) + i, [got[-1]], decode=True, epoch=3)
            got.append(res.token.token_id)
        assert got == want, bounds


def test_micro_batch_size_does_not_change_outputs():
    one = load(LayerRange(0, 30), n_ubatch=512)
    small = load(LayerRange(0, 30), n_ubatch=3)
    assert generate([small], "s", PROMPT, 3) == generate([one], "s", PROMPT, 3)


def test_head_row_depends_only_on_the_token_prefix():
    head = load(LayerRange(0, 10))
    a = head.prefill(StepRequest("a", 0, 0, tuple(PROMPT))).hidden.to_numpy()
    b = head.prefill(StepRequest("b", 0, 0, tuple(PROMPT[:5] + [1, 2, 3]))).hidden.to_numpy()
    assert a.shape == (len(PROMPT), MODEL.n_embd) and a.dtype == np.float32
    assert np.array_equal(a[:5], b[:5])
    assert not np.any(np.all(a[5:] == b[5:], axis=1))


def test_seed_and_temperature_change_the_draw():
    stages = chain_of(0, 15, 30)

    def run(sid: str, sampling: SamplingParams) -> list[int]:
        return generate(stages, sid, PROMPT, 7, sampling=sampling)

    greedy = run("g", SamplingParams())
    seeded = run("s1", SamplingParams(temperature=1.5, seed=1))
    assert run("s1-again", SamplingParams(temperature=1.5, seed=1)) == seeded
    assert run("s2", SamplingParams(temperature=1.5, seed=2)) != seeded
    assert seeded != greedy
    # top_k=1 leaves only the argmax, whatever the temperature and seed.
    assert run("k1", SamplingParams(temperature=1.5, top_k=1, seed=3)) == greedy


def test_n_top_logprobs_returns_that_many():
    tail = chain_of(0, 30)
    for k in (1, 5, 20):
        res, _ = step(tail, f"k{k}", 0, PROMPT, sampling=SamplingParams(n_top_logprobs=k))
        assert len(res.token.top) == k


# ---- fault knobs ---------------------------------------------------------------------------------
def test_delay_is_applied_to_every_call():
    stages = chain_of(0, 30)
    generate(stages, "d", PROMPT, 0)
    stages[0].set_faults(FakeFaults(delay_s=0.15))
    t0 = time.monotonic()
    res, _ = step(stages, "d", len(PROMPT), [1], decode=True)
    assert res.ok
    assert time.monotonic() - t0 >= 0.15
    assert step(stages, "d", len(PROMPT) + 1, [2], decode=True)[0].ok  # honoured per call, not once
    assert time.monotonic() - t0 >= 0.30


def test_memory_budget_is_exhausted_at_the_exact_token_count():
    budget = FakeFaults(memory_budget_bytes=10 * BYTES_PER_TOKEN, bytes_per_token=BYTES_PER_TOKEN)
    ref = generate(chain_of(0, 30), "ref", PROMPT, 3)  # 8 prompt tokens + 3 decodes = 11 tokens
    (engine,) = stages = chain_of(0, 30, faults=budget)
    tokens = generate(stages, "m", PROMPT, 2)  # caches 8 + 2 = 10 tokens: exactly the budget
    assert tokens == ref[:3]
    assert engine.metrics().kv_bytes == 10 * BYTES_PER_TOKEN

    res, _ = step(stages, "m", 10, [tokens[-1]], decode=True)  # the 11th token does not fit
    assert res.status is Status.RESOURCE_EXHAUSTED and res.retry_after_s
    assert "budget" in res.message
    res, _ = step(stages, "other", 0, [1])  # nor does a new session's first token
    assert res.status is Status.RESOURCE_EXHAUSTED
    assert engine.health().active_sessions == 1
    assert engine.metrics().kv_bytes == 10 * BYTES_PER_TOKEN

    # State is unchanged: with room again, the same decode gives the reference token.
    engine.set_faults(FakeFaults(memory_budget_bytes=11 * BYTES_PER_TOKEN, bytes_per_token=BYTES_PER_TOKEN))
    res, _ = step(stages, "m", 10, [tokens[-1]], decode=True)
    assert res.ok and res.n_past == 11 and res.token.token_id == ref[3]


def test_memory_budget_refuses_a_prefill_one_token_too_long():
    faults = FakeFaults(memory_budget_bytes=len(PROMPT) * BYTES_PER_TOKEN, bytes_per_token=BYTES_PER_TOKEN)
    (engine,) = stages = chain_of(0, 30, faults=faults)
    res, _ = step(stages, "long", 0, PROMPT + [1])
    assert res.status is Status.RESOURCE_EXHAUSTED
    assert engine.health().active_sessions == 0
    assert step(stages, "fits", 0, PROMPT)[0].ok


def test_load_spec_budget_applies_too():
    engine = load(LayerRange(0, 30), FakeFaults(bytes_per_token=BYTES_PER_TOKEN),
                  memory_budget_bytes=3 * BYTES_PER_TOKEN)
    assert step([engine], "a", 0, PROMPT[:3])[0].ok
    assert step([engine], "a", 3, [1], decode=True)[0].status is Status.RESOURCE_EXHAUSTED


def test_malformed_output_is_nan_hidden_and_out_of_vocab_token():
    bad = FakeFaults(malformed_output=True)
    head, tail = chain_of(0, 15, 30)
    good = head.prefill(StepRequest("s", 0, 0, tuple(PROMPT)))
    head.set_faults(bad)
    tail.set_faults(bad)
    res = head.decode(StepRequest("s", 0, len(PROMPT), (1,)))
    # Structurally valid: right name, shape and dtype; semantically wrong: every value is NaN.
    assert res.ok and res.hidden.validate() is None
    assert res.hidden.shape == (1, MODEL.n_embd) and res.hidden.dtype == "f32"
    assert np.isnan(res.hidden.to_numpy()).all()
    res = tail.prefill(StepRequest("s", 0, 0, tuple(PROMPT), hidden=good.hidden))
    assert res.ok and res.token.token_id == MODEL.n_vocab  # one past the vocabulary
    assert np.isnan(res.token.logprob)


def test_crash_raises_on_exactly_call_n_plus_one():
    (engine,) = stages = chain_of(0, 30, faults=FakeFaults(crash_after_calls=3))
    tokens = generate(stages, "c", PROMPT, 2)  # calls 1..3
    with pytest.raises(FakeCrash):
        step(stages, "c", len(PROMPT) + 2, [tokens[-1]], decode=True)  # call 4
    with pytest.raises(FakeCrash):  # a dead process stays dead
        step(stages, "c2", 0, PROMPT)
    assert engine.health().healthy is False
    engine.set_faults(FakeFaults())
    assert engine.health().healthy is True
    assert step(stages, "c", len(PROMPT) + 2, [tokens[-1]], decode=True)[0].ok


def test_crash_after_zero_calls_fails_the_first_call():
    engine = load(LayerRange(0, 30), FakeFaults(crash_after_calls=0))
    with pytest.raises(FakeCrash):
        engine.prefill(StepRequest("s", 0, 0, tuple(PROMPT)))
    assert engine.health().active_sessions == 0


# ---- cancellation during a slow step -------------------------------------------------------------
def _cancel_soon(engine: FakeEngine, session_id: str, after_s: float) -> threading.Thread:
    t = threading.Timer(after_s, engine.cancel, args=(session_id,))
    t.start()
    return t


def test_cancel_stops_a_delayed_first_prefill():
    engine = load(LayerRange(0, 30), FakeFaults(delay_s=5.0))
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault(
        "r", engine.prefill(StepRequest("slow", 0, 0, tuple(PROMPT)))))
    t0 = time.monotonic()
    worker.start()
    while "slow" not in engine.session_ids():  # the session exists once its step has started
        assert time.monotonic() - t0 < 2.0, "the delayed prefill never started"
        time.sleep(0.001)
    engine.cancel("slow")
    worker.join(timeout=2.0)
    assert not worker.is_alive()
    assert result["r"].status is Status.CANCELLED and time.monotonic() - t0 < 2.0
    assert engine.health().active_sessions == 0  # a first prefill that failed keeps nothing


def test_cancel_stops_a_delayed_decode_and_keeps_n_past():
    (engine,) = stages = chain_of(0, 30)
    tokens = generate(stages, "slow", PROMPT, 0)
    engine.set_faults(FakeFaults(delay_s=5.0))
    timer = _cancel_soon(engine, "slow", 0.05)
    t0 = time.monotonic()
    res = engine.decode(StepRequest("slow", 0, len(PROMPT), (tokens[0],)))
    timer.join()
    assert res.status is Status.CANCELLED and time.monotonic() - t0 < 2.0
    assert engine.metrics().kv_bytes == len(PROMPT) * FakeFaults().bytes_per_token
    release_all(stages, "slow")
    assert engine.health().active_sessions == 0
