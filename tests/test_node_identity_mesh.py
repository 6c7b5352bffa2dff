"""Node identity with real node processes: unnamed spares for one range get ids of their own and fail
over like named ones; a second process claiming a live node's id is refused and exits without harming
the first; a node names its gRPC and data-plane addresses in its log and in ``meshnet nodes``."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import subprocess
import time

from mesh_util import HEARTBEAT_S, NodeProc
from meshnet.contract import GREEDY
from meshnet.generation import Generation
from meshnet.membership.cli import run_nodes
from meshnet.proto import meshnet_pb2 as pb


def _listed(mesh) -> list[tuple[str, str, tuple[int, int]]]:
    return [(s.info.node_id, s.info.address, (s.info.layers.start, s.info.layers.end))
            for s in mesh.tracker_stub().ListNodes(pb.Empty(), timeout=5).nodes]


def _ready(proc) -> NodeProc:
    line = proc.stdout.readline()
    assert line.startswith("MESHNET_NODE_READY"), line
    fields = dict(kv.split("=", 1) for kv in line.split()[1:])
    return NodeProc(proc, fields["node_id"], fields["address"])


def test_unnamed_spares_have_own_ids_and_a_killed_one_fails_over(mesh, tok, solo):
    head, spare1, spare2, tail = mesh.start_nodes([("a-head", "0:10"), (None, "10:20"), (None, "10:20"),
                                                   ("d-tail", "20:30")])
    assert spare1.node_id != spare2.node_id and spare1.address != spare2.address
    middles = sorted((nid, addr) for nid, addr, layers in _listed(mesh) if layers == (10, 20))
    assert middles == sorted([(spare1.node_id, spare1.address), (spare2.node_id, spare2.address)])

    client = mesh.client()
    _, route = client.route()
    victim = spare1 if spare1.node_id in {h.node_id for h in route} else spare2
    gen = Generation(client, tok, solo.prompt_ids(0), 64, GREEDY, stop_at_eog=False)
    for i, _ in enumerate(gen):
        if i + 1 == 10:
            victim.kill()
    assert gen.result.generated_token_ids == solo.greedy(0)
    assert client.failovers == 1
    survivor = spare2 if victim is spare1 else spare1
    assert [n.active_sessions() for n in (head, survivor, tail)] == [0, 0, 0]


def test_node_logs_and_lists_its_grpc_and_data_plane_addresses(mesh, tmp_path):
    log_path = tmp_path / "node.log"
    with open(log_path, "w") as log:
        node = _ready(mesh.spawn_node("0:30", "solo", "smollm2", "--engine", "fake", stderr=log))
    mesh.nodes.append(node)
    mesh.wait_registered({"solo"})
    # The node's line, not its engine worker's "engine worker pid N serving layers 0:30", which comes first.
    line = re.compile(r"serving layers \S+: gRPC (\S+), data plane (\S+);")
    deadline = time.monotonic() + 10
    while not line.search(log_path.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    m = line.search(log_path.read_text())
    assert m, log_path.read_text()
    assert m.group(1) == node.address
    data_address = m.group(2)
    assert re.fullmatch(r"127\.0\.0\.1:\d+", data_address) and data_address != node.address
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert run_nodes(argparse.Namespace(tracker=mesh.tracker, join_token=None, tls_ca=None, json=True)) == 0
    [row] = json.loads(out.getvalue())["nodes"]
    assert (row["node_id"], row["address"], row["data_address"]) == ("solo", node.address, data_address)
    # The route hands clients the same data plane.
    [hop] = mesh.tracker_stub().GetRoute(pb.RouteRequest(), timeout=5).hops
    assert hop.data_address == data_address


def test_a_node_bound_to_every_interface_registers_this_machines_address(mesh):
    """It registered 0.0.0.0:PORT, which no other machine can dial, unless --advertise was given; then,
    with its tracker on this machine (dialled at 127.0.0.1), 127.0.0.1, which clients elsewhere were
    handed in routes and refused at: it registers the address other machines reach this one at (the
    tracker's own "other machines reach it at"), loopback only where there is none."""
    from meshnet.wire.addresses import this_machine_address

    here = this_machine_address("0.0.0.0")
    here = "127.0.0.1" if here == "0.0.0.0" else here
    node = _ready(mesh.spawn_node("0:30", "wild", "smollm2", "--engine", "fake", "--host", "0.0.0.0"))
    mesh.nodes.append(node)
    mesh.wait_registered({"wild"})
    [hop] = mesh.tracker_stub().GetRoute(pb.RouteRequest(), timeout=5).hops
    assert hop.address.rpartition(":")[0] == here and hop.address == node.address
    assert hop.data_address.rpartition(":")[0] == here and hop.data_address != hop.address
    # and it is dialled there: a step through the route goes through
    client = mesh.client()
    from meshnet.contract import StepRequest

    assert client.step(StepRequest("w", 0, 0, (1, 2, 3)), decode=False).ok


def test_dialable_host_is_the_bind_host_unless_a_wildcard():
    from meshnet.wire.addresses import dialable_host

    from meshnet.wire.addresses import this_machine_address

    here = this_machine_address("0.0.0.0")
    # a tracker dialled by loopback: this machine's address, which others can dial too (loopback without one)
    assert dialable_host("0.0.0.0", "127.0.0.1:7700") == ("127.0.0.1" if here == "0.0.0.0" else here)
    assert dialable_host("10.1.2.3", "127.0.0.1:7700") == "10.1.2.3"  # a named interface stays
    assert dialable_host("0.0.0.0", None) == "0.0.0.0"  # nothing to route to
    assert dialable_host("0.0.0.0", "no-such-host.invalid:7700") == "0.0.0.0"


def test_second_process_with_a_live_id_is_refused_and_the_first_keeps_it(mesh):
    (first,) = mesh.start_nodes([("b-mid", "10:20")], "smollm2", "--engine", "fake")

    # Same id (and so the same key file), another port: refused, and it exits with the tracker's words.
    second = mesh.spawn_node("10:20", "b-mid", "smollm2", "--engine", "fake", stderr=subprocess.PIPE)
    try:
        stdout, stderr = second.communicate(timeout=30)
    finally:
        if second.poll() is None:
            second.kill()
            second.wait()
    assert second.returncode == 1, stderr
    assert "error: tracker refused this node: ALREADY_EXISTS" in stderr
    assert "node id 'b-mid' is in use by a live node at " + first.address in stderr
    assert "Traceback" not in stderr
    assert "MESHNET_NODE_READY" not in stdout  # it said ready before the tracker's refusal came
    # The refused process did not deregister the id it never held: the first keeps serving under it.
    time.sleep(4 * HEARTBEAT_S)
    assert _listed(mesh) == [("b-mid", first.address, (10, 20))]
    assert first.proc.poll() is None


def test_a_node_killed_and_restarted_on_another_port_gets_its_id_back():
    """Restarted under its --node-id before the tracker's entry for the dead process expired (any free
    port: another address), it was refused for good and exited. The tracker says when that entry
    expires (trailing metadata), and the node asks again until then: it registers at its new address.
    A live holder (the test above) is heard from in time, so the refusal stands."""
    from mesh_util import Mesh

    mesh = Mesh(heartbeat_s=2.0)  # an entry lives 6 s: longer than a node takes to start again
    try:
        (first,) = mesh.start_nodes([("b-mid", "10:20")], "smollm2", "--engine", "fake")
        first.kill()
        t0 = time.monotonic()
        (again,) = mesh.start_nodes([("b-mid", "10:20")], "smollm2", "--engine", "fake")
        assert again.address != first.address and again.proc.poll() is None
        assert _listed(mesh) == [("b-mid", again.address, (10, 20))]
        assert "asking again until then" in again.log_tail()
        assert time.monotonic() - t0 < 6.0 + 10  # the entry's TTL and a start, not a give-up
    finally:
        mesh.close()
