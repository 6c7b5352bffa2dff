"""The TLS data plane against hostile peers: garbage after the handshake, a close_notify in the middle of
a message, a client silent after its handshake, a flood of half-open handshakes. Each is closed (at the
auth deadline at the latest) and a good client's step still goes through."""

from __future__ import annotations

import os
import socket
import ssl
import time

import pytest

from meshnet.wire.data_plane import AUTH, ENVELOPE, HEADER, DataPlaneConnection, recv_message, send_message
from meshnet.wire.envelope import replies_to_result
from meshnet.wire.security import client_ssl_context
from test_data_plane import TOKEN, _prefill
from test_tls_data_plane import _closed, cert, tls_server  # noqa: F401 (fixtures)


def _tls(address: str, cert) -> ssl.SSLSocket:
    host, port = address.rsplit(":", 1)
    return client_ssl_context(cert.cert).wrap_socket(socket.create_connection((host, int(port)), timeout=5),
                                                     server_hostname=host)


def _good_step(address: str, cert, n: int = 3) -> int:
    conn = DataPlaneConnection(address, TOKEN, 5, client_ssl_context(cert.cert))
    try:
        replies, error = conn.call(_prefill(n, f"good{n}"))
        assert error is None
        return replies_to_result(replies).n_past
    finally:
        conn.close()


def test_garbage_under_the_tls_layer_after_the_handshake_closes_only_that_connection(tls_server, cert):
    server, address = tls_server()
    sock = _tls(address, cert)
    send_message(sock, AUTH, TOKEN.encode())
    assert recv_message(sock) == (AUTH, b"")
    raw = socket.socket(fileno=os.dup(sock.fileno()))
    raw.sendall(os.urandom(64) + b"\x17\x03\x03\x00\x10" + b"\x00" * 16)  # not a record TLS can open
    assert _closed(sock)
    raw.close()
    assert _good_step(address, cert) == 3
    assert server.stats["steps"] == 1


def test_a_close_notify_in_the_middle_of_a_message_closes_the_connection(tls_server, cert):
    server, address = tls_server()
    sock = _tls(address, cert)
    send_message(sock, AUTH, TOKEN.encode())
    assert recv_message(sock) == (AUTH, b"")
    sock.sendall(HEADER.pack(1000, ENVELOPE) + b"\x00" * 10)  # 10 of the 1000 bytes promised
    with pytest.raises(ssl.SSLEOFError):  # close_notify sent; the server hangs up without answering one
        sock.unwrap()
    sock.close()
    assert _good_step(address, cert, 5) == 5
    deadline = time.monotonic() + 5
    while server.open_connections and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.open_connections == 0 and server.stats["steps"] == 1


def test_a_client_silent_after_its_handshake_is_closed_at_the_auth_deadline(tls_server, cert):
    server, address = tls_server(auth_timeout_s=0.3)
    sock = _tls(address, cert)  # handshake done, no join token sent
    started = time.monotonic()
    assert _closed(sock)
    assert time.monotonic() - started < 2
    assert server.stats["timed_out"] == 1 and server.open_connections == 0


def test_a_good_client_completes_a_step_among_many_half_open_handshakes(tls_server, cert):
    server, address = tls_server(auth_timeout_s=1.0, max_connections=64)
    host, port = address.rsplit(":", 1)
    half = []
    for _ in range(40):
        s = socket.create_connection((host, int(port)), timeout=5)
        s.sendall(HEADER.pack(100, 22)[:3])  # the first bytes of a TLS record, then nothing
        half.append(s)
    assert _good_step(address, cert, 7) == 7
    assert all(_closed(s) for s in half)
    assert server.stats["timed_out"] == 40 and server.stats["steps"] == 1
    for s in half:
        s.close()
