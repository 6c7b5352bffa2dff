"""The tracker goes away while its nodes keep serving: a client that has had a route goes on opening
sessions through it, and one that never had a route gets a clear error."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from meshnet.client.mesh_client import MeshUnavailable
from meshnet.client.remote import StageFailure
from meshnet.contract import GREEDY, NamedTensor, StepRequest
from meshnet.generation import generate


def test_new_sessions_take_the_last_route_while_the_tracker_is_down(mesh, tok, solo):
    head, tail = mesh.start_nodes([("a-head", "0:15"), ("d-tail", "15:30")])
    client = mesh.client(report_deliveries=False)
    before = generate(client, tok, solo.prompt_ids(0), 16, GREEDY, stop_at_eog=False)
    assert before.generated_token_ids == solo.greedy(0, 16)
    mesh.server.stop(grace=0).wait()
    during = generate(client, tok, solo.prompt_ids(1), 16, GREEDY, stop_at_eog=False)
    assert during.generated_token_ids == solo.greedy(1, 16)
    assert client.failovers == 0
    assert [head.active_sessions(), tail.active_sessions()] == [0, 0]
    # A failed node in the last route leaves nothing to take without the tracker.
    with pytest.raises(MeshUnavailable, match="goes through a failed node"):
        client.route({head.node_id})
    # A node restarted at its address meanwhile is another process (it cannot tell the tracker), but it
    # serves: new sessions take it.
    _, hops = client.route()
    grpc_port, data_port = hops[-1].address.rsplit(":", 1)[1], hops[-1].data_pool.address.rsplit(":", 1)[1]
    tail.kill()
    again = mesh.spawn_node("15:30", tail.node_id, "smollm2", "--port", grpc_port, "--data-port", data_port)
    try:
        assert again.stdout.readline().startswith("MESHNET_NODE_READY")  # once it gives up waiting for the tracker
        after = generate(client, tok, solo.prompt_ids(2), 16, GREEDY, stop_at_eog=False)
        assert after.generated_token_ids == solo.greedy(2, 16)
    finally:
        again.kill()
        again.wait(10)
    # Nor one where a node of other layers now answers at the address: its layers in place of the route's
    # gave wrong tokens with a 200 (the probe asked only whether something answered there).
    other = mesh.spawn_node("20:30", "y-other", "smollm2", "--port", grpc_port, "--data-port", data_port)
    try:
        assert other.stdout.readline().startswith("MESHNET_NODE_READY")
        time.sleep(1.1)  # past the last probe's answer (kept a second)
        with pytest.raises(MeshUnavailable, match=f"node {tail.node_id} of its last route is now a node serving "
                                                  f"layers 20:30 at 127.0.0.1:{grpc_port}, not 15:30"):
            client.route()
        # A step of a route from before, sent for layers 15:30, is refused there rather than run on 20:30:
        # to the client, a node gone from its route (it fails over).
        hidden = NamedTensor.from_numpy("hidden", np.zeros((2, 576), dtype=np.float32))
        step = StepRequest(session_id="s-old-route", epoch=1, position=0, token_ids=(1, 2), hidden=hidden)
        with pytest.raises(StageFailure, match="UNAVAILABLE: .*serves layers 20:30, but the step was routed "
                                               "to it for layers 15:30"):
            hops[-1].step(step, decode=False)
    finally:
        other.kill()
        other.wait(10)
    # Nor one whose node died meanwhile: the route came back as it was (the API's /health said "ok" for
    # it, and each new session waited out a failover's deadline to learn otherwise).
    time.sleep(1.1)  # past the last probe's answer (kept a second)
    with pytest.raises(MeshUnavailable, match=f"node {tail.node_id} of its last route does not answer at "):
        client.route()
    client.close()
    fresh = mesh.client(report_deliveries=False)
    with pytest.raises(MeshUnavailable, match=f"^no route: .*\\(no tracker answers at {mesh.tracker}: is it "
                                              f"running, and is that its address \\(--tracker HOST:PORT\\)\\?\\)$"):
        fresh.route()  # it said gRPC's "failed to connect to all addresses" and no more
    fresh.close()


@pytest.mark.slow
def test_a_client_reaches_a_restarted_tracker_within_seconds_however_long_it_was_away():
    """gRPC's reconnect backoff grew to 120 s: after a 2-minute outage, nodes took 20-65 s to register
    with the restarted tracker (calls in between fail at once, without trying), and the mesh routed
    nothing meanwhile. Here a caller that tries every second, as a node's heartbeat loop does, through a
    20 s outage: with the default backoff its next attempt came 5-9 s after the restart."""
    import time

    import grpc

    from meshnet.proto import meshnet_pb2 as pb
    from meshnet.proto import meshnet_pb2_grpc as pb_grpc
    from meshnet.tracker.server import serve_tracker
    from meshnet.wire.security import open_channel

    server, port = serve_tracker("127.0.0.1", 0)
    channel = open_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.TrackerStub(channel)
    stub.ListNodes(pb.Empty(), timeout=5)
    server.stop(None).wait()
    away_until = time.monotonic() + 20
    while time.monotonic() < away_until:
        with pytest.raises(grpc.RpcError):
            stub.ListNodes(pb.Empty(), timeout=1)
        time.sleep(1)
    server, _ = serve_tracker("127.0.0.1", port)
    try:
        back = time.monotonic()
        while True:
            try:
                assert stub.ListNodes(pb.Empty(), timeout=1).nodes == []
                break
            except grpc.RpcError:
                assert time.monotonic() - back < 4.0, "no connection 4 s after the tracker came back"
                time.sleep(0.1)
    finally:
        channel.close()
        server.stop(None)


def test_once_the_tracker_has_not_answered_route_requests_wait_a_second_while_the_last_route_serves(caplog):
    """A tracker that drops packets (a partition, not a refused connection) cost every new session the
    whole 5 s GetRoute timeout before the last route served, and each API request (which asks twice) 10 s.
    The short wait holds only where the last route can serve, and for 10 s at a time, so that a tracker
    slower than a second is not given up on for good."""
    import grpc
    from mesh_util import RpcFailure

    from meshnet.client.router import ROUTE_RETRY_FULL_S, ROUTE_TIMEOUT_S, ROUTE_TIMEOUT_UNREACHABLE_S, Router
    from meshnet.proto import meshnet_pb2 as pb

    class Tracker:  # answers in turn: each item a Route, or a status code to fail with
        def __init__(self, answers):
            self.answers, self.timeouts = list(answers), []

        def GetRoute(self, request, timeout):
            self.timeouts.append(timeout)
            answer = self.answers.pop(0)
            if isinstance(answer, grpc.StatusCode):
                raise RpcFailure(answer)
            return answer

    assert (ROUTE_TIMEOUT_S, ROUTE_TIMEOUT_UNREACHABLE_S, ROUTE_RETRY_FULL_S) == (5.0, 1.0, 10.0)
    lost, denied = grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.PERMISSION_DENIED
    now = [100.0]
    router = Router("127.0.0.1:1")
    router._clock = lambda: now[0]
    router.tracker = Tracker([lost])
    with pytest.raises(MeshUnavailable) as ei:  # said only "Deadline Exceeded", naming no tracker
        router.route()
    assert str(ei.value) == "no route: DEADLINE_EXCEEDED (the tracker at 127.0.0.1:1 did not answer within 5 s)"
    route = pb.Route(epoch=7, hops=[pb.Hop(node_id="a", address="127.0.0.1:1")])
    router.tracker = Tracker([lost, route, lost, lost, lost, lost, lost, denied, lost])
    router._unreachable_at = None  # as before the check above
    calls = [set(), set(), set(), set(), {"a"}, "later", set(), set(), set()]
    for exclude in calls:
        if exclude == "later":
            now[0] += ROUTE_RETRY_FULL_S + 0.1
            exclude = set()
        try:
            router.route(exclude)
        except MeshUnavailable:
            pass  # the last route's node does not answer its probe here: only the waits matter
    assert router.tracker.timeouts == [
        5.0,  # no route yet: nothing else could serve
        5.0,  # the route
        5.0,  # unanswered: the last route serves
        1.0,  # ... and the next request waits a second
        5.0,  # a request that excludes the last route's node: nothing else could serve
        5.0,  # 10 s later the whole timeout again: unanswered
        1.0,
        1.0,  # a refusal is an answer
        5.0,
    ]
    # Back from an outage the client says so once (it warned with every route the tracker did not give).
    router.tracker = Tracker([route, route])
    with caplog.at_level(logging.INFO, logger="meshnet.client"):
        router.route()
        router.route()
    assert [r.getMessage() for r in caplog.records if "answers again" in r.getMessage()] == [
        "tracker 127.0.0.1:1 answers again"]
    router.close()
    router.tracker_channel.close()


def test_a_middle_node_restarted_before_and_while_the_tracker_is_down_still_serves_the_last_route(mesh, tok, solo):
    """The API's last route named a node's old process; the node was restarted (same id, range and ports)
    and the tracker died before this client asked again. Every request then failed after ~10 s: a step the
    new process could not take at once (its peers' pooled connections went to the old one) was followed by
    a probe that took "another process answers" for "down", and without the tracker the route through it
    counted as failed. The probe of the last route now takes the process that answers as the node's.

    Then the node is restarted again, the tracker still down: it could not ask which nodes are registered,
    so it refused to forward to the next one, and its client stepped that link itself for 5 minutes, saying
    to open a data port that was open. The node keeps the list beside its key and starts from it: the
    client's steps go node to node again."""
    head, middle, tail = mesh.start_nodes([("a-head", "0:12"), ("b-mid", "12:25"), ("c-tail", "25:30")])
    client = mesh.client(report_deliveries=False)
    restarted: list = []

    def restart_middle(kill) -> None:
        kill()
        restarted.append(mesh.spawn_node("12:25", middle.node_id, "smollm2", "--port", grpc_port, "--data-port",
                                         data_port))
        assert restarted[-1].stdout.readline().startswith("MESHNET_NODE_READY")

    try:
        before = generate(client, tok, solo.prompt_ids(0), 8, GREEDY, stop_at_eog=False)
        assert before.generated_token_ids == solo.greedy(0, 8)
        _, hops = client.route()
        grpc_port, data_port = hops[1].address.rsplit(":", 1)[1], hops[1].data_pool.address.rsplit(":", 1)[1]
        restart_middle(middle.kill)
        mesh.server.stop(grace=0).wait()
        after = generate(client, tok, solo.prompt_ids(1), 8, GREEDY, stop_at_eog=False)
        assert after.generated_token_ids == solo.greedy(1, 8)
        restart_middle(restarted[-1].kill)  # the tracker still down
        again = generate(client, tok, solo.prompt_ids(2), 8, GREEDY, stop_at_eog=False)
        assert again.generated_token_ids == solo.greedy(2, 8)
        assert client.blocked_links.blocked_now() == 0  # no link stepped by the client
    finally:
        for proc in restarted:
            proc.kill()
            proc.wait(10)
        client.close()
