"""A next node, or the link to it, that stops taking bytes while its connection stays open: a forwarded
step is never sent from a thread that must not block, and the node's Health names the stalled next node.

The kernel's own view of the socket is what is tested: bytes queued unacknowledged (a peer that does not
read) and bytes retransmitted without an acknowledgement (a link that drops them, in network namespaces)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from meshnet.contract import StepRequest
from meshnet.node.forwarding import Forwarder, WouldWait
from meshnet.proto import meshnet_pb2 as pb
from meshnet.wire.data_plane import FORWARD, ConnectionPool, DataPlaneConnection
from meshnet.wire.envelope import request_to_frames


def _bare(sock: socket.socket) -> DataPlaneConnection:
    """A DataPlaneConnection over ``sock`` as it is after its handshake (no data plane behind it)."""
    conn = object.__new__(DataPlaneConnection)
    conn.sock, conn.tls, conn.last_used = sock, False, time.monotonic()
    return conn


def test_a_connection_whose_peer_does_not_read_would_make_a_send_wait():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        sender = socket.create_connection(listener.getsockname())
        receiver, _ = listener.accept()  # accepted, never read
        try:
            conn = _bare(sender)
            assert not conn.would_wait(3000)  # a decode step's hidden states, nothing queued
            assert not conn.stalled()
            sender.setblocking(False)
            sent = 0
            try:
                while True:  # until the kernel takes no more: the receiver's window and our buffer are full
                    sent += sender.send(b"x" * 65536)
            except BlockingIOError:
                pass
            sender.setblocking(True)
            assert sent > 0 and conn.would_wait(3000)
        finally:
            sender.close()
            receiver.close()


def test_the_forwarder_does_not_send_on_a_connection_that_would_wait_unless_it_may(monkeypatch):
    """connect=False is the engine worker channel's reading thread: a send there that blocked up to the
    forwarder's 10 s held up the answers to the supervisor's 5 s pings, and the worker was killed."""
    from meshnet.wire.data_plane_server import DataPlaneServer

    got = []
    server = DataPlaneServer("127.0.0.1", 0, lambda frames: None, "tok", run_forward=got.append)
    server.start()
    fwd = Forwarder("tok")
    try:
        hop = pb.ForwardHop(node_id="n", data_address=f"127.0.0.1:{server.port}")
        frames = request_to_frames(StepRequest("s", 1, 0, (1,), step_id=1), True)
        assert fwd.send(hop, frames) is None  # connected: pooled now
        monkeypatch.setattr(DataPlaneConnection, "would_wait", lambda self, n: True)
        with pytest.raises(WouldWait):
            fwd.send(hop, frames, connect=False)
        assert fwd.send(hop, frames) is None  # a thread that may wait sends it
        deadline = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(got) == 2 and server.stats["accepted"] == 1  # the one connection, handed back each time
    finally:
        fwd.close()
        server.stop()


def test_health_names_a_next_node_whose_connection_has_stalled(monkeypatch):
    """A send into a connection whose link stopped carrying bytes succeeds (the kernel buffers it), so no
    failure is recorded; the stalled connection is what says so."""
    from meshnet.wire.data_plane_server import DataPlaneServer

    server = DataPlaneServer("127.0.0.1", 0, lambda frames: None, None, run_forward=lambda frames: None)
    server.start()
    fwd = Forwarder(None)
    try:
        hop = pb.ForwardHop(node_id="c-tail", data_address=f"127.0.0.1:{server.port}")
        assert fwd.send(hop, request_to_frames(StepRequest("s", 1, 0, (1,), step_id=1), True)) is None
        assert fwd.unreachable_next() == []
        monkeypatch.setattr(ConnectionPool, "stalled", lambda self: True)
        assert fwd.unreachable_next() == [("c-tail", hop.data_address)]
    finally:
        fwd.close()
        server.stop()


def test_health_names_a_next_node_a_send_to_has_blocked_on_for_a_second(monkeypatch):
    """A send on a thread that may wait (its connection's buffer full) blocked up to the forwarder's 10 s,
    and the connection, in use, was not among the idle ones Health looks at: the client learnt of the link
    only after that send, and a reconnection, timed out (21 s)."""
    import threading

    from meshnet.wire.data_plane_server import DataPlaneServer

    server = DataPlaneServer("127.0.0.1", 0, lambda frames: None, None, run_forward=lambda frames: None)
    server.start()
    fwd = Forwarder(None)
    try:
        hop = pb.ForwardHop(node_id="c-tail", data_address=f"127.0.0.1:{server.port}")
        frames = request_to_frames(StepRequest("s", 1, 0, (1,), step_id=1), True)
        assert fwd.send(hop, frames) is None
        blocked = threading.Event()

        def blocking_send(self, kind, payloads, timeout_s=None):
            blocked.wait(10)  # as sendall into a full buffer, until the peer takes bytes again

        monkeypatch.setattr(DataPlaneConnection, "send", blocking_send)
        sender = threading.Thread(target=fwd.send, args=(hop, frames))
        sender.start()
        time.sleep(0.3)
        assert fwd.unreachable_next() == []  # a send may take a moment
        time.sleep(1.0)
        assert fwd.unreachable_next() == [("c-tail", hop.data_address)]
        blocked.set()
        sender.join(10)
        assert fwd.unreachable_next() == []
    finally:
        fwd.close()
        server.stop()


_SINK = """
import socket, sys
with socket.create_server(("10.99.0.2", 0)) as s:
    print(s.getsockname()[1], flush=True)
    c, _ = s.accept()
    while c.recv(65536):
        pass
"""


@pytest.mark.netns
def test_a_connection_whose_acknowledgements_stop_is_stalled_until_they_come_back():
    """Two network namespaces' worth of link: the peer reads, but the route back to the sender drops its
    acknowledgements (``ip route add blackhole``), then the sender has no route at all. Bytes sent
    meanwhile stay queued (retransmitted unacknowledged, or never sent): stalled a second after the send;
    the route back, acknowledged and no longer stalled."""
    from meshnet.netem.namespaces import NetnsUnavailable, probe

    try:
        probe()
    except NetnsUnavailable as e:
        pytest.skip(f"network namespaces unavailable: {e}")
    ns, here, there = f"mnet-{os.getpid()}-stall", f"mst{os.getpid() % 100000}a", f"mst{os.getpid() % 100000}b"

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)

    ip("netns", "add", ns)
    sink = None
    try:
        ip("link", "add", here, "type", "veth", "peer", "name", there)
        ip("link", "set", there, "netns", ns)
        ip("addr", "add", "10.99.0.1/30", "dev", here)
        ip("link", "set", here, "up")
        ip("-n", ns, "addr", "add", "10.99.0.2/30", "dev", there)
        ip("-n", ns, "link", "set", there, "up")
        sink = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", _SINK], stdout=subprocess.PIPE,
                                text=True)
        port = int(sink.stdout.readline())
        conn = _bare(socket.create_connection(("10.99.0.2", port), timeout=5))
        conn.send(FORWARD, [b"x" * 3000])
        time.sleep(1.2)
        assert not conn.stalled() and conn.queued_bytes() == 0  # acknowledged
        for where, dest in ((("-n", ns), "10.99.0.1/32"),  # the peer's acknowledgements are lost
                            ((), "10.99.0.2/32")):  # no route to send by at all
            ip(*where, "route", "add", "blackhole", dest)
            conn.send(FORWARD, [b"y" * 3000])  # taken into the buffer: the send itself succeeds
            assert not conn.stalled()  # just sent
            deadline = time.monotonic() + 10
            while not conn.stalled() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert conn.stalled() and conn.queued_bytes() >= 3000, dest
            ip(*where, "route", "del", "blackhole", dest)
            deadline = time.monotonic() + 20  # the next retransmission (its timeout doubles) is acknowledged
            while conn.queued_bytes() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert conn.queued_bytes() == 0 and not conn.stalled(), dest
        conn.close()
    finally:
        if sink is not None:
            sink.kill()
            sink.wait(10)
        subprocess.run(["ip", "route", "del", "blackhole", "10.99.0.2/32"], capture_output=True, timeout=10)
        subprocess.run(["ip", "link", "del", here], capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
