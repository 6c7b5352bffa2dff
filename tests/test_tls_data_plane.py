"""The step data plane under TLS: a node serving TLS serves its data plane over TLS with the same
certificate, clients and forwarding nodes verify it with the mesh's CA, and a TLS mesh forwards steps
node to node with the same output as one process."""

from __future__ import annotations

import socket
import ssl

import pytest

from meshnet.proto import meshnet_pb2 as pb
from meshnet.wire.data_plane import AUTH, HEADER, DataPlaneConnection, recv_message, send_message
from meshnet.wire.envelope import replies_to_result
from meshnet.wire.security import client_ssl_context, server_ssl_context
from test_data_plane import MODEL, TOKEN, _prefill, data_planes
from test_forwarding import generate_recording_steps
from tls_util import self_signed_cert

N = 24


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    return self_signed_cert(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def tls_server(cert):
    """``tls_server(host, **limits) -> (server, "127.0.0.1:PORT")``: TLS data planes over a fake middle stage."""
    with data_planes() as start:
        yield lambda host="127.0.0.1", **limits: start(host, tls=server_ssl_context(cert), **limits)


def _closed(sock) -> bool:
    try:
        return sock.recv(1) == b""
    except (ConnectionResetError, ssl.SSLError):
        return True


def test_steps_round_trip_over_tls_and_a_large_request_is_read_whole(tls_server, cert):
    """A 1200-row prefill arrives in 10 frames, most of them decrypted into the TLS layer in one go, where
    the selector cannot see them: the server must still read them all."""
    server, address = tls_server()
    conn = DataPlaneConnection(address, TOKEN, 5, client_ssl_context(cert.cert))
    for n in (1200, 3, 1):
        replies, error = conn.call(_prefill(n, f"s{n}"))
        assert error is None
        res = replies_to_result(replies)
        assert res.ok and res.hidden.shape == (n, MODEL.n_embd) and res.n_past == n
    assert conn.reusable()
    assert server.stats["steps"] == 3 and server.stats["unauthenticated"] == 0
    conn.close()


def test_replayed_steps_go_one_round_trip_each_over_tls(tls_server, cert):
    _, address = tls_server()
    conn = DataPlaneConnection(address, TOKEN, 5, client_ssl_context(cert.cert))
    answers = conn.call_many([_prefill(4, "a"), _prefill(5, "b"), _prefill(6, "c")], 5)
    assert [replies_to_result(r).n_past for r, e in answers] == [4, 5, 6]
    conn.close()


def test_plaintext_and_unverified_clients_are_refused(tls_server, cert, tmp_path):
    server, address = tls_server("0.0.0.0")
    address = address.replace("0.0.0.0", "127.0.0.1")
    host, port = address.rsplit(":", 1)
    plain = socket.create_connection((host, int(port)), timeout=5)
    send_message(plain, AUTH, TOKEN.encode())  # not a TLS ClientHello: the handshake fails
    assert _closed(plain)
    other_ca = self_signed_cert(tmp_path, name="another mesh").cert
    with pytest.raises(ssl.SSLCertVerificationError):
        DataPlaneConnection(address, TOKEN, 5, client_ssl_context(other_ca))
    wrong_name = client_ssl_context(cert.cert)
    with pytest.raises(ssl.SSLCertVerificationError, match="(?i)hostname|IP address mismatch"):
        DataPlaneConnection(f"127.0.0.2:{port}", TOKEN, 5, wrong_name)  # the certificate names 127.0.0.1
    assert server.stats["unauthenticated"] >= 2 and server.stats["steps"] == 0


def test_a_handshake_that_never_finishes_is_closed_at_the_auth_deadline(tls_server):
    server, address = tls_server(auth_timeout_s=0.3)
    host, port = address.rsplit(":", 1)
    silent = socket.create_connection((host, int(port)), timeout=5)
    half = socket.create_connection((host, int(port)), timeout=5)
    half.sendall(HEADER.pack(100, 22)[:3])  # the first bytes of a TLS record, then nothing
    assert _closed(silent) and _closed(half)
    assert server.stats["timed_out"] == 2 and server.open_connections == 0


def test_the_join_token_is_still_checked_inside_tls(tls_server, cert):
    server, address = tls_server()
    host, port = address.rsplit(":", 1)
    ctx = client_ssl_context(cert.cert)
    sock = ctx.wrap_socket(socket.create_connection((host, int(port)), timeout=5), server_hostname=host)
    send_message(sock, AUTH, b"wrong")
    kind, payload = recv_message(sock)
    assert kind == 4 and payload.startswith(b"UNAUTHENTICATED")
    assert server.stats["unauthenticated"] == 1


def test_a_tls_mesh_forwards_steps_node_to_node_with_solo_output(cert, tok, solo):
    from mesh_util import Mesh

    mesh = Mesh(tls=cert)
    try:
        mesh.start_nodes([("a-head", "0:10"), ("b-mid", "10:20"), ("c-tail", "20:30")])
        infos = mesh.tracker_stub().ListNodes(pb.Empty(), timeout=5).nodes
        assert all(n.info.data_address for n in infos)  # TLS nodes now serve a data plane
        client = mesh.client(tls_ca=cert.cert, forwarding=True)
        ids, steps = generate_recording_steps(client, tok, solo.prompt_ids(0), N)
        assert ids == solo.greedy(0, N)
        # Every step was forwarded node to node (the client recorded token ids only).
        assert len(steps) == N and {rec.through for rec in steps} == {1}
        assert client.failovers == 0
        client.close()
    finally:
        mesh.close()
