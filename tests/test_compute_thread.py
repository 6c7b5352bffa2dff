"""Every CPU graph of a process with several stages runs on one thread (one OpenMP team)."""

from __future__ import annotations

import threading

import ggml
import pytest

from meshnet.contract import StepRequest
from meshnet.local_mesh import load_local_chain, plan_ranges


@pytest.mark.parametrize("stages", [1, 3])
def test_the_stages_of_a_process_compute_on_one_thread(smollm2_path, monkeypatch, stages):
    threads: list[int] = []
    real = ggml.ggml_backend_graph_compute

    def recorded(backend, graph):
        threads.append(threading.get_ident())
        return real(backend, graph)

    monkeypatch.setattr(ggml, "ggml_backend_graph_compute", recorded)
    path = str(smollm2_path)
    chain = load_local_chain(path, plan_ranges(path, stages, None), n_threads=2, progress=False)
    try:
        res = chain.step(StepRequest("s", 1, 0, (1, 2, 3, 4)), False)
        for i in range(3):
            res = chain.step(StepRequest("s", 1, 4 + i, (res.token.token_id,)), True)
        assert res.ok
    finally:
        for eng in chain.stages:
            eng.stage.close()
    assert len(threads) == 4 * stages
    assert len(set(threads)) == 1
    assert threads[0] != threading.get_ident()  # a scheduler's or the shared compute thread
