"""Membership with real node processes: nodes create and use their keys, a forged heartbeat or a
wrong-key deregister for a live node is refused, and a killed node leaves routing within three
heartbeat intervals."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time

import grpc
import pytest

from mesh_util import HEARTBEAT_S, Mesh, rpc_code
from meshnet.backends.cpu_features import ggml_cpu_features
from meshnet.membership.identity import NodeIdentity, load_identity
from meshnet.proto import meshnet_pb2 as pb


@pytest.fixture
def mesh(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    m = Mesh()
    yield m
    m.close()


def test_nodes_sign_and_cannot_be_impersonated_or_deregistered(mesh, tmp_path, smollm2_path):
    key_path = tmp_path / "tail.key"
    head, tail = mesh.start_nodes([("x-head", "0:15"), ("y-tail", "15:30")])
    # A node without --node-id takes its key's id; --identity puts the key where asked.
    proc = subprocess.Popen([sys.executable, "-m", "meshnet.cli", "node", "--tracker", mesh.tracker, "--model",
                             "smollm2", "--layers", "15:30", "--threads", "1", "--identity", str(key_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("MESHNET_NODE_READY"), line
        derived = dict(kv.split("=", 1) for kv in line.split()[1:])["node_id"]
        assert derived == load_identity(key_path).node_id
        assert stat.S_IMODE(os.stat(key_path).st_mode) == 0o600
        head_key = tmp_path / "config" / "meshnet" / "node-x-head.key"
        assert stat.S_IMODE(os.stat(head_key).st_mode) == 0o600
        mesh.wait_registered({derived})

        stub = mesh.tracker_stub()
        listed = {s.info.node_id: s for s in stub.ListNodes(pb.Empty(), timeout=5).nodes}
        assert set(listed) == {"x-head", "y-tail", derived}
        assert all(s.signed for s in listed.values())
        # Each node registers the device it computes on: ggml's CPU device, with the host's memory.
        host_bytes = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        assert {(s.info.device.name, s.info.device.type, s.info.device.memory_total_bytes)
                for s in listed.values()} == {("CPU", "cpu", host_bytes)}
        # ...and the SIMD features its ggml's CPU kernels were compiled with, as ggml itself reports them.
        assert {tuple(s.info.device.cpu_features) for s in listed.values()} == {ggml_cpu_features()}
        assert all(0 < s.info.free_memory_bytes <= host_bytes for s in listed.values())

        attacker = NodeIdentity.generate()
        for victim in ("y-tail", derived):
            forged = attacker.sign(pb.HeartbeatRequest(node_id=victim, active_sessions=16))
            assert rpc_code(stub.Heartbeat, forged, timeout=5) == grpc.StatusCode.UNAUTHENTICATED
            assert rpc_code(stub.Heartbeat, pb.HeartbeatRequest(node_id=victim, active_sessions=16),
                            timeout=5) == grpc.StatusCode.UNAUTHENTICATED
            wrong_key = attacker.sign(pb.NodeRef(node_id=victim))
            assert rpc_code(stub.Deregister, wrong_key, timeout=5) == grpc.StatusCode.UNAUTHENTICATED
            assert rpc_code(stub.Deregister, pb.NodeRef(node_id=victim), timeout=5) == \
                grpc.StatusCode.UNAUTHENTICATED
        # Nothing changed: every node is still there, with its own load, and keeps heartbeating.
        time.sleep(3 * HEARTBEAT_S)
        listed = {s.info.node_id: s for s in stub.ListNodes(pb.Empty(), timeout=5).nodes}
        assert set(listed) == {"x-head", "y-tail", derived}
        assert all(s.active_sessions == 0 and s.last_heartbeat_age_s < 3 * HEARTBEAT_S for s in listed.values())
        # The real node deregisters itself with its key (SIGTERM: drain, then a signed Deregister).
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert derived not in mesh.registered()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_killed_signed_node_leaves_routing_within_three_heartbeats(mesh, smollm2_path):
    head, tail, spare = mesh.start_nodes([("x-head", "0:15"), ("y-tail", "15:30"), ("z-spare", "15:30")])
    stub = mesh.tracker_stub()
    routed = [h.node_id for h in stub.GetRoute(pb.RouteRequest(), timeout=5).hops]
    victim = tail if "y-tail" in routed else spare
    victim.kill()
    t0 = time.monotonic()
    while victim.node_id in mesh.registered():
        time.sleep(0.02)
    assert time.monotonic() - t0 <= 3 * HEARTBEAT_S + 0.2
    hops = [h.node_id for h in stub.GetRoute(pb.RouteRequest(), timeout=5).hops]
    assert victim.node_id not in hops and len(hops) == 2
