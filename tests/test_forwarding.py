"""Node-to-node forwarding: the head gets token ids, each stage sends its output to the next, the tail's
token comes to the client's await. Real SmolLM2 nodes on loopback, and the await registry alone."""

from __future__ import annotations

import logging
import socket
import time

import pytest

from mesh_util import wait_for

from meshnet.client.mesh_client import MeshClient
from meshnet.contract import GREEDY
from meshnet.generation import Generation
from meshnet.node.forwarding import AwaitedOutcomes
from meshnet.node.service import StepOutcome
from meshnet.proto import meshnet_pb2 as pb
from meshnet.wire.data_plane import AWAIT, FORWARD, ERROR, encode_messages, recv_message, decode_error

N = 32


def _generate(client, tok, prompt_ids, n: int = N, kill=None, after: int = 8) -> list[int]:
    gen = Generation(client, tok, prompt_ids, n, GREEDY, stop_at_eog=False)
    for i, _ in enumerate(gen):
        if kill is not None and i + 1 == after:
            kill()
    return gen.result.generated_token_ids


def generate_recording_steps(client: MeshClient, tok, prompt_ids, n: int) -> tuple[list[int], list]:
    """Greedy ids of ``n`` tokens, and the steps the client recorded for the session (read before its
    release at the end)."""
    gen = Generation(client, tok, prompt_ids, n, GREEDY, stop_at_eog=False)
    steps = []
    for _ in gen:
        steps = client._sessions[next(iter(client._sessions))].steps
    return gen.result.generated_token_ids, steps


def test_forwarded_generation_equals_solo_and_the_client_keeps_no_hidden_states(mesh, tok, solo):
    nodes = mesh.start_nodes([("a-head", "0:10"), ("b-mid", "10:20"), ("c-tail", "20:30")])
    client = mesh.client(forwarding=True)
    ids, steps = generate_recording_steps(client, tok, solo.prompt_ids(0), N)
    assert ids == solo.greedy(0, N)
    # Every step was forwarded: the client recorded token ids only, no hop's hidden states.
    assert len(steps) == N and {rec.through for rec in steps} == {1}
    assert all(x is None for rec in steps for x in rec.inputs)
    assert client.failovers == 0
    assert [n.active_sessions() for n in nodes] == [0, 0, 0]
    client.close()


@pytest.mark.parametrize("victim_range", ["10:20", "20:30"])
def test_a_node_killed_while_forwarding_is_replaced_with_identical_output(mesh, tok, solo, victim_range, caplog):
    specs = [("a-head", "0:10"), ("b-mid", "10:20"), ("c-tail", "20:30")]
    spare_id = "z-spare-mid" if victim_range == "10:20" else "z-spare-tail"
    nodes = mesh.start_nodes(specs + [(spare_id, victim_range)])
    client = mesh.client(forwarding=True)
    _, route = client.route()
    in_route = {h.node_id for h in route}
    victim = next(n for n in nodes if n.node_id in in_route and n.node_id.endswith(
        ("mid", "spare-mid") if victim_range == "10:20" else ("tail", "spare-tail")))
    with caplog.at_level(logging.WARNING, logger="meshnet.client"):
        out = _generate(client, tok, solo.prompt_ids(1), kill=victim.kill)
    assert out == solo.greedy(1, N)
    assert client.failovers == 1
    client.close()
    assert [n.active_sessions() for n in nodes if n is not victim] == [0, 0, 0]
    if victim_range == "10:20":  # the head found it dead: the failure names the dead node, and says who saw it
        assert any(f"node {victim.node_id} at {victim.address}: UNAVAILABLE: the hop before it could not forward "
                   in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_a_head_killed_while_forwarding_is_rebuilt_alone_and_the_hops_after_it_keep_their_caches(mesh, tok, solo):
    """A forwarded step records only the head's inputs, so a failover replayed every hop of the route from
    the token ids, one after the other: a dead head cost each session a replay through all three stages.
    Only the new head is rebuilt now; the middle and the tail keep their caches (the retried step rolls
    them back, should they have run it), and the output is the same."""
    nodes = mesh.start_nodes([("a-head", "0:10"), ("z-spare-head", "0:10"), ("b-mid", "10:20"), ("c-tail", "20:30")])
    client = mesh.client(forwarding=True)
    _, route = client.route()
    victim = next(n for n in nodes if n.node_id == route[0].node_id)
    spare = next(n for n in nodes if n.node_id.endswith("head") and n is not victim)
    kept = [n for n in nodes if n.node_id in ("b-mid", "c-tail")]
    prompt = solo.prompt_ids(2)

    def counts(node) -> tuple[int, int]:
        m = node.stub().Metrics(pb.Empty(), timeout=5)
        return m.prefill_tokens, m.decode_tokens

    before = {n.node_id: counts(n) for n in [*kept, spare]}  # a node's speed probe at start counts too
    gen, steps = Generation(client, tok, prompt, N, GREEDY, stop_at_eog=False), []
    for i, _ in enumerate(gen):
        steps = client._sessions[next(iter(client._sessions))].steps
        if i + 1 == 8:
            victim.kill()
    assert gen.result.generated_token_ids == solo.greedy(2, N) and client.failovers == 1
    # the step retried after the failover says rollback (a kept hop may have run it), and only that one
    assert [i for i, rec in enumerate(steps) if rec.req.rollback] == [8]
    stepped = {n.node_id: tuple(a - b for a, b in zip(counts(n), before[n.node_id])) for n in [*kept, spare]}
    # each kept hop prefilled the prompt once and decoded each later token once (the retried step perhaps
    # twice); the new head took the replay of the 8 steps before the kill, then the rest
    assert [stepped[n.node_id][0] for n in kept] == [len(prompt)] * 2, stepped
    assert all(N - 1 <= stepped[n.node_id][1] <= N for n in kept), stepped
    assert stepped[spare.node_id] == (len(prompt), N - 1), stepped
    client.close()
    assert [n.active_sessions() for n in nodes if n is not victim] == [0, 0, 0]


def test_hops_kept_after_a_head_that_died_once_it_forwarded_roll_the_retried_step_back(mesh, tok, solo, monkeypatch):
    """The head forwarded a step, the middle and the tail ran it, and the head died before answering the
    client: the client fails over with those two hops kept, holding one step more than its log. The retried
    step says rollback, so they cut it back and run it again (without it they refused it FAILED_PRECONDITION,
    the session lost); the output equals the uninterrupted run."""
    from meshnet.client.remote import StageFailure

    nodes = mesh.start_nodes([("a-head", "0:10"), ("z-spare-head", "0:10"), ("b-mid", "10:20"), ("c-tail", "20:30")])
    client = mesh.client(forwarding=True)
    real, calls = MeshClient._run_forwarded, []

    def head_dies_after_forwarding(self, log_, req, decode):
        calls.append(req.position)
        if len(calls) == 9:
            real(self, log_, req, decode)  # every hop ran it: the tail sampled its token
            head = next(n for n in nodes if n.node_id == log_.hops[0].node_id)
            head.kill()
            raise StageFailure(head.node_id, head.address, "UNAVAILABLE", "the head died before it answered")
        return real(self, log_, req, decode)

    monkeypatch.setattr(MeshClient, "_run_forwarded", head_dies_after_forwarding)
    kept = [n for n in nodes if n.node_id in ("b-mid", "c-tail")]
    before = [n.stub().Metrics(pb.Empty(), timeout=5).decode_tokens for n in kept]
    assert _generate(client, tok, solo.prompt_ids(3)) == solo.greedy(3, N) and client.failovers == 1
    after = [n.stub().Metrics(pb.Empty(), timeout=5).decode_tokens for n in kept]
    assert [a - b for a, b in zip(after, before)] == [N, N]  # the retried step ran twice there, no replay
    client.close()


def _firewall_before(monkeypatch, mesh, node_id: str) -> str:
    """Emulate a firewall that lets the client reach ``node_id``'s data port but not the nodes before it:
    the route the client hands on to the nodes names a closed port (returned) for it, while the client's
    own connections to it go to its real one. The tracker's node list holds the closed port too (nodes
    send on only to listed data addresses), as it lists a real port behind a firewall."""
    import dataclasses

    from meshnet.client.remote import RemoteStage

    with socket.socket() as s:  # a port nothing listens on: connecting is refused at once
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    real = RemoteStage.forward_hop

    def through_a_firewall(self):
        hop = real(self)
        if self.node_id == node_id:
            hop.data_address = closed
        return hop

    monkeypatch.setattr(RemoteStage, "forward_hop", through_a_firewall)
    listed = mesh.service.registry.statuses

    def listed_with_the_closed_port():
        out = listed()
        return out + [dataclasses.replace(s, record=dataclasses.replace(s.record, node_id=f"{node_id}-firewalled",
                                                                          data_address=closed))
                      for s in out if s.record.node_id == node_id]

    monkeypatch.setattr(mesh.service.registry, "statuses", listed_with_the_closed_port)
    return closed


def test_a_link_between_two_nodes_that_fails_is_stepped_by_the_client_with_identical_output(
        mesh, tok, solo, monkeypatch, caplog):
    """A firewall lets the client reach both nodes but not the head the tail's data port. Before, every attempt failed the tail over onto the same route, 27
    times, until the session gave up; now the client blocks that link, replays the session once and steps
    it itself, with the solo run's tokens."""
    closed = _firewall_before(monkeypatch, mesh, "b-tail")
    nodes = mesh.start_nodes([("a-head", "0:15"), ("b-tail", "15:30")])
    client = mesh.client(forwarding=True, failover_deadline_s=5.0)
    with caplog.at_level(logging.WARNING, logger="meshnet.client"):
        ids, steps = generate_recording_steps(client, tok, solo.prompt_ids(2), N)
    assert ids == solo.greedy(2, N)
    assert client.failovers == 1  # the one replay onto the same two nodes
    assert len(steps) == N and {rec.through for rec in steps} == {2}  # every step stepped by the client
    warned = [r.getMessage() for r in caplog.records if "cannot reach node b-tail" in r.getMessage()]
    assert len(warned) == 1
    assert "node a-head cannot reach node b-tail, which answers this client's health checks" in warned[0]
    assert "open the data port of b-tail to a-head" in warned[0]
    # A second session on the same client is stepped by it from the start: no replay, no new warning.
    ids = _generate(client, tok, solo.prompt_ids(3))
    assert ids == solo.greedy(3, N) and client.failovers == 1
    client.close()
    assert [n.active_sessions() for n in nodes] == [0, 0]
    # The head says so in its own log, once (its operator looks there for the firewall).
    head_log = nodes[0].log_path.read_text()
    assert head_log.count(f"this node could not forward to its data plane at {closed}") == 1, head_log[-2000:]
    # Refused (nothing listening there, or a firewall's reject): the node's log names both causes.
    assert ("(next node b-tail refused the connection: it has stopped or is restarting (clients fail over), or a "
            "firewall rejects this node; if that node is up") in head_log, head_log[-2000:]


def test_a_failed_link_in_the_middle_of_a_route_is_found_by_health_and_stepped_by_the_client(
        mesh, tok, solo, monkeypatch, caplog):
    """The middle node cannot reach the tail's data port: it could tell only the tail, so nobody answered
    the client's await: every node answering Health, the client waited each attempt out, failed the tail
    over onto the same route again and again, and gave the session up after two minutes. The middle node's
    Health now names the node it could not reach; the client blocks that link after the step's deadline,
    replays once, and steps the route itself."""
    import time

    _firewall_before(monkeypatch, mesh, "c-tail")
    nodes = mesh.start_nodes([("a-head", "0:10"), ("b-mid", "10:20"), ("c-tail", "20:30")])
    client = mesh.client(forwarding=True, failover_deadline_s=5.0)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="meshnet.client"):
        ids, steps = generate_recording_steps(client, tok, solo.prompt_ids(0), N)
    took = time.monotonic() - started
    assert ids == solo.greedy(0, N)
    assert client.failovers == 1 and {rec.through for rec in steps} == {3}
    warned = [r.getMessage() for r in caplog.records if "cannot reach node c-tail" in r.getMessage()]
    assert len(warned) == 1
    assert "node b-mid cannot reach node c-tail, which answers this client's health checks" in warned[0]
    assert "could not forward the step to it (its Health says so), while this client waited on node c-tail" \
        in warned[0]
    assert took < 40, took  # one step's deadline (seconds), not the 60 s of the node's timeout
    client.close()
    assert [n.active_sessions() for n in nodes] == [0, 0, 0]


def test_a_forwarded_step_reaching_a_node_of_other_layers_is_refused_not_run(mesh, tok, solo, monkeypatch):
    """With the tracker away, the middle node restarts serving other layers at the same address: the head
    went on forwarding the session's steps there, and the replay after its NOT_FOUND ran them on layers
    15:20 in place of 10:20 (wrong tokens, no error). Each forwarded hop now names the range the route
    gave it, and the node refuses other ranges: the session fails (no other route without the tracker)
    rather than go on wrong. The client's health probe of the last route, whose answer is kept a second,
    is made to miss the change here, as it does within that second."""
    from meshnet.client.mesh_client import MeshUnavailable
    from meshnet.client.router import Router

    monkeypatch.setattr(Router, "_serves_other", lambda self, stage, caps: None)
    nodes = mesh.start_nodes([("a-head", "0:10"), ("b-mid", "10:20"), ("c-tail", "20:30")])
    # no ledger reports (the tracker stays away) and a short failover deadline: the session fails either way
    client = mesh.client(forwarding=True, report_deliveries=False, failover_deadline_s=2.0)
    _, route = client.route()
    grpc_port, data_port = route[1].address.rsplit(":", 1)[1], route[1].data_pool.address.rsplit(":", 1)[1]
    other = []

    def restart_mid_with_other_layers():
        mesh.server.stop(grace=0).wait()
        nodes[1].kill()
        other.append(mesh.spawn_node("15:20", "b-mid", "smollm2", "--port", grpc_port, "--data-port", data_port))
        assert other[0].stdout.readline().startswith("MESHNET_NODE_READY")

    try:
        # The probe, made blind to the range here, takes the new process for the route's node; its refusal
        # of the range fails the session.
        with pytest.raises(MeshUnavailable, match="node b-mid serves layers 15:20, but the step was routed to it "
                                                  "for layers 10:20; get a new route"):
            out = _generate(client, tok, solo.prompt_ids(3), kill=restart_mid_with_other_layers)
            assert out == solo.greedy(3, N)  # never reached: before, the wrong tokens came here
    finally:
        for p in other:
            p.kill()
            p.wait(10)
    client.close()


def test_a_node_of_another_range_refuses_first_and_names_the_routes_node():
    """A node now serving 0:30 where the route expects 0:10 judged the step's next hops by its own range
    first (INVALID_ARGUMENT, which ends the session) instead of refusing it as a node gone from the route
    (UNAVAILABLE: fail over); and a forwarded step it refused was reported under its own id, which the
    client does not know (it blamed the route's tail)."""
    from meshnet.contract import ArtifactId, LayerRange, StepRequest
    from meshnet.engine.fake import FakeEngine, FakeModel
    from meshnet.load_spec import LoadSpec
    from meshnet.node.service import NodeService
    from meshnet.wire.envelope import request_to_frames

    eng = FakeEngine(FakeModel())
    assert eng.load(LoadSpec(path="", artifact=ArtifactId(FakeModel().sha256, LayerRange(0, 30)))).ok
    svc = NodeService(eng, "new-process", pb.ModelIdentity(sha256=FakeModel().sha256))
    hops = [pb.ForwardHop(node_id=n, data_address=f"127.0.0.1:{p}", layers=pb.LayerRange(start=s, end=e))
            for n, p, s, e in (("b-mid", 1, 10, 20), ("c-tail", 2, 20, 30))]
    req = StepRequest("s1", 1, 0, (1, 2, 3))
    head = pb.ForwardHop(node_id="a-head", layers=pb.LayerRange(start=0, end=10))
    out = svc.run_step(request_to_frames(req, False, next_hops=hops, receiver=head))
    assert (out.code, out.message) == ("UNAVAILABLE", "node new-process serves layers 0:30, but the step was "
                                                      "routed to it for layers 0:10; get a new route")
    reported = []
    svc.forwarder.report = lambda tail, step, failure, connect=True: reported.append((tail.node_id, failure))
    svc.run_forward(request_to_frames(req, False, next_hops=hops[1:], receiver=hops[0]))
    assert [(t, f.node_id, f.code) for t, f in reported] == [("c-tail", "b-mid", "UNAVAILABLE")]
    assert eng.health().active_sessions == 0  # nothing ran


def test_a_middle_node_that_lost_the_session_is_rebuilt_by_replay(mesh, tok, solo):
    """The middle node frees the session behind the client's back: its NOT_FOUND reaches the tail as a
    HopFailure, the tail answers the client's await with it, and the client replays the session."""
    nodes = mesh.start_nodes([("a-head", "0:10"), ("b-mid", "10:20"), ("c-tail", "20:30")])
    client = mesh.client(forwarding=True)

    def drop_on_mid():
        sid = next(iter(client._sessions))
        nodes[1].stub().Release(pb.SessionRequest(session_id=sid), timeout=5)

    out = _generate(client, tok, solo.prompt_ids(2), kill=drop_on_mid)
    assert out == solo.greedy(2, N)
    assert client.failovers == 1
    client.close()
    assert [n.active_sessions() for n in nodes] == [0, 0, 0]


def test_a_node_that_loses_the_session_step_after_step_is_given_up_with_the_reason(mesh, tok, solo):
    """Every replay costs the whole history: a node that frees the session again at once (an idle timeout
    shorter than a step) is given up after MAX_LOSSES_IN_A_ROW steps in a row, instead of replaying for
    ever; losses that are not in a row are rebuilt each time, with the solo output."""
    from meshnet.client.mesh_client import MAX_LOSSES_IN_A_ROW, MeshUnavailable

    nodes = mesh.start_nodes([("a-head", "0:10"), ("b-mid", "10:20"), ("c-tail", "20:30")])
    client = mesh.client(forwarding=True)

    def drop_on_mid(when):
        def step_done(i: int) -> None:
            if when(i):
                sid = next(iter(client._sessions))
                nodes[1].stub().Release(pb.SessionRequest(session_id=sid), timeout=5)
        return step_done

    def generate(prompt_ids, after_token) -> list[int]:
        gen = Generation(client, tok, prompt_ids, 20, GREEDY, stop_at_eog=False)
        for i, _ in enumerate(gen):
            after_token(i)
        return gen.result.generated_token_ids

    assert generate(solo.prompt_ids(2), drop_on_mid(lambda i: i >= 3 and i % 2 == 1)) == solo.greedy(2, 20)
    assert client.failovers == 8  # tokens 4, 6, ... 18 (0-based 3, 5, ... 17): a loss every other step
    with pytest.raises(MeshUnavailable) as e:
        generate(solo.prompt_ids(2), drop_on_mid(lambda i: i >= 3))
    assert f"lost it {MAX_LOSSES_IN_A_ROW} steps in a row" in str(e.value) and "b-mid" in str(e.value)
    assert client.failovers == 8 + MAX_LOSSES_IN_A_ROW - 1  # the last loss is not replayed
    client.close()
    assert wait_for(lambda: [n.active_sessions() for n in nodes] == [0, 0, 0], 10) is not None


# ---- the tail's await registry, plain data ---------------------------------------------------------------

def test_an_outcome_reaches_its_await_whichever_comes_first():
    reg = AwaitedOutcomes(StepOutcome)
    got = []
    reg.await_(("s", 1, 1), got.append)
    reg.deliver(("s", 1, 1), StepOutcome("OK", message="first"))
    reg.deliver(("s", 2, 1), StepOutcome("OK", message="second"))
    assert reg.pending == (1, 0)
    reg.await_(("s", 2, 1), got.append)
    assert [o.message for o in got] == ["first", "second"]
    # Another epoch is another step.
    reg.deliver(("s", 3, 1), StepOutcome("OK"))
    reg.await_(("s", 3, 2), got.append)
    assert len(got) == 2 and reg.pending == (1, 1)


def test_expired_and_surplus_entries_are_dropped_and_their_awaits_answered():
    reg = AwaitedOutcomes(StepOutcome, ttl_s=0.0)
    got = []
    reg.await_(("s", 1, 1), got.append)
    reg.deliver(("t", 1, 1), StepOutcome("OK"))  # sweeps the expired await first
    assert [o.code for o in got] == ["DEADLINE_EXCEEDED"]
    reg = AwaitedOutcomes(StepOutcome, max_entries=2)
    for i in range(3):
        reg.await_(("s", i, 1), got.append)
    assert reg.pending == (0, 2) and [o.code for o in got] == ["DEADLINE_EXCEEDED"] * 2
    assert "keeps at most 2 awaits" in got[-1].message


def test_an_await_expires_without_other_traffic_and_a_superseded_one_is_told_so():
    """An await of a step that never comes was answered only when another await or outcome arrived: on a
    node nothing else reached, its client waited until the connection's idle timeout (300 s) closed it. The
    node's sweep answers it after ``ttl_s``; a second await of the same step answers the first one saying
    it was superseded (the words said "in time", after 0.2 s)."""
    reg = AwaitedOutcomes(StepOutcome, ttl_s=0.05)
    got = []
    reg.await_(("s", 1, 1), got.append)
    reg.await_(("s", 1, 1), got.append)
    assert [(o.code, o.message) for o in got] == [
        ("DEADLINE_EXCEEDED", "the await was superseded by another await of the same step")]
    reg.sweep()
    assert len(got) == 1 and reg.pending == (0, 1)  # not yet expired
    time.sleep(0.06)
    reg.sweep()
    assert reg.pending == (0, 0) and (got[1].code, got[1].message) == (
        "DEADLINE_EXCEEDED", "no outcome of the awaited step reached this node within 0.05 s")


# ---- the data plane refuses forwarding kinds it does not serve ----------------------------------------------

@pytest.mark.parametrize("kind", [FORWARD, AWAIT])
def test_a_data_plane_without_forwarding_refuses_forward_and_await(kind):
    from meshnet.wire.data_plane import AUTH
    from meshnet.wire.data_plane_server import DataPlaneServer

    server = DataPlaneServer("127.0.0.1", 0, lambda frames: StepOutcome("OK"))
    server.start()
    try:
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        sock.sendall(encode_messages(AUTH, (b"",)))
        assert recv_message(sock)[0] == AUTH
        sock.sendall(encode_messages(kind, (pb.AwaitStep(session_id="s").SerializeToString(),)))
        got, payload = recv_message(sock)
        assert got == ERROR
        code, _, message = decode_error(payload)
        assert code == "INVALID_ARGUMENT" and f"message kind {kind}" in message
        sock.close()
    finally:
        server.stop()


def test_a_hop_found_silent_while_the_client_waited_on_another_is_named_with_both():
    """The message named the silent middle node, then the tail's data plane it had waited on, as if it were
    the middle node's: "node m at 10.99.0.3:17103: ...; data plane 10.99.0.3:17102: no answer"."""
    from types import SimpleNamespace

    from meshnet.client.forwarded import _unanswered
    from meshnet.client.remote import StageFailure

    mid = SimpleNamespace(node_id="m", address="10.99.0.3:17103")
    tail = SimpleNamespace(node_id="t", address="10.99.0.3:17101")
    waited = StageFailure("t", tail.address, "DEADLINE_EXCEEDED", "data plane 10.99.0.3:17102: no answer within 1.50s")
    f = _unanswered([mid], [], tail, waited)
    assert (f.node_id, f.address, f.code) == ("m", "10.99.0.3:17103", "DEADLINE_EXCEEDED")
    assert f.message == ("does not answer Health (or another process does: it restarted), while this client waited "
                         "on node t: data plane 10.99.0.3:17102: no answer within 1.50s")
    assert _unanswered([tail], [], tail, waited) is waited  # the hop waited on is the silent one: its own failure


def test_the_prompt_rows_a_route_reused_are_the_least_any_stage_reused(mesh, tok):
    """The API's cached_tokens counted the tail's prefix cache alone: after the head restarted (its cache
    empty, every row computed), a prompt the tail had seen still counted 236 of 300 rows as cached. A
    forwarded first step carries the least reuse of the stages it passed (Envelope.reused_before); a
    client-orchestrated one takes the least of its hops' replies."""
    from mesh_util import free_port

    ports = ("--port", str(free_port()), "--data-port", str(free_port()))
    head, tail = mesh.start_nodes([("a-head", "0:15", ports), ("b-tail", "15:30")])

    def prompt(question: str) -> list[int]:
        return tok.encode("<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n"
                          f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")

    first, second, third = prompt("What is 2+2?"), prompt("Name a colour."), prompt("Say hello.")
    common = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    def cached(forwarding: bool, ids: list[int]) -> int:
        client = mesh.client(forwarding=forwarding, report_deliveries=False)
        try:
            gen = Generation(client, tok, ids, 4, GREEDY, stop_at_eog=False)
            list(gen)
            return gen.result.cached_tokens
        finally:
            client.close()

    assert [cached(True, first), cached(True, second)] == [0, common]
    assert [cached(False, first), cached(False, second)] == [len(first) - 1, len(second) - 1]  # seen whole
    head.kill()  # its prefix cache goes with it; the tail keeps its own
    mesh.start_nodes([("a-head", "0:15", ports)])
    assert cached(False, third) == 0  # the tail had the system prompt's rows: it counted `common`
    assert cached(True, second) == common  # the head had only `third`'s: the tail counted all but a row
