"""Batched stages on the real model: sessions that share iterations give what each gives alone, and the
KV pool holds memory for the tokens sessions hold, not for their context length."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from conftest import GOLDEN_SET, golden_exact, load_golden
from golden_check import assert_greedy_matches
from meshnet.contract import GREEDY, ArtifactId, LayerRange, Status, StepRequest
from meshnet.load_spec import LoadSpec
from meshnet.engine.ggml_engine import GgmlEngine
from meshnet.engine.ggml_stage import GgmlStage
from meshnet.generation import Generation, generate
from meshnet.local_mesh import load_local_chain, plan_ranges
from solo_reference import PROMPTS

OTHER_PROMPTS = ("Write a haiku about the sea.", "def fibonacci(n):", "Once upon a time, in a small village,",
                 "The three primary colors are", "Translate to French: good morning", "Q: What is 12 * 7?\nA:",
                 "Roses are red,", "import numpy as np\n")
N_TOKENS = 24


def _together(chain, tok, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy ids of every prompt, each generated in its own thread, all started at once."""
    start = threading.Barrier(len(prompts))
    out: list = [None] * len(prompts)

    def run(i: int) -> None:
        start.wait()
        out[i] = generate(chain, tok, prompts[i], n, GREEDY, stop_at_eog=False).generated_token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert all(o is not None for o in out), "a concurrent generation did not finish"
    return out


# 8 sessions on one stage are what the 32-session run and the 3-stage run of 8 each cover already
@pytest.mark.parametrize("n_sessions,n_stages", [pytest.param(8, 1, marks=pytest.mark.long), (8, 3), (32, 1)])
def test_concurrent_requests_equal_each_request_alone(smollm2_path, tok, solo, n_sessions, n_stages):
    path = str(smollm2_path)
    chain = load_local_chain(path, plan_ranges(path, n_stages), n_threads=2, n_ctx=512, max_sessions=n_sessions)
    texts = list(PROMPTS) + [OTHER_PROMPTS[i % len(OTHER_PROMPTS)] + " " * (i // len(OTHER_PROMPTS))
                             for i in range(n_sessions - len(PROMPTS))]
    prompts = [tok.encode(t) for t in texts]
    n_tokens = N_TOKENS if n_sessions <= 8 else N_TOKENS // 2  # 32 x 24 decodes alone cost 10-35 s
    alone = [generate(chain, tok, p, n_tokens, GREEDY, stop_at_eog=False).generated_token_ids for p in prompts]
    iterations_before = chain.stages[-1].metrics().iterations
    together = _together(chain, tok, prompts, n_tokens)
    assert together == alone
    # The golden prompts, run beside the others, equal the one-stage solo run on this machine ...
    for i in range(len(PROMPTS)):
        assert together[i] == solo.greedy(i, n_tokens), f"golden prompt {i}"
    # ... and llama.cpp's goldens for the running CPU features (rule 3 where no set matches them).
    if GOLDEN_SET is not None:
        golden = load_golden("SmolLM2-135M-Instruct.Q4_1")
        for i in range(len(PROMPTS)):
            assert_greedy_matches(golden, i, together[i], golden_exact())
    tail = chain.stages[-1].metrics()
    steps = n_sessions * n_tokens
    # Alone, every step is an iteration of its own; shared, fewer: how many sessions meet in one depends
    # on the machine's load (96 iterations for 192 steps once, on a busy machine).
    assert tail.iterations - iterations_before < steps * 3 / 4, "sessions did not share iterations"
    assert tail.max_batch_rows >= 4
    assert [s.health().active_sessions for s in chain.stages] == [0] * n_stages


@pytest.mark.slow
def test_a_short_prompt_behind_a_long_prefill_answers_first_and_both_equal_each_alone(smollm2_path, tok):
    """Prefills ran in arrival order: a question arriving during a long document's prefill got its first
    token only after the whole prefill (24 s behind 3000 tokens on one thread). Now the fewest tokens
    left go first: the question's first token comes while the document (3 chunks) still
    prefills, and each output equals its run alone."""
    path = str(smollm2_path)
    # no prefix cache: the runs alone would leave the document's cells for the run together to reuse
    # micro-batches of 64 tokens: the document is 3 whole chunks, and the question never fits beside one
    chain = load_local_chain(path, plan_ranges(path, 1), n_threads=2, n_ctx=512, max_sessions=2, prefix_cache=0,
                             n_ubatch=64)
    long_ids = tok.encode(" ".join(OTHER_PROMPTS) * 10)[:192]
    short_ids = tok.encode(PROMPTS[0])
    alone = [generate(chain, tok, p, 4, GREEDY, stop_at_eog=False).generated_token_ids for p in (long_ids, short_ids)]
    firsts: list[str] = []
    out: dict = {}

    def run(name: str, ids: list[int]) -> None:
        ids_out = []
        for ev in Generation(chain, tok, ids, 4, GREEDY, stop_at_eog=False):
            if not ids_out:
                firsts.append(name)
            ids_out.append(ev.token.token_id)
        out[name] = ids_out

    stage = chain.stages[0]
    long_t = threading.Thread(target=run, args=("long", long_ids))
    long_t.start()
    deadline = time.monotonic() + 30
    while stage.metrics().waiting_steps == 0 and time.monotonic() < deadline:  # the document's prefill is queued
        time.sleep(0.001)
    short_t = threading.Thread(target=run, args=("short", short_ids))
    short_t.start()
    long_t.join(120)
    short_t.join(120)
    assert firsts == ["short", "long"]
    assert [out["long"], out["short"]] == alone


def test_sessions_past_the_split_kv_depth_equal_each_alone(smollm2_path, tok):
    """2 concurrent greedy sessions decoding across 256 tokens (past it a decode row reads 512 cells and
    ggml's attention changes path) give the ids each gives alone; kept prefixes on (the defaults). Their
    prompts bring them near that depth, so that the decodes around it are few (300 decodes each took 11-32
    s); the mechanism is also checked row by row in the test below."""
    path = str(smollm2_path)
    chain = load_local_chain(path, plan_ranges(path, 1), n_threads=2, n_ctx=1024, max_sessions=8,
                             progress=False)
    # texts whose greedy ids, decoded beside each other through the multi-stream call past 256, differ
    # from alone within 48 tokens (at position 270 on the AVX-512 VM: found by trying rotations with that
    # call forced; elsewhere the row-by-row test below still holds the mechanism)
    texts = list(OTHER_PROMPTS) + list(PROMPTS)
    prompts = [tok.encode(" ".join(texts[i:] + texts[:i]) * 6)[:236 + 4 * (i - 2)] for i in (2, 3)]
    n = 48
    alone = [generate(chain, tok, p, n, GREEDY, stop_at_eog=False).generated_token_ids for p in prompts]
    assert _together(chain, tok, prompts, n) == alone
    assert [len(p) for p in prompts] == [236, 240] and all(len(a) == n for a in alone)  # both cross 256


def test_a_deep_decode_gives_the_same_logits_in_any_batch_and_slot(smollm2_path):
    """A decode row reading 512 or more cells takes ggml's split-KV attention when alone (as llama.cpp's
    solo decode does); in a multi-stream call it would round differently (measured: logits 0.53 apart at
    depth 300). The stage attends such a row on its own, so its logits are the same bits whether it runs
    alone in slot 0, alone in slot 3, or beside three shallow decodes."""
    from meshnet.engine.ggml_stage import BatchItem

    stage = GgmlStage(str(smollm2_path), LayerRange(0, 30), n_threads=2, n_ctx=1024, n_slots=4)
    rng = np.random.default_rng(7)
    prompt = rng.integers(100, 40000, 300).astype(np.int32)
    nxt = np.asarray([504], dtype=np.int32)

    def deep_logits(slot_of_deep: int, others: int) -> np.ndarray:
        kvs = [stage.new_session(reserve_tokens=320) for _ in range(4)]
        deep = kvs[slot_of_deep]
        stage.forward(deep, 0, token_ids=prompt)
        shallow = [kv for kv in kvs if kv is not deep][:others]
        for kv in shallow:
            stage.forward(kv, 0, token_ids=prompt[:12])
        items = [BatchItem(kv.slot, 12, nxt) for kv in shallow] + [BatchItem(deep.slot, 300, nxt)]
        out = stage.forward_batch(items)[-1]
        for kv in kvs:
            kv.free()
        return out

    alone = deep_logits(0, 0)
    assert alone.shape == (1, 49152)
    np.testing.assert_array_equal(deep_logits(3, 0), alone)
    np.testing.assert_array_equal(deep_logits(3, 3), alone)
    stage.close()


def test_kv_pool_memory_follows_the_tokens_held(smollm2_path):
    """32 sessions of 200 tokens: the pool's resident bytes stay within 1.25x the bytes of the cells they
    hold (pages are committed as cells are written, not for 32 x n_ctx up front), and go back on release."""
    stage = GgmlStage(str(smollm2_path), LayerRange(0, 2), n_threads=2, n_ctx=2048, n_slots=32)
    pool = stage.pool
    assert pool.resident_bytes() == 0
    rng = np.random.default_rng(0)
    sessions = [stage.new_session(reserve_tokens=200) for _ in range(32)]
    for kv in sessions:
        stage.forward(kv, 0, token_ids=rng.integers(0, 49152, 200).astype(np.int32))
    held = 32 * 200 * pool.bytes_per_token
    resident = pool.resident_bytes()
    assert held <= resident <= 1.25 * held, (resident, held)
    assert pool.nbytes_virtual == 32 * 2048 * pool.bytes_per_token  # what per-session caches would pin
    for kv in sessions:
        kv.free()
    assert pool.resident_bytes() <= 32 * 4 * 2 * 4096  # at most the partial edge pages of each slot
    stage.close()


def test_a_pool_larger_than_the_machines_memory_maps_and_serves(smollm2_path):
    """A pool's address space is not committed memory: on Python 3.11, whose mmap module lacks
    MAP_NORESERVE, 20 slots of 100k tokens (46 GB for SmolLM2) failed with ENOMEM on a 24 GiB machine."""
    import resource

    with open("/proc/sys/vm/overcommit_memory") as f:
        if f.read().strip() == "2":
            pytest.skip("vm.overcommit_memory is 2 (strict): the kernel counts even MAP_NORESERVE maps")
    if resource.getrlimit(resource.RLIMIT_AS)[0] != resource.RLIM_INFINITY:
        pytest.skip("an address-space limit (ulimit -v) is set: such a map cannot fit under it")
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    bytes_per_token = 23_040  # SmolLM2: 30 layers x (K + V) x 192 F16 values
    n_ctx = -(-2 * total // (20 * bytes_per_token))  # twice the machine's memory in all
    stage = GgmlStage(str(smollm2_path), LayerRange(0, 30), n_threads=2, n_ctx=n_ctx, n_slots=20,
                      kv_tokens=1024)
    try:
        assert stage.pool.bytes_per_token == bytes_per_token
        assert stage.pool.nbytes_virtual == 20 * n_ctx * bytes_per_token > 2 * total - 20 * bytes_per_token
        kv = stage.new_session(reserve_tokens=100)
        stage.forward(kv, 0, token_ids=np.arange(1, 101, dtype=np.int32))
        assert 100 * bytes_per_token <= stage.pool.resident_bytes() <= 1.25 * 100 * bytes_per_token
        kv.free()
    finally:
        stage.close()


def test_a_context_past_the_trained_one_is_warned_about_once_a_model(smollm2_path, caplog):
    """llama.cpp warns when n_ctx passes the model's training context; --n-ctx 100000 said nothing."""
    with caplog.at_level("WARNING", logger="meshnet.engine"):
        for layers, n_ctx in ((LayerRange(0, 1), 8193), (LayerRange(1, 2), 8193), (LayerRange(0, 1), 8192)):
            GgmlStage(str(smollm2_path), layers, n_threads=1, n_ctx=n_ctx, n_slots=1).close()
    assert [r.getMessage() for r in caplog.records] == [
        "n_ctx 8193 is past the 8192 tokens of context the model was trained on: positions past them may give "
        "worse text"]  # the head warns; the other stage and a context within the trained one do not


def test_a_pool_counts_only_its_own_pages_beside_another(smollm2_path):
    """Two pools mapped one after the other: cells written in one are not counted in the other's
    resident bytes (the kernel would merge two adjacent mappings of the same kind into one)."""
    first = GgmlStage(str(smollm2_path), LayerRange(0, 2), n_threads=2, n_ctx=512, n_slots=4)
    second = GgmlStage(str(smollm2_path), LayerRange(0, 2), n_threads=2, n_ctx=512, n_slots=4)
    for stage in (first, second):
        kv = stage.new_session(reserve_tokens=100)
        stage.forward(kv, 0, token_ids=np.arange(1, 101, dtype=np.int32))
        held = 100 * stage.pool.bytes_per_token
        assert held <= stage.pool.resident_bytes() <= 1.25 * held
        kv.free()
    first.close()
    second.close()


def test_pool_admits_by_tokens_and_keeps_its_promises(smollm2_path):
    """A pool of 1000 cells: sessions reserve what their steps say they need; one that does not fit is
    refused with RESOURCE_EXHAUSTED and a retry hint while the others keep running."""
    eng = GgmlEngine()
    assert eng.load(LoadSpec(str(smollm2_path), ArtifactId("", LayerRange(0, 30)), n_ctx=512,
                             max_sessions=8, kv_tokens=1000)).ok
    first = eng.prefill(StepRequest("a", 0, 0, (504, 3575, 282), reserve_tokens=500))
    assert first.ok
    refused = eng.prefill(StepRequest("b", 0, 0, (504, 3575)))  # no hint: the whole context, 512 cells
    assert refused.status is Status.RESOURCE_EXHAUSTED and refused.retry_after_s > 0
    assert "512 KV cells; 500 of 1000" in refused.message
    fits = eng.prefill(StepRequest("c", 0, 0, (504, 3575), reserve_tokens=400))
    assert fits.ok
    nxt = eng.decode(StepRequest("a", 0, 3, (first.token.token_id,)))
    assert nxt.ok and nxt.n_past == 4
    m = eng.metrics()
    assert (m.kv_tokens_reserved, m.kv_tokens_capacity, m.kv_tokens_held) == (900, 1000, 4 + 2)
    eng.release("a")
    assert eng.prefill(StepRequest("b", 0, 0, (504, 3575))).ok



def test_a_session_larger_than_the_whole_pool_is_refused_at_once(smollm2_path):
    """A reservation no back-off could ever admit (more cells than the pool holds) is INVALID_ARGUMENT,
    not RESOURCE_EXHAUSTED with a retry hint; the pool is untouched and serves the next request."""
    eng = GgmlEngine()
    assert eng.load(LoadSpec(str(smollm2_path), ArtifactId("", LayerRange(0, 30)), n_ctx=512,
                             max_sessions=4, kv_tokens=300)).ok
    refused = eng.prefill(StepRequest("big", 0, 0, (504, 3575), reserve_tokens=400))
    assert refused.status is Status.INVALID_ARGUMENT and refused.retry_after_s is None
    assert "needs 400 KV cells, more than the 300 the stage's pool holds" in refused.message
    assert eng.metrics().kv_tokens_reserved == 0
    assert eng.prefill(StepRequest("small", 0, 0, (504, 3575), reserve_tokens=300)).ok


def test_the_api_caps_budgets_by_the_pool(smollm2_path):
    """In process, a session's context is the smaller of n_ctx and the stage's pool: a request without
    max_tokens gets a budget the pool can hold (it used to wait 30 s for a 503 no retry could cure)."""
    from fastapi.testclient import TestClient

    from meshnet.api.app import create_app
    from meshnet.api.backend import local_backend

    backend = local_backend(str(smollm2_path), n_ctx=1024, max_sessions=2, kv_tokens=300, name="smollm2")
    try:
        assert backend.n_ctx == 300
        with TestClient(create_app(backend)) as http:
            r = http.post("/v1/completions", json={"prompt": "Hello", "temperature": 0, "max_tokens": 5})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
            # no max_tokens: what the pool still holds after a 290-token prompt (the last token is never
            # fed back, so it needs no cell)
            r = http.post("/v1/completions", json={"prompt": [504] * 290, "temperature": 0,
                                                   "logit_bias": {"2": -100, "0": -100}})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 300 - 290 + 1
            assert r.json()["choices"][0]["finish_reason"] == "length"
            r = http.post("/v1/completions", json={"prompt": "Hello " * 400, "temperature": 0})
            assert r.status_code == 400 and "maximum context length is 300 tokens" in r.json()["error"]["message"]
    finally:
        backend.close()


def test_sixty_four_requests_against_a_pool_sized_for_sixteen(smollm2_path, tok):
    """64 concurrent completions, a KV pool with cells for 16 of them: each answer is a 200 with its
    tokens, or a clear 503 with Retry-After; the pool never holds more than its budget."""
    import asyncio

    import httpx

    from meshnet.api.backend import local_backend
    from meshnet.api.server import start_api_in_thread, stop_api

    prompt, max_tokens = "The capital of France is", 4
    per_request = len(tok.encode(prompt)) + max_tokens
    backend = local_backend("smollm2", n_threads=2, n_ctx=256, max_sessions=64,
                            kv_tokens=16 * per_request)
    pool = backend.chain.stages[0].stage.pool
    server, thread = start_api_in_thread(backend, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.config.port}"
    peak = [0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(0.01):
            peak[0] = max(peak[0], pool.tokens_reserved)

    async def one(client, i):
        r = await client.post("/v1/completions", json={"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens,
                                                      "temperature": 0})
        return r.status_code, r.headers.get("retry-after"), r.json()

    async def load():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        answers = asyncio.run(load())
    finally:
        stop.set()
        watcher.join()
        stop_api(server, thread)
    statuses = [a[0] for a in answers]
    assert set(statuses) <= {200, 503}, statuses
    assert statuses.count(200) >= 16
    for status, retry_after, body in answers:
        if status == 200:
            assert body["usage"]["completion_tokens"] == max_tokens
        else:
            assert retry_after is not None and int(retry_after) > 0
            assert body["error"]["code"] in ("server_busy", "mesh_error") and body["error"]["message"]
    assert 0 < peak[0] <= 16 * per_request
    # what is left is the finished sessions the stage keeps for their prefixes, each its held cells
    kept = backend.chain.stages[0].stage.prefix_cache
    assert 0 < len(kept) <= 4 and kept.tokens == len(kept) * (per_request - 1)
    assert pool.tokens_reserved == kept.tokens and pool.slots_in_use == len(kept)


def test_decodes_that_fill_their_streams_are_read_in_place(smollm2_path):
    """Decode rows in every slot below the streams' count are the streams themselves once sorted by
    slot: the graph then has no gather or scatter of them (its one ``get_rows`` is the embedding) and no
    copy before the cache writes, and each row's logits are the bits it gets decoding alone, whatever
    order the sessions came in."""
    import ggml

    from meshnet.engine.ggml_stage import BatchItem

    stage = GgmlStage(str(smollm2_path), LayerRange(0, 30), n_threads=2, n_ctx=256, n_slots=4)
    rng = np.random.default_rng(11)
    kvs = [stage.new_session(reserve_tokens=40) for _ in range(4)]
    for i, kv in enumerate(kvs):
        stage.forward(kv, 0, token_ids=rng.integers(100, 40000, 10 + i).astype(np.int32))
    items = [BatchItem(kv.slot, 10 + i, np.asarray([500 + i], dtype=np.int32)) for i, kv in enumerate(kvs)]
    alone = [stage.forward_batch([it])[0] for it in items]
    order = [3, 1, 0, 2]
    together = stage.forward_batch([items[i] for i in order])
    shape, dec, _ = stage.shape_of([items[i] for i in order])
    assert (shape.n_dec, shape.dec_streams, shape.dec_in_order) == (4, 4, True)
    assert [items[order[i]].slot for i in dec] == [0, 1, 2, 3]
    gf = stage._graph(shape).gf
    ops = [ggml.ggml_op_desc(ggml.ggml_graph_node(gf, i)).decode() for i in range(ggml.ggml_graph_n_nodes(gf))]
    assert (ops.count("GET_ROWS"), ops.count("CONT")) == (1, 0)
    for k, i in enumerate(order):
        np.testing.assert_array_equal(together[k], alone[i])
    for kv in kvs:
        kv.free()
    stage.close()


@pytest.mark.parametrize("own_buffers", [4, 1])
def test_decode_groups_taking_turns_keep_their_graphs_placed(smollm2_path, monkeypatch, own_buffers):
    """Decode groups that take turns at a stage each run their own graph: with a compute buffer each, a
    graph is placed once, not again after every other group's iteration; where there are fewer buffers
    than groups (1 here) they are taken over and given back. Either way every row's logits are the bits
    the graphs give placed in the shared buffer (``OWN_BUFFERS`` 0)."""
    from meshnet.engine.ggml_graph import StepGraph
    from meshnet.engine.ggml_stage import BatchItem

    placed = []
    real_place = StepGraph.place
    monkeypatch.setattr(StepGraph, "place", lambda g, galloc: (placed.append(g.shape), real_place(g, galloc))[1])

    def run(own: int) -> list[np.ndarray]:
        stage = GgmlStage(str(smollm2_path), LayerRange(0, 30), n_threads=1, n_ctx=256, n_slots=8)
        stage.OWN_BUFFERS = own
        rng = np.random.default_rng(5)
        kvs = [stage.new_session(reserve_tokens=40) for _ in range(5)]
        for i, kv in enumerate(kvs):
            stage.forward(kv, 0, token_ids=rng.integers(100, 40000, 8 + i).astype(np.int32))
        placed.clear()
        out = []
        for step in range(3):
            for group in ([0, 1, 2], [3, 4]):
                items = [BatchItem(kvs[i].slot, 8 + i + step, np.asarray([700 + 13 * i + step], np.int32))
                         for i in group]
                out += stage.forward_batch(items)
        for kv in kvs:
            kv.free()
        stage.close()
        return out

    shared = run(0)
    assert len(placed) == 6  # the two graphs placed again at every turn in the one buffer
    own = run(own_buffers)
    assert len(placed) == (2 if own_buffers >= 2 else 6)
    assert len(set(placed)) == 2
    for a, b in zip(own, shared):
        np.testing.assert_array_equal(a, b)
