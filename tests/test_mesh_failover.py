"""Real processes on loopback: a tracker, SmolLM2 nodes, and a node killed in the middle of a generation."""

from __future__ import annotations

import re
import threading
import time

import grpc
import numpy as np
import pytest

from meshnet.client.mesh_client import MeshUnavailable
from meshnet.contract import GREEDY, LayerRange, NamedTensor, Outcome, Status, StepRequest
from meshnet.generation import Generation
from meshnet.proto import meshnet_pb2 as pb
from meshnet.local_mesh import load_local_chain
from meshnet.wire.envelope import request_to_frames


def _run_killing(client, tok, prompt_ids, kill, after: int = 10, n: int = 64) -> list[int]:
    gen = Generation(client, tok, prompt_ids, n, GREEDY, stop_at_eog=False)
    for i, _ in enumerate(gen):
        if i + 1 == after:
            kill()
    return gen.result.generated_token_ids


def test_kill_middle_node_with_spare_equals_uninterrupted_run(mesh, tok, solo):
    head, mid, spare, tail = mesh.start_nodes([("a-head", "0:10"), ("b-mid", "10:20"), ("c-spare", "10:20"),
                                               ("d-tail", "20:30")])
    client = mesh.client()
    _, route = client.route()
    in_route = {h.node_id for h in route}
    victim = mid if mid.node_id in in_route else spare
    out = _run_killing(client, tok, solo.prompt_ids(0), victim.kill)
    assert out == solo.greedy(0)
    assert client.failovers == 1
    # Every node released the session when the generation ended.
    survivors = [n for n in (head, mid, spare, tail) if n is not victim]
    assert [n.active_sessions() for n in survivors] == [0, 0, 0]



def test_a_failover_replays_onto_the_spare_that_computes_as_the_dead_node(mesh, tok, solo, caplog):
    """Two spares of the middle range join mid-generation: one with the dead node's thread count, one with
    2 threads (another numerics key: ggml splits long attention rows across threads). The replay goes to
    the one computing alike, silently; when the next session's middle node dies, the other spare takes
    over with a warning that the output continues within tolerance rather than bit for bit (this prompt stays under the 512 cells
    where threads change the bits, so its ids still equal the solo run's)."""
    head, mid, tail = mesh.start_nodes([("a-head", "0:10"), ("b-mid", "10:20"), ("d-tail", "20:30")])
    client = mesh.client()
    spares = []

    def kill_mid():
        spares.extend(mesh.start_nodes([("c-2threads", "10:20", ("--threads", "2")), ("e-alike", "10:20")]))
        mid.kill()

    with caplog.at_level("WARNING", logger="meshnet.client"):
        assert _run_killing(client, tok, solo.prompt_ids(0), kill_mid) == solo.greedy(0)
        keys = {n.info.node_id: n.info.numerics for n in mesh.tracker_stub().ListNodes(pb.Empty(), timeout=5).nodes}
        assert keys["e-alike"] == keys["a-head"] and keys["e-alike"].endswith(" threads=1 weights=repacked")
        assert keys["c-2threads"] == keys["e-alike"].replace(" threads=1 ", " threads=2 ")
        assert [h.node_id for h in client.last_hops] == ["a-head", "e-alike", "d-tail"]
        assert not [r for r in caplog.records if "computes otherwise" in r.getMessage()]
        assert (client.failovers, client.unlike_failovers) == (1, 0)
        victims = []

        def kill_its_mid():  # whichever spare the new session's route took
            victims.append(next(n for n in spares if n.node_id == client.last_hops[1].node_id))
            victims[0].kill()

        assert _run_killing(client, tok, solo.prompt_ids(1), kill_its_mid) == solo.greedy(1)
    assert (client.failovers, client.unlike_failovers) == (2, 1)  # what generate --json reports
    [survivor] = [n.node_id for n in spares if n is not victims[0]]
    assert [h.node_id for h in client.last_hops] == ["a-head", survivor, "d-tail"]
    [warning] = [r.getMessage() for r in caplog.records if "computes otherwise" in r.getMessage()]
    assert f"node {survivor} replaces {victims[0].node_id} on layers [10, 20) but computes otherwise" in warning
    assert "threads=2 vs threads=1" in warning or "threads=1 vs threads=2" in warning
    assert "within tolerance of an uninterrupted run, not bit for bit" in warning
    client.close()


@pytest.mark.parametrize("small", [("--n-ctx", "32"), ("--kv-tokens", "32")], ids=["n-ctx", "kv-pool"])
def test_a_spare_too_small_for_the_session_is_not_failed_over_to(mesh, tok, solo, small):
    """The only spare of the middle range holds 32-token sessions (its context, or its whole KV pool: a
    pool that small registered with the model's context and took routes and failovers, whose every
    session it then refused): new routes keep the 4096-token chain, and when its middle node dies under
    a 64-token session the client does not replay onto the spare (which refused the replay, and the
    request was blamed), but reports that no route holds the session."""
    head, mid, small, tail = mesh.start_nodes([("a-head", "0:10"), ("b-mid", "10:20"),
                                               ("c-small", "10:20", small), ("d-tail", "20:30")])
    client = mesh.client(failover_deadline_s=3)
    _, hops, n_ctx = client.route_with_context()
    assert [h.node_id for h in hops] == ["a-head", "b-mid", "d-tail"] and n_ctx == 4096
    gen = Generation(client, tok, solo.prompt_ids(0), 64, GREEDY, stop_at_eog=False)
    with pytest.raises(MeshUnavailable, match=r"holding fewer than \d+ tokens a session: c-small \(32\)"):
        for i, _ in enumerate(gen):
            if i + 1 == 10:
                mid.kill()
    assert [n.active_sessions() for n in (head, small, tail)] == [0, 0, 0]
    client.close()

def test_a_failover_onto_a_spare_at_its_session_limit_waits_for_room(mesh, tok, solo):
    """The only spare holds its one session when the middle node dies: the replay's first step there is
    refused RESOURCE_EXHAUSTED, and the session failed at once, its user's answer lost mid-way. It now
    waits for room (as a new session does) and finishes as the solo run, once the spare's session ends."""
    head, mid, tail = mesh.start_nodes([("a-head", "0:10"), ("b-mid", "10:20"), ("d-tail", "20:30")])
    client = mesh.client()
    held = []

    def fill_spare_then_kill_mid():
        (spare,) = mesh.start_nodes([("c-spare", "10:20", ["--max-sessions", "1"])])
        stub = spare.stub()
        hidden = NamedTensor.from_numpy("hidden", np.zeros((2, 576), dtype=np.float32))
        frames = request_to_frames(StepRequest("other-user", 1, 0, (1, 2), hidden=hidden), decode=False)
        assert stub.Step(frames[0], timeout=30).n_past == 2  # the spare's one session, another user's
        held.append(spare)
        mid.kill()
        threading.Timer(3.0, lambda: stub.Release(pb.SessionRequest(session_id="other-user"), timeout=5)).start()

    out = _run_killing(client, tok, solo.prompt_ids(2), fill_spare_then_kill_mid, n=32)
    assert out == solo.greedy(2, 32)
    assert client.failovers == 1 and [h.node_id for h in client.last_hops] == ["a-head", "c-spare", "d-tail"]
    client.close()
    assert [n.active_sessions() for n in (head, held[0], tail)] == [0, 0, 0]


def test_kill_without_spare_fails_fast_and_survivors_release(mesh, tok, solo):
    head, mid, tail = mesh.start_nodes([("a-head", "0:10"), ("b-mid", "10:20"), ("d-tail", "20:30")])
    client = mesh.client()
    killed_at = []

    def kill():
        mid.kill()
        killed_at.append(time.monotonic())

    epoch, _ = client.route()
    gen = Generation(client, tok, solo.prompt_ids(0), 64, GREEDY, stop_at_eog=False)
    with pytest.raises(MeshUnavailable, match=r"layers \[10, 20\)"):
        for i, _ in enumerate(gen):
            if i + 1 == 10:
                kill()
    assert time.monotonic() - killed_at[0] < 10
    assert head.active_sessions() == 0 and tail.active_sessions() == 0
    # The survivors are fenced: a step of the failed session still on its way (a stalled node that
    # resumes and passes on a prefill it held) cannot recreate it.
    hidden = NamedTensor.from_numpy("hidden", np.zeros((3, 576), np.float32))
    late = request_to_frames(StepRequest(gen.session_id, epoch, 0, (1, 2, 3), hidden=hidden), False)
    with pytest.raises(grpc.RpcError) as refused:
        list(tail.stub().StepStream(iter(late), timeout=10))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION, refused.value.details()
    assert tail.active_sessions() == 0


def test_a_new_session_waits_for_a_node_the_tracker_just_dropped_to_come_back(mesh, tok, solo):
    """`meshnet up` drops a node from the tracker the moment it exits and restarts it within seconds. A
    `meshnet generate` that had printed its route and opened its session in that gap failed at once ("no
    node serves layers [0, 10)"), where a running generation waits up to the failover deadline for a
    replacement. A client that had a route now waits the same way for its new session's."""
    head, _ = mesh.start_nodes([("a-head", "0:10"), ("d-tail", "10:30")])
    client = mesh.client()
    client.route_with_context()  # what generate prints before its first step
    assert mesh.service.registry.deregister("a-head")  # as `meshnet up` does when a node's process exits
    t0 = time.monotonic()
    # the node is back at its next heartbeat (0.3 s here), told by the tracker it is not registered
    ids = list(Generation(client, tok, solo.prompt_ids(0), 8, GREEDY, stop_at_eog=False))
    assert [e.token.token_id for e in ids] == solo.greedy(0, 8) and time.monotonic() - t0 < client.failover_deadline_s
    # A client the tracker never gave a route is told at once: nothing suggests one is coming.
    head.proc.kill()
    head.proc.wait(timeout=10)
    assert mesh.service.registry.deregister("a-head")
    fresh = mesh.client()
    t0 = time.monotonic()
    with pytest.raises(MeshUnavailable, match=r"layers \[0, 10\)"):
        list(Generation(fresh, tok, solo.prompt_ids(0), 8, GREEDY, stop_at_eog=False))
    assert time.monotonic() - t0 < 1.0


def test_prompts_sessions_and_release_on_one_chain(mesh, smollm2_path, solo):
    mesh.start_nodes([("a-head", "0:10"), ("b-mid", "10:20"), ("d-tail", "20:30")])
    client = mesh.client()

    def greedy(prompt, n, sid):
        res = client.step(StepRequest(sid, 0, 0, tuple(prompt)), decode=False)
        assert res.ok, res.message
        out, pos = [res.token.token_id], len(prompt)
        for _ in range(n - 1):
            res = client.step(StepRequest(sid, 0, pos, (out[-1],)), decode=True)
            assert res.ok, res.message
            out.append(res.token.token_id)
            pos += 1
        return out

    ids = solo.prompt_ids(1)
    # Prompts of 38 and then 39 tokens on the same chain each equal a fresh single-process run.
    local = load_local_chain(str(smollm2_path), [LayerRange(0, 30)], n_threads=1, progress=False)
    for n in (38, 39):
        want = [local.step(StepRequest(f"ref{n}", 0, 0, tuple(ids[:n])), decode=False).token.token_id]
        for k in range(3):
            want.append(local.step(StepRequest(f"ref{n}", 0, n + k, (want[-1],)), decode=True).token.token_id)
        assert greedy(ids[:n], 4, f"p{n}") == want
        client.release(f"p{n}")
    # Two interleaved sessions equal their solo runs.
    solo_a, solo_b = greedy(ids, 8, "solo-a"), greedy(ids[:40], 8, "solo-b")
    client.release("solo-a")
    client.release("solo-b")
    ra = client.step(StepRequest("ia", 0, 0, tuple(ids)), decode=False)
    rb = client.step(StepRequest("ib", 0, 0, tuple(ids[:40])), decode=False)
    a, b = [ra.token.token_id], [rb.token.token_id]
    for k in range(7):
        a.append(client.step(StepRequest("ia", 0, len(ids) + k, (a[-1],)), decode=True).token.token_id)
        b.append(client.step(StepRequest("ib", 0, 40 + k, (b[-1],)), decode=True).token.token_id)
    assert (a, b) == (solo_a, solo_b)
    assert solo_a == solo.greedy(1, 8)
    # A released session id cannot be decoded.
    client.release("ia")
    res = client.step(StepRequest("ia", 0, len(ids) + 7, (a[-1],)), decode=True)
    assert res.status is Status.NOT_FOUND


def test_eight_concurrent_sessions_each_equal_alone(mesh, solo):
    mesh.start_nodes([("a-head", "0:15"), ("d-tail", "15:30")])
    prompts = [solo.prompt_ids(i) for i in range(4)] * 2
    client = mesh.client()
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:
        sid = f"c{i}"
        res = client.step(StepRequest(sid, 0, 0, tuple(prompts[i])), decode=False)
        out, pos = [res.token.token_id], len(prompts[i])
        for _ in range(11):
            res = client.step(StepRequest(sid, 0, pos, (out[-1],)), decode=True)
            out.append(res.token.token_id)
            pos += 1
        client.release(sid)
        results[i] = out

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i in range(8):
        assert results[i] == solo.greedy(i % 4, 12), f"session {i}"


def test_sessions_opening_together_spread_over_two_replicas(mesh, solo):
    """Eight sessions opening at once all took the replica the last heartbeats ranked first, the other
    idle: the tracker now counts the routes it hands a session until the nodes' next heartbeat."""
    head, r1, r2 = mesh.start_nodes([("a-head", "0:15"), ("b-one", "15:30"), ("c-two", "15:30")])
    client = mesh.client()
    opened = [client.step(StepRequest(f"s{i}", 0, 0, tuple(solo.prompt_ids(i % 4))), decode=False)
              for i in range(8)]
    assert all(res.ok for res in opened)
    held = [r1.active_sessions(), r2.active_sessions()]
    # As the tracker's cost would split them given the speeds the two probed (hop_cost: 1/speed x (1 +
    # sessions/16), ties to the first id): a replica probed much faster may rightly take all eight.
    speeds = {n.info.node_id: n.info.decode_tokens_per_s
              for n in mesh.tracker_stub().ListNodes(pb.Empty(), timeout=5).nodes}
    expected = [0, 0]
    for _ in range(8):
        cost = [(1 + expected[i] / 16) / speeds[n] for i, n in enumerate(("b-one", "c-two"))]
        expected[cost.index(min(cost))] += 1
    # before: all eight on the one cheapest at the last heartbeat. A heartbeat whose count was taken before
    # a session opened, read after that session's grant, can move one session (seen: 3/5 for 4/4).
    assert sum(held) == 8 and abs(held[0] - expected[0]) <= 1, (held, expected, speeds)
    for i in range(8):
        client.release(f"s{i}")
    client.close()


def test_node_killed_with_eight_batched_sessions_in_flight(mesh, tok, solo):
    """Eight sessions share the nodes' iterations; the middle replica holding the most of them is killed while
    all are decoding, and each of its sessions fails over to the other, replays, and finishes equal to its
    solo run. (The replicas share new sessions: the one a route query named first may hold none of them.)"""
    head, mid, spare, tail = mesh.start_nodes([("a-head", "0:10"), ("b-mid", "10:20"), ("c-spare", "10:20"),
                                               ("d-tail", "20:30")])
    client = mesh.client()
    n_tokens, started = 24, threading.Barrier(8)
    tokens_seen = threading.Semaphore(0)
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:
        gen = Generation(client, tok, solo.prompt_ids(i % 4), n_tokens, GREEDY, stop_at_eog=False,
                         session_id=f"batched-{i}")
        started.wait()
        for k, _ in enumerate(gen):
            if k == 6:
                tokens_seen.release()
        results[i] = gen.result.generated_token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for _ in range(8):  # every session is past its prefill and decoding
        assert tokens_seen.acquire(timeout=120)
    victim = max((mid, spare), key=lambda n: n.active_sessions())
    assert victim.active_sessions() >= 1
    victim.kill()
    for t in threads:
        t.join(180)
    for i in range(8):
        assert results.get(i) == solo.greedy(i % 4, n_tokens), f"session {i}"
    assert client.failovers >= 1
    survivors = [n for n in (head, mid, spare, tail) if n is not victim]
    assert [n.active_sessions() for n in survivors] == [0, 0, 0]


def test_node_restarted_under_its_id_takes_back_its_range_mid_generation(mesh, tok, solo):
    """No spare: the middle node dies after token 10 and is started again under the same id (as
    ``meshnet up`` or an operator restarts it), at a new address; the client routes through the new
    process, replays the session onto it, and the 64 ids equal the solo run."""
    head, mid, tail = mesh.start_nodes([("a-head", "0:10"), ("b-mid", "10:20"), ("d-tail", "20:30")])
    client = mesh.client(failover_deadline_s=90)
    restarted: list = []

    def restart() -> None:
        deadline = time.monotonic() + 30
        while "b-mid" in mesh.registered() and time.monotonic() < deadline:
            time.sleep(0.05)  # the tracker refuses a live id from another address until it expires
        restarted.extend(mesh.start_nodes([("b-mid", "10:20")]))

    thread = threading.Thread(target=restart)

    def kill():
        mid.kill()
        thread.start()

    out = _run_killing(client, tok, solo.prompt_ids(0), kill)
    thread.join(60)
    assert out == solo.greedy(0)
    assert client.failovers == 1
    assert restarted[0].node_id == "b-mid" and restarted[0].address != mid.address
    client.close()
    assert [n.active_sessions() for n in (head, restarted[0], tail)] == [0, 0, 0]


def test_node_restarted_under_its_id_at_its_own_address_is_failed_at_once(mesh, tok, solo, caplog):
    """No spare: after token 10 the middle node is stopped, so that the next forwarded step reaches it and
    goes no further, then killed and started again at once under the same id and the same ports. That
    step is lost, yet a process answers Health at the old address by the time the client first probes
    (its step deadline and probe_s are 8 s here): the client tells the processes apart by their instance
    ids (Hop, Health), fails the middle node instead of waiting out its 60-s step timeout and blaming the
    tail, and replays onto the new process; the 64 ids equal the solo run."""
    import logging
    import signal

    from mesh_util import free_port

    from meshnet.client.deadline import DeadlinePolicy

    port, data_port = free_port(), free_port()
    ports = ("--port", str(port), "--data-port", str(data_port))
    head, mid, tail = mesh.start_nodes([("a-head", "0:10"), ("b-mid", "10:20", ports), ("d-tail", "20:30")])
    client = mesh.client(failover_deadline_s=30, step_deadline=DeadlinePolicy(floor_s=8.0, probe_s=8.0))
    restarted: list = []

    def restart() -> None:
        time.sleep(0.5)  # the next step is sent meanwhile and sits in the stopped node's socket
        mid.kill()
        restarted.extend(mesh.start_nodes([("b-mid", "10:20", ports)]))

    thread = threading.Thread(target=restart)

    def kill():
        mid.proc.send_signal(signal.SIGSTOP)
        thread.start()

    with caplog.at_level(logging.INFO, logger="meshnet.client"):
        out = _run_killing(client, tok, solo.prompt_ids(0), kill)
    thread.join(60)
    assert out == solo.greedy(0)
    assert client.failovers == 1
    assert restarted[0].node_id == "b-mid" and restarted[0].address == mid.address
    messages = [r.getMessage() for r in caplog.records]
    assert f"node b-mid at {mid.address} restarted since it was routed to (another process answers)" in messages
    assert not any(f"node d-tail at {tail.address}:" in m and "failing over" in m for m in messages), messages
    # The warning says how long the client goes on looking (the failover deadline: 30 s here, from the failure).
    [failing] = [m for m in messages if "failing over" in m]
    assert re.search(r"; failing over \(up to (29|30) s\)$", failing), failing
    client.close()
    assert [n.active_sessions() for n in (head, restarted[0], tail)] == [0, 0, 0]


def test_replay_onto_a_node_holding_a_stale_copy_of_the_session(mesh, tok, solo):
    """The head dies after token 10 and the session is replayed from hop 0, through the tail it already
    ran on. The tail's copy must go before the replay reaches it; here the first unconditional release
    sent to the tail is lost (as one is when the node is stalled or overloaded for a moment), so only a
    release fenced at the new epoch, sent right before the replay, clears it. The ids equal the solo
    run and no node keeps the session."""
    head, spare, tail = mesh.start_nodes([("a-head", "0:15"), ("b-head", "0:15"), ("d-tail", "15:30")])
    client = mesh.client()
    _, route = client.route()
    victim = head if route[0].node_id == head.node_id else spare
    lost = []

    def kill():
        tail_stage = client._sessions[gen.session_id].hops[1]
        real = tail_stage.release

        def release(session_id, superseded_by=0, timeout_s=5.0):
            if superseded_by == 0 and not lost:
                lost.append(session_id)
                return Outcome(Status.FAILED_PRECONDITION, "DEADLINE_EXCEEDED: lost")
            return real(session_id, superseded_by, timeout_s)

        tail_stage.release = release
        victim.kill()

    gen = Generation(client, tok, solo.prompt_ids(0), 64, GREEDY, stop_at_eog=False)
    for i, _ in enumerate(gen):
        if i + 1 == 10:
            kill()
    assert gen.result.generated_token_ids == solo.greedy(0)
    assert client.failovers == 1
    survivor = spare if victim is head else head
    assert [survivor.active_sessions(), tail.active_sessions()] == [0, 0]
    client.close()


def test_a_registration_claiming_all_layers_at_a_head_nodes_address_is_failed_over(mesh, tok, solo):
    """A registration that claims layers 0:30 at the address of a node serving 0:15 (a liar, or a stale
    entry): the node answered hidden states where the route wanted the tail's token, and generation died
    of an AssertionError. The client now fails that hop over and the answer is unchanged."""
    head, tail = mesh.start_nodes([("b-head", "0:15"), ("c-tail", "15:30")])
    stub = mesh.tracker_stub()
    liar = next(n.info for n in stub.ListNodes(pb.Empty(), timeout=5).nodes if n.info.node_id == "b-head")
    liar.node_id, liar.layers.end, liar.decode_tokens_per_s = "a-liar", 30, 1e6
    stub.Register(liar, timeout=5)
    stop = threading.Event()

    def heartbeat():
        while not stop.wait(0.1):
            stub.Heartbeat(pb.HeartbeatRequest(node_id="a-liar"), timeout=5)

    beating = threading.Thread(target=heartbeat, daemon=True)
    beating.start()
    try:
        client = mesh.client()
        assert [h.node_id for h in client.route()[1]] == ["a-liar"]
        assert _run_killing(client, tok, solo.prompt_ids(0), lambda: None, n=16) == solo.greedy(0)[:16]
        assert client.failovers == 1 and [h.node_id for h in client.last_hops] == ["b-head", "c-tail"]
        client.close()
    finally:
        stop.set()
        beating.join(5)


def test_new_sessions_route_around_a_node_this_client_cannot_reach(mesh, tok, solo, monkeypatch):
    """A node the tracker lists but this client cannot reach (it advertises a name only its own network
    resolves): the first session pays a failover onto the two-hop chain, the next ones are routed around
    it at once instead of each paying its own."""
    from meshnet.tracker import routing

    # Every hop costs the same here, so that the one-hop route is the tracker's first choice whatever each
    # node's start-up speed probe measured (on a busy machine the whole model's probe, taken at a bad moment,
    # made the two halves look cheaper).
    monkeypatch.setattr(routing, "hop_cost", lambda node: 1.0)
    mesh.start_nodes([("a-unreachable", "0:30", ("--advertise", "a-unreachable.invalid:9512")),
                      ("b-head", "0:15"), ("c-tail", "15:30")])
    client = mesh.client()
    _, plain = client.route()
    assert [h.node_id for h in plain] == ["a-unreachable"]  # one hop is cheaper than two
    assert _run_killing(client, tok, solo.prompt_ids(0), lambda: None, n=16) == solo.greedy(0)[:16]
    assert client.failovers == 1 and [h.node_id for h in client.last_hops] == ["b-head", "c-tail"]
    assert _run_killing(client, tok, solo.prompt_ids(1), lambda: None, n=16) == solo.greedy(1)[:16]
    assert client.failovers == 1 and [h.node_id for h in client.last_hops] == ["b-head", "c-tail"]
    client.close()


def test_the_apis_metrics_count_a_failover_over_the_mesh(mesh, smollm2_path):
    """Over a mesh, `/metrics` said nothing of failovers: after three, only an error counter had moved. The
    API over a mesh with a spare: a streamed greedy answer whose middle node is killed mid-stream ends as
    the same request did before, and `/metrics` counts the failover."""
    import json

    from fastapi.testclient import TestClient

    from meshnet.api.app import create_app
    from meshnet.api.backend import mesh_backend

    head, mid, spare, tail = mesh.start_nodes([("a-head", "0:10"), ("b-mid", "10:20"), ("c-spare", "10:20"),
                                               ("d-tail", "20:30")])
    body = {"prompt": "The history of the lighthouse", "max_tokens": 48, "temperature": 0, "ignore_eos": True,
            "stream": True}
    backend = mesh_backend(mesh.tracker, str(smollm2_path))
    try:
        with TestClient(create_app(backend)) as http:

            def answer(kill_after: int | None = None) -> str:
                text = []
                with http.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    for line in r.iter_lines():
                        if not line.startswith("data: {"):
                            continue
                        chunk = json.loads(line[6:])
                        assert chunk["choices"][0]["finish_reason"] in (None, "length"), chunk
                        text.append(chunk["choices"][0]["text"])
                        if len(text) == kill_after:
                            next(n for n in (mid, spare) if n.active_sessions()).kill()
                return "".join(text)

            def figures() -> dict[str, float]:
                return {line.split()[0]: float(line.split()[1]) for line in http.get("/metrics").text.splitlines()
                        if line.startswith("meshnet_mesh_")}

            alone = answer()
            assert figures() == {"meshnet_mesh_failovers_total": 0.0, "meshnet_mesh_unlike_failovers_total": 0.0,
                                 "meshnet_mesh_orphan_releases_pending": 0.0, "meshnet_mesh_blocked_links": 0.0}
            assert answer(kill_after=8) == alone
            after = figures()
            assert after["meshnet_mesh_failovers_total"] == 1.0
            assert after["meshnet_mesh_unlike_failovers_total"] == 0.0  # the spare computes as the dead node
            assert after["meshnet_mesh_orphan_releases_pending"] == 1.0  # the dead node's copy, never confirmed
    finally:
        backend.close()
