"""The link emulator's proxy on loopback: bytes pass intact and in order, delay and bandwidth only slow
them (lower bounds only: the machine is shared), a blackhole holds them until it heals."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from mesh_util import wait_for
from meshnet.netem.control import NetemProcess
from meshnet.netem.link import LinkSpec
from meshnet.netem.proxy import EmulatorThread, Listener


@pytest.fixture
def echo():
    """A TCP echo server on loopback; yields its port."""
    srv = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve(conn):
        with conn:
            try:
                while data := conn.recv(65536):
                    conn.sendall(data)
                conn.shutdown(socket.SHUT_WR)
            except ConnectionResetError:
                pass  # the reset test drops connections

    def accept():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                threading.Thread(target=serve, args=(srv.accept()[0],), daemon=True).start()
            except TimeoutError:
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield srv.getsockname()[1]
    stop.set()
    t.join(2)
    srv.close()


@pytest.fixture
def emu(echo):
    e = EmulatorThread({"127.0.0.1": "client"})
    port = e.listen(Listener("server", ("127.0.0.1", 0), ("127.0.0.1", echo)))
    yield e, port
    e.close()


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            break
        buf += chunk
    return bytes(buf)


def test_bytes_cross_intact_both_ways_and_are_counted(emu):
    e, port = emu
    payload = os.urandom(3 * 1024 * 1024 + 17)  # more than the proxy queues: backpressure on the way
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        t = threading.Thread(target=s.sendall, args=(payload,))
        t.start()
        got = _recv_exactly(s, len(payload))
        t.join()
        s.shutdown(socket.SHUT_WR)
        assert s.recv(1) == b""  # the echo server's end of stream came through after the data
    assert got == payload
    deadline = time.monotonic() + 5
    while e.stats()["client-server"]["connections"] and time.monotonic() < deadline:
        time.sleep(0.02)  # both ends closed: the proxy lets the connection go
    stats = e.stats()["client-server"]
    assert (stats["a_to_b"], stats["b_to_a"], stats["connections"]) == (len(payload), len(payload), 0)


def test_delay_and_bandwidth_slow_a_round_trip_by_at_least_what_they_add(emu):
    e, port = emu
    e.set_link("client", "server", LinkSpec(delay_s=0.1))
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        t0 = time.monotonic()
        s.sendall(b"ping")
        assert _recv_exactly(s, 4) == b"ping"
        assert time.monotonic() - t0 >= 0.2  # one delay each way
        e.set_link("client", "server", LinkSpec(rate_bps=1e6, burst_bytes=16 * 1024))
        t0 = time.monotonic()
        s.sendall(b"x" * 300_000)
        assert _recv_exactly(s, 300_000) == b"x" * 300_000
        # Each direction paces 300 kB at 1 MB/s after a 16 KiB burst; the echo overlaps the two.
        assert time.monotonic() - t0 >= (300_000 - 16 * 1024) / 1e6


def test_blackhole_holds_open_and_new_connections_until_it_heals(emu):
    e, port = emu
    old = socket.create_connection(("127.0.0.1", port), timeout=10)
    old.sendall(b"a")
    assert _recv_exactly(old, 1) == b"a"
    e.set_link("client", "server", LinkSpec(blackhole=True))
    old.sendall(b"held")
    new = socket.create_connection(("127.0.0.1", port), timeout=10)  # accepted, but not forwarded
    new.sendall(b"new")
    for s in (old, new):
        s.settimeout(0.5)
        with pytest.raises(TimeoutError):
            s.recv(10)
    assert e.stats()["client-server"]["connections"] == 1  # the new one waits before its upstream
    e.set_link("client", "server", LinkSpec())
    for s, want in ((old, b"held"), (new, b"new")):
        s.settimeout(10)
        assert _recv_exactly(s, len(want)) == want
        s.close()


def test_reset_drops_open_connections_with_a_tcp_reset_and_new_ones_pass(emu):
    e, port = emu
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"a")
    assert _recv_exactly(s, 1) == b"a"
    assert e.reset("client", "server") == 1
    with pytest.raises(ConnectionResetError):
        s.sendall(b"b")
        s.recv(1)
    s.close()
    assert wait_for(lambda: e.stats()["client-server"]["connections"] == 0, 5) is not None
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s2:
        s2.sendall(b"c")
        assert _recv_exactly(s2, 1) == b"c"


def test_emulator_process_speaks_json_lines(echo, tmp_path):
    config = {"hosts": {"127.0.0.1": "client"},
              "listeners": [{"owner": "server", "listen": ["127.0.0.1", 0], "target": ["127.0.0.1", echo]}],
              "links": [{"a": "client", "b": "server", "delay_s": 0.01}]}
    netem = NetemProcess(config, tmp_path)
    try:
        with socket.create_connection(("127.0.0.1", netem.ports[0]), timeout=10) as s:
            s.sendall(b"hello")
            assert _recv_exactly(s, 5) == b"hello"
            assert netem.reset("client", "server") == 1
        netem.set_link("client", "server", delay_s=0.02, rate_bps=1e6)
        link = netem.stats()["client-server"]
        assert (link["a_to_b"], link["b_to_a"]) == (5, 5)
        assert link["spec"] == {"delay_s": 0.02, "rate_bps": 1e6, "burst_bytes": None, "blackhole": False}
        with pytest.raises(ValueError, match="delay_s must be >= 0"):
            netem.set_link("client", "server", delay_s=-1)
        with pytest.raises(ValueError, match="unknown op"):
            netem._ask({"op": "reboot"})
    finally:
        netem.close()
    assert netem.proc.returncode == 0
