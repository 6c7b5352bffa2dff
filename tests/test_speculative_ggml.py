"""Speculative decoding on the bundled SmolLM2: verification rows give the bits of single decodes, rollback
keeps the pool and the prefix cache honest, and greedy output with n-gram drafts equals plain decoding
token for token, in process (one stage and three)."""

from __future__ import annotations

import numpy as np
import pytest

from meshnet.bench.spec_bench import PROMPTS
from meshnet.chat_template import chat_prompt_ids
from meshnet.contract import GREEDY, LayerRange, SamplingParams, StepRequest
from meshnet.engine.ggml_stage import BatchItem, GgmlStage
import meshnet.generation as generation
from meshnet.generation import Generation, generate
from meshnet.local_mesh import load_local_chain
from meshnet.speculative import Speculation

JSON_EDIT, PROSE = PROMPTS["json-edit"], PROMPTS["prose"]  # the speculative bench's prompts
RANGES3 = [LayerRange(0, 12), LayerRange(12, 25), LayerRange(25, 30)]


@pytest.fixture(scope="module")
def stage(smollm2_path):
    st = GgmlStage(str(smollm2_path), LayerRange(0, 30), n_threads=2, n_ctx=1024, n_slots=4, kv_tokens=4096)
    yield st
    st.close()


@pytest.mark.parametrize("depth", [40, 300])
def test_verification_rows_equal_single_decodes_bit_for_bit(stage, depth):
    """k + 1 rows in one graph (beside another session's decode) against the same rows decoded one by one.
    Past 256 cached tokens a decode reads 512 cells and ggml's flash attention splits them across threads;
    a call of several query rows goes row by row and rounds differently, so a verification step that
    attended its rows in one call would not be exact there (measured below): rows attended one by one are."""
    rng = np.random.default_rng(depth)
    prompt = rng.integers(100, 40000, depth).astype(np.int32)
    drafts = rng.integers(100, 40000, 7).astype(np.int32)
    a, b, other = stage.new_session(1024), stage.new_session(1024), stage.new_session(64)
    try:
        stage.forward(a, 0, prompt)
        stage.forward(b, 0, prompt)
        stage.forward(other, 0, prompt[:9])
        singles = np.concatenate([stage.forward_batch([BatchItem(a.slot, depth + i, drafts[i:i + 1])])[0]
                                  for i in range(len(drafts))])
        verify, _ = stage.forward_batch([BatchItem(b.slot, depth, drafts, rows_alone=True),
                                         BatchItem(other.slot, 9, prompt[9:10])])
        assert verify.shape == singles.shape == (7, stage.cfg.n_vocab)
        assert np.array_equal(verify, singles)
        # The same rows as one multi-row call (a prefill's path), written over the same cells.
        one_call = stage.forward_batch([BatchItem(b.slot, depth, drafts, n_out=7)])[0]
        assert np.array_equal(one_call, singles) == (depth < 256)
    finally:
        for kv in (a, b, other):
            kv.free()


def test_rollback_forgets_rows_for_the_prefix_cache(smollm2_path):
    """A session cut back and retired is kept with only the rows it still holds: a prompt that continues
    with the rejected drafts reuses none of them, and its output equals a fresh run."""
    chain = load_local_chain(str(smollm2_path), [LayerRange(0, 30)], n_threads=2, progress=False, n_ctx=512,
                             prefix_cache=2)
    engine = chain.stages[0]
    prompt = tuple(range(1000, 1040))
    first = chain.step(StepRequest("a", 0, 0, prompt), decode=False).token.token_id
    drafts = (7, 8, 9)
    res = chain.step(StepRequest("a", 0, 40, (first, *drafts), verify=True), decode=True)
    assert res.ok and len(res.tokens) == 4
    assert chain.step(StepRequest("a", 0, 41, (res.tokens[0].token_id,), rollback=True), decode=True).ok
    kv = engine._sessions["a"].state
    assert len(kv.keys) == len(kv.paths) == 42 and kv.keys[40:] == [first, res.tokens[0].token_id]
    chain.release("a")
    assert engine.stage.prefix_cache.tokens == 42
    longer = prompt + (first, *drafts, 11)
    got = chain.step(StepRequest("b", 0, 0, longer), decode=False)
    fresh = load_local_chain(str(smollm2_path), [LayerRange(0, 30)], n_threads=2, progress=False, n_ctx=512,
                             prefix_cache=0).step(StepRequest("c", 0, 0, longer), decode=False)
    assert got.token == fresh.token
    assert engine.metrics().kv_tokens_held >= len(longer)


@pytest.fixture(scope="module")
def chains(smollm2_path):
    one = load_local_chain(str(smollm2_path), [LayerRange(0, 30)], n_threads=2, progress=False)
    three = load_local_chain(str(smollm2_path), RANGES3, n_threads=2, progress=False)
    return one, three


@pytest.mark.parametrize("text,n", [(JSON_EDIT, 96), (PROSE, 48)])
def test_greedy_with_drafts_equals_plain_decoding(chains, tok, text, n):
    one, three = chains
    ids = chat_prompt_ids(tok, [{"role": "user", "content": text}])
    plain = generate(one, tok, ids, n, GREEDY, stop_at_eog=False)
    spec = generate(three, tok, ids, n, GREEDY, stop_at_eog=False, speculation=Speculation(6, adaptive=False))
    assert spec.generated_token_ids == plain.generated_token_ids
    assert spec.verify_steps > 0 and spec.drafted >= spec.accepted
    if text is JSON_EDIT:
        # the copy-edit repeats its input: most drafts are right, and decoding passes 256 cached tokens
        assert len(ids) + n > 300
        assert spec.accepted > n // 3, (spec.drafted, spec.accepted)


def _seeded_run(chain, tok, ids, row_cost_s: float) -> list[int]:
    """A seeded, sampled, speculative generation on a fake clock: each step costs 1 s plus ``row_cost_s``
    per draft row (an idle machine against a loaded one)."""
    clock = [0.0]

    class Clocked:  # the chain, each step advancing the fake clock by its cost
        def step(self, req, decode):
            clock[0] += 1.0 + row_cost_s * (len(req.token_ids) - 1)
            return chain.step(req, decode)

        def cancel(self, session_id):
            chain.cancel(session_id)

        def release(self, session_id):
            chain.release(session_id)

    gen = Generation(Clocked(), tok, ids, 40, SamplingParams(temperature=0.8, seed=1234), stop_at_eog=False,
                     speculation=Speculation(8))
    saved = generation.time.perf_counter
    generation.time.perf_counter = lambda: clock[0]
    try:
        list(gen)
    finally:
        generation.time.perf_counter = saved
    return gen.result.generated_token_ids, gen.result.drafted


def test_a_seeded_sampled_speculative_run_does_not_depend_on_the_machines_speed(chains, tok):
    """With a seed a sampled run is reproducible: the draft budget, which follows measured times, does not
    pick its drafts (a sampled token at a drafted position spends its draw on the acceptance test)."""
    ids = chat_prompt_ids(tok, [{"role": "user", "content": JSON_EDIT}])
    fast, drafted_fast = _seeded_run(chains[0], tok, ids, row_cost_s=0.01)  # drafts nearly free
    slow, drafted_slow = _seeded_run(chains[0], tok, ids, row_cost_s=5.0)  # drafts dear: the budget would stop
    assert fast == slow and len(fast) == 40
    assert drafted_fast == drafted_slow > 0
