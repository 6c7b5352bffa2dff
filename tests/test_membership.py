"""Membership without processes: node identities on disk, signatures, and the tracker refusing
impersonation, forged heartbeats, wrong-key deregistration, stale and replayed messages."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import stat
import time

import grpc
import pytest

from mesh_util import RpcFailure
from meshnet.ledger.store import Ledger
from meshnet.membership.auth import AuthError, Authenticator, MemoryBindings
from meshnet.membership.cli import add_nodes_parser, format_nodes
from meshnet.membership.identity import (IdentityError, NodeIdentity, SignatureError, default_identity_path,
                                         load_or_create_identity, node_id_for, node_identity, verify_message)
from meshnet.proto import meshnet_pb2 as pb
from meshnet.proto import meshnet_pb2_grpc as pb_grpc
from meshnet.tracker.server import serve_tracker
from meshnet.wire.envelope import PROTOCOL_MAJOR, PROTOCOL_MINOR
from meshnet.wire.security import open_channel

SHA = "ef" * 32


def node_info(node_id: str, start: int = 0, end: int = 30, port: int = 9) -> pb.NodeInfo:
    return pb.NodeInfo(node_id=node_id, address=f"127.0.0.1:{port}", layers=pb.LayerRange(start=start, end=end),
                       model=pb.ModelIdentity(sha256=SHA, architecture="llama", n_layer=30), backend="cpu",
                       protocol_major=PROTOCOL_MAJOR, protocol_minor=PROTOCOL_MINOR, max_sessions=4,
                       decode_tokens_per_s=12.5)


# ---- identities ----------------------------------------------------------------------------------------

def test_identity_is_created_once_with_private_permissions(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    path = default_identity_path("a/head")
    assert path == tmp_path / "cfg" / "meshnet" / "node-a_head.key"
    with pytest.raises(ValueError, match="unnamed node"):
        default_identity_path(None)
    first = load_or_create_identity(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    again = load_or_create_identity(path)
    assert again.public_key == first.public_key and len(first.public_key) == 32
    assert first.node_id == node_id_for(first.public_key) and len(first.node_id) == 32
    assert int(first.node_id, 16) >= 0  # hex

    os.chmod(path, 0o644)
    with pytest.raises(IdentityError, match="chmod 600"):
        load_or_create_identity(path)
    bad = tmp_path / "bad.key"
    bad.write_text("not a key")
    os.chmod(bad, 0o600)
    with pytest.raises(IdentityError, match="not an unencrypted PEM private key"):
        load_or_create_identity(bad)
    # A path under a file said "File exists"; a directory got the chmod advice.
    with pytest.raises(IdentityError) as ei:
        load_or_create_identity(bad / "sub" / "node.key")
    assert str(ei.value) == f"cannot create identity file {bad}/sub/node.key: {bad} is a file, not a directory"
    with pytest.raises(IdentityError) as ei:
        load_or_create_identity(tmp_path)
    assert str(ei.value) == f"identity file {tmp_path} is a directory; name a key file (it is created when missing)"


def test_unnamed_nodes_get_a_fresh_key_each_named_ones_keep_theirs(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    # Two unnamed processes (two spares for one range): two ids, and no key file written.
    a, b = node_identity(None, None), node_identity(None, None)
    assert a.node_id != b.node_id and a.path is None and b.path is None
    assert not (tmp_path / "cfg").exists()
    # A named node restarts with the same key, kept in its own file.
    first, again = node_identity("mid", None), node_identity("mid", None)
    assert first.public_key == again.public_key
    assert first.path == tmp_path / "cfg" / "meshnet" / "node-mid.key"
    # --identity wins over the name's default file.
    explicit = node_identity("mid", tmp_path / "own.key")
    assert explicit.path == tmp_path / "own.key" and explicit.public_key != first.public_key


def test_signatures_cover_every_field_and_the_time():
    me = NodeIdentity.generate()
    hb = me.sign(pb.HeartbeatRequest(node_id=me.node_id, active_sessions=2))
    assert verify_message(hb) == me.public_key
    tampered = pb.HeartbeatRequest()
    tampered.CopyFrom(hb)
    tampered.active_sessions = 3
    with pytest.raises(SignatureError, match="bad signature"):
        verify_message(tampered)
    old = me.sign(pb.HeartbeatRequest(node_id=me.node_id), timestamp=time.time() - 120)
    with pytest.raises(SignatureError, match="timestamp is 120 s old"):
        verify_message(old)
    future = me.sign(pb.HeartbeatRequest(node_id=me.node_id), timestamp=time.time() + 300)
    with pytest.raises(SignatureError, match="in the future"):
        verify_message(future)
    # A signature for one message type does not verify for another with the same bytes.
    ref = pb.NodeRef(node_id=me.node_id, public_key=hb.public_key, timestamp=hb.timestamp, signature=hb.signature)
    with pytest.raises(SignatureError, match="bad signature"):
        verify_message(ref)


def test_authenticator_rules():
    bindings = MemoryBindings()
    auth = Authenticator(bindings)
    alice, mallory = NodeIdentity.generate(), NodeIdentity.generate()
    # Unsigned messages pass only for ids no key owns.
    assert auth.check("legacy", pb.HeartbeatRequest(node_id="legacy")) is False
    # A readable id is bound to the first key that registers it.
    reg = alice.sign(node_info("alice"))
    assert auth.check("alice", reg, bind=True) is True
    auth.bind("alice", reg)
    with pytest.raises(AuthError, match="belongs to another key"):
        auth.check("alice", mallory.sign(node_info("alice")), bind=True)
    with pytest.raises(AuthError, match="unsigned"):
        auth.check("alice", pb.HeartbeatRequest(node_id="alice"))
    # A key's own id cannot be claimed by another key, even before that key registered.
    with pytest.raises(AuthError, match="is the id of another key"):
        auth.check(alice.node_id, mallory.sign(node_info(alice.node_id)), bind=True)
    # An unbound readable id must register before it heartbeats.
    with pytest.raises(AuthError, match="register first"):
        auth.check("bob", mallory.sign(pb.HeartbeatRequest(node_id="bob")))
    # Replays are refused.
    hb = alice.sign(pb.HeartbeatRequest(node_id="alice"))
    auth.check("alice", hb)
    with pytest.raises(AuthError, match="replayed"):
        auth.check("alice", hb)
    # Partly signed messages are not "unsigned".
    with pytest.raises(AuthError, match="public_key must be 32 bytes"):
        auth.check("legacy", pb.HeartbeatRequest(node_id="legacy", timestamp=time.time()))
    strict = Authenticator(MemoryBindings(), require_signatures=True)
    with pytest.raises(AuthError, match="accepts only signed"):
        strict.check("legacy", pb.HeartbeatRequest(node_id="legacy"))


# ---- the tracker over gRPC ------------------------------------------------------------------------------

@pytest.fixture
def tracker(tmp_path):
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    state = {"ledger": Ledger(url)}
    server, port = serve_tracker("127.0.0.1", 0, heartbeat_interval_s=5.0, ledger=state["ledger"])
    state.update(server=server, port=port, url=url)
    channel = open_channel(f"127.0.0.1:{port}")
    try:
        yield pb_grpc.TrackerStub(channel), state
    finally:
        channel.close()
        state["server"].stop(None)
        state["ledger"].close()


def refusal(fn, request) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as ei:
        fn(request, timeout=5)
    return ei.value.code(), ei.value.details()


def route_ids(stub) -> list[str]:
    return [h.node_id for h in stub.GetRoute(pb.RouteRequest(), timeout=5).hops]


def test_forged_heartbeat_and_wrong_key_deregister_are_refused(tracker):
    stub, _ = tracker
    victim, attacker = NodeIdentity.generate(), NodeIdentity.generate()
    stub.Register(victim.sign(node_info(victim.node_id)), timeout=5)
    assert route_ids(stub) == [victim.node_id]
    [status] = stub.ListNodes(pb.Empty(), timeout=5).nodes
    assert status.signed is True

    code, msg = refusal(stub.Heartbeat, attacker.sign(pb.HeartbeatRequest(node_id=victim.node_id,
                                                                          active_sessions=4)))
    assert code is grpc.StatusCode.UNAUTHENTICATED and "is the id of another key" in msg
    code, msg = refusal(stub.Heartbeat, pb.HeartbeatRequest(node_id=victim.node_id, active_sessions=4))
    assert code is grpc.StatusCode.UNAUTHENTICATED and "unsigned" in msg
    assert stub.ListNodes(pb.Empty(), timeout=5).nodes[0].active_sessions == 0  # nothing was changed

    code, msg = refusal(stub.Deregister, attacker.sign(pb.NodeRef(node_id=victim.node_id)))
    assert code is grpc.StatusCode.UNAUTHENTICATED and "Deregister" in msg
    code, msg = refusal(stub.Deregister, pb.NodeRef(node_id=victim.node_id))
    assert code is grpc.StatusCode.UNAUTHENTICATED
    # The attacker cannot take the id over by registering it either.
    code, msg = refusal(stub.Register, attacker.sign(node_info(victim.node_id, port=6666)))
    assert code is grpc.StatusCode.UNAUTHENTICATED
    assert route_ids(stub) == [victim.node_id]
    assert stub.GetRoute(pb.RouteRequest(), timeout=5).hops[0].address == "127.0.0.1:9"

    # Stale and replayed messages from the real key are refused too.
    code, msg = refusal(stub.Heartbeat, victim.sign(pb.HeartbeatRequest(node_id=victim.node_id),
                                                    timestamp=time.time() - 90))
    assert code is grpc.StatusCode.UNAUTHENTICATED and "90 s old" in msg
    hb = victim.sign(pb.HeartbeatRequest(node_id=victim.node_id))
    assert stub.Heartbeat(hb, timeout=5).known is True
    code, msg = refusal(stub.Heartbeat, hb)
    assert code is grpc.StatusCode.UNAUTHENTICATED and "replayed" in msg

    stub.Deregister(victim.sign(pb.NodeRef(node_id=victim.node_id)), timeout=5)
    assert stub.ListNodes(pb.Empty(), timeout=5).nodes == []


def test_a_readable_id_stays_bound_to_its_key_across_a_tracker_restart(tracker):
    stub, state = tracker
    owner, other = NodeIdentity.generate(), NodeIdentity.generate()
    stub.Register(owner.sign(node_info("a-head", 0, 15)), timeout=5)
    code, msg = refusal(stub.Register, other.sign(node_info("a-head", 0, 15, port=7)))
    assert code is grpc.StatusCode.UNAUTHENTICATED and "belongs to another key" in msg
    # A refused registration leaves nothing half-registered behind.
    code, _ = refusal(stub.Register, other.sign(node_info("b-tail", 15, 30), timestamp=time.time() - 600))
    assert code is grpc.StatusCode.UNAUTHENTICATED
    assert [n.info.node_id for n in stub.ListNodes(pb.Empty(), timeout=5).nodes] == ["a-head"]

    state["server"].stop(None).wait()
    state["ledger"].close()
    state["ledger"] = Ledger(state["url"])
    state["server"], _ = serve_tracker("127.0.0.1", state["port"], heartbeat_interval_s=5.0, ledger=state["ledger"])
    # The restarted tracker forgot the registration (heartbeats are told to register again) but not the key.
    deadline = time.monotonic() + 10
    while True:
        try:
            assert stub.Heartbeat(owner.sign(pb.HeartbeatRequest(node_id="a-head")), timeout=5).known is False
            break
        except grpc.RpcError:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    code, _ = refusal(stub.Register, other.sign(node_info("a-head", 0, 15, port=7)))
    assert code is grpc.StatusCode.UNAUTHENTICATED
    stub.Register(owner.sign(node_info("a-head", 0, 15)), timeout=5)
    assert stub.ListNodes(pb.Empty(), timeout=5).nodes[0].signed is True


def test_a_registration_refused_after_its_signature_passed_binds_no_id(tracker):
    """A signed registration refused for its protocol version, or because a live node holds the id, bound
    the id to its key all the same: the id's owner was then refused as "another key"."""
    stub, _ = tracker
    squatter, owner = NodeIdentity.generate(), NodeIdentity.generate()
    old = node_info("c-mid", 10, 20)
    old.protocol_major = PROTOCOL_MAJOR + 1
    code, msg = refusal(stub.Register, squatter.sign(old))
    assert code is grpc.StatusCode.FAILED_PRECONDITION and "speaks protocol" in msg
    unsigned_holder = node_info("d-tail", 20, 30, port=11)
    stub.Register(unsigned_holder, timeout=5)
    code, msg = refusal(stub.Register, squatter.sign(node_info("d-tail", 20, 30, port=12)))
    assert code is grpc.StatusCode.ALREADY_EXISTS
    stub.Deregister(pb.NodeRef(node_id="d-tail"), timeout=5)
    stub.Register(owner.sign(node_info("c-mid", 10, 20)), timeout=5)
    stub.Register(owner.sign(node_info("d-tail", 20, 30, port=12)), timeout=5)
    listed = {n.info.node_id: n.signed for n in stub.ListNodes(pb.Empty(), timeout=5).nodes}
    assert listed == {"c-mid": True, "d-tail": True}


def test_registrations_with_oversized_fields_are_refused_and_routes_stay_small(tracker):
    """Two registrations with 9 MiB addresses made every route larger than gRPC's message limit: no client
    got a route although honest nodes held every layer."""
    stub, _ = tracker
    stub.Register(node_info("honest", 0, 30), timeout=5)
    for field, value, what in [("address", "127.0.0.1:" + "1" * 400, "an address of 410 characters (at most 300)"),
                               ("data_address", "h" * 301, "a data address of 301 characters (at most 300)"),
                               ("engine", "e" * 65, "an engine name of 65 characters (at most 64)")]:
        big = node_info("liar", 0, 30, port=8)
        setattr(big, field, value)
        code, msg = refusal(stub.Register, big)
        assert code is grpc.StatusCode.INVALID_ARGUMENT
        assert msg == f"Register: node 'liar' has {what}"
    big = node_info("liar", 0, 30, port=8)
    big.device.description = "d" * 257
    code, msg = refusal(stub.Register, big)
    assert msg == "Register: node 'liar' has a device description of 257 characters (at most 256)"
    big = node_info("liar", 0, 30, port=8)
    big.device.cpu_features.extend(["x" * 100] * 30)
    code, msg = refusal(stub.Register, big)
    assert msg == "Register: node 'liar' has a CPU feature list of 3029 characters (at most 2048)"
    assert route_ids(stub) == ["honest"]


def test_loopback_addresses_are_told_from_where_they_were_registered():
    """Plain data: a loopback address registered from another machine cannot serve anyone but its own
    machine; from this machine (loopback, or one of its own addresses) it can."""
    from meshnet.wire.addresses import loopback_seen_from_elsewhere as seen, this_machine_address

    why = seen("127.0.0.1:7701", "ipv4:192.0.2.7:41234")
    assert why == ("127.0.0.1:7701 is a loopback address, which only its own machine can dial, but it registered "
                   "from 192.0.2.7: start the node with --host 0.0.0.0 (or its address), with --advertise HOST:PORT "
                   "where others reach it by another address")
    assert seen("[::1]:7701", "ipv6:%5B2001:db8::7%5D:41234").startswith("[::1]:7701 is a loopback address")
    assert seen("localhost:7701", "ipv4:192.0.2.7:1").startswith("localhost:7701 is a loopback")
    assert seen("127.0.0.5:7701", "ipv4:192.0.2.7:1") is not None  # all of 127.0.0.0/8
    for other_spelling in ("LOCALHOST", "localhost.", "node.localhost", "localhost.localdomain", "ip6-localhost",
                           "127.1", "2130706433", "[::ffff:127.0.0.1]"):
        assert seen(f"{other_spelling}:7701", "ipv4:192.0.2.7:1") is not None, other_spelling
    assert seen("127.example:7701", "ipv4:192.0.2.7:1") is None
    assert seen("127.0.0.1:7701", "ipv4:127.0.0.1:41234") is None
    assert seen("127.0.0.1:7701", "ipv6:%5B::1%5D:41234") is None
    assert seen("127.0.0.1:7701", "ipv6:%5B::ffff:127.0.0.1%5D:41234") is None  # a tracker on :: seen over IPv4
    assert seen("127.0.0.1:7701", "ipv6:%5B::ffff:192.0.2.7%5D:41234") is not None
    assert seen("192.0.2.9:7701", "ipv4:192.0.2.7:41234") is None  # not loopback: dialled as given
    assert seen("node-a.lan:7701", "ipv4:192.0.2.7:41234") is None  # a name: not ours to judge
    assert seen("127.0.0.1:7701", "unix:/tmp/tracker.sock") is None
    own = this_machine_address("0.0.0.0")
    if own != "0.0.0.0":  # a machine with a default route: a node there dialling the tracker by that address
        assert seen("127.0.0.1:7701", f"ipv4:{own}:41234") is None


def test_a_loopback_node_registering_from_another_machine_is_refused_by_name(caplog):
    """A node left on the default --host 127.0.0.1 but pointed at a tracker on another machine registered,
    was picked as the fastest, and every client dialled its own loopback for it. The tracker refuses it,
    and the node stops on the refusal (INVALID_ARGUMENT is among the fatal ones) rather than retry."""
    from meshnet.node.membership import FATAL_REFUSALS
    from meshnet.tracker.registry import Registry
    from meshnet.tracker.service import TrackerService

    class Aborted(Exception):
        pass

    class Context:
        def __init__(self, peer: str) -> None:
            self._peer, self.status = peer, None

        def peer(self) -> str:
            return self._peer

        def abort(self, code, details):
            self.status = (code, details)
            raise Aborted(details)

    service = TrackerService(Registry())
    elsewhere = Context("ipv4:192.0.2.7:41234")
    with pytest.raises(Aborted), caplog.at_level(logging.WARNING, logger="meshnet.tracker.members"):
        service.Register(node_info("far", 0, 30, port=14805), elsewhere)
    # The tracker's own log says so too (only the node heard of it): its operator looks there.
    assert [r.getMessage() for r in caplog.records] == [f"refused node far: {elsewhere.status[1].split(': ', 2)[2]}"]
    assert elsewhere.status == (grpc.StatusCode.INVALID_ARGUMENT, "Register: node 'far': 127.0.0.1:14805 is a "
                                "loopback address, which only its own machine can dial, but it registered from "
                                "192.0.2.7: start the node with --host 0.0.0.0 (or its address), with --advertise "
                                "HOST:PORT where others reach it by another address")
    assert grpc.StatusCode.INVALID_ARGUMENT in FATAL_REFUSALS
    data_loopback = node_info("far", 0, 30)
    data_loopback.address, data_loopback.data_address = "192.0.2.7:14805", "127.0.0.1:14806"
    with pytest.raises(Aborted):
        service.Register(data_loopback, elsewhere)
    assert elsewhere.status[1].startswith("Register: node 'far': 127.0.0.1:14806 is a loopback address")
    relayed = node_info("behind-nat", 0, 30)
    relayed.relayed = True  # reached through the tracker's relay: its own address is never dialled
    service.Register(relayed, elsewhere)
    service.Register(node_info("near", 0, 30), Context("ipv4:127.0.0.1:41234"))
    assert [service.registry.get(n).node_id for n in ("behind-nat", "near")] == ["behind-nat", "near"]
    assert service.registry.get("far") is None


def test_required_signatures_refuse_unsigned_nodes():
    server, port = serve_tracker("127.0.0.1", 0, require_signatures=True)
    try:
        with open_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.TrackerStub(channel)
            code, msg = refusal(stub.Register, node_info("legacy"))
            assert code is grpc.StatusCode.UNAUTHENTICATED and "accepts only signed" in msg
            me = NodeIdentity.generate()
            stub.Register(me.sign(node_info(me.node_id)), timeout=5)
            assert route_ids(stub) == [me.node_id]
    finally:
        server.stop(None)


def test_meshnet_nodes_lists_range_backend_load_speed_relay_and_age(tracker):
    stub, state = tracker
    me = NodeIdentity.generate()
    info = node_info(me.node_id, 0, 15)
    info.backend = "vulkan"
    info.data_address = "127.0.0.1:10"
    info.free_memory_bytes = 3 << 30
    info.n_ctx = 4096
    info.device.CopyFrom(pb.DeviceInfo(name="Vulkan0", description="Radeon", type="gpu",
                                       memory_total_bytes=8 << 30, index=0))
    stub.Register(me.sign(info), timeout=5)
    stub.Heartbeat(me.sign(pb.HeartbeatRequest(node_id=me.node_id, active_sessions=3)), timeout=5)
    stub.Register(node_info("legacy", 15, 30), timeout=5)
    cpu_node = node_info("cpu-node", 15, 30)
    cpu_node.device.CopyFrom(pb.DeviceInfo(name="CPU", description="AMD EPYC", type="cpu", memory_total_bytes=8 << 30,
                                           cpu_features=["SSE3", "AVX", "AVX2", "FMA", "AVX512", "AVX512_VNNI"]))
    stub.Register(cpu_node, timeout=5)
    parser = argparse.ArgumentParser(prog="meshnet")
    add_nodes_parser(parser.add_subparsers(dest="command"))
    def table(*flags: str) -> str:
        args = parser.parse_args(["nodes", "--tracker", f"127.0.0.1:{state['port']}", "--no-load", *flags])
        assert args.func.__name__ == "run_nodes"
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert args.func(args) == 0
        return out.getvalue()

    # By default what a node is beyond its range (backend, signing, data plane, device) stays out: the
    # table took 267 columns for three nodes of `meshnet up`, its device alone 80.
    header, *rows = table().splitlines()
    assert header.split() == ["NODE", "MODEL", "LAYERS", "CTX", "LOAD", "SPEED", "RELAY", "HEARTBEAT", "ADDRESS"]
    assert {r.split()[0]: r.split()[-1] for r in rows}[me.node_id] == "127.0.0.1:9"
    assert max(len(line) for line in table().splitlines()) <= 120  # its generated node id alone is 32
    header, *rows = table("--wide").splitlines()
    assert header.split() == ["NODE", "MODEL", "LAYERS", "CTX", "BACKEND", "LOAD", "SPEED", "RELAY", "HEARTBEAT",
                              "SIGNED", "ADDRESS", "DATA", "DEVICE"]
    cells = {r.split()[0]: r.split()[:1] + r.split()[2:] for r in rows}  # MODEL checked below
    assert {r.split()[0]: r.split()[1] for r in rows}[me.node_id] == info.model.sha256[:12]
    assert cells[me.node_id][1:6] == ["[0,", "15)/30", "4096", "vulkan", "3/4"]
    assert cells["legacy"][3] == "-"  # a node that did not say its context
    assert cells[me.node_id][6:9] == ["12.5", "tok/s", "direct"]
    assert cells[me.node_id][9].endswith("s") and float(cells[me.node_id][9][:-1]) < 5
    assert cells[me.node_id][11:] == ["yes", "127.0.0.1:9", "127.0.0.1:10", "Radeon", "(3.0/8.0", "GiB", "free)"]
    assert cells["legacy"][11:] == ["no", "127.0.0.1:9", "-", "-"]
    # A CPU node shows which SIMD kernels it runs (beyond what AVX2 implies): exact ids need the same.
    assert cells["cpu-node"][14:19] == ["AMD", "EPYC", "[AVX2", "AVX512", "AVX512_VNNI]"]

    args = parser.parse_args(["nodes", "--tracker", f"127.0.0.1:{state['port']}", "--json"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert args.func(args) == 0
    nodes = {n["node_id"]: n for n in json.loads(out.getvalue())["nodes"]}
    assert nodes[me.node_id]["layers"] == [0, 15] and nodes[me.node_id]["active_sessions"] == 3
    assert (nodes[me.node_id]["n_ctx"], nodes["legacy"]["n_ctx"]) == (4096, 0)
    assert nodes[me.node_id]["relay"] == "direct" and nodes["legacy"]["signed"] is False
    assert (nodes[me.node_id]["address"], nodes[me.node_id]["data_address"]) == ("127.0.0.1:9", "127.0.0.1:10")
    assert nodes["legacy"]["data_address"] == ""
    assert nodes[me.node_id]["device"] == {"name": "Vulkan0", "description": "Radeon", "type": "gpu",
                                           "memory_total_bytes": 8 << 30, "index": 0, "cpu_features": []}
    assert nodes["cpu-node"]["device"]["cpu_features"] == ["SSE3", "AVX", "AVX2", "FMA", "AVX512", "AVX512_VNNI"]
    assert nodes[me.node_id]["free_memory_bytes"] == 3 << 30 and nodes["legacy"]["device"] is None

    # Nothing listens at 127.0.0.1:9: no figures, but why (it looked like a relayed node's, which is not asked).
    assert nodes[me.node_id]["load"]["error"].startswith("UNAVAILABLE: failed to connect")
    args = parser.parse_args(["nodes", "--tracker", f"127.0.0.1:{state['port']}"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert args.func(args) == 0
    said = [line for line in out.getvalue().splitlines() if line.startswith(f"node {me.node_id} at")]
    assert len(said) == 1 and said[0].startswith(f"node {me.node_id} at 127.0.0.1:9 does not answer from here "
                                                 "(UNAVAILABLE: failed to connect")
    assert said[0].endswith("clients on this machine cannot reach it either (a node behind NAT or a firewall joins "
                            "with --relay)")
    assert {r.split()[0]: r.split()[8] for r in out.getvalue().splitlines()[1:4]}[me.node_id] == "unreachable"

    # With the nodes' figures: KV cells held/reserved/capacity, rows per iteration, steps in queue.
    load = {"kv_tokens_held": 120, "kv_tokens_reserved": 400, "kv_tokens_capacity": 8192, "kv_bytes": 1 << 20,
            "mean_batch_rows": 6.5, "max_batch_rows": 40, "waiting_steps": 2, "mean_queue_ms": 1.25,
            "weight_bytes": 1_755_000_000}
    reply = stub.ListNodes(pb.Empty(), timeout=5)
    header, *rows = format_nodes(reply, {me.node_id: load}, wide=True).splitlines()
    assert header.split()[7:11] == ["KV_HELD/RSVD/CAP", "BATCH_ROWS", "QUEUE", "WEIGHTS"]
    cells = {r.split()[0]: r.split()[:1] + r.split()[2:] for r in rows}
    assert cells[me.node_id][8:17] == ["120/400/8192", "6.5", "(max", "40)", "2", "(1.2", "ms)", "1.6", "GiB"]
    assert cells["legacy"][8:12] == ["-", "-", "-", "-"]

    # An unreachable tracker is an error message, not a trace.
    args = parser.parse_args(["nodes", "--tracker", "127.0.0.1:1"])
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert args.func(args) == 1
    assert "error: tracker 127.0.0.1:1: UNAVAILABLE" in err.getvalue()


def test_meshnet_nodes_lists_a_models_nodes_in_layer_order():
    """Rows came in node-id order: with random ids a tail was listed above its head."""
    reply = pb.NodeList(nodes=[pb.NodeStatus(info=node_info(n, a, b))
                               for n, a, b in (("9b12", 20, 30), ("eb82", 0, 10), ("0c3f", 10, 20), ("1aaa", 10, 20))])
    assert [row.split()[0] for row in format_nodes(reply).splitlines()[1:]] == ["eb82", "0c3f", "1aaa", "9b12"]


def test_meshnet_nodes_names_the_layers_no_node_serves():
    from meshnet.membership.cli import nodes_dict

    reply = pb.NodeList(nodes=[pb.NodeStatus(info=node_info("head", 0, 10)), pb.NodeStatus(info=node_info("tail", 20, 30)),
                               pb.NodeStatus(info=node_info("late", 28, 30))])
    assert format_nodes(reply).splitlines()[-1] == f"model {SHA[:12]}: no node serves layers [10, 20): no route until one does"
    assert nodes_dict(reply)["unserved_layers"] == {SHA: [[10, 20]]}
    whole = pb.NodeList(nodes=[pb.NodeStatus(info=node_info("head", 0, 10)), pb.NodeStatus(info=node_info("rest", 10, 30))])
    assert len(format_nodes(whole).splitlines()) == 3 and nodes_dict(whole)["unserved_layers"] == {}


def test_meshnet_nodes_names_replicas_that_compute_otherwise():
    """Layers served by replicas with other numerics keys get a line under the table (a failover between
    them is within tolerance), one per run of layers whatever the number of replicas; nodes on other
    layers, with the same key, or without one, add none."""
    from meshnet.membership.cli import nodes_dict

    one = "ggml-python=0.0.37 backend=cpu simd=AVX2 threads=1 weights=repacked"
    two = one.replace("threads=1", "threads=2")
    infos = [node_info("head", 0, 10), node_info("mid", 10, 20), node_info("mid2", 10, 30), node_info("twin", 10, 20),
             node_info("old", 10, 20), node_info("tail", 20, 30)]
    for i, key in zip(infos, [two, one, two, one, "", one]):
        i.numerics = key
    reply = pb.NodeList(nodes=[pb.NodeStatus(info=i) for i in infos])
    expected = [f"model {SHA[:12]}: layers [10, 20) are served by nodes that compute otherwise (mid, twin: "
                "threads=1; mid2: threads=2): a failover between them continues within tolerance, not bit for bit",
                f"model {SHA[:12]}: layers [20, 30) are served by nodes that compute otherwise (mid2: threads=2; "
                "tail: threads=1): a failover between them continues within tolerance, not bit for bit"]
    assert format_nodes(reply).splitlines()[-2:] == expected
    data = nodes_dict(reply)
    assert data["unlike_replicas"] == expected
    crowd = [node_info(f"r{i}", 10, 20) for i in range(40)]
    for i, info in enumerate(crowd):
        info.numerics = (one, two)[i % 2]
    assert len(format_nodes(pb.NodeList(nodes=[pb.NodeStatus(info=i) for i in infos + crowd])).splitlines()) == \
        1 + len(infos) + len(crowd) + 2  # header, rows, and still a line per run of layers
    assert [n["numerics"] for n in data["nodes"]] == [two, one, two, one, "", one]


def test_a_node_is_ready_without_waiting_for_a_tracker_nothing_answers_for(tmp_path, monkeypatch):
    """A node started while its tracker is down printed its ready line only after the whole wait for a
    refusal (5 s), which none can send: tests and `meshnet up`'s restarts waited for nothing. Two tries
    that found nothing at the tracker's address end the wait (here it would otherwise last 30 s)."""
    import socket
    import threading
    import types

    import meshnet.node.cli as node_cli
    from meshnet.node.membership import Membership

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    identity = NodeIdentity.generate()
    membership = Membership(pb_grpc.TrackerStub(open_channel(f"127.0.0.1:{port}")), identity, "n1",
                            lambda: pb.NodeInfo(node_id="n1"), lambda: (0, 0.0),
                            types.SimpleNamespace(flush=lambda tracker, max_batches: True), lambda why: None)
    stop = threading.Event()
    threading.Thread(target=membership.run, args=(stop,), daemon=True).start()
    monkeypatch.setattr(node_cli, "READY_WAIT_S", 30.0)
    try:
        t0 = time.monotonic()
        assert node_cli._registered_or_trying(types.SimpleNamespace(membership=membership)) is True
        assert time.monotonic() - t0 < 15  # the second try comes about a second after the first
        assert membership.unreachable_tries >= node_cli.READY_UNREACHABLE_TRIES
        assert not membership.registered.is_set() and membership.refusal is None
    finally:
        stop.set()


def test_a_node_silent_past_its_ttl_and_back_before_a_sweep_is_said_to_leave_and_join(caplog):
    """A node stopped (SIGSTOP) for a few seconds registered again over its expired entry: no line said
    it had gone, nor that it was back."""
    from meshnet.tracker.node_info import record_from_info
    from meshnet.tracker.registry import Registry

    now = [100.0]
    registry = Registry(heartbeat_interval_s=1.0, clock=lambda: now[0])
    record = record_from_info(node_info("n2", 10, 20, port=14920))
    with caplog.at_level(logging.INFO, logger="meshnet.tracker.members"):
        registry.register(record, PROTOCOL_MAJOR, PROTOCOL_MINOR)
        now[0] += 1.0
        registry.register(record, PROTOCOL_MAJOR, PROTOCOL_MINOR)  # re-registering while alive: no line
        now[0] += 6.0
        registry.register(record, PROTOCOL_MAJOR, PROTOCOL_MINOR)
    assert [r.getMessage() for r in caplog.records] == [
        "node n2 joined: layers [10, 20) at 127.0.0.1:14920",
        "node n2 left routing: silent for 6.0 s (no heartbeat)",
        "node n2 joined: layers [10, 20) at 127.0.0.1:14920"]


def test_a_node_restarted_within_its_ttl_at_its_address_is_said_to_restart(caplog):
    """Killed and restarted at once under its id and ports (a supervisor, an operator), a node registered
    again over its live entry, and the tracker's log said nothing at all."""
    from meshnet.tracker.node_info import record_from_info
    from meshnet.tracker.registry import Registry

    registry = Registry(heartbeat_interval_s=1.0, clock=lambda: 100.0)
    first = node_info("n3", 10, 20, port=14930)
    first.instance = "process-1"
    with caplog.at_level(logging.INFO, logger="meshnet.tracker.members"):
        registry.register(record_from_info(first), PROTOCOL_MAJOR, PROTOCOL_MINOR)
        registry.register(record_from_info(first), PROTOCOL_MAJOR, PROTOCOL_MINOR)  # the same process: no line
        first.instance = "process-2"
        registry.register(record_from_info(first), PROTOCOL_MAJOR, PROTOCOL_MINOR)
    assert [r.getMessage() for r in caplog.records] == [
        "node n3 joined: layers [10, 20) at 127.0.0.1:14930",
        "node n3 restarted: a new process at 127.0.0.1:14930"]


def test_a_tracker_on_every_interface_of_a_machine_without_a_default_route_says_its_address_is_unknown(monkeypatch):
    """Without a default route the line naming where other machines reach the tracker was left out without
    a word, and its dashboard line named no address either."""
    from meshnet.tracker import cli as tracker_cli

    monkeypatch.setattr(tracker_cli, "this_machine_address", lambda host: host)  # no route: the wildcard back
    assert tracker_cli.reached_at("0.0.0.0", 7700) == (
        "tracker: this machine has no default route, so its address on the network other machines share is not "
        "known here: they reach the tracker at that address, port 7700")
    monkeypatch.setattr(tracker_cli, "this_machine_address", lambda host: "10.99.0.1")
    assert tracker_cli.reached_at("::", 7700) == "tracker: other machines reach it at 10.99.0.1:7700"
    assert tracker_cli.reached_at("127.0.0.1", 7700) is None


def test_a_tracker_on_every_interface_says_where_it_is_reached_whether_it_is_open_and_who_comes_and_goes(tmp_path):
    """`meshnet tracker --host 0.0.0.0` printed 0.0.0.0 addresses nobody can open, nothing about running
    without a join token, and no line when nodes joined or died."""
    import subprocess
    import sys
    import threading

    from meshnet.wire.addresses import this_machine_address

    env = {k: v for k, v in os.environ.items() if k != "MESHNET_JOIN_TOKEN"}
    env["HOME"] = str(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "meshnet.cli", "tracker", "--host", "0.0.0.0", "--port", "0",
                             "--heartbeat", "0.2", "--dashboard-host", "0.0.0.0", "--dashboard-port", "0",
                             "--ledger", "sqlite://"], stderr=subprocess.PIPE, text=True, env=env)
    try:
        lines = []
        while not lines or not lines[-1].startswith("tracker: ledger"):
            lines.append(proc.stderr.readline().rstrip("\n"))
            assert lines[-1] or proc.poll() is None, lines
        port = int(lines[0].rsplit(":", 1)[1])
        here = this_machine_address("0.0.0.0")
        if here != "0.0.0.0":  # a machine with a default route (else there is no address to name)
            assert f"tracker: other machines reach it at {here}:{port}" in lines
            assert any(line.startswith(f"tracker: dashboard on http://{here}:") for line in lines), lines
        else:
            assert any(line.startswith("tracker: this machine has no default route") for line in lines), lines
        assert (f"tracker: no join token: anyone who reaches port {port} can join nodes to this mesh and use it "
                "(pass --join-token, or set $MESHNET_JOIN_TOKEN, on every machine)") in lines
        with open_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.TrackerStub(channel)
            stub.Register(node_info("a-head", 0, 15, port=14690), timeout=5)
            stub.Register(node_info("b-tail", 15, 30, port=14691), timeout=5)
            stub.Deregister(pb.NodeRef(node_id="a-head"), timeout=5)
            # b-tail sends no heartbeat: silent past 3 intervals, it is said to leave though nobody asks
        events = []
        give_up = threading.Timer(30, proc.terminate)  # a line that never comes ends the reads, not the test
        give_up.start()
        while len(events) < 6:
            events.append(proc.stderr.readline().rstrip("\n").split(" tracker: ", 1)[-1])
        give_up.cancel()
        # Nodes at loopback addresses, which a tracker on every interface hands to other machines, are warned of.
        loopback = ("node {} registered 127.0.0.1:{}, which only this machine can dial, while the tracker serves "
                    "other machines: they cannot reach it (start it with --host 0.0.0.0, with --advertise HOST:PORT "
                    "where others reach it by another address)")
        assert events[:5] == ["node a-head joined: layers [0, 15) at 127.0.0.1:14690", loopback.format("a-head", 14690),
                              "node b-tail joined: layers [15, 30) at 127.0.0.1:14691", loopback.format("b-tail", 14691),
                              "node a-head left"]
        assert events[5].startswith("node b-tail left routing: silent for ") and events[5].endswith(" s (no heartbeat)")
    finally:
        proc.terminate()
        proc.wait(30)


def test_heartbeats_go_on_while_the_tracker_takes_long_to_record_finished_work():
    """Work reports went out on the heartbeat thread, after each beat: a tracker whose ledger took longer
    than its TTL (3 beats) to record one (a busy database) saw the node go silent and took it out of
    routing (the API answered 503 "no registered node serves this model" with both nodes alive). Reports
    now go on their own thread: beats go on while one is stuck, and the report is sent when it frees."""
    import threading
    import types

    from meshnet.node.membership import Membership

    beats, reports_entered, release = [], threading.Event(), threading.Event()

    class Tracker:
        def Register(self, info, timeout):
            return pb.RegisterReply(heartbeat_interval_s=0.05, ttl_s=0.15)

        def Heartbeat(self, req, timeout):
            beats.append(req.node_id)
            return pb.HeartbeatReply(known=True)

    def flush(tracker, max_batches):  # the tracker's ledger busy until released
        reports_entered.set()
        assert release.wait(30)
        return True

    membership = Membership(Tracker(), NodeIdentity.generate(), "n1", lambda: pb.NodeInfo(node_id="n1"),
                            lambda: (0, 0.0), types.SimpleNamespace(flush=flush), lambda why: None)
    stop = threading.Event()
    threading.Thread(target=membership.run, args=(stop,), daemon=True).start()
    try:
        assert reports_entered.wait(10)
        stuck_at = len(beats)
        deadline = time.monotonic() + 10
        while len(beats) < stuck_at + 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(beats) >= stuck_at + 5, f"{len(beats) - stuck_at} heartbeats while a work report was stuck"
        assert membership.registered.is_set()
    finally:
        release.set()
        stop.set()


def test_a_node_refused_for_good_stops_reporting_work_too():
    """The work-report thread ends with the beat loop, also when the tracker refused the node for good
    (neither stopped nor leaving): it was left waiting for a heartbeat that never comes."""
    import threading
    import types

    from meshnet.node.membership import Membership

    class Tracker:
        def Register(self, info, timeout):
            return pb.RegisterReply(heartbeat_interval_s=0.05, ttl_s=0.15)

        def Heartbeat(self, req, timeout):
            raise RpcFailure(grpc.StatusCode.UNAUTHENTICATED, "Heartbeat: signature does not verify")

    refusals = []
    membership = Membership(Tracker(), NodeIdentity.generate(), "n1", lambda: pb.NodeInfo(node_id="n1"),
                            lambda: (0, 0.0), types.SimpleNamespace(flush=lambda tracker, max_batches: True),
                            refusals.append)
    before = {t.ident for t in threading.enumerate() if t.name == "work-reports"}
    runner = threading.Thread(target=membership.run, args=(threading.Event(),), daemon=True)
    runner.start()
    runner.join(10)
    assert not runner.is_alive() and refusals == ["UNAUTHENTICATED: Heartbeat: signature does not verify"]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and \
            {t.ident for t in threading.enumerate() if t.name == "work-reports"} - before:
        time.sleep(0.01)
    assert not {t.ident for t in threading.enumerate() if t.name == "work-reports"} - before


def test_a_node_whose_tracker_never_answers_says_so_again_every_while(monkeypatch, caplog):
    """A node started with a mistyped --tracker warned once ("tracker unreachable; retrying"), printed that it
    serves, and was silent for good: it looked healthy while never part of a mesh. It now says so again every
    REMIND_S (here 1 s) while the tracker does not answer, with how long it has tried."""
    import logging
    import threading
    import types

    from meshnet.node import membership as membership_module
    from meshnet.node.membership import Membership

    class Tracker:
        def Register(self, info, timeout):
            raise RpcFailure(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses")

    monkeypatch.setattr(membership_module, "REMIND_S", 1.0)
    membership = Membership(Tracker(), NodeIdentity.generate(), "n1", lambda: pb.NodeInfo(node_id="n1"),
                            lambda: (0, 0.0), types.SimpleNamespace(flush=lambda tracker, max_batches: True),
                            lambda why: None)
    stop = threading.Event()
    runner = threading.Thread(target=membership.run, args=(stop,), daemon=True)
    with caplog.at_level(logging.WARNING, logger="meshnet.node"):
        runner.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and sum("still no answer" in r.getMessage() for r in caplog.records) < 2:
            time.sleep(0.05)
        stop.set()
        runner.join(5)
    said = [r.getMessage() for r in caplog.records]
    assert said[0] == "tracker unreachable (failed to connect to all addresses); retrying", said
    again = [m for m in said if m.startswith("still no answer from the tracker after ")]
    assert len(again) >= 2 and all(m.endswith("(failed to connect to all addresses); retrying: is --tracker its "
                                              "address, and is it running?") for m in again), said
    tried = [int(m.split("after ")[1].split(" s")[0]) for m in again]
    assert 1 <= tried[0] < tried[1], again  # seconds since the first warning, growing
    assert not membership.registered.is_set()
