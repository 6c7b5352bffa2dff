"""Relayed nodes: a node with no listening socket, reached through its outbound stream to the tracker."""

from __future__ import annotations

import json
import os
import statistics
import threading
import time

import grpc
import numpy as np
import pytest

from mesh_util import rpc_code, run_generate
from solo_reference import PROMPTS
from meshnet.client.relayed import RelayedStage
from meshnet.client.remote import RemoteStage
from meshnet.contract import GREEDY, NamedTensor, StepRequest
from meshnet.generation import Generation
from meshnet.membership.identity import NodeIdentity
from meshnet.proto import meshnet_pb2 as pb
from meshnet.tracker.relay import RelayHub



def listening_ports(pid: int) -> list[int]:
    """TCP ports process ``pid`` listens on: its socket fds matched by inode against /proc/net/tcp{,6}
    entries in state 0A (LISTEN)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = []
    for table in ("tcp", "tcp6"):
        try:
            lines = open(f"/proc/{pid}/net/{table}").read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:
                ports.append(int(f[1].rsplit(":", 1)[1], 16))
    return ports


def _route_ids(client, exclude=frozenset()):
    r = client.router.tracker.GetRoute(pb.RouteRequest(exclude_node_ids=sorted(exclude)), timeout=5)
    return [(h.node_id, h.relayed) for h in r.hops]


def test_relayed_middle_node_opens_no_port_and_matches_solo_run(mesh, tok, solo):
    head, = mesh.start_nodes([("a-head", "0:10")])
    tail, = mesh.start_nodes([("d-tail", "20:30")])
    mid, = mesh.start_nodes([("b-relay", "10:20")], "smollm2", "--relay")
    assert mid.address == "relay:b-relay"
    # The check itself sees a direct node's sockets; the relayed node has none listening.
    assert len(listening_ports(head.proc.pid)) == 2  # gRPC + data plane
    assert listening_ports(mid.proc.pid) == []
    listed = {s.info.node_id: s.info for s in mesh.tracker_stub().ListNodes(pb.Empty(), timeout=5).nodes}
    assert listed["b-relay"].relayed and listed["b-relay"].address == "relay:b-relay"
    assert not listed["a-head"].relayed

    client = mesh.client()
    assert _route_ids(client) == [("a-head", False), ("b-relay", True), ("d-tail", False)]
    gen = Generation(client, tok, solo.prompt_ids(0), 64, GREEDY, stop_at_eog=False)
    for _ in gen:
        pass
    assert gen.result.generated_token_ids == solo.greedy(0)
    assert client.failovers == 0
    stage = RelayedStage("b-relay", client.router.tracker_channel)
    assert stage.health().active_sessions == 0  # released through the relay
    caps = stage.capabilities()
    assert (caps.node_id, caps.layers.start, caps.layers.end) == ("b-relay", 10, 20)
    # The command line reads every hop's context length, the relayed one's through the tracker.
    _, hops, n_ctx = client.route_with_context()
    assert [h.node_id for h in hops] == ["a-head", "b-relay", "d-tail"] and n_ctx == caps.n_ctx == 4096
    client.close()
    proc = run_generate(mesh.tracker, PROMPTS[0], "--max-tokens", "8")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["generated_token_ids"] == solo.greedy(0, 8)


def test_direct_replica_preferred_and_relay_overhead_measured(mesh, smollm2_path):
    mesh.start_nodes([("a-head", "0:10"), ("b-direct", "10:20"), ("d-tail", "20:30")])
    relayed, = mesh.start_nodes([("b-relay", "10:20")], "smollm2", "--relay")
    client = mesh.client()
    # Both replicas are live: routing takes the direct one, and the relayed one only without it.
    assert _route_ids(client) == [("a-head", False), ("b-direct", False), ("d-tail", False)]
    assert _route_ids(client, {"b-direct"}) == [("a-head", False), ("b-relay", True), ("d-tail", False)]

    # Per-hop decode latency, same range, same inputs: direct (TCP data plane), direct over gRPC only,
    # and relayed (client -> tracker -> node's stream and back).
    listed = {s.info.node_id: s.info for s in mesh.tracker_stub().ListNodes(pb.Empty(), timeout=5).nodes}
    d = listed["b-direct"]
    direct = client.router.stage(pb.Hop(node_id=d.node_id, address=d.address, data_address=d.data_address))
    direct_grpc = RemoteStage(d.node_id, d.address, client.router._channels[d.address])
    relay = client.router.stage(pb.Hop(node_id="b-relay", address="relay:b-relay", relayed=True))
    assert isinstance(relay, RelayedStage)
    rng = np.random.default_rng(0)
    prompt = NamedTensor.from_numpy("hidden", rng.standard_normal((4, 576)).astype(np.float32))
    row = NamedTensor.from_numpy("hidden", rng.standard_normal((1, 576)).astype(np.float32))
    n = 40
    timings = {}
    for name, stage in (("direct-tcp", direct), ("direct-grpc", direct_grpc), ("relayed", relay)):
        sid = f"lat-{name}"
        assert stage.prefill(StepRequest(sid, 0, 0, (1, 2, 3, 4), hidden=prompt)).ok
        ts = []
        for i in range(n):
            t0 = time.perf_counter()
            res = stage.decode(StepRequest(sid, 0, 4 + i, (5,), hidden=row))
            ts.append(time.perf_counter() - t0)
            assert res.ok, res.message
        stage.release(sid)
        timings[name] = statistics.median(ts[5:]) * 1e3
    overhead = timings["relayed"] - timings["direct-tcp"]
    print(f"\nrelay per-hop decode latency (median of {n - 5}, ms): "
          + ", ".join(f"{k} {v:.2f}" for k, v in timings.items())
          + f"; relay overhead vs direct-tcp {overhead:.2f} ms, vs direct-grpc "
          f"{timings['relayed'] - timings['direct-grpc']:.2f} ms")
    assert relay.health().active_sessions == 0
    client.close()
    assert relayed.proc.poll() is None


def test_killing_relayed_node_fails_over_to_direct_spare(mesh, tok, solo):
    mesh.start_nodes([("a-head", "0:10"), ("d-tail", "20:30")])
    mid, = mesh.start_nodes([("b-relay", "10:20")], "smollm2", "--relay")
    client = mesh.client()
    gen = Generation(client, tok, solo.prompt_ids(0), 64, GREEDY, stop_at_eog=False)
    for i, _ in enumerate(gen):
        if i == 0:
            assert [h.node_id for h in client._sessions[gen.session_id].hops] == ["a-head", "b-relay", "d-tail"]
            mesh.start_nodes([("c-spare", "10:20")])  # direct spare joins; the session keeps its route
        if i + 1 == 10:
            mid.kill()
    assert gen.result.generated_token_ids == solo.greedy(0)
    assert client.failovers == 1
    # The dead node's stream is gone: it is out of routes and calls to it are UNAVAILABLE at once.
    assert ("b-relay", True) not in _route_ids(client)
    t0 = time.monotonic()
    assert rpc_code(client.router.tracker.RelayControl, pb.RelayControlRequest(
        node_id="b-relay", kind=pb.RelayDown.HEALTH), timeout=5) == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - t0 < 1
    client.close()


def test_relay_refuses_unsigned_and_unregistered_hellos(mesh):
    stub = mesh.tracker_stub()
    # Nothing registered as relayed under this id: the signed hello of a stranger is refused.
    ident = NodeIdentity.generate()
    hello = ident.sign(pb.NodeRef(node_id=ident.node_id))
    assert rpc_code(lambda: list(stub.Relay(iter([pb.RelayUp(hello=hello)]), timeout=5))) == \
        grpc.StatusCode.FAILED_PRECONDITION
    assert rpc_code(lambda: list(stub.Relay(iter([pb.RelayUp(hello=pb.NodeRef(node_id="x"))]), timeout=5))) == \
        grpc.StatusCode.UNAUTHENTICATED
    assert rpc_code(lambda: list(stub.Relay(iter([pb.RelayUp()]), timeout=5))) == grpc.StatusCode.INVALID_ARGUMENT
    assert rpc_code(stub.RelayControl, pb.RelayControlRequest(node_id="nobody", kind=pb.RelayDown.HEALTH),
                    timeout=5) == grpc.StatusCode.UNAVAILABLE


def test_hub_answers_unavailable_when_a_stream_closes_mid_call():
    hub = RelayHub()
    assert hub.call("n", pb.RelayDown(kind=pb.RelayDown.HEALTH), 1).code == "UNAVAILABLE"
    link = hub.attach("n")
    answers = []
    t = threading.Thread(target=lambda: answers.append(hub.call("n", pb.RelayDown(kind=pb.RelayDown.HEALTH), 5)))
    t.start()
    down = link.outgoing.get(timeout=5)
    assert down.call_id == 1 and down.kind == pb.RelayDown.HEALTH
    hub.detach(link, "relay stream closed")
    t.join(5)
    assert answers[0].code == "UNAVAILABLE" and not hub.attached("n")
    # An answer matched by call id; a reattached node replaces its old link.
    link2 = hub.attach("n")
    t = threading.Thread(target=lambda: answers.append(hub.call("n", pb.RelayDown(kind=pb.RelayDown.STEP), 5)))
    t.start()
    down = link2.outgoing.get(timeout=5)
    link2.answer(pb.RelayUp(call_id=down.call_id, code="RESOURCE_EXHAUSTED", has_retry_after=True, retry_after_s=0.5))
    t.join(5)
    assert (answers[1].code, answers[1].retry_after_s) == ("RESOURCE_EXHAUSTED", 0.5)
    link3 = hub.attach("n")
    assert link2.closed and hub.get("n") is link3


def test_relayed_node_reattaches_after_tracker_restart(mesh, tok, solo):
    from meshnet.tracker.server import serve_tracker

    mesh.start_nodes([("a-head", "0:10"), ("d-tail", "20:30")])
    mesh.start_nodes([("b-relay", "10:20")], "smollm2", "--relay")
    port = int(mesh.tracker.rsplit(":", 1)[1])
    mesh.server.stop(grace=0).wait()
    mesh.server, _ = serve_tracker("127.0.0.1", port, heartbeat_interval_s=0.3)
    client = mesh.client()
    deadline = time.monotonic() + 20
    while True:  # the node re-registers, then opens a new relay stream
        try:
            if ("b-relay", True) in _route_ids(client):
                break
        except grpc.RpcError:
            pass
        assert time.monotonic() < deadline, "relayed node never reattached"
        time.sleep(0.1)
    gen = Generation(client, tok, solo.prompt_ids(0), 8, GREEDY, stop_at_eog=False)
    for _ in gen:
        pass
    assert gen.result.generated_token_ids == solo.greedy(0, 8)
    client.close()


def test_a_relayed_step_left_unanswered_names_the_relay_and_the_wait():
    """A relayed node that did not answer was failed over with gRPC's own words, "DEADLINE_EXCEEDED: Deadline
    Exceeded", which named neither the relay nor how long the client had waited."""
    from mesh_util import RpcFailure

    from meshnet.client.remote import StageFailure
    from meshnet.contract import StepRequest

    class Tracker:
        def RelayStep(self, frames, timeout, metadata):
            raise RpcFailure(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")

    with grpc.insecure_channel("127.0.0.1:1") as channel:
        stage = RelayedStage("b-relay", channel)
        stage.tracker = Tracker()
        with pytest.raises(StageFailure) as ei:
            stage._step(StepRequest("s", 1, 0, (1, 2)), False, 2.5)
    assert (ei.value.node_id, ei.value.code) == ("b-relay", "DEADLINE_EXCEEDED")
    assert str(ei.value).endswith("no answer through the tracker's relay within 2.5 s"), str(ei.value)
