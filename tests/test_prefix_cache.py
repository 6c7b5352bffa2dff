"""Exact prefix reuse: a prompt that starts like a finished session's skips the rows they share, and its
output is the same bits as computed from scratch."""

from __future__ import annotations

import numpy as np
import pytest

from mesh_util import greedy_steps
from meshnet.contract import GREEDY, ArtifactId, LayerRange, StepRequest
from meshnet.load_spec import LoadSpec
from meshnet.engine.ggml_engine import GgmlEngine
from meshnet.engine.prefix_cache import ROWWISE, SPLIT, TILED, alone_paths, usable_prefix
from meshnet.generation import generate
from meshnet.local_mesh import load_local_chain, plan_ranges


def test_alone_paths_follow_the_micro_batches():
    assert alone_paths(40, 512, 1024) == ROWWISE * 40
    assert alone_paths(600, 512, 1024) == TILED * 600  # 512 + 88 rows: both calls tiled
    assert alone_paths(530, 512, 1024) == TILED * 512 + ROWWISE * 18
    assert alone_paths(513, 512, 1024) == TILED * 512 + SPLIT  # one row over 768 cells


@pytest.mark.parametrize("common,paths,expect", [
    (30, ROWWISE * 40, 30),                       # short prompt: every shared row
    (39, ROWWISE * 40, 39),
    (40, ROWWISE * 40, 39),                       # the last row is always computed: its output is wanted
    (100, TILED * 150, 86),                       # tiled prompt: at least 64 rows left, so tiled again
    (50, TILED * 150, 50),
    (529, TILED * 512 + ROWWISE * 18, 528),       # one row over 768 cells would take the split path
    (512, TILED * 512 + SPLIT, 512),
    (0, ROWWISE * 5, 0),
])
def test_usable_prefix_keeps_every_computed_row_on_its_alone_path(common, paths, expect):
    assert usable_prefix(common, paths, 512, 1024) == expect


def _engine(path, prefix_cache: int, layers: LayerRange = LayerRange(0, 30), **kw) -> GgmlEngine:
    eng = GgmlEngine()
    kw = {"n_ctx": 1024, "max_sessions": 4, **kw}
    assert eng.load(LoadSpec(str(path), ArtifactId("", layers), prefix_cache=prefix_cache, **kw)).ok
    return eng


def _greedy(eng: GgmlEngine, sid: str, prompt: list[int], n: int) -> list[int]:
    out = greedy_steps(eng.prefill, eng.decode, sid, prompt, n, reserve_tokens=len(prompt) + n)
    eng.release(sid)
    return out


def test_a_shared_prefix_is_reused_and_gives_the_same_tokens(smollm2_path):
    """A 25-token prefix shared by two short prompts (row-by-row attention), and a 120-token prefix
    shared by two long ones (tiled): the second prompt of each pair computes only its own rows (at least 64
    for the tiled one), and every greedy id equals an engine that keeps nothing."""
    rng = np.random.default_rng(1)
    head, tail = list(rng.integers(100, 40000, 25)), list(rng.integers(100, 40000, 120))
    pairs = [(head + list(rng.integers(100, 40000, 12)), head + list(rng.integers(100, 40000, 10)), 10),
             (tail + list(rng.integers(100, 40000, 80)), tail + list(rng.integers(100, 40000, 30)), 64)]
    fresh, kept = _engine(smollm2_path, 0), _engine(smollm2_path, 4)
    for first, second, computed in pairs:
        want = [_greedy(fresh, "a", first, 8), _greedy(fresh, "b", second, 8)]
        got = [_greedy(kept, "a", first, 8)]
        rows = kept.metrics().batch_rows
        got.append(_greedy(kept, "b", second, 8))
        assert got == want
        assert kept.metrics().batch_rows - rows == computed + 7  # its own rows, then 7 decodes
    assert fresh.stage.prefix_cache.capacity == 0 and len(kept.stage.prefix_cache) == 4


def test_kept_sessions_give_way_to_new_ones(smollm2_path):
    """A pool of 300 cells: kept sessions hold cells, and a new session that needs them pushes the oldest
    out instead of being refused."""
    eng = _engine(smollm2_path, 4, kv_tokens=300)
    for i in range(3):
        _greedy(eng, f"s{i}", [504 + i] * 90, 4)
    assert len(eng.stage.prefix_cache) == 3 and eng.metrics().kv_tokens_reserved == 3 * 93
    # kept sessions move to the highest slots: open ones stay in the lowest, which decodes attend over
    assert eng.stage.prefix_cache.slots == [7, 6, 5] and eng.stage.pool.acquire(1) == 0
    eng.stage.pool.release(0)
    assert _greedy(eng, "big", [7] * 150, 4)
    assert len(eng.stage.prefix_cache) == 2  # two gave way to its 154 cells, then it was kept itself
    m = eng.metrics()  # kept cells count as held, and as reserved: they are the pool's memory in use
    assert m.active_sessions == 0 and m.kv_tokens_held == m.kv_tokens_reserved == m.kv_tokens_kept == 93 + 153


def test_three_stages_reuse_prefixes_exactly(smollm2_path, tok):
    """In three stages the head and middle stage hand on the kept output rows of the shared prefix: chat
    requests sharing the chat template's system prompt equal a chain that keeps nothing."""
    path = str(smollm2_path)
    prompts = [tok.encode(t) for t in ("<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n"
                                       f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
                                       for q in ("What is 2+2?", "Name a colour.", "Say hello."))]
    ids, cached = {}, {}
    for keep in (0, 4):
        chain = load_local_chain(path, plan_ranges(path, 3), n_threads=2, n_ctx=512, progress=False,
                                 prefix_cache=keep)
        results = [generate(chain, tok, p, 12, GREEDY, stop_at_eog=False) for p in prompts]
        ids[keep] = [r.generated_token_ids for r in results]
        cached[keep] = [r.cached_tokens for r in results]  # what the API reports as usage's cached_tokens
        if keep:
            assert all(len(s.stage.prefix_cache) == 3 for s in chain.stages)
            rows = chain.stages[0].metrics().batch_rows
            assert rows < sum(len(p) + 11 for p in prompts)  # the shared rows were not computed again
    assert ids[4] == ids[0]
    common = next(i for i, (a, b) in enumerate(zip(*prompts[:2])) if a != b)
    assert cached[0] == [0, 0, 0] and cached[4] == [0, common, common] and common > 20, (cached, common)


def test_a_later_stage_reuses_only_rows_computed_from_the_same_hidden_states(smollm2_path):
    """Two replicas of the first range whose outputs differ in the last bits (micro-batches of 64 and of
    512 tokens: the rows after the first 64 take other attention paths) feed one tail. A prompt routed
    through the second replica reuses only the 64 rows whose hidden states equal those the tail kept, and
    its token and log-prob are the bits the tail computes from scratch."""
    from dataclasses import replace

    head_a = _engine(smollm2_path, 0, LayerRange(0, 12), n_ubatch=64)
    head_b = _engine(smollm2_path, 0, LayerRange(0, 12), n_ubatch=512)
    kept, fresh = _engine(smollm2_path, 4, LayerRange(12, 30)), _engine(smollm2_path, 0, LayerRange(12, 30))
    rng = np.random.default_rng(0)
    first = [int(t) for t in rng.integers(100, 40000, 100)]
    second = first + [int(t) for t in rng.integers(100, 40000, 30)]

    def step(head, tail, sid, prompt):
        req = StepRequest(sid, 0, 0, tuple(prompt), reserve_tokens=len(prompt) + 1)
        h = head.prefill(req)
        t = tail.prefill(replace(req, hidden=h.hidden))
        assert h.ok and t.ok, (h.message, t.message)
        head.release(sid)
        tail.release(sid)
        return t.token, h.hidden.to_numpy()

    _, rows_a = step(head_a, kept, "one", first)
    rows = kept.metrics().batch_rows
    got, rows_b = step(head_b, kept, "two", second)
    assert np.array_equal(rows_a[:64], rows_b[:64]) and not np.array_equal(rows_a[64:], rows_b[64:100])
    assert kept.metrics().batch_rows - rows == 130 - 64
    want, _ = step(head_b, fresh, "two", second)
    assert (got.token_id, got.logprob) == (want.token_id, want.logprob)


def test_figures_are_safe_to_read_while_kept_sessions_give_way(smollm2_path):
    """Metrics read the kept sessions' cells while the scheduler's thread drops kept sessions for room
    (steps that grow beyond their reservation): no error, and the figures agree once all have ended."""
    import threading

    eng = _engine(smollm2_path, 64, n_ubatch=4, kv_tokens=400, max_sessions=2, n_ctx=256)
    stop, reads, errors = threading.Event(), [0], []

    def read() -> None:
        while not stop.is_set():
            try:
                eng.metrics()
                reads[0] += 1
            except Exception as e:  # noqa: BLE001 - the failure is the finding
                errors.append(e)
                return

    reader = threading.Thread(target=read)
    reader.start()
    rng = np.random.default_rng(0)
    try:
        for k in range(40):  # each reserves 1 cell, so each chunk's step grows it, dropping kept ones
            r = eng.prefill(StepRequest(f"s{k}", 0, 0, tuple(int(t) for t in rng.integers(100, 40000, 12)),
                                        reserve_tokens=1))
            assert r.ok, r.message
            eng.release(f"s{k}")
    finally:
        stop.set()
        reader.join()
    assert errors == [] and reads[0] > 0
    m = eng.metrics()
    assert m.active_sessions == 0 and m.kv_tokens_held == m.kv_tokens_kept == m.kv_tokens_reserved > 0


def test_the_start_up_speed_probe_takes_no_place_in_the_prefix_cache(smollm2_path):
    """A tail kept the probe's 9 cells from start-up, one of its --prefix-cache places."""
    from meshnet.node.engine_loader import measure_decode_speed

    eng = _engine(smollm2_path, 4, layers=LayerRange(20, 30))
    assert measure_decode_speed(eng, steps=8) > 0
    m = eng.metrics()
    assert len(eng.stage.prefix_cache) == 0 and m.kv_tokens_kept == m.kv_tokens_held == 0
    assert m.decode_tokens == 8  # the probe ran its steps


def test_the_speed_probe_runs_on_a_pool_smaller_than_the_context(smollm2_path):
    """With a small --kv-tokens the probe's session asked for a whole context's cells, was refused, and the
    node registered 0 tokens/s (routing then guessed its speed)."""
    from meshnet.node.engine_loader import measure_decode_speed

    eng = _engine(smollm2_path, 4, layers=LayerRange(20, 30), kv_tokens=400)
    assert measure_decode_speed(eng, steps=8) > 0
    assert eng.metrics().decode_tokens == 8
