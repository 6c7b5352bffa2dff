"""The tracker: registry expiry and epochs on a fake clock, then the real gRPC service on 127.0.0.1."""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import grpc
import pytest

from meshnet.contract import LayerRange
from meshnet.proto import meshnet_pb2 as pb
from meshnet.proto import meshnet_pb2_grpc as pb_grpc
from meshnet.tracker.registry import NodeIdInUse, ProtocolMismatch, Registry
from meshnet.tracker.routing import NodeRecord, plan_route
from meshnet.tracker.cli import add_tracker_parser
from meshnet.tracker.server import serve_tracker, start_tracker
from meshnet.wire.envelope import PROTOCOL_MAJOR, PROTOCOL_MINOR
from meshnet.wire.security import open_channel

SHA = "c0ffee" * 10 + "beef"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def record(node_id: str, start: int, end: int, n_layer: int = 30, address: str = "127.0.0.1:9") -> NodeRecord:
    return NodeRecord(node_id=node_id, address=address, model_sha256=SHA, architecture="llama",
                      n_layer=n_layer, layers=LayerRange(start, end))


# ---- registry ------------------------------------------------------------------------------------------

def test_node_expires_after_three_intervals_and_not_before():
    clock = FakeClock()
    reg = Registry(heartbeat_interval_s=2.0, clock=clock)
    assert reg.ttl_s == 6.0
    reg.register(record("n1", 0, 30), PROTOCOL_MAJOR, PROTOCOL_MINOR)
    clock.now += 5.999
    assert [r.node_id for r in reg.alive()] == ["n1"]
    assert reg.statuses()[0].last_heartbeat_age_s == pytest.approx(5.999)
    clock.now += 0.001  # exactly three intervals of silence
    assert reg.alive() == []
    assert reg.heartbeat("n1", 0, 0.0) is False  # it must register again


def test_heartbeat_keeps_a_node_alive_and_updates_load():
    clock = FakeClock()
    reg = Registry(heartbeat_interval_s=1.0, clock=clock)
    reg.register(record("n1", 0, 30), PROTOCOL_MAJOR, PROTOCOL_MINOR)
    for _ in range(10):
        clock.now += 2.5
        assert reg.heartbeat("n1", active_sessions=3, decode_tokens_per_s=42.0) is True
    clock.now += 2.0
    [r] = reg.alive()
    assert (r.active_sessions, r.decode_tokens_per_s) == (3, 42.0)
    reg.heartbeat("n1", active_sessions=1, decode_tokens_per_s=0.0)  # 0 = no new measurement
    [r] = reg.alive()
    assert (r.active_sessions, r.decode_tokens_per_s) == (1, 42.0)
    assert reg.heartbeat("stranger", 0, 0.0) is False


def test_reregister_replaces_the_entry_at_the_same_address_or_after_expiry():
    clock = FakeClock()
    reg = Registry(heartbeat_interval_s=1.0, clock=clock)
    reg.register(record("n1", 0, 10, address="10.0.0.1:1"), PROTOCOL_MAJOR, PROTOCOL_MINOR)
    # The same node re-registering (or restarted on its port) replaces its entry.
    reg.register(record("n1", 0, 30, address="10.0.0.1:1"), PROTOCOL_MAJOR, PROTOCOL_MINOR)
    [r] = reg.alive()
    assert (r.address, r.layers) == ("10.0.0.1:1", LayerRange(0, 30))
    # Once the old entry expired, any address may take the id.
    clock.now += 3.0
    reg.register(record("n1", 10, 30, address="10.0.0.1:2"), PROTOCOL_MAJOR, PROTOCOL_MINOR)
    [r] = reg.alive()
    assert (r.address, r.layers) == ("10.0.0.1:2", LayerRange(10, 30))
    assert len(reg.statuses()) == 1
    assert reg.deregister("n1") is True and reg.deregister("n1") is False
    assert reg.alive() == []


def test_live_id_claimed_from_another_address_is_refused_naming_both():
    clock = FakeClock()
    reg = Registry(heartbeat_interval_s=1.0, clock=clock)
    reg.register(record("mid", 10, 20, address="10.0.0.1:1"), PROTOCOL_MAJOR, PROTOCOL_MINOR)
    clock.now += 2.5
    assert reg.heartbeat("mid", 0, 0.0) is True
    clock.now += 2.9  # still live: 2.9 s of silence against a 3 s ttl
    with pytest.raises(NodeIdInUse) as ei:
        reg.register(record("mid", 10, 20, address="10.0.0.2:7"), PROTOCOL_MAJOR, PROTOCOL_MINOR)
    assert (ei.value.node_id, ei.value.live_address) == ("mid", "10.0.0.1:1")
    assert "'mid'" in str(ei.value) and "10.0.0.1:1" in str(ei.value) and "expires in 0.1 s" in str(ei.value)
    # The live entry is untouched.
    assert [(r.node_id, r.address) for r in reg.alive()] == [("mid", "10.0.0.1:1")]


def test_protocol_mismatch_names_both_versions():
    reg = Registry(clock=FakeClock())
    with pytest.raises(ProtocolMismatch) as ei:
        reg.register(record("n1", 0, 30), PROTOCOL_MAJOR + 1, 3)
    msg = str(ei.value)
    assert f"{PROTOCOL_MAJOR + 1}.3" in msg and f"{PROTOCOL_MAJOR}.{PROTOCOL_MINOR}" in msg
    assert isinstance(ei.value, ValueError)
    reg.register(record("n1", 0, 30), PROTOCOL_MAJOR, PROTOCOL_MINOR + 7)  # a newer minor is fine
    assert len(reg.alive()) == 1


def test_epochs_strictly_increase():
    reg = Registry(clock=FakeClock())
    a = reg.next_epoch(0)
    b = reg.next_epoch(0)
    c = reg.next_epoch(100)
    d = reg.next_epoch(5)
    assert a < b < c < d
    assert (a, b, c, d) == (1, 2, 101, 102)


def test_a_forged_previous_epoch_cannot_exhaust_the_epoch_space(tracker):
    """A client's previous_epoch near 2**64 once moved the shared counter to its top: every later GetRoute,
    any client's, failed INTERNAL ("Value out of range") until the tracker restarted."""
    tracker.Register(info("n0", 0, 30, port=9000), timeout=5)
    for forged in ((1 << 64) - 2, (1 << 63), (1 << 62) + 1):
        with pytest.raises(grpc.RpcError) as ei:
            tracker.GetRoute(pb.RouteRequest(previous_epoch=forged), timeout=5)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"previous_epoch {forged} was never handed out" in ei.value.details()
    # A remembered epoch (a client across a tracker restart) is still taken, and routes keep coming.
    remembered = tracker.GetRoute(pb.RouteRequest(previous_epoch=1 << 62), timeout=5).epoch
    assert remembered == (1 << 62) + 1
    assert tracker.GetRoute(pb.RouteRequest(previous_epoch=remembered), timeout=5).epoch == remembered + 1
    assert tracker.GetRoute(pb.RouteRequest(), timeout=5).epoch == remembered + 2


def test_registry_refuses_a_previous_epoch_it_never_handed_out():
    reg = Registry(clock=FakeClock())
    with pytest.raises(ValueError, match="never handed out"):
        reg.next_epoch((1 << 64) - 2)
    assert reg.next_epoch(0) == 1
    top = reg.next_epoch(1 << 62)
    assert reg.next_epoch(top) == top + 1  # epochs it handed out are always taken back


def test_registry_is_thread_safe():
    reg = Registry(clock=FakeClock())
    epochs: list[int] = []

    def worker(w: int) -> None:
        for i in range(50):
            reg.register(record(f"w{w}-{i}", 0, 30), PROTOCOL_MAJOR, PROTOCOL_MINOR)
            reg.heartbeat(f"w{w}-{i}", i, 1.0)
            reg.alive()
            epochs.append(reg.next_epoch(0))

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(reg.alive()) == 400
    assert sorted(epochs) == list(range(1, 401))  # no epoch handed out twice


def test_registry_rejects_bad_records():
    reg = Registry(clock=FakeClock())
    with pytest.raises(ValueError, match="exceeds the model's 30 layers"):
        reg.register(record("n1", 0, 31), PROTOCOL_MAJOR, PROTOCOL_MINOR)
    with pytest.raises(ValueError, match="address is empty"):
        reg.register(record("n1", 0, 30, address=""), PROTOCOL_MAJOR, PROTOCOL_MINOR)
    with pytest.raises(ValueError, match="heartbeat interval"):
        Registry(heartbeat_interval_s=0)


# ---- the gRPC service ----------------------------------------------------------------------------------

def info(node_id: str, start: int, end: int, n_layer: int = 30, port: int = 9000, sha: str = SHA,
         major: int = PROTOCOL_MAJOR) -> pb.NodeInfo:
    return pb.NodeInfo(node_id=node_id, address=f"127.0.0.1:{port}",
                       model=pb.ModelIdentity(sha256=sha, architecture="llama", n_layer=n_layer),
                       layers=pb.LayerRange(start=start, end=end), engine="fake", backend="cpu",
                       protocol_major=major, protocol_minor=PROTOCOL_MINOR, max_sessions=4)


@pytest.fixture
def tracker():
    server, port = serve_tracker("127.0.0.1", 0, heartbeat_interval_s=0.5)
    channel = open_channel(f"127.0.0.1:{port}")
    try:
        yield pb_grpc.TrackerStub(channel)
    finally:
        channel.close()
        server.stop(None)


def test_register_of_a_live_id_from_another_address_is_already_exists(tracker):
    tracker.Register(info("mid", 10, 20, port=9100), timeout=5)
    tracker.Register(info("mid", 10, 20, port=9100), timeout=5)  # the node itself again: fine
    with pytest.raises(grpc.RpcError) as ei:
        tracker.Register(info("mid", 10, 20, port=9101), timeout=5)
    assert ei.value.code() is grpc.StatusCode.ALREADY_EXISTS
    assert "node id 'mid'" in ei.value.details() and "127.0.0.1:9100" in ei.value.details()
    listed = tracker.ListNodes(pb.Empty(), timeout=5).nodes
    assert [(n.info.node_id, n.info.address) for n in listed] == [("mid", "127.0.0.1:9100")]
    # After the holder leaves, the id is free for the new address.
    tracker.Deregister(pb.NodeRef(node_id="mid"), timeout=5)
    tracker.Register(info("mid", 10, 20, port=9101), timeout=5)
    listed = tracker.ListNodes(pb.Empty(), timeout=5).nodes
    assert [(n.info.node_id, n.info.address) for n in listed] == [("mid", "127.0.0.1:9101")]


def test_a_route_names_the_process_registered_last_at_an_address(tracker):
    """A node restarted under its id at its address registers a new instance id; routes carry it, so a
    client can tell the process it was routed to from the one answering there now."""
    for i, (s, e) in enumerate([(0, 10), (10, 20), (20, 30)]):
        first = info(f"n{s}", s, e, port=9200 + i)
        first.instance = f"{i:x}" * 16
        tracker.Register(first, timeout=5)
    again = info("n10", 10, 20, port=9201)
    again.instance = "f" * 16
    tracker.Register(again, timeout=5)
    route = tracker.GetRoute(pb.RouteRequest(), timeout=5)
    assert [(h.node_id, h.instance) for h in route.hops] == [("n0", "0" * 16), ("n10", "f" * 16), ("n20", "2" * 16)]
    assert {n.info.node_id: n.info.instance for n in tracker.ListNodes(pb.Empty(), timeout=5).nodes}["n10"] == "f" * 16
    long = info("n99", 0, 30, port=9299)
    long.instance = "x" * 65
    with pytest.raises(grpc.RpcError) as ei:
        tracker.Register(long, timeout=5)
    assert ei.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert ei.value.details() == "Register: node 'n99' has an instance id of 65 characters (at most 64)"


def test_routes_handed_out_together_spread_over_replicas_until_the_nodes_heartbeat(tracker):
    """Eight requests at once saw the same session counts (from the last heartbeats) and all took the
    cheapest replica, the other idle: 8/0, then 0/8. A route a session opens on now counts on its nodes
    until their next heartbeat, which reports the sessions themselves."""
    for node_id, s, e, speed in [("h", 0, 10, 90.0), ("m1", 10, 20, 93.7), ("m2", 10, 20, 91.7), ("t", 20, 30, 90.0)]:
        msg = info(node_id, s, e, port=9400 + len(node_id) * 10 + s)
        msg.decode_tokens_per_s, msg.max_sessions = speed, 16
        tracker.Register(msg, timeout=5)
    opening = pb.RouteRequest(opens_session=True)
    mids = [tracker.GetRoute(opening, timeout=5).hops[1].node_id for _ in range(8)]
    assert sorted(mids) == ["m1"] * 4 + ["m2"] * 4
    # A route asked for without a session (a health check) counts nothing.
    for node_id in ("m1", "m2"):
        assert tracker.Heartbeat(pb.HeartbeatRequest(node_id=node_id, active_sessions=0), timeout=5).known
    assert [tracker.GetRoute(pb.RouteRequest(), timeout=5).hops[1].node_id for _ in range(3)] == ["m1"] * 3
    # A heartbeat replaces the routes counted on a node by the sessions it reports.
    assert tracker.Heartbeat(pb.HeartbeatRequest(node_id="m1", active_sessions=0), timeout=5).known
    assert tracker.Heartbeat(pb.HeartbeatRequest(node_id="m2", active_sessions=8), timeout=5).known
    assert [tracker.GetRoute(opening, timeout=5).hops[1].node_id for _ in range(4)] == ["m1"] * 4
    listed = {n.info.node_id: n.active_sessions for n in tracker.ListNodes(pb.Empty(), timeout=5).nodes}
    assert listed["m2"] == 8 and listed["m1"] == 0  # what the nodes said, routes not counted


def test_a_failover_route_prefers_nodes_computing_as_the_hops_it_replaces(tracker):
    """Nodes register their numerics key and routes carry it; a route asked for ``prefer_like`` the old
    route's hops takes the spare with the replaced hop's key over a faster one, and a malformed
    ``prefer_like`` is INVALID_ARGUMENT naming the hop."""
    avx2, avx512 = "ggml cpu [AVX2] threads=1 repacked", "ggml cpu [AVX512] threads=1 repacked"
    for node_id, s, e, key, speed in [("h", 0, 10, avx2, 50.0), ("fast", 10, 20, avx512, 500.0),
                                      ("same", 10, 20, avx2, 5.0), ("t", 20, 30, avx2, 50.0)]:
        msg = info(node_id, s, e, port=9300 + s)
        msg.numerics, msg.decode_tokens_per_s = key, speed
        tracker.Register(msg, timeout=5)
    plain = tracker.GetRoute(pb.RouteRequest(), timeout=5)
    assert [(h.node_id, h.numerics) for h in plain.hops] == [("h", avx2), ("fast", avx512), ("t", avx2)]
    like = [pb.Hop(node_id=n, layers=pb.LayerRange(start=s, end=e), numerics=avx2)
            for n, s, e in [("h", 0, 10), ("dead", 10, 20), ("t", 20, 30)]]
    route = tracker.GetRoute(pb.RouteRequest(exclude_node_ids=["dead"], prefer_like=like), timeout=5)
    assert [h.node_id for h in route.hops] == ["h", "same", "t"]
    listed = {n.info.node_id: n.info.numerics for n in tracker.ListNodes(pb.Empty(), timeout=5).nodes}
    assert listed == {"h": avx2, "fast": avx512, "same": avx2, "t": avx2}
    for hop, fragment in [(pb.Hop(layers=pb.LayerRange(start=5, end=5)), "prefer_like[0] has layer range [5, 5); expected start < end"),
                          (pb.Hop(layers=pb.LayerRange(start=0, end=9), numerics="x" * 513),
                           "prefer_like[0] has a numerics key of 513 characters (at most 512)")]:
        with pytest.raises(grpc.RpcError) as ei:
            tracker.GetRoute(pb.RouteRequest(prefer_like=[hop]), timeout=5)
        assert ei.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert ei.value.details() == f"GetRoute: {fragment}"
    long = info("n99", 0, 30, port=9399)
    long.numerics = "y" * 513
    with pytest.raises(grpc.RpcError) as ei:
        tracker.Register(long, timeout=5)
    assert ei.value.details() == "Register: node 'n99' has a numerics key of 513 characters (at most 512)"


def test_route_deregister_and_bad_calls(tracker):
    for i, (s, e) in enumerate([(20, 30), (0, 10), (10, 20)]):
        reply = tracker.Register(info(f"n{s}", s, e, port=9000 + i), timeout=5)
        assert (reply.heartbeat_interval_s, reply.ttl_s) == (0.5, 1.5)

    route = tracker.GetRoute(pb.RouteRequest(model_sha256=SHA, previous_epoch=41), timeout=5)
    assert route.epoch > 41
    assert [h.node_id for h in route.hops] == ["n0", "n10", "n20"]
    assert [(h.layers.start, h.layers.end) for h in route.hops] == [(0, 10), (10, 20), (20, 30)]
    assert [h.address for h in route.hops] == ["127.0.0.1:9001", "127.0.0.1:9002", "127.0.0.1:9000"]
    assert (route.model.sha256, route.model.architecture, route.model.n_layer) == (SHA, "llama", 30)
    # Empty model = the only model served; epochs keep increasing.
    again = tracker.GetRoute(pb.RouteRequest(), timeout=5)
    assert again.epoch > route.epoch and [h.node_id for h in again.hops] == ["n0", "n10", "n20"]

    listed = tracker.ListNodes(pb.Empty(), timeout=5)
    assert [n.info.node_id for n in listed.nodes] == ["n0", "n10", "n20"]
    assert listed.nodes[0].info.protocol_major == PROTOCOL_MAJOR and listed.nodes[0].info.max_sessions == 4
    assert all(0 <= n.last_heartbeat_age_s < 1.5 for n in listed.nodes)

    tracker.Deregister(pb.NodeRef(node_id="n10"), timeout=5)
    with pytest.raises(grpc.RpcError) as ei:
        tracker.GetRoute(pb.RouteRequest(model_sha256=SHA), timeout=5)
    assert ei.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "no node serves layers [10, 20)" in ei.value.details()

    bad = [
        (info("", 0, 10), "node_id is empty"),
        (pb.NodeInfo(node_id="x", model=pb.ModelIdentity(sha256=SHA, n_layer=30),
                     layers=pb.LayerRange(start=0, end=10), protocol_major=PROTOCOL_MAJOR), "empty address"),
        (info("x", 10, 10), "bad layer range [10, 10)"),
        (info("x", 20, 31), "bad layer range [20, 31) for a model of 30 layers"),
        (info("x", 0, 10, sha=""), "empty model sha256"),
    ]
    for request, fragment in bad:
        with pytest.raises(grpc.RpcError) as ei:
            tracker.Register(request, timeout=5)
        assert ei.value.code() is grpc.StatusCode.INVALID_ARGUMENT, fragment
        assert fragment in ei.value.details()

    with pytest.raises(grpc.RpcError) as ei:
        tracker.Register(info("x", 0, 10, major=PROTOCOL_MAJOR + 1), timeout=5)
    assert ei.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert f"{PROTOCOL_MAJOR + 1}.{PROTOCOL_MINOR}" in ei.value.details()
    assert f"{PROTOCOL_MAJOR}.{PROTOCOL_MINOR}" in ei.value.details()

    assert tracker.Heartbeat(pb.HeartbeatRequest(node_id="ghost"), timeout=5).known is False
    assert tracker.Heartbeat(pb.HeartbeatRequest(node_id="n0", active_sessions=2), timeout=5).known is True
    with pytest.raises(grpc.RpcError) as ei:
        tracker.Heartbeat(pb.HeartbeatRequest(node_id="n0", decode_tokens_per_s=math.nan), timeout=5)
    assert ei.value.code() is grpc.StatusCode.INVALID_ARGUMENT

    # Still serving after every bad call: put the middle back and the route is whole again.
    tracker.Register(info("n10b", 10, 20, port=9003), timeout=5)
    route2 = tracker.GetRoute(pb.RouteRequest(model_sha256=SHA, previous_epoch=route.epoch), timeout=5)
    assert [h.node_id for h in route2.hops] == ["n0", "n10b", "n20"]
    assert route2.epoch > again.epoch


def test_get_route_model_selection(tracker):
    with pytest.raises(grpc.RpcError) as ei:
        tracker.GetRoute(pb.RouteRequest(), timeout=5)
    assert ei.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "no node is registered" in ei.value.details()

    other = "d" * 64
    tracker.Register(info("a", 0, 30), timeout=5)
    tracker.Register(info("b", 0, 8, n_layer=8, sha=other), timeout=5)
    with pytest.raises(grpc.RpcError) as ei:
        tracker.GetRoute(pb.RouteRequest(), timeout=5)
    assert ei.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert SHA in ei.value.details() and other in ei.value.details()
    assert [h.node_id for h in tracker.GetRoute(pb.RouteRequest(model_sha256=other), timeout=5).hops] == ["b"]

    with pytest.raises(grpc.RpcError) as ei:
        tracker.GetRoute(pb.RouteRequest(model_sha256="e" * 64), timeout=5)
    assert ei.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "no registered node serves this model" in ei.value.details()

    # Excluding the only node of a model names the layers it leaves uncovered.
    with pytest.raises(grpc.RpcError) as ei:
        tracker.GetRoute(pb.RouteRequest(model_sha256=SHA, exclude_node_ids=["a"]), timeout=5)
    assert "no node serves layers [0, 30) (excluded: a)" in ei.value.details()


def test_silent_node_leaves_routing_over_grpc():
    clock = FakeClock()
    server, port = serve_tracker(registry=Registry(heartbeat_interval_s=2.0, clock=clock))
    try:
        with open_channel(f"127.0.0.1:{port}") as channel:
            # Connected before the first call: once, on a loaded machine, that call met a refused connect.
            grpc.channel_ready_future(channel).result(timeout=10)
            stub = pb_grpc.TrackerStub(channel)
            stub.Register(info("solo", 0, 30), timeout=5)
            clock.now += 5.9
            assert [h.node_id for h in stub.GetRoute(pb.RouteRequest(), timeout=5).hops] == ["solo"]
            clock.now += 0.1
            with pytest.raises(grpc.RpcError) as ei:
                stub.GetRoute(pb.RouteRequest(model_sha256=SHA), timeout=5)
            assert ei.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert stub.Heartbeat(pb.HeartbeatRequest(node_id="solo"), timeout=5).known is False
    finally:
        server.stop(None)


def test_tracker_subcommand_parser():
    parser = argparse.ArgumentParser(prog="meshnet")
    add_tracker_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["tracker"])
    assert (args.host, args.port, args.heartbeat, args.join_token, args.tls_cert, args.tls_key) == \
        ("127.0.0.1", 7700, 2.0, None, None, None)
    args = parser.parse_args(["tracker", "--port", "0", "--heartbeat", "0.5", "--join-token", "s3cret"])
    assert (args.port, args.heartbeat, args.join_token) == (0, 0.5, "s3cret")
    assert args.func.__name__ == "run_tracker"
    bad = parser.parse_args(["tracker", "--tls-cert", "only-cert.pem"])
    assert args.func(bad) == 2


def test_run_tracker_serves_until_sigterm():
    """The CLI entry prints where it listens, serves, and exits 0 on SIGTERM."""
    src = str(Path(__file__).resolve().parents[1] / "src")
    code = ("import argparse, sys\n"
            "from meshnet.tracker.cli import add_tracker_parser\n"
            "p = argparse.ArgumentParser(); add_tracker_parser(p.add_subparsers(dest='command'))\n"
            "a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))\n")
    env = {**os.environ, "PYTHONPATH": src, "MESHNET_JOIN_TOKEN": ""}
    proc = subprocess.Popen([sys.executable, "-c", code, "tracker", "--port", "0", "--heartbeat", "0.7",
                             "--dashboard-port", "0", "--ledger", "sqlite://"], env=env,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        assert line.startswith("tracker listening on 127.0.0.1:"), line
        port = int(line.strip().rsplit(":", 1)[1])
        line = proc.stderr.readline()
        assert line.startswith("tracker: dashboard on http://127.0.0.1:"), line
        with urllib.request.urlopen(line.split()[-1] + "api/state", timeout=5) as r:
            state = json.loads(r.read())
        assert (state["nodes"], state["tracker"]["heartbeat_interval_s"]) == ([], 0.7)
        with open_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.TrackerStub(channel)
            assert stub.Heartbeat(pb.HeartbeatRequest(node_id="x"), timeout=5).known is False
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert "tracker stopped" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_an_internal_error_in_a_handler_is_logged_once_a_minute_not_only_answered(caplog):
    """A tracker whose ledger failed answered each registration INTERNAL and logged nothing: only the
    node's log said why. It is logged now, once a minute per method and message (nodes retry each second)."""
    import grpc

    from meshnet.tracker import refusals

    class Aborted(Exception):
        pass

    class Context:
        def abort(self, code, details):
            self.code, self.details = code, details
            raise Aborted

        def set_trailing_metadata(self, metadata):
            pass

    class Handler:
        @refusals.rpc
        def Register(self, request, context):
            raise RuntimeError("ledger write failed: attempt to write a readonly database")

    refusals._logged.clear()
    with caplog.at_level("ERROR", logger="meshnet.tracker"):
        for _ in range(3):
            ctx = Context()
            try:
                Handler().Register(None, ctx)
            except Aborted:
                pass
            assert ctx.code is grpc.StatusCode.INTERNAL
            assert ctx.details == ("tracker error in Register: RuntimeError: ledger write failed: attempt to "
                                   "write a readonly database")
    assert [r.getMessage() for r in caplog.records] == [ctx.details]


@pytest.mark.parametrize("field, value, named", [
    ("node_id", "evil\nnode 1234 joined: layers [0, 30) at 1.2.3.4:5", "holds characters other than letters"),
    ("node_id", "a b", "holds characters other than letters"),
    ("address", "not an address", "has a bad address: bad address 'not an address'"),
    ("address", "127.0.0.1:0", "has a bad address: bad address '127.0.0.1:0'"),
    ("data_address", "zzz", "has a bad data address: bad address 'zzz'"),
])
def test_register_refuses_an_id_or_address_nobody_could_use(tracker, field, value, named):
    """A newline in a node id forged lines of the tracker's log; an address that is no HOST:PORT was
    registered and handed to clients in routes."""
    message = info("ok-id", 0, 30)
    setattr(message, field, value)
    with pytest.raises(grpc.RpcError) as ei:
        tracker.Register(message, timeout=5)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in ei.value.details()
    assert list(tracker.ListNodes(pb.Empty(), timeout=5).nodes) == []


def test_a_relayed_node_registers_under_an_address_without_spaces_or_control_characters(tracker):
    relayed = info("r1", 0, 30)
    relayed.relayed, relayed.address = True, "relay:r1"
    tracker.Register(relayed, timeout=5)
    relayed.node_id, relayed.address = "r2", "relay:r2\nnode r3 joined"
    with pytest.raises(grpc.RpcError) as ei:
        tracker.Register(relayed, timeout=5)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "expected 'relay:r2'" in ei.value.details()
    assert [n.info.node_id for n in tracker.ListNodes(pb.Empty(), timeout=5).nodes] == ["r1"]


def test_a_full_registry_refuses_new_node_ids_until_one_leaves():
    """20,000 registrations made ListNodes larger than gRPC's message limit and every node list failed."""
    server, port = serve_tracker("127.0.0.1", 0, heartbeat_interval_s=0.5, registry=Registry(0.5, max_nodes=2))
    channel = open_channel(f"127.0.0.1:{port}")
    tracker = pb_grpc.TrackerStub(channel)
    try:
        tracker.Register(info("a", 0, 30, port=9001), timeout=5)
        tracker.Register(info("b", 0, 30, port=9002), timeout=5)
        tracker.Register(info("b", 0, 30, port=9002), timeout=5)  # a node registering again is no new one
        with pytest.raises(grpc.RpcError) as ei:
            tracker.Register(info("c", 0, 30, port=9003), timeout=5)
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "the tracker holds 2 nodes, its limit: node 'c' is refused until one leaves" in ei.value.details()
        tracker.Deregister(pb.NodeRef(node_id="a"), timeout=5)
        tracker.Register(info("c", 0, 30, port=9003), timeout=5)
        assert sorted(n.info.node_id for n in tracker.ListNodes(pb.Empty(), timeout=5).nodes) == ["b", "c"]
    finally:
        channel.close()
        server.stop(None)


def test_a_tracker_serving_other_machines_warns_of_a_node_only_its_machine_can_dial(caplog):
    """On the tracker's machine a node left on --host 127.0.0.1 (or bound to every interface on a machine
    without a default route) registered 127.0.0.1, which routes handed to clients elsewhere, and neither
    side said a word."""
    import logging

    server, port, _ = start_tracker("0.0.0.0", 0, heartbeat_interval_s=0.5)
    channel = open_channel(f"127.0.0.1:{port}")
    try:
        with caplog.at_level(logging.WARNING, logger="meshnet.tracker.members"):
            pb_grpc.TrackerStub(channel).Register(info("near", 0, 30, port=9123), timeout=5)
        assert [r.getMessage() for r in caplog.records] == [
            "node near registered 127.0.0.1:9123, which only this machine can dial, while the tracker serves other "
            "machines: they cannot reach it (start it with --host 0.0.0.0, with --advertise HOST:PORT where others "
            "reach it by another address)"]
    finally:
        channel.close()
        server.stop(None)
    # A tracker on loopback serves this machine alone: nothing to warn of.
    caplog.clear()
    server, port, _ = start_tracker("127.0.0.1", 0, heartbeat_interval_s=0.5)
    channel = open_channel(f"127.0.0.1:{port}")
    try:
        with caplog.at_level(logging.WARNING, logger="meshnet.tracker.members"):
            pb_grpc.TrackerStub(channel).Register(info("near", 0, 30, port=9123), timeout=5)
        assert caplog.records == []
    finally:
        channel.close()
        server.stop(None)


def test_a_node_claiming_another_layer_count_for_a_served_model_is_refused_and_routes_stay():
    # Routing takes a model's n_layer as the largest any node of it claims: one registration saying the
    # served model has 60 layers turned every honest node of it unusable (and drew every route to itself).
    clock = FakeClock()
    reg = Registry(heartbeat_interval_s=1.0, clock=clock)
    reg.register(record("a", 0, 19), PROTOCOL_MAJOR, PROTOCOL_MINOR)
    reg.register(record("b", 19, 30), PROTOCOL_MAJOR, PROTOCOL_MINOR)
    with pytest.raises(ValueError, match=r"60 layers.*30"):
        reg.register(record("liar", 0, 60, n_layer=60, address="127.0.0.1:10"), PROTOCOL_MAJOR, PROTOCOL_MINOR)
    assert [h.node_id for h in plan_route(reg.routable(), SHA)] == ["a", "b"]
    clock.now += 3.5  # the model's nodes are gone: another layer count may be served under the id again
    reg.register(record("c", 0, 60, n_layer=60, address="127.0.0.1:11"), PROTOCOL_MAJOR, PROTOCOL_MINOR)
    assert [h.node_id for h in plan_route(reg.routable(), SHA)] == ["c"]


def test_a_node_a_route_request_excluded_is_avoided_for_a_minute_and_afresh_once_it_registers_again():
    from meshnet.tracker.registry import AVOID_S

    clock = FakeClock()
    reg = Registry(heartbeat_interval_s=1000.0, clock=clock)
    for r in (record("a", 0, 15), record("b", 15, 30, address="127.0.0.1:10"), record("b2", 15, 30, address="127.0.0.1:11")):
        reg.register(r, PROTOCOL_MAJOR, PROTOCOL_MINOR)
    assert reg.avoided(["b", "stranger"]) == {"b"}  # ids the registry does not hold are ignored
    assert reg.avoided() == {"b"}
    clock.now += AVOID_S - 0.001
    assert reg.avoided() == {"b"}
    clock.now += 0.001
    assert reg.avoided() == set()
    assert reg.avoided(["b"]) == {"b"}
    reg.register(record("b", 15, 30, address="127.0.0.1:10"), PROTOCOL_MAJOR, PROTOCOL_MINOR)  # restarted
    assert reg.avoided() == set()


def test_a_route_request_that_excluded_a_node_spares_other_clients_the_node(tracker):
    """Every new client was handed the node it could not reach (it measured fastest), and each waited for it
    before routing around it; once a client excluded it, the next clients are routed around it."""
    tracker.Register(info("a", 0, 15, port=9200), timeout=5)
    nat = info("b-nat", 15, 30, port=9201)
    nat.decode_tokens_per_s = 166.8
    lan = info("b-lan", 15, 30, port=9202)
    lan.decode_tokens_per_s = 146.1
    tracker.Register(nat, timeout=5)
    tracker.Register(lan, timeout=5)
    assert [h.node_id for h in tracker.GetRoute(pb.RouteRequest(), timeout=5).hops] == ["a", "b-nat"]
    assert [h.node_id for h in tracker.GetRoute(pb.RouteRequest(exclude_node_ids=["b-nat"]), timeout=5).hops] == [
        "a", "b-lan"]
    assert [h.node_id for h in tracker.GetRoute(pb.RouteRequest(), timeout=5).hops] == ["a", "b-lan"]
