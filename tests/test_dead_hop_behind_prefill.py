"""A hop that dies while another session's long prefill runs ahead of a step: found within seconds (its
Health is asked every ``DeadlinePolicy.probe_s``), though the step's deadline, lengthened by the prefill
it waits behind, is the ceiling; and a step merely slow at a live stage is waited for, not failed over.

The long prefill is another session's step in flight on the step's clock (``HopClock.begin``): the
deadline it gives is what is tested, not how long a real prefill takes. Fake engines, one crashing or
sleeping on request (``--fault``), in node processes of their own."""

from __future__ import annotations

import time

import pytest

from meshnet.client.remote import RemoteStage
from meshnet.contract import ArtifactId, LayerRange, StepRequest
from meshnet.engine.fake import FakeEngine, FakeModel
from meshnet.load_spec import LoadSpec
from mesh_util import greedy_steps

STEP_TIMEOUT_S = 20.0  # the ceiling: what a step behind the long prefill waited before a node was failed over
PROMPT = (5, 6, 7)


def _fake_greedy(prompt: tuple[int, ...], n: int) -> list[int]:
    eng = FakeEngine(FakeModel())
    assert eng.load(LoadSpec(path="", artifact=ArtifactId(FakeModel().sha256, LayerRange(0, 30)))).ok
    return greedy_steps(eng.prefill, eng.decode, "ref", prompt, n)


def _behind_a_long_prefill(client, forwarding: bool, route: list[str]) -> None:
    """Put another session's 100,000-token prefill in flight where the next step goes: on the route's
    clock when it is forwarded, else on the middle hop's; the next decode's deadline is then the ceiling."""
    clock = client.clocks["forward:" + ">".join(route) if forwarding else route[1]]
    clock.begin(False, 100_000)  # never ended: it runs ahead of every later step
    assert clock.deadline_s(True, 1) == STEP_TIMEOUT_S


@pytest.mark.parametrize("forwarding, crash", [(True, "sigkill"), (False, "hang")])
def test_a_hop_that_dies_behind_a_long_prefill_is_failed_over_in_seconds(mesh, forwarding, crash):
    """The middle node dies (forwarded: killed, its step lost between head and tail, which both answer)
    or hangs (client-orchestrated: the client waits on it) running the session's first decode. The step
    failed over after its deadline, the 20 s ceiling (60 s by default); now after a Health probe."""
    dies = ["--in-process-engine", "--fault", f"crash={crash},after=1"]  # the node process dies, not a worker
    mesh.start_nodes([("a-head", "0:10"), ("b-mid", "10:20", dies), ("d-tail", "20:30")], "smollm2", "--engine", "fake")
    client = mesh.client(forwarding=forwarding, step_timeout_s=STEP_TIMEOUT_S)
    first = client.step(StepRequest("s", 0, 0, PROMPT), decode=False)  # b-mid's one step before it dies
    assert first.ok and [h.node_id for h in client.last_hops] == ["a-head", "b-mid", "d-tail"]
    mesh.start_nodes([("c-spare", "10:20")], "smollm2", "--engine", "fake")
    _behind_a_long_prefill(client, forwarding, ["a-head", "b-mid", "d-tail"])
    t0 = time.monotonic()
    res = client.step(StepRequest("s", 0, len(PROMPT), (first.token.token_id,)), decode=True)
    waited_s = time.monotonic() - t0
    print(f"\n{crash} of the middle node behind a long prefill to the step's answer: {waited_s:.2f} s")
    assert res.ok and [first.token.token_id, res.token.token_id] == _fake_greedy(PROMPT, 2)
    assert client.failovers == 1
    assert [h.node_id for h in client.last_hops] == ["a-head", "c-spare", "d-tail"]
    assert waited_s < 10, f"{waited_s:.1f} s: the step waited out its deadline, not a Health probe"
    client.close()


def test_a_step_slow_behind_work_at_a_live_stage_is_waited_for_not_failed_over(mesh, monkeypatch):
    """Every step takes 3 s at the middle node (as behind a long prefill there): past probe_s (2 s) the
    hops' Health is asked, all answer, and the step is waited for: no failover, no replay."""
    probes: list[str] = []
    answers = RemoteStage.answers

    def counted(stage: RemoteStage) -> bool:
        probes.append(stage.node_id)
        return answers(stage)

    monkeypatch.setattr(RemoteStage, "answers", counted)
    mesh.start_nodes([("a-head", "0:10"), ("b-mid", "10:20", ["--in-process-engine", "--fault", "delay=3"]),
                      ("d-tail", "20:30")], "smollm2", "--engine", "fake")
    client = mesh.client(step_timeout_s=STEP_TIMEOUT_S)
    first = client.step(StepRequest("s", 0, 0, PROMPT), decode=False)
    assert first.ok
    _behind_a_long_prefill(client, True, ["a-head", "b-mid", "d-tail"])
    probes.clear()
    t0 = time.monotonic()
    res = client.step(StepRequest("s", 0, len(PROMPT), (first.token.token_id,)), decode=True)
    waited_s = time.monotonic() - t0
    assert res.ok and [first.token.token_id, res.token.token_id] == _fake_greedy(PROMPT, 2)
    assert client.failovers == 0
    assert "b-mid" in probes, "the wait past probe_s asked no Health"
    assert 2.5 < waited_s < 10
    client.close()
