"""The shard-engine contract as a reusable test suite: every engine's test module subclasses it.

The suite drives only the public contract (prefill, decode, cancel, release, health, metrics,
capabilities, load) and mostly through :func:`meshnet.chain.run_step`, so the same tests hold the fake
engine, the ggml engine and later remote stubs to one behaviour. It asserts real values: statuses, token
ids, ``n_past``, session counts.

A subclass (named ``Test...``) provides these fixtures:

``new_engine``
    ``() -> ShardEngine``: a new, unloaded engine.
``load_spec``
    ``(layers: LayerRange, **overrides) -> LoadSpec``: what to load for a layer range; ``overrides`` are
    LoadSpec fields (the suite passes ``max_sessions``).
``n_layer``
    layers in the whole model (at least 3, so a chain has a head, a middle and a tail).
``prompt_ids``
    a prompt as token ids (at least 4), valid for the model.

It may override ``fresh_chain`` / ``chain`` (a list of loaded stages covering ``[0, n_layer)``) and
``make_chain`` (``n_stages -> stages``; return None when an engine cannot split, which skips the 1-vs-3
stage test). Each test runs at most a few dozen steps, so an engine at ~10 ms a step keeps the suite fast.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

import numpy as np
import pytest

from meshnet.chain import release_all, run_step
from meshnet.contract import GREEDY, LayerRange, NamedTensor, SamplingParams, Status, StepRequest, StepResult, split_layers
from meshnet.load_spec import AuxiliaryState, MultiTokenPrediction
from meshnet.engine.base import ShardEngine

N_DECODE = 8  # greedy decodes after the prompt in the generation tests
SEEDED = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=1234)

Chain = list[ShardEngine]


# ---- helpers ---------------------------------------------------------------------------------------
def step(stages: Sequence[ShardEngine], session_id: str, position: int, tokens: Sequence[int], *,
         decode: bool = False, epoch: int = 0, sampling: SamplingParams = GREEDY) -> tuple[StepResult, int]:
    """One step through the chain: the tail's (or failing stage's) result and that stage's index."""
    req = StepRequest(session_id=session_id, epoch=epoch, position=position,
                      token_ids=tuple(int(t) for t in tokens), sampling=sampling)
    return run_step(stages, req, decode=decode)


def generate(stages: Sequence[ShardEngine], session_id: str, prompt: Sequence[int], n_decode: int, *,
             epoch: int = 0, sampling: SamplingParams = GREEDY) -> list[int]:
    """Prefill ``prompt`` then decode ``n_decode`` tokens, asserting OK and an exact ``n_past`` each step.

    Returns the ``1 + n_decode`` sampled token ids (the prefill's, then each decode's).
    """
    n_vocab = stages[-1].capabilities().n_vocab
    res, at = step(stages, session_id, 0, prompt, epoch=epoch, sampling=sampling)
    assert res.status is Status.OK, (at, res.message)
    assert at == len(stages) - 1
    assert res.n_past == len(prompt)
    tokens = [res.token.token_id]
    for i in range(n_decode):
        pos = len(prompt) + i
        res, at = step(stages, session_id, pos, [tokens[-1]], decode=True, epoch=epoch, sampling=sampling)
        assert res.status is Status.OK, (at, res.message)
        assert res.n_past == pos + 1
        assert res.hidden is None and res.token is not None
        tokens.append(res.token.token_id)
    assert all(0 <= t < n_vocab for t in tokens), tokens
    return tokens


def active(stages: Sequence[ShardEngine]) -> list[int]:
    return [s.health().active_sessions for s in stages]


# ---- the suite -------------------------------------------------------------------------------------
class EngineContractSuite:
    """Contract tests shared by every engine; see the module docstring for the fixtures to provide."""

    @pytest.fixture
    def fresh_chain(self, new_engine: Callable[[], ShardEngine], load_spec, n_layer: int):
        """Factory ``(n_stages=3, **load_overrides) -> list of loaded stages`` covering ``[0, n_layer)``."""

        def build(n_stages: int = 3, **overrides) -> Chain:
            stages = []
            for layers in split_layers(n_layer, n_stages):
                engine = new_engine()
                out = engine.load(load_spec(layers, **overrides))
                assert out.ok, (layers, out.message)
                stages.append(engine)
            return stages

        return build

    @pytest.fixture
    def chain(self, fresh_chain) -> Chain:
        return fresh_chain()

    @pytest.fixture
    def make_chain(self, fresh_chain):
        return fresh_chain

    # ---- capabilities and a plain generation ---------------------------------------------------
    def test_capabilities_cover_the_model(self, chain: Chain, n_layer: int, prompt_ids):
        caps = [s.capabilities() for s in chain]
        assert [c.artifact.layers for c in caps] == split_layers(n_layer, 3)
        assert [(c.is_head, c.is_tail) for c in caps] == [(True, False), (False, False), (False, True)]
        assert len({(c.n_layer, c.n_embd, c.n_vocab, c.artifact.sha256) for c in caps}) == 1
        assert caps[0].n_layer == n_layer
        assert caps[0].n_ctx > len(prompt_ids) + N_DECODE
        assert all(0 <= t < caps[0].n_vocab for t in prompt_ids)
        for s in chain:
            h = s.health()
            assert (h.loaded, h.healthy, h.active_sessions) == (True, True, 0)

    def test_prefill_then_greedy_decodes(self, chain: Chain, prompt_ids):
        tokens = generate(chain, "gen", prompt_ids, N_DECODE)
        assert len(tokens) == N_DECODE + 1
        assert active(chain) == [1, 1, 1]
        for s in chain:
            m = s.metrics()
            assert (m.prefill_tokens, m.decode_tokens, m.active_sessions) == (len(prompt_ids), N_DECODE, 1)
        res, _ = step(chain, "gen", len(prompt_ids) + N_DECODE, [tokens[-1]], decode=True)
        assert res.ok and np.isfinite(res.token.logprob) and res.token.logprob <= 0.0
        release_all(chain, "gen")
        assert active(chain) == [0, 0, 0]

    # ---- determinism ---------------------------------------------------------------------------
    def test_same_session_on_a_fresh_chain_is_identical(self, chain: Chain, fresh_chain, prompt_ids):
        first = generate(chain, "det", prompt_ids, N_DECODE)
        assert generate(fresh_chain(), "det", prompt_ids, N_DECODE) == first

    def test_outputs_do_not_depend_on_session_id_or_epoch(self, chain: Chain, prompt_ids):
        a = generate(chain, "id-a", prompt_ids, 3, epoch=0)
        assert generate(chain, "another-id", prompt_ids, 3, epoch=7) == a

    def test_interleaved_sessions_equal_solo_runs(self, chain: Chain, fresh_chain, prompt_ids):
        prompts = {"a": list(prompt_ids), "b": list(reversed(prompt_ids)) + [prompt_ids[0]]}
        solo = {sid: generate(fresh_chain(), "solo-" + sid, p, 4) for sid, p in prompts.items()}
        got: dict[str, list[int]] = {sid: [] for sid in prompts}
        for sid, p in prompts.items():
            res, _ = step(chain, sid, 0, p)
            assert res.ok, res.message
            got[sid].append(res.token.token_id)
        for i in range(4):
            for sid, p in prompts.items():
                res, _ = step(chain, sid, len(p) + i, [got[sid][-1]], decode=True)
                assert res.ok and res.n_past == len(p) + i + 1, res.message
                got[sid].append(res.token.token_id)
        assert got == solo

    # ---- batching: concurrent sessions share iterations ------------------------------------------
    @staticmethod
    def _variants(prompt_ids, n: int) -> list[list[int]]:
        """``n`` distinct prompts of different lengths built from the suite's prompt."""
        base = list(prompt_ids)
        return [base[i % len(base):] + base[:i % len(base)] + base[:i // len(base) + 1] for i in range(n)]

    @staticmethod
    def _run_together(chain: Chain, jobs: dict[str, list[int]], n_decode: int, during=None) -> dict:
        """Generate every job in its own thread, all released at once; returns each job's tokens or the
        status that stopped it. ``during(sid, i)`` runs in a job's thread before its ``i``-th decode."""
        import threading

        start = threading.Barrier(len(jobs))
        out: dict[str, object] = {}

        def run(sid: str, prompt: list[int]) -> None:
            start.wait()
            res, _ = step(chain, sid, 0, prompt)
            if not res.ok:
                out[sid] = res.status
                return
            tokens = [res.token.token_id]
            for i in range(n_decode):
                if during is not None:
                    during(sid, i)
                res, _ = step(chain, sid, len(prompt) + i, [tokens[-1]], decode=True)
                if not res.ok:
                    out[sid] = res.status
                    return
                tokens.append(res.token.token_id)
            out[sid] = tokens

        threads = [threading.Thread(target=run, args=(sid, p)) for sid, p in jobs.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a concurrent generation hung"
        return out

    def test_concurrent_sessions_are_batched_and_equal_solo_runs(self, chain: Chain, fresh_chain, prompt_ids):
        jobs = {f"c{i}": p for i, p in enumerate(self._variants(prompt_ids, 6))}
        solo = {sid: generate(fresh_chain(), "solo", p, N_DECODE) for sid, p in jobs.items()}
        before = chain[-1].metrics()
        got = self._run_together(chain, jobs, N_DECODE)
        assert got == solo
        after = chain[-1].metrics()
        steps = len(jobs) * (N_DECODE + 1)
        # Every step ran, in fewer iterations than steps: sessions shared them.
        assert after.decode_tokens - before.decode_tokens == len(jobs) * N_DECODE
        assert after.iterations - before.iterations < steps
        assert after.max_batch_rows > 1

    def test_a_session_cancelled_inside_a_batch_fails_alone(self, chain: Chain, fresh_chain, prompt_ids):
        jobs = {f"k{i}": p for i, p in enumerate(self._variants(prompt_ids, 4))}
        solo = {sid: generate(fresh_chain(), "solo", p, N_DECODE) for sid, p in jobs.items()}

        def cancel_k1(sid: str, i: int) -> None:
            if sid == "k1" and i == 3:
                for s in chain:
                    s.cancel("k1")

        got = self._run_together(chain, jobs, N_DECODE, during=cancel_k1)
        assert got.pop("k1") is Status.CANCELLED
        assert got == {sid: solo[sid] for sid in got}

    def test_a_session_released_inside_a_batch_leaves_the_others(self, chain: Chain, fresh_chain, prompt_ids):
        jobs = {f"r{i}": p for i, p in enumerate(self._variants(prompt_ids, 4))}
        solo = {sid: generate(fresh_chain(), "solo", p, N_DECODE) for sid, p in jobs.items()}

        def release_r2(sid: str, i: int) -> None:
            if sid == "r2" and i == 2:
                release_all(chain, "r2")

        got = self._run_together(chain, jobs, N_DECODE, during=release_r2)
        assert got.pop("r2") is Status.NOT_FOUND  # its next decode finds no KV cache: replay it
        assert got == {sid: solo[sid] for sid in got}
        assert active(chain) == [3, 3, 3]

    def test_overflowing_hidden_states_fail_their_step_alone(self, chain: Chain, fresh_chain, prompt_ids):
        """Finite hidden states far beyond any model's activations (a stage's float32 arithmetic overflows on
        them; the ggml tail answered token 0 with OK) are refused in the middle of a batch, before the step
        runs: the session's next good step and the sessions batched beside it give their solo tokens."""
        jobs = {f"o{i}": p for i, p in enumerate(self._variants(prompt_ids, 4))}
        solo = {sid: generate(fresh_chain(), "solo", p, N_DECODE) for sid, p in jobs.items()}
        row_shape = chain[1].capabilities().hidden_row_shape
        refused = []

        def overflow_o1(sid: str, i: int) -> None:
            bad = {2: (chain[1], -3e38), 5: (chain[2], 1e30)}  # decode index -> (stage, value)
            if sid != "o1" or i not in bad:
                return
            stage, value = bad[i]
            rows = np.full((1, *row_shape), value, np.float32)
            req = StepRequest(sid, 0, len(jobs[sid]) + i, (solo[sid][i],), hidden=NamedTensor.from_numpy("hidden", rows))
            res = stage.decode(req)
            refused.append((res.status, res.message, res.hidden, res.token))

        got = self._run_together(chain, jobs, N_DECODE, during=overflow_o1)
        assert got == solo
        assert [r[0] for r in refused] == [Status.INVALID_ARGUMENT] * 2, refused
        for (_, message, hidden, token), value in zip(refused, ("3e+38", "1e+30")):
            assert message.startswith(f"hidden states hold a value of magnitude {value} (row 0 of 1), beyond the "
                                      "1e+09 a stage accepts"), message
            assert hidden is None and token is None
        assert active(chain) == [4, 4, 4]

    def test_one_stage_equals_three_stages(self, chain: Chain, make_chain, prompt_ids):
        if make_chain is None:
            pytest.skip("this engine provides no make_chain(n_stages) factory")
        one = make_chain(1)
        assert len(one) == 1 and one[0].capabilities().is_head and one[0].capabilities().is_tail
        assert generate(one, "s", prompt_ids, N_DECODE) == generate(chain, "s", prompt_ids, N_DECODE)

    def test_seeded_sampling_is_reproducible(self, chain: Chain, fresh_chain, prompt_ids):
        first = generate(chain, "seeded", prompt_ids, 4, sampling=SEEDED)
        assert generate(fresh_chain(), "seeded", prompt_ids, 4, sampling=SEEDED) == first

    def test_second_prefill_extends_the_session(self, chain: Chain, prompt_ids):
        k = len(prompt_ids) // 2
        whole = generate(chain, "whole", prompt_ids, 2)
        res, _ = step(chain, "split", 0, prompt_ids[:k])
        assert res.ok and res.n_past == k, res.message
        res, _ = step(chain, "split", k, prompt_ids[k:])
        assert res.ok and res.n_past == len(prompt_ids), res.message
        got = [res.token.token_id]
        for i in range(2):
            res, _ = step(chain, "split", len(prompt_ids) + i, [got[-1]], decode=True)
            assert res.ok, res.message
            got.append(res.token.token_id)
        assert got == whole

    # ---- session lifecycle ---------------------------------------------------------------------
    def test_unknown_session_is_not_found(self, chain: Chain, prompt_ids):
        res, at = step(chain, "nobody", 0, [prompt_ids[0]], decode=True)
        assert (res.status, at) == (Status.NOT_FOUND, 0) and res.message
        # Extending a prefill needs the cached prefix too.
        res, at = step(chain, "nobody", 3, prompt_ids)
        assert (res.status, at) == (Status.NOT_FOUND, 0)
        assert active(chain) == [0, 0, 0]

    def test_released_session_is_not_found(self, chain: Chain, prompt_ids):
        tokens = generate(chain, "gone", prompt_ids, 1)
        release_all(chain, "gone")
        assert active(chain) == [0, 0, 0]
        res, at = step(chain, "gone", len(prompt_ids) + 1, [tokens[-1]], decode=True)
        assert (res.status, at) == (Status.NOT_FOUND, 0)
        # The id is free again: a replay from position 0 recreates it with the same outputs.
        assert generate(chain, "gone", prompt_ids, 1) == tokens

    def test_release_and_cancel_are_idempotent(self, chain: Chain, prompt_ids):
        generate(chain, "idem", prompt_ids, 0)
        for s in chain:
            assert s.cancel("idem").ok and s.cancel("idem").ok
            assert s.release("idem").ok and s.release("idem").ok
            assert s.cancel("never-existed").ok and s.release("never-existed").ok
        assert active(chain) == [0, 0, 0]

    def test_decode_after_cancel_is_cancelled(self, chain: Chain, prompt_ids):
        tokens = generate(chain, "c", prompt_ids, 1)
        for s in chain:
            assert s.cancel("c").ok
        res, at = step(chain, "c", len(prompt_ids) + 1, [tokens[-1]], decode=True)
        assert (res.status, at) == (Status.CANCELLED, 0) and res.message
        res, at = step(chain, "c", len(prompt_ids) + 1, [tokens[-1]])
        assert (res.status, at) == (Status.CANCELLED, 0)
        # Cancelling keeps the cache until release; other sessions are unaffected.
        assert active(chain) == [1, 1, 1]
        assert generate(chain, "other", prompt_ids, 1) == tokens
        release_all(chain, "c")
        assert active(chain) == [1, 1, 1]

    def test_stale_epoch_is_refused_and_a_higher_one_accepted(self, chain: Chain, prompt_ids):
        tokens = generate(chain, "e", prompt_ids, 0, epoch=5)
        pos = len(prompt_ids)
        res, at = step(chain, "e", pos, [tokens[-1]], decode=True, epoch=4)
        assert (res.status, at) == (Status.FAILED_PRECONDITION, 0) and res.message
        res, _ = step(chain, "e", pos, [tokens[-1]], decode=True, epoch=6)
        assert res.ok and res.n_past == pos + 1, res.message
        # The session moved to epoch 6: epoch 5 is stale now.
        res, at = step(chain, "e", pos + 1, [res.token.token_id], decode=True, epoch=5)
        assert (res.status, at) == (Status.FAILED_PRECONDITION, 0)

    def test_wrong_position_is_refused_and_leaves_the_session_unchanged(self, chain: Chain, prompt_ids):
        ref = generate(chain, "ref", prompt_ids, 2)
        generate(chain, "p", prompt_ids, 0)
        pos = len(prompt_ids)
        for bad in (pos + 1, pos - 1, 0):
            res, at = step(chain, "p", bad, [ref[0]], decode=True)
            assert (res.status, at) == (Status.FAILED_PRECONDITION, 0), bad
            assert res.message
        res, at = step(chain, "p", pos + 2, prompt_ids)  # a prefill extension at a wrong position
        assert (res.status, at) == (Status.FAILED_PRECONDITION, 0)
        res, _ = step(chain, "p", pos, [ref[0]], decode=True)
        assert res.ok and res.n_past == pos + 1, res.message
        assert res.token.token_id == ref[1]

    def test_session_limit_is_resource_exhausted(self, fresh_chain, prompt_ids):
        chain = fresh_chain(max_sessions=2)
        assert all(s.capabilities().max_sessions == 2 for s in chain)
        generate(chain, "one", prompt_ids, 0)
        generate(chain, "two", prompt_ids, 0)
        res, at = step(chain, "three", 0, prompt_ids)
        assert (res.status, at) == (Status.RESOURCE_EXHAUSTED, 0) and res.message
        assert res.retry_after_s is not None and res.retry_after_s > 0
        assert active(chain) == [2, 2, 2]
        release_all(chain, "one")
        generate(chain, "three", prompt_ids, 0)

    # ---- malformed input -----------------------------------------------------------------------
    MALFORMED = [
        "empty_tokens", "decode_two_tokens", "token_id_out_of_vocab", "negative_token_id",
        "hidden_wrong_shape", "hidden_rows_not_matching_tokens", "hidden_wrong_dtype",
        "hidden_byte_count", "hidden_sent_to_head", "missing_hidden_on_middle", "missing_hidden_on_tail",
        "bad_temperature", "bad_top_p", "bad_n_top_logprobs", "prompt_longer_than_n_ctx",
        "extension_past_n_ctx",
    ]

    @pytest.mark.parametrize("case", MALFORMED)
    def test_malformed_input_is_invalid_argument(self, chain: Chain, prompt_ids, case: str):
        head, mid, tail = chain
        caps = head.capabilities()
        n, prompt = len(prompt_ids), tuple(int(t) for t in prompt_ids)
        ref = generate(chain, "ref", prompt_ids, 1)
        # Session "good" is prefilled stage by stage, keeping valid hidden states to corrupt.
        good = StepRequest("good", 0, 0, prompt)
        h0 = head.prefill(good)
        h1 = mid.prefill(replace(good, hidden=h0.hidden))
        assert h0.ok and h1.ok and tail.prefill(replace(good, hidden=h1.hidden)).ok
        x = h0.hidden.to_numpy()  # [n, n_embd] f32

        def hidden_of(array: np.ndarray) -> NamedTensor:
            return NamedTensor.from_numpy("hidden", array)

        bad = StepRequest("bad", 0, 0, prompt)
        cases = {
            "empty_tokens": (head, False, replace(bad, token_ids=())),
            "decode_two_tokens": (head, True, StepRequest("good", 0, n, (ref[0], ref[0]))),
            "token_id_out_of_vocab": (head, False, replace(bad, token_ids=prompt[:-1] + (caps.n_vocab,))),
            "negative_token_id": (head, False, replace(bad, token_ids=(-1,))),
            "hidden_wrong_shape": (mid, False, replace(bad, hidden=hidden_of(
                np.zeros((n, caps.n_embd + 1), np.float32)))),
            "hidden_rows_not_matching_tokens": (mid, False, replace(bad, token_ids=prompt[:-1], hidden=h0.hidden)),
            "hidden_wrong_dtype": (mid, False, replace(bad, hidden=hidden_of(x.astype(np.float16)))),
            "hidden_byte_count": (mid, False, replace(bad, hidden=NamedTensor(
                "hidden", (n, caps.n_embd), "f32", h0.hidden.data[:-4]))),
            "hidden_sent_to_head": (head, False, replace(bad, hidden=h0.hidden)),
            "missing_hidden_on_middle": (mid, False, bad),
            "missing_hidden_on_tail": (tail, False, bad),
            "bad_temperature": (tail, False, replace(bad, hidden=h1.hidden,
                                                     sampling=SamplingParams(temperature=-1.0))),
            "bad_top_p": (tail, False, replace(bad, hidden=h1.hidden, sampling=SamplingParams(top_p=0.0))),
            "bad_n_top_logprobs": (tail, False, replace(bad, hidden=h1.hidden,
                                                        sampling=SamplingParams(n_top_logprobs=21))),
            "prompt_longer_than_n_ctx": (head, False, replace(
                bad, token_ids=tuple(prompt[i % n] for i in range(caps.n_ctx + 1)))),
            "extension_past_n_ctx": (head, False, StepRequest(
                "good", 0, n, tuple(prompt[i % n] for i in range(caps.n_ctx - n + 1)))),
        }
        stage, decode, req = cases[case]
        before = active(chain)
        errors_before = stage.metrics().errors.get("INVALID_ARGUMENT", 0)

        res = stage.decode(req) if decode else stage.prefill(req)

        assert res.status is Status.INVALID_ARGUMENT, (case, res.status, res.message)
        assert res.message, case
        assert res.hidden is None and res.token is None
        assert active(chain) == before, "a refused request must not create a session"
        assert stage.metrics().errors.get("INVALID_ARGUMENT", 0) == errors_before + 1
        # The stage still serves good requests, and session "good" is where it was.
        res, _ = step(chain, "good", n, [ref[0]], decode=True)
        assert res.ok and res.n_past == n + 1, res.message
        assert res.token.token_id == ref[1]

    # ---- load ----------------------------------------------------------------------------------
    def test_not_loaded_engine_is_failed_precondition(self, new_engine, prompt_ids):
        engine = new_engine()
        assert not engine.loaded
        h = engine.health()
        assert (h.loaded, h.healthy, h.active_sessions) == (False, False, 0)
        req = StepRequest("s", 0, 0, tuple(prompt_ids))
        res = engine.prefill(req)
        assert res.status is Status.FAILED_PRECONDITION and res.message
        assert engine.decode(replace(req, token_ids=req.token_ids[:1])).status is Status.FAILED_PRECONDITION
        assert engine.cancel("s").ok and engine.release("s").ok
        with pytest.raises(RuntimeError):
            engine.capabilities()

    def test_layer_range_outside_the_model_is_invalid_argument(self, new_engine, load_spec, n_layer: int,
                                                               prompt_ids):
        engine = new_engine()
        for layers in (LayerRange(0, n_layer + 1), LayerRange(n_layer, n_layer + 2)):
            out = engine.load(load_spec(layers))
            assert out.status is Status.INVALID_ARGUMENT and out.message, layers
            assert not engine.loaded
        assert engine.prefill(StepRequest("s", 0, 0, tuple(prompt_ids))).status is Status.FAILED_PRECONDITION
        # The same engine still loads a valid range afterwards.
        assert engine.load(load_spec(LayerRange(0, n_layer))).ok

    def test_reserved_hook_is_not_implemented(self):
        with pytest.raises(NotImplementedError):
            AuxiliaryState(enabled=True, kind="recurrent")
        # Disabled, it is a plain default; MTP is on by default (used where the file has the block).
        assert not AuxiliaryState().enabled and MultiTokenPrediction().enabled

    # ---- sampling output -----------------------------------------------------------------------
    def test_top_logprobs_are_sorted_descending(self, chain: Chain, prompt_ids):
        sp = SamplingParams(n_top_logprobs=3)
        res, _ = step(chain, "top", 0, prompt_ids, sampling=sp)
        n_vocab = chain[-1].capabilities().n_vocab
        for _ in range(2):
            assert res.ok, res.message
            top = res.token.top
            assert len(top) == 3
            lps = [t.logprob for t in top]
            assert lps == sorted(lps, reverse=True) and all(lp <= 0.0 for lp in lps)
            assert len({t.token_id for t in top}) == 3 and all(0 <= t.token_id < n_vocab for t in top)
            # Greedy takes the most likely token, so its log-prob is the best one.
            assert res.token.logprob == pytest.approx(lps[0], abs=1e-4)
            res, _ = step(chain, "top", res.n_past, [res.token.token_id], decode=True, sampling=sp)
        res, _ = step(chain, "top", res.n_past, [res.token.token_id], decode=True)
        assert res.ok and res.token.top == ()
