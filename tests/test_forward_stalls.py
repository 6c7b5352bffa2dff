"""A next node, or the link to it, that stops taking bytes while its connection stays open: a forwarded
step is never sent from a thread that must not block, and the node's Health names the stalled next node.

The kernel's own view of the socket is what is tested: bytes queued unacknowledged (a peer that does not
read) and bytes retransmitted without an acknowledgement (a link that drops them, in network namespaces)."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from meshnet.contract import StepRequest
from meshnet.node.forwarding import Forwarder, WouldWait
from meshnet.proto import meshnet_pb2 as pb
from meshnet.wire.data_plane import AUTH, FORWARD, ConnectionPool, DataPlaneConnection, encode_messages, recv_message
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


def test_health_names_a_next_node_whose_connection_has_stalled_and_logs_it_once(monkeypatch, caplog):
    """A send into a connection whose link stopped carrying bytes succeeds (the kernel buffers it), so no
    failure is recorded; the stalled connection is what says so. The node logs it once, however often Health
    is asked (it logged nothing, while clients stepped the link themselves)."""
    from meshnet.wire.data_plane_server import DataPlaneServer

    server = DataPlaneServer("127.0.0.1", 0, lambda frames: None, None, run_forward=lambda frames: None)
    server.start()
    fwd = Forwarder(None)
    try:
        hop = pb.ForwardHop(node_id="c-tail", data_address=f"127.0.0.1:{server.port}")
        assert fwd.send(hop, request_to_frames(StepRequest("s", 1, 0, (1,), step_id=1), True)) is None
        assert fwd.unreachable_next() == []
        monkeypatch.setattr(ConnectionPool, "stalled", lambda self: True)
        with caplog.at_level(logging.WARNING, logger="meshnet.node"):
            for _ in range(3):  # a client's probes while its step is overdue
                assert fwd.unreachable_next() == [("c-tail", hop.data_address)]
        warned = [r.getMessage() for r in caplog.records if "this node could not forward" in r.getMessage()]
        assert len(warned) == 1
        assert warned[0].startswith(f"this node could not forward to its data plane at {hop.data_address}: what it "
                                    "sent on an open connection went unacknowledged for 1 s or more (next node c-tail;")
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


class _GoesBlack:
    """A next node's data plane that authenticates every connection and reads what comes, until
    :meth:`black` makes the connections open so far stop reading (as a firewall that dropped their state
    drops their packets); connections opened after are read."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.accepted: list[socket.socket] = []
        self._black: set[int] = set()  # indexes into accepted
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            self.accepted.append(sock)
            threading.Thread(target=self._serve, args=(sock, len(self.accepted) - 1), daemon=True).start()

    def _serve(self, sock: socket.socket, index: int) -> None:
        try:
            assert recv_message(sock)[0] == AUTH
            sock.sendall(encode_messages(AUTH, (b"",)))
            sock.settimeout(0.05)
            while not self._closed.is_set():
                if index in self._black:
                    time.sleep(0.05)
                    continue
                try:
                    if not sock.recv(1 << 20):
                        return
                except TimeoutError:
                    pass
        except OSError:
            return

    def black(self) -> None:
        self._black.update(range(len(self.accepted)))

    def close(self) -> None:
        self._closed.set()
        self.listener.close()
        for sock in self.accepted:
            sock.close()


def test_a_pooled_connection_gone_black_is_logged_once_though_new_ones_carry_the_steps(caplog):
    """The next node's open connection goes black: a send on it blocks until the forwarder's timeout, and
    a new connection carries the step. Nothing was logged (only a step that failed altogether was), though
    each such connection cost a step the timeout; now the node logs it, naming the next node and its
    address, once a minute however many connections and steps it takes."""
    node = _GoesBlack()
    fwd = Forwarder(None, timeout_s=0.5)
    hop = pb.ForwardHop(node_id="b-next", data_address=node.address)
    big = [pb.Envelope(session_id="s", n_chunks=1, payload=b"x" * (1 << 20))]
    try:
        with caplog.at_level(logging.WARNING, logger="meshnet.node"):
            assert fwd.send(hop, big) is None and len(node.accepted) == 1
            for connections in (2, 3, 4):  # each time the open connection goes black, a new one takes over
                node.black()
                for _ in range(64):  # until the kernel's buffers of the black connection are full
                    assert fwd.send(hop, big) is None
                    if len(node.accepted) == connections:
                        break
                assert len(node.accepted) == connections
        warned = [r.getMessage() for r in caplog.records if "this node could not forward" in r.getMessage()]
        assert warned == [f"this node could not forward to its data plane at {node.address}: sending on an open "
                          "connection failed (timed out) (next node b-next; if that node is up, its data port must "
                          "be open to the nodes before it in a route; clients step such a link themselves "
                          "meanwhile)"]
    finally:
        fwd.close()
        node.close()


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
