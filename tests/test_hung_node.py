"""A node that stops answering without dying (SIGSTOP): failed over in seconds, and the session it
held is freed once it comes back."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from mesh_util import wait_for
from meshnet.client.orphans import OrphanReleaser
from meshnet.contract import GREEDY, ArtifactId, LayerRange, Outcome, Status, StepRequest
from meshnet.load_spec import LoadSpec
from meshnet.engine.fake import FakeEngine, FakeModel
from meshnet.generation import Generation


def test_stopped_middle_node_fails_over_in_seconds_and_frees_its_session_on_resume(mesh, tok, solo):
    head, mid, spare, tail = mesh.start_nodes([("a-head", "0:10"), ("b-mid", "10:20"), ("c-spare", "10:20"),
                                               ("d-tail", "20:30")])
    client = mesh.client()
    _, route = client.route()
    victim = mid if mid.node_id in {h.node_id for h in route} else spare
    gen = Generation(client, tok, solo.prompt_ids(0), 64, GREEDY, stop_at_eog=False)
    stopped_at, stall_s = None, None
    try:
        for i, _ in enumerate(gen):
            if stopped_at is not None and stall_s is None:
                stall_s = time.monotonic() - stopped_at  # the token that waited out the failover
            if i + 1 == 10:
                victim.proc.send_signal(signal.SIGSTOP)
                stopped_at = time.monotonic()
        assert gen.result.generated_token_ids == solo.greedy(0)
        assert client.failovers == 1
        print(f"\nSIGSTOP to the next token: {stall_s:.2f} s")
        assert stall_s < 10  # the old fixed step timeout alone was 60 s
        # The generation ended: the route's nodes hold nothing; the stopped one still holds its copy.
        assert [n.active_sessions() for n in (head, tail)] == [0, 0]
        assert client.orphans.pending() == 1
    finally:
        victim.proc.send_signal(signal.SIGCONT)
    resumed_at = time.monotonic()
    freed_s = wait_for(lambda: victim.active_sessions() == 0, 5.0)
    print(f"SIGCONT to 0 sessions on the resumed node: {time.monotonic() - resumed_at:.2f} s")
    assert freed_s is not None, f"resumed node still holds {victim.active_sessions()} session(s)"
    assert wait_for(lambda: client.orphans.pending() == 0, 5.0) is not None
    assert client.orphans.released == 1
    client.close()


@pytest.mark.parametrize("forwarding", [False, True])
def test_a_node_stopped_before_a_clients_first_step_there_is_left_in_seconds(mesh, tok, solo, forwarding):
    """A hop this client has not timed got the whole step timeout (60 s) as its deadline: a fresh API's
    first request waited a minute on a stopped node with a spare ready. It now gets a few seconds, then
    its Health is asked."""
    head, mid, spare, tail = mesh.start_nodes([("a-head", "0:10"), ("b-mid", "10:20"), ("c-spare", "10:20"),
                                               ("d-tail", "20:30")])
    client = mesh.client(forwarding=forwarding)
    _, route = client.route()
    victim = mid if mid.node_id in {h.node_id for h in route} else spare
    victim.proc.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        gen = Generation(client, tok, solo.prompt_ids(1), 16, GREEDY, stop_at_eog=False)
        tokens = iter(gen)
        next(tokens)
        first_token_s = time.monotonic() - t0
        for _ in tokens:
            pass
        assert gen.result.generated_token_ids == solo.greedy(1, 16)
        assert client.failovers == 1 and victim.node_id not in {h.node_id for h in client.last_hops}
        print(f"\nfirst token past a stopped node: {first_token_s:.2f} s")
        assert first_token_s < 30  # it was the 60 s step timeout
    finally:
        victim.proc.send_signal(signal.SIGCONT)
    client.close()


def test_the_only_node_of_a_range_stopped_then_resumed_takes_its_session_back(mesh, tok, solo):
    """No spare: the middle node stops after token 10 and resumes 3 s later, within the client's
    failover deadline. The client routes through it again (it answers Health at its old address),
    has it free its stale copy of the session, replays, and the 64 ids equal the solo run."""
    head, mid, tail = mesh.start_nodes([("a-head", "0:10"), ("b-mid", "10:20"), ("d-tail", "20:30")])
    client = mesh.client()
    gen = Generation(client, tok, solo.prompt_ids(0), 64, GREEDY, stop_at_eog=False)
    resume = threading.Timer(3.0, mid.proc.send_signal, args=(signal.SIGCONT,))
    try:
        for i, _ in enumerate(gen):
            if i + 1 == 10:
                mid.proc.send_signal(signal.SIGSTOP)
                resume.start()
    finally:
        resume.join(10)
        mid.proc.send_signal(signal.SIGCONT)
    assert gen.result.generated_token_ids == solo.greedy(0)
    assert client.failovers == 1
    assert (client.orphans.pending(), client.orphans.released) == (0, 0)  # freed before the replay
    assert [n.active_sessions() for n in (head, mid, tail)] == [0, 0, 0]
    client.close()


def test_node_stopped_when_its_session_ends_frees_the_session_on_resume(mesh, solo):
    """The generation ends while a node of its route is stopped: the release it could not deliver is
    retried in the background, so the node frees the session once it runs again (not minutes later,
    at its idle sweep)."""
    head, tail = mesh.start_nodes([("a-head", "0:15"), ("d-tail", "15:30")])
    client = mesh.client()
    res = client.step(StepRequest("ends-while-stopped", 0, 0, tuple(solo.prompt_ids(0))), decode=False)
    assert res.ok and res.token.token_id == solo.greedy(0, 1)[0]
    assert [head.active_sessions(), tail.active_sessions()] == [1, 1]
    tail.proc.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        client.release("ends-while-stopped")
        print(f"\nrelease with a stopped node returned after {time.monotonic() - t0:.2f} s")
        assert head.active_sessions() == 0
    finally:
        tail.proc.send_signal(signal.SIGCONT)
    freed_s = wait_for(lambda: tail.active_sessions() == 0, 10.0)
    assert freed_s is not None, f"resumed node still holds {tail.active_sessions()} session(s)"
    print(f"SIGCONT to 0 sessions: {freed_s:.2f} s")
    client.close()


# ---- the pieces, without processes ---------------------------------------------------------------

def _fake(layers=LayerRange(0, 30)) -> FakeEngine:
    engine = FakeEngine(FakeModel())
    assert engine.load(LoadSpec(path="", artifact=ArtifactId("", layers))).ok
    return engine


def test_superseded_release_frees_older_sessions_only_and_fences_their_old_steps():
    engine = _fake()
    for sid, epoch in (("moved", 3), ("back", 5)):
        assert engine.prefill(StepRequest(sid, epoch, 0, (1, 2, 3))).ok
    assert engine.release_superseded("moved", 4).ok
    assert engine.release_superseded("back", 5).ok  # routed back here at that epoch: kept
    assert engine.session_ids() == ["back"]
    # A step sent before the move, arriving late, cannot recreate the session...
    late = engine.prefill(StepRequest("moved", 3, 0, (1, 2, 3)))
    assert late.status is Status.FAILED_PRECONDITION and "moved to epoch 4" in late.message
    assert engine.session_ids() == ["back"]
    # ...but the session's own client may bring it back at the new epoch.
    assert engine.prefill(StepRequest("moved", 4, 0, (1, 2, 3))).ok
    assert sorted(engine.session_ids()) == ["back", "moved"]


class _FlakyStage:
    """Answers release only from the ``answers_from``-th call on (a stopped node resuming)."""

    node_id = "stalled"

    def __init__(self, answers_from: int, engine: FakeEngine) -> None:
        self.calls: list[tuple[str, int, float]] = []
        self.answers_from, self.engine = answers_from, engine

    def release(self, session_id: str, superseded_by: int = 0, timeout_s: float = 5.0) -> Outcome:
        self.calls.append((session_id, superseded_by, timeout_s))
        if len(self.calls) < self.answers_from:
            return Outcome(Status.FAILED_PRECONDITION, "DEADLINE_EXCEEDED: no answer")
        return self.engine.release_superseded(session_id, superseded_by)


def test_orphan_releaser_retries_until_the_node_answers():
    engine = _fake()
    assert engine.prefill(StepRequest("s", 1, 0, (1, 2))).ok
    stage = _FlakyStage(answers_from=3, engine=engine)
    releaser = OrphanReleaser(attempt_timeout_s=0.5, retry_s=0.05)
    releaser.add(stage, "s", 2)
    assert wait_for(lambda: releaser.pending() == 0, 5.0) is not None
    assert stage.calls == [("s", 2, 0.5)] * 3
    assert (releaser.released, engine.session_ids()) == (1, [])
    releaser.close()


def test_a_closing_client_tries_each_pending_release_once_more():
    """`meshnet generate` exits right after its failover: the node it left, resumed meanwhile, kept the
    session (and its KV reservation) until its idle sweep, 300 s later."""
    engine = _fake()
    assert engine.prefill(StepRequest("s", 1, 0, (1, 2))).ok
    stage = _FlakyStage(answers_from=2, engine=engine)
    releaser = OrphanReleaser(attempt_timeout_s=0.5, retry_s=60.0)  # the next retry would be a minute away
    releaser.add(stage, "s", 2)
    # the first attempt failed and the release waits for its next one
    assert wait_for(lambda: len(stage.calls) == 1 and releaser._attempting == 0, 5.0) is not None
    assert engine.session_ids() == ["s"] and releaser.pending() == 1
    releaser.close(last_try_s=0.5)
    assert stage.calls == [("s", 2, 0.5), ("s", 2, 0.5)]
    assert (releaser.released, engine.session_ids()) == (1, [])


def test_orphan_releaser_gives_up_after_its_horizon():
    stage = _FlakyStage(answers_from=10**9, engine=_fake())
    releaser = OrphanReleaser(horizon_s=0.3, retry_s=0.05)
    releaser.add(stage, "s", 2)
    assert wait_for(lambda: releaser.pending() == 0, 5.0) is not None
    assert releaser.released == 0 and 3 <= len(stage.calls) <= 10
    releaser.close()


@pytest.mark.parametrize("victim_at", [1, 0])
def test_steps_lost_inside_a_killed_node_fail_over_once_another_session_finds_it_down(mesh, solo, victim_at):
    """Two sessions' decode steps sit inside the middle node when it is killed; nothing answers for them,
    so each waited out its own deadline at the tail (4-8 s under load; 20 s here). A third session's step
    is refused by the dead node at once: from then on the two stop waiting too, and all three fail over
    to the spare with the ids of the solo runs. (Killed, the head breaks the connections its callers
    wait on, so it needs none of this: the same holds for it.)"""
    from meshnet.client.deadline import DeadlinePolicy

    ranges = ["0:10", "10:20", "20:30"]
    nodes = mesh.start_nodes([("a-head", ranges[0]), ("b-mid", ranges[1]), ("d-tail", ranges[2])])
    victim = nodes[victim_at]
    # Health first asked at 20 s too: the lost steps stop waiting on the finding alone.
    client = mesh.client(step_timeout_s=30, step_deadline=DeadlinePolicy(floor_s=20, ceiling_s=30, probe_s=20))
    first = {}
    for i in range(3):  # every session through the victim
        res = client.step(StepRequest(f"s{i}", 0, 0, tuple(solo.prompt_ids(i))), decode=False)
        assert res.ok and res.token.token_id == solo.greedy(i, 1)[0]
        first[i] = res.token.token_id
    mesh.start_nodes([("c-spare", ranges[victim_at])])

    def decode(i: int) -> StepRequest:
        return StepRequest(f"s{i}", 0, len(solo.prompt_ids(i)), (first[i],))

    got: dict[int, object] = {}

    def run(i: int) -> None:
        got[i] = client.step(decode(i), decode=True)

    victim.proc.send_signal(signal.SIGSTOP)
    waiting = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for t in waiting:
        t.start()
    time.sleep(1.0)  # both steps forwarded into the stopped node
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(10)
    t0 = time.monotonic()
    run(2)  # refused by the dead node at once: the client records it
    for t in waiting:
        t.join(30)
    waited_s = time.monotonic() - t0
    print(f"\nthe two lost steps answered {waited_s:.2f} s after the third found the node down")
    assert waited_s < 10, f"the lost steps waited {waited_s:.1f} s: their 20 s deadline, not the finding"
    for i in range(3):
        assert got[i].ok and got[i].token.token_id == solo.greedy(i, 2)[1]
    assert client.failovers == 3
    client.close()
