"""Speculative decoding without a real model: n-gram drafts, the acceptance rule, verification steps and
rollback on the fake engine, the wire codec, and the rejection rule of sampled verification."""

from __future__ import annotations

import numpy as np
import pytest

from meshnet.chain import LocalChain
from meshnet.contract import MAX_DRAFT_TOKENS, ArtifactId, LayerRange, NamedTensor, SampledToken, SamplingParams, Status, StepRequest, StepResult
from meshnet.load_spec import LoadSpec
from meshnet.engine.fake import FakeEngine, FakeModel
from meshnet.generation import Generation
from meshnet.sampling import sample
from meshnet.speculative import DraftBudget, DraftCosts, Speculation, accepted_prefix, ngram_draft, speculation_from
from meshnet.wire.envelope import frames_to_request, replies_to_result, request_to_frames, result_to_replies

PROMPT = (11, 22, 33, 44, 55, 66, 77, 88)


def fake_chain(*bounds: int) -> LocalChain:
    engines = []
    for a, b in zip(bounds, bounds[1:]):
        e = FakeEngine(FakeModel())
        assert e.load(LoadSpec(path="", artifact=ArtifactId("", LayerRange(a, b)))).ok
        engines.append(e)
    return LocalChain(engines)


def greedy_tokens(chain: LocalChain, sid: str, prompt, n: int) -> list[int]:
    """n greedy tokens one decode step at a time."""
    res = chain.step(StepRequest(sid, 0, 0, tuple(prompt)), decode=False)
    out, pos = [res.token.token_id], len(prompt)
    while len(out) < n:
        res = chain.step(StepRequest(sid, 0, pos, (out[-1],)), decode=True)
        assert res.ok, res.message
        out.append(res.token.token_id)
        pos += 1
    return out


# ---- drafts and acceptance ----------------------------------------------------------------------
def test_ngram_draft_takes_the_longest_most_recent_match():
    seq = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 4, 2, 3]
    # "2 3" ends the sequence (no earlier "4 2 3"); its last earlier occurrence is followed by 7 8 4
    assert ngram_draft(seq, 3) == [7, 8, 4]
    assert ngram_draft(seq, 10) == [7, 8, 4, 2, 3]
    assert ngram_draft([5, 1, 2, 3, 6, 2, 3], 2, ngram_max=3) == [6, 2]
    assert ngram_draft([1, 2, 3, 4], 4) == []  # nothing recurs
    assert ngram_draft([1, 2, 1], 4, ngram_min=2) == []  # only a 1-gram recurs
    assert ngram_draft([1, 2, 1], 4) == [2, 1]
    assert ngram_draft([1, 2, 1], 0) == []



def test_ngram_draft_copies_the_occurrence_whose_context_matches_furthest_back():
    # "1 2 3" occurs twice before the end: after "10 11" (followed by 20 21) and, later, after "30"
    # (followed by 40): the text now ends "10 11 1 2 3", so the copy is of the first one.
    seq = [10, 11, 1, 2, 3, 20, 21, 30, 1, 2, 3, 40, 10, 11, 1, 2, 3]
    assert ngram_draft(seq, 2) == [20, 21]
    # Where no occurrence's context matches further back than another's, the most recent one is taken.
    assert ngram_draft([7, 1, 2, 3, 20, 8, 1, 2, 3, 40, 9, 1, 2, 3], 1) == [40]
    # Contexts compared back to the start of the text: the earliest occurrence has none before it.
    assert ngram_draft([1, 2, 3, 5, 6, 1, 2, 3, 7, 6, 1, 2, 3], 1) == [7]

def test_accepted_prefix_stops_at_the_first_disagreement():
    toks = [SampledToken(t, 0.0) for t in (5, 6, 9, 8)]
    assert accepted_prefix([5, 6, 7], toks) == 2
    assert accepted_prefix([5, 6, 9], toks) == 3
    assert accepted_prefix([4, 6, 9], toks) == 0
    assert accepted_prefix([], toks[:1]) == 0


def test_speculation_settings_are_validated():
    assert Speculation(0).validate() and Speculation(MAX_DRAFT_TOKENS + 1).validate()
    assert Speculation(4, ngram_max=1, ngram_min=2).validate()
    with pytest.raises(ValueError, match="draft_tokens"):
        Generation(fake_chain(0, 30), None, PROMPT, 4, speculation=Speculation(0))


# ---- verification steps and rollback on the fake engine -----------------------------------------
def test_verification_step_samples_after_every_row_as_single_decodes_do():
    want = greedy_tokens(fake_chain(0, 30), "ref", PROMPT, 6)
    chain = fake_chain(0, 12, 30)
    first = chain.step(StepRequest("s", 0, 0, PROMPT), decode=False).token.token_id
    assert first == want[0]
    drafts = [want[1], want[2], 999]  # two right, one wrong
    res = chain.step(StepRequest("s", 0, len(PROMPT), (first, *drafts), verify=True), decode=True)
    assert res.ok, res.message
    assert len(res.tokens) == 4 and res.token == res.tokens[-1]
    assert [t.token_id for t in res.tokens[:3]] == want[1:4]  # the 4th follows the wrong draft
    assert res.n_past == len(PROMPT) + 4
    assert accepted_prefix(drafts, res.tokens) == 2
    # Roll back the rejected row (999 at len + 3) and continue: the same tokens as never drafting it.
    pos = len(PROMPT) + 3
    res = chain.step(StepRequest("s", 0, pos, (want[3],), rollback=True), decode=True)
    assert res.ok and res.n_past == pos + 1 and res.token.token_id == want[4]


def test_a_position_below_the_session_needs_the_rollback_flag():
    chain = fake_chain(0, 30)
    chain.step(StepRequest("s", 0, 0, PROMPT), decode=False)
    res = chain.step(StepRequest("s", 0, 3, (1,)), decode=True)
    assert res.status is Status.FAILED_PRECONDITION and "rollback" in res.message
    res = chain.step(StepRequest("s", 0, len(PROMPT) + 1, (1,), rollback=True), decode=True)
    assert res.status is Status.FAILED_PRECONDITION and "only 8 tokens" in res.message


def test_bad_verification_steps_are_invalid_arguments():
    chain = fake_chain(0, 30)
    chain.step(StepRequest("s", 0, 0, PROMPT), decode=False)
    res = chain.step(StepRequest("s", 0, len(PROMPT), tuple(range(1, MAX_DRAFT_TOKENS + 3)), verify=True),
                     decode=True)
    assert res.status is Status.INVALID_ARGUMENT and "at most" in res.message
    res = chain.step(StepRequest("s", 0, len(PROMPT), (1, 2, 3)), decode=True)
    assert res.status is Status.INVALID_ARGUMENT and "exactly 1 token" in res.message


def test_rollback_cuts_every_layer_chain_back():
    """A rolled-back session computes what one that never saw the rejected rows computes, on every
    stage (the fake's per-layer chains are its KV cache)."""
    a, b = fake_chain(0, 10, 30), fake_chain(0, 10, 30)
    for c in (a, b):
        c.step(StepRequest("s", 0, 0, PROMPT), decode=False)
    a.step(StepRequest("s", 0, len(PROMPT), (5, 6, 7, 8), verify=True), decode=True)
    ra = a.step(StepRequest("s", 0, len(PROMPT) + 1, (42, 43), rollback=True), decode=False)
    b.step(StepRequest("s", 0, len(PROMPT), (5,)), decode=True)
    rb = b.step(StepRequest("s", 0, len(PROMPT) + 1, (42, 43)), decode=False)
    assert ra.token == rb.token
    assert a.stages[0]._sessions["s"].state.rows == b.stages[0]._sessions["s"].state.rows
    assert a.stages[1]._sessions["s"].token_ids == b.stages[1]._sessions["s"].token_ids


def test_speculative_generation_equals_plain_on_the_fake_engine():
    """Drafts are mostly rejected on the fake's random logits: every round rolls back."""
    prompt = PROMPT * 3
    plain = Generation(fake_chain(0, 30), _NoTok(), prompt, 40, stop_at_eog=False)
    list(plain)
    spec = Generation(fake_chain(0, 7, 30), _NoTok(), prompt, 40, stop_at_eog=False,
                      speculation=Speculation(4, ngram_min=1, adaptive=False))
    list(spec)
    assert spec.result.generated_token_ids == plain.result.generated_token_ids
    assert spec.result.verify_steps > 0 and spec.result.drafted > 0


class _NoTok:
    """A tokenizer stand-in for the fake's ids (no end-of-generation token, no text)."""

    def is_eog(self, token_id: int) -> bool:
        return False

    def stream_decoder(self):
        return self

    def feed(self, token_id: int) -> str:
        return ""


# ---- the wire -----------------------------------------------------------------------------------
def test_verify_and_rollback_cross_the_envelope():
    hidden = NamedTensor.from_numpy("hidden", np.ones((3, 4), dtype=np.float32))
    req = StepRequest("s", 2, 9, (1, 2, 3), hidden=hidden, verify=True, rollback=True)
    back, decode = frames_to_request(request_to_frames(req, decode=True))
    assert back == req and decode
    toks = (SampledToken(4, -0.5), SampledToken(5, -1.5), SampledToken(6, -0.25))
    res = StepResult(Status.OK, token=toks[-1], tokens=toks, n_past=12)
    assert replies_to_result(result_to_replies(req, res)) == res
    plain = StepResult(Status.OK, token=toks[0], n_past=10)
    assert replies_to_result(result_to_replies(req, plain)) == plain


# ---- the rejection rule of sampled verification --------------------------------------------------
def test_sampled_verification_keeps_the_target_distribution():
    """With a one-hot draft x, keep x with probability p(x), else draw from p without x: the token's
    distribution is p whatever x (measured over 20000 seeds, each a deterministic draw)."""
    logits = np.log(np.asarray([0.5, 0.2, 0.15, 0.1, 0.05], dtype=np.float32))
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(20000)]
    for draft in (0, 3):
        counts = np.bincount([sample(logits, p, [], 7, draft=draft).token_id for p in params], minlength=5)
        assert np.allclose(counts / counts.sum(), [0.5, 0.2, 0.15, 0.1, 0.05], atol=0.012), (draft, counts)
    # a draft the filters removed is never kept
    topk = SamplingParams(temperature=1.0, top_k=2, seed=1)
    assert all(sample(logits, SamplingParams(temperature=1.0, top_k=2, seed=s), [], 7, draft=4).token_id in (0, 1)
               for s in range(200))
    assert sample(logits, topk, [], 7, draft=4) == sample(logits, topk, [], 7, draft=4)


def test_draft_budget_drafts_only_where_drafts_pay_for_themselves():
    b = DraftBudget(8)
    assert b.choose(8) == 0  # the first decode step measures a plain step's time
    b.observe(0, 0, 0.010)
    assert b.t0 == 0.010
    assert b.choose(8) == 2 and b.choose(1) == 1  # a probe measures what a draft row costs
    b.observe(2, 0, 0.020)
    # In one process a draft row costs half a decode step: after a missed probe no draft pays.
    assert b.c == 0.005 and b.chances[0] < 0.4
    assert b.choose(8) == 0
    # Every draft right (a copy): long drafts pay, as long as the lookup found them.
    for _ in range(10):
        b.observe(4, 4, 0.010 + 4 * 0.005)
    assert abs(b.c - 0.005) < 1e-9 and min(b.chances) > 0.8
    assert b.choose(8) >= 4 and b.choose(3) == 3
    # Across a wide-area link a round is mostly delay (60 ms, a draft row 0.5-5 ms): a text whose drafts
    # are right half the time still drafts, and drafts long while they come right in runs.
    wan = DraftBudget(8)
    wan.observe(0, 0, 0.060)
    wan.observe(4, 1, 0.062)
    assert wan.choose(8) >= 1
    for _ in range(8):
        wan.observe(8, 8, 0.064)
    assert wan.choose(8) == 8
    for _ in range(40):  # drafts missing at 5 ms a row
        wan.observe(4, 0, 0.080)
    assert wan.chances[0] < 0.1 and wan.choose(8) == 0  # drafts never right: drafting stops
    for _ in range(60):  # old misses fade while nothing is drafted, yet only a probe starts it again
        wan.observe(0, 0, 0.060)
    picks = [wan.choose(8) for _ in range(DraftBudget.REPROBE - 1)]  # the choice above declined once
    assert picks == [0] * (DraftBudget.REPROBE - 2) + [DraftBudget.PROBE]
    wan.observe(2, 2, 0.070)  # the probe's drafts came right (the text repeats again): drafting resumes
    assert wan.choose(8) >= 2


def test_where_drafts_never_come_right_across_slow_links_few_rounds_draft():
    """Prose across a 25 ms and a 50 ms link (plain step 73 / 120 ms, a draft row 5 ms), the lookup finding
    2 drafts every round and none ever right: the rounds that draft in 64 (the misses that teach the
    budget, then probes). Stopped by misses alone, the budget drafted again every round or two (46 and 63
    of 64 rounds)."""
    for t0, most in ((0.073, 14), (0.120, 26)):
        b = DraftBudget(10, DraftCosts(t0=t0, c=0.005))
        drafted = 0
        for _ in range(64):
            k = b.choose(2)
            b.observe(k, 0, t0 + 0.005 * k)
            drafted += k > 0
        assert drafted == most


def test_generations_of_one_client_share_what_steps_cost():
    """The step costs one budget measured (a plain step, then a probe) are the next budget's start: over a
    60 ms link with 2 ms draft rows it drafts from its first round, without measuring again, while its
    acceptance starts from the prior (the text is another)."""
    costs = DraftCosts()
    first = DraftBudget(8, costs)
    assert first.choose(8) == 0
    first.observe(0, 0, 0.060)
    assert first.choose(8) == DraftBudget.PROBE
    first.observe(2, 2, 0.064)
    assert costs.t0 == 0.060 and abs(costs.c - 0.002) < 1e-12
    second = DraftBudget(8, costs)
    assert second.chances == (0.5, 0.5)
    picked = second.choose(8)
    assert picked > DraftBudget.PROBE  # a real pick (E(k) / t(k) best at 4 drafts here), not a probe
    second.observe(picked, 0, 0.060 + picked * 0.004)
    assert abs(costs.c - (0.7 * 0.002 + 0.3 * 0.004)) < 1e-12  # updated for every generation after it
    assert DraftBudget(8).t0 is None  # a budget without shared costs measures for itself


def test_a_budget_that_stopped_drafting_probes_again_ever_less_often():
    """One slow probe (a draft row measured at 1.5 decode steps) stops drafting; after REPROBE declined
    rounds the budget probes again, and drafts once the probe shows drafts are cheap and right; where
    they stay dear, the next probe comes after twice as many rounds."""
    b = DraftBudget(8)
    b.observe(0, 0, 0.010)
    assert b.choose(8) == 2
    b.observe(2, 2, 0.040)  # both right, but a slow step
    assert b.c == 0.015
    declined = [b.choose(8) for _ in range(DraftBudget.REPROBE)]
    assert declined == [0] * (DraftBudget.REPROBE - 1) + [DraftBudget.PROBE]
    b.observe(2, 2, 0.012)  # the machine was only busy: a draft row costs 1 ms
    assert b.choose(8) >= 2
    dear = DraftBudget(8)
    dear.observe(0, 0, 0.010)
    dear.choose(8)
    for probe_gap in (8, 16, 32):
        dear.observe(2, 0, 0.040)
        picks = [dear.choose(8) for _ in range(probe_gap)]
        assert picks == [0] * (probe_gap - 1) + [2]
    assert dear.choose(0) == 0  # nothing found: not a declined round


def test_a_request_naming_only_a_draft_count_keeps_the_servers_kind_and_draft_model():
    """``speculative`` null means the server's ``--speculative``: a new ``draft_tokens`` alone changes the
    count, not the drafter."""
    drafter = object()
    spec = speculation_from(None, 4, Speculation(8, drafter=drafter))
    assert (spec.draft_tokens, spec.drafter) == (4, drafter)
    spec = speculation_from(None, 3, Speculation(8))
    assert (spec.draft_tokens, spec.drafter) == (3, None)
    assert speculation_from(None, None, None) is None and speculation_from("none", 4, Speculation(8)) is None
