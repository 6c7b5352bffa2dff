"""Join token and TLS on a real tracker: refusals are UNAUTHENTICATED / UNAVAILABLE, the right client gets in."""

from __future__ import annotations

import grpc
import pytest

from meshnet.proto import meshnet_pb2 as pb
from meshnet.proto import meshnet_pb2_grpc as pb_grpc
from meshnet.tracker.server import serve_tracker
from meshnet.wire.security import (
    JOIN_TOKEN_METADATA,
    JoinTokenInterceptor,
    TlsConfig,
    add_port,
    make_server,
    open_channel,
)
from conftest import TRACKER_TOKEN as TOKEN
from tls_util import self_signed_cert


def _ping(channel: grpc.Channel, **kw) -> pb.HeartbeatReply:
    return pb_grpc.TrackerStub(channel).Heartbeat(pb.HeartbeatRequest(node_id="nobody"), timeout=5, **kw)


def test_call_without_token_is_unauthenticated(token_tracker):
    with open_channel(token_tracker) as channel, pytest.raises(grpc.RpcError) as ei:
        _ping(channel)
    assert ei.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert ei.value.details().startswith("missing join token")


def test_call_with_wrong_token_is_unauthenticated(token_tracker):
    with open_channel(token_tracker, join_token="guess") as channel, pytest.raises(grpc.RpcError) as ei:
        _ping(channel)
    assert ei.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert ei.value.details().startswith("wrong join token")


def test_call_with_right_token_succeeds_on_every_method(token_tracker):
    with open_channel(token_tracker, join_token=TOKEN) as channel:
        stub = pb_grpc.TrackerStub(channel)
        assert _ping(channel).known is False
        assert list(stub.ListNodes(pb.Empty(), timeout=5).nodes) == []
        # Caller metadata is kept alongside the token.
        assert _ping(channel, metadata=[("x-trace", "1")]).known is False


def test_token_checked_on_streaming_calls_too():
    """The interceptor refuses every RPC kind, not only unary ones (nodes stream envelopes)."""
    echo = grpc.method_handlers_generic_handler("test.Echo", {
        "Stream": grpc.stream_stream_rpc_method_handler(lambda it, ctx: (x for x in it)),
        "Server": grpc.unary_stream_rpc_method_handler(lambda req, ctx: iter([req, req])),
    })
    server = make_server(TOKEN)
    server.add_generic_rpc_handlers((echo,))
    port = add_port(server, "127.0.0.1:0", None)
    server.start()
    try:
        for token, ok in ((None, False), ("nope", False), (TOKEN, True)):
            with open_channel(f"127.0.0.1:{port}", join_token=token) as channel:
                stream = channel.stream_stream("/test.Echo/Stream")
                server_stream = channel.unary_stream("/test.Echo/Server")
                if ok:
                    assert list(stream(iter([b"a", b"b"]), timeout=5)) == [b"a", b"b"]
                    assert list(server_stream(b"x", timeout=5)) == [b"x", b"x"]
                else:
                    for call in (lambda: list(stream(iter([b"a"]), timeout=5)),
                                 lambda: list(server_stream(b"x", timeout=5))):
                        with pytest.raises(grpc.RpcError) as ei:
                            call()
                        assert ei.value.code() is grpc.StatusCode.UNAUTHENTICATED
    finally:
        server.stop(None)


def test_an_api_with_a_wrong_token_is_refused_at_start(token_tracker):
    """It served, and answered every request 503 with the tracker's refusal."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "meshnet.cli", "api", "--tracker", token_tracker,
                        "--join-token", "wrong", "--port", "0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "serving" not in r.stderr  # as node's
    assert f"error: --tracker {token_tracker}: " in r.stderr and "join token" in r.stderr


def test_interceptor_refuses_an_empty_token():
    with pytest.raises(ValueError, match="join token is empty"):
        JoinTokenInterceptor("")
    assert JOIN_TOKEN_METADATA == "x-meshnet-join-token"


# ---- TLS -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def self_signed(tmp_path_factory) -> TlsConfig:
    return self_signed_cert(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def tls_tracker(self_signed):
    server, port = serve_tracker(tls=self_signed, join_token=TOKEN)
    try:
        yield port
    finally:
        server.stop(None)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_tls_client_with_ca_succeeds(tls_tracker, self_signed, host):
    with open_channel(f"{host}:{tls_tracker}", join_token=TOKEN, tls_ca=self_signed.cert) as channel:
        assert _ping(channel).known is False


def test_tls_still_requires_the_token(tls_tracker, self_signed):
    with open_channel(f"127.0.0.1:{tls_tracker}", tls_ca=self_signed.cert) as channel, \
            pytest.raises(grpc.RpcError) as ei:
        _ping(channel)
    assert ei.value.code() is grpc.StatusCode.UNAUTHENTICATED


def test_plaintext_client_cannot_talk_to_a_tls_tracker(tls_tracker):
    with open_channel(f"127.0.0.1:{tls_tracker}", join_token=TOKEN) as channel, \
            pytest.raises(grpc.RpcError) as ei:
        _ping(channel)
    assert ei.value.code() is grpc.StatusCode.UNAVAILABLE


def test_the_cli_says_tls_where_a_plaintext_client_meets_a_tls_tracker(tls_tracker, self_signed, capsys):
    """It said only "UNAVAILABLE: ... Socket closed"."""
    import argparse

    from meshnet.membership.cli import run_nodes

    args = argparse.Namespace(tracker=f"127.0.0.1:{tls_tracker}", join_token=TOKEN, tls_ca=None, json=True)
    assert run_nodes(args) == 1
    assert "Socket closed (a server speaking TLS closes plaintext connections so: pass --tls-ca with its CA)" \
        in capsys.readouterr().err
    assert run_nodes(argparse.Namespace(**{**vars(args), "tls_ca": self_signed.cert})) == 0
    assert "--tls-ca" not in capsys.readouterr().err


def test_waiting_for_a_route_speaks_tls_with_the_ca_it_is_given(tls_tracker, self_signed):
    """`meshnet generate --wait` dialled a TLS tracker in plaintext whatever --tls-ca said."""
    from meshnet.up import wait_for_route

    address = f"127.0.0.1:{tls_tracker}"
    with pytest.raises(TimeoutError) as e:  # the tracker answers: it has no nodes
        wait_for_route(address, 0.3, TOKEN, progress=False, tls_ca=self_signed.cert)
    assert "no node is registered" in str(e.value) and "Socket closed" not in str(e.value)
    with pytest.raises(TimeoutError) as e:
        wait_for_route(address, 0.3, TOKEN, progress=False)
    assert "pass --tls-ca with its CA" in str(e.value)


def test_a_node_whose_tls_settings_do_not_match_the_trackers_exits_before_loading(tls_tracker, tmp_path):
    """It loaded the model, then logged "tracker unreachable ... Socket closed; retrying" forever."""
    import subprocess
    import sys

    other = self_signed_cert(tmp_path, name="someone else")
    for extra, why in (([], "(a server speaking TLS closes plaintext connections so: pass --tls-ca with its CA)"),
                       (["--tls-ca", other.cert, "--tls-cert", other.cert, "--tls-key", other.key],
                        f"(its certificate does not verify with the CA in --tls-ca {other.cert})")):
        r = subprocess.run([sys.executable, "-m", "meshnet.cli", "node", "--engine", "fake", "--tracker",
                            f"127.0.0.1:{tls_tracker}", "--join-token", TOKEN, *extra],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and "Traceback" not in r.stderr
        assert f"error: --tracker 127.0.0.1:{tls_tracker}: " in r.stderr and why in r.stderr, r.stderr
        assert "serving layers" not in r.stderr and "MESHNET_NODE_READY" not in r.stdout


def test_a_node_that_would_serve_plaintext_in_a_tls_mesh_is_refused(tls_tracker, self_signed):
    """With --tls-ca but no certificate it registered, serving plaintext that no TLS client can reach."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "meshnet.cli", "node", "--engine", "fake", "--tracker",
                        f"127.0.0.1:{tls_tracker}", "--join-token", TOKEN, "--tls-ca", self_signed.cert],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "error: --tls-ca without --tls-cert: in a mesh that speaks TLS" in r.stderr


def test_tls_client_rejects_an_untrusted_certificate(tls_tracker, tmp_path):
    other = self_signed_cert(tmp_path, name="someone else").cert  # another CA: does not vouch for the tracker's
    with open_channel(f"127.0.0.1:{tls_tracker}", join_token=TOKEN, tls_ca=other) as channel, \
            pytest.raises(grpc.RpcError) as ei:
        _ping(channel)
    assert ei.value.code() is grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("valid_from_days, message", [(-3, "expired on"), (3, "is not valid before")])
def test_a_certificate_outside_its_validity_is_refused_at_start(tmp_path, valid_from_days, message):
    """A node with an expired certificate started, registered and showed SIGNED yes; every client then
    failed its handshake (CERTIFICATE_VERIFY_FAILED: certificate has expired)."""
    import subprocess
    import sys

    cert = self_signed_cert(tmp_path, valid_from_days=valid_from_days)
    with pytest.raises(ValueError, match=f"TLS certificate .*cert.pem' {message} .* UTC"):
        serve_tracker(tls=cert)
    r = subprocess.run([sys.executable, "-m", "meshnet.cli", "node", "--engine", "fake", "--tracker", "127.0.0.1:9",
                        "--tls-cert", cert.cert, "--tls-key", cert.key, "--tls-ca", cert.cert],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


def test_a_certificate_that_does_not_name_the_nodes_address_is_refused_at_start(tmp_path):
    """A node advertising an address its certificate does not name started, registered and printed READY;
    every request then failed (503 "no route" from the API, the handshake's "IP address mismatch" only in
    its log). The names are checked the way clients check them, before the model loads."""
    import subprocess
    import sys

    from meshnet.wire.security import unnamed_host_problem

    cert = self_signed_cert(tmp_path)  # DNS:localhost, IP:127.0.0.1
    assert unnamed_host_problem(cert.cert, "127.0.0.1") is None
    assert unnamed_host_problem(cert.cert, "LOCALHOST") is None
    assert unnamed_host_problem(cert.cert, "127.0.0.2") == (
        f"TLS certificate {cert.cert!r} names 127.0.0.1, localhost, not 127.0.0.2, the address this node "
        "registers: every client dialling it would refuse the handshake; add 127.0.0.2 to its subjectAltName, "
        "or pass --advertise with an address it names")
    assert unnamed_host_problem(cert.cert, "node.localhost") is not None
    r = subprocess.run([sys.executable, "-m", "meshnet.cli", "node", "--engine", "fake", "--tracker", "127.0.0.1:9",
                        "--tls-cert", cert.cert, "--tls-key", cert.key, "--tls-ca", cert.cert,
                        "--advertise", "192.0.2.41:7701"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "names 127.0.0.1, localhost, not 192.0.2.41, the address this node registers" in r.stderr


def test_a_wildcard_certificate_names_one_label(tmp_path):
    from meshnet.wire.security import unnamed_host_problem

    d = tmp_path / "wild"
    d.mkdir()
    cert = _openssl_cert(d, "DNS:*.mesh.example,IP:192.0.2.10")
    assert unnamed_host_problem(cert.cert, "node1.mesh.example") is None
    assert unnamed_host_problem(cert.cert, "192.0.2.10") is None
    assert unnamed_host_problem(cert.cert, "a.node1.mesh.example") is not None
    assert unnamed_host_problem(cert.cert, "mesh.example") is not None
    assert unnamed_host_problem(cert.cert, "node1.mesh.example.") is not None  # written otherwise
    (tmp_path / "tld").mkdir()
    assert unnamed_host_problem(_openssl_cert(tmp_path / "tld", "DNS:*.test").cert, "node.test") is not None


def test_the_name_check_falls_back_to_the_common_name_as_clients_do(tmp_path):
    """Without a DNS entry (no subjectAltName, or IP entries only) OpenSSL checks a name against the common
    name, and gRPC and Python's ssl accept such a certificate: the node must start with it."""
    import shutil
    import subprocess

    from meshnet.wire.security import unnamed_host_problem

    if shutil.which("openssl") is None:
        pytest.skip("no openssl command on this machine")
    cert = tmp_path / "cn.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                    "-days", "1", "-subj", "/CN=node.hd.test", "-keyout", str(tmp_path / "k.pem"), "-out", str(cert)],
                   check=True, capture_output=True)
    assert unnamed_host_problem(str(cert), "node.hd.test") is None
    assert unnamed_host_problem(str(cert), "NODE.hd.test") is None
    assert "names CN=node.hd.test, not other.hd.test" in unnamed_host_problem(str(cert), "other.hd.test")
    assert unnamed_host_problem(str(cert), "192.0.2.5") is not None  # an address is never the common name
    (tmp_path / "ipcn").mkdir()
    ip_only = _openssl_cert(tmp_path / "ipcn", "IP:192.0.2.10")  # its CN is "mesh"
    assert unnamed_host_problem(ip_only.cert, "mesh") is None and unnamed_host_problem(ip_only.cert, "192.0.2.10") is None


def test_missing_tls_files_are_named(tmp_path):
    with pytest.raises(ValueError, match="cannot read TLS certificate .*nope.pem"):
        serve_tracker(tls=TlsConfig(cert=str(tmp_path / "nope.pem"), key=str(tmp_path / "nope.key")))
    with pytest.raises(ValueError, match="cannot read TLS CA certificate"):
        open_channel("127.0.0.1:1", tls_ca=str(tmp_path / "nope.pem"))


def test_a_new_channel_reaches_a_server_restarted_on_a_dead_servers_port():
    """A channel to an address whose previous server died does not inherit that server's refusal: each
    channel keeps its own connections (a process-wide pool hands the new channel the dead connection's
    backoff and it fails with UNAVAILABLE at once, as a tracker on a reused port did in the suite)."""
    server, port = serve_tracker("127.0.0.1", 0)
    old = open_channel(f"127.0.0.1:{port}")
    assert list(pb_grpc.TrackerStub(old).ListNodes(pb.Empty(), timeout=5).nodes) == []
    server.stop(grace=0).wait()
    with pytest.raises(grpc.RpcError) as refused:
        pb_grpc.TrackerStub(old).ListNodes(pb.Empty(), timeout=5)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    again, port_again = serve_tracker("127.0.0.1", port)
    try:
        assert port_again == port
        fresh = open_channel(f"127.0.0.1:{port}")
        assert list(pb_grpc.TrackerStub(fresh).ListNodes(pb.Empty(), timeout=5).nodes) == []
    finally:
        again.stop(grace=0).wait()
        old.close()


@pytest.fixture
def not_trackers():
    """A gRPC server without the tracker's service (what a node's port is to a tracker client) and an
    HTTP/1 server (meshnet api, the dashboard): ``(grpc_address, http_address)``."""
    import http.server
    import threading
    from concurrent import futures

    grpc_server = grpc.server(futures.ThreadPoolExecutor(2))
    grpc_port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    http_server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=http_server.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{grpc_port}", f"127.0.0.1:{http_server.server_address[1]}"
    finally:
        grpc_server.stop(None)
        http_server.shutdown()


def test_an_address_that_serves_no_tracker_is_named_so(not_trackers, capsys):
    """`--tracker` given a node's port said "UNIMPLEMENTED: Method not found!" (and a node retried it
    forever); given an HTTP server, "Failed parsing HTTP/2"."""
    import argparse
    import subprocess
    import sys

    from meshnet.membership.cli import run_nodes

    grpc_address, http_address = not_trackers
    for address, why in ((grpc_address, "that address serves gRPC without this tracker call: a node's port (give the tracker's)"),
                         (http_address, "that address is not a gRPC server (an HTTP server, such as meshnet api")):
        assert run_nodes(argparse.Namespace(tracker=address, join_token=None, tls_ca=None, json=True)) == 1
        assert why in capsys.readouterr().err
        node = subprocess.run([sys.executable, "-m", "meshnet.cli", "node", "--engine", "fake", "--tracker", address],
                              capture_output=True, text=True, timeout=60)
        assert node.returncode == 1 and f"error: --tracker {address}: " in node.stderr and why in node.stderr, \
            node.stderr
        assert "MESHNET_NODE_READY" not in node.stdout
    api = subprocess.run([sys.executable, "-m", "meshnet.cli", "api", "--tracker", grpc_address, "--port", "0"],
                         capture_output=True, text=True, timeout=60)
    assert api.returncode == 1 and f"error: --tracker {grpc_address}: " in api.stderr  # as the node's above
    assert "serves gRPC without this tracker call" in api.stderr and "serving" not in api.stderr


def test_a_tls_tracker_keeps_failed_handshakes_off_its_stderr(self_signed, tmp_path):
    """gRPC's C core wrote "I... ssl_transport_security.cc:... Handshake failed ..." for every plaintext
    client of a `meshnet tracker --tls-cert`: a line per port scan."""
    import os
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "tracker.log"
    with open(log, "w") as err:
        tracker = subprocess.Popen([sys.executable, "-m", "meshnet.cli", "tracker", "--port", str(port), "--tls-cert",
                                    self_signed.cert, "--tls-key", self_signed.key, "--ledger", "sqlite://"],
                                   stderr=err, env={k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"})
        try:
            deadline = time.monotonic() + 60
            while "tracker listening on" not in log.read_text():
                assert tracker.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
            for _ in range(3):
                with pytest.raises(grpc.RpcError) as e:
                    pb_grpc.TrackerStub(open_channel(f"127.0.0.1:{port}")).ListNodes(pb.Empty(), timeout=5)
                assert e.value.code() is grpc.StatusCode.UNAVAILABLE
            tls = pb_grpc.TrackerStub(open_channel(f"127.0.0.1:{port}", tls_ca=self_signed.cert))
            assert list(tls.ListNodes(pb.Empty(), timeout=5).nodes) == []  # it serves
        finally:
            tracker.terminate()
            tracker.wait(30)
    assert "Handshake failed" not in log.read_text() and "tracker stopped" in log.read_text()


def _openssl_cert(d, san: str) -> TlsConfig:
    """The README's openssl command for a mesh's self-signed certificate, with subjectAltName ``san``."""
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("no openssl command on this machine")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                    "-days", "365", "-subj", "/CN=mesh", "-addext", f"subjectAltName={san}",
                    "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem")], check=True, capture_output=True)
    return TlsConfig(cert=str(d / "cert.pem"), key=str(d / "key.pem"))


def test_the_readmes_certificate_serves_and_one_without_the_dialled_address_is_named_so(tmp_path, capsys):
    """A certificate naming another host failed with gRPC's "Hostname Verification Check failed" alone."""
    import argparse

    from meshnet.membership.cli import run_nodes

    (tmp_path / "ok").mkdir()
    (tmp_path / "other").mkdir()
    for d, san, rc in ((tmp_path / "ok", "IP:127.0.0.1,IP:192.0.2.10,DNS:localhost", 0),
                       (tmp_path / "other", "DNS:elsewhere.example", 1)):
        tls = _openssl_cert(d, san)
        server, port = serve_tracker(tls=tls)
        try:
            assert run_nodes(argparse.Namespace(tracker=f"127.0.0.1:{port}", join_token=None, tls_ca=tls.cert,
                                                json=True)) == rc
        finally:
            server.stop(None)
    assert "its certificate does not name the address dialled: give it a subjectAltName" in capsys.readouterr().err


def test_callers_refused_for_their_token_are_logged_once_a_minute_per_address_and_reason(caplog):
    """A node or client with a wrong or no token was refused without a word in the tracker's log."""
    import logging

    from meshnet.tracker.server import start_tracker

    server, port, _ = start_tracker(port=0, join_token=TOKEN)
    try:
        with caplog.at_level(logging.WARNING, logger="meshnet.security"):
            for token in ("guess", "guess", None, "again"):
                with open_channel(f"127.0.0.1:{port}", join_token=token) as channel, pytest.raises(grpc.RpcError):
                    _ping(channel)
        lines = [r.getMessage() for r in caplog.records if r.name == "meshnet.security"]
        assert lines == [
            "refused /meshnet.v1.Tracker/Heartbeat from 127.0.0.1: wrong join token (logged once a minute per address)",
            "refused /meshnet.v1.Tracker/Heartbeat from 127.0.0.1: missing join token (logged once a minute per "
            "address)"]
    finally:
        server.stop(0).wait()


def test_the_tracker_command_timestamps_its_refusals_as_its_membership_lines():
    """`meshnet tracker` printed a caller refused for its token as a bare line (logging's last resort),
    without the time and the "tracker:" its lines about nodes carry."""
    import re
    import subprocess
    import sys

    tracker = subprocess.Popen([sys.executable, "-m", "meshnet.cli", "tracker", "--port", "0", "--ledger", "sqlite://",
                                "--dashboard-port", "-1", "--join-token", TOKEN], stderr=subprocess.PIPE, text=True)
    try:
        port = int(next(x for x in tracker.stderr if x.startswith("tracker listening on")).rsplit(":", 1)[1])
        with open_channel(f"127.0.0.1:{port}", join_token="guess") as channel, pytest.raises(grpc.RpcError):
            _ping(channel)
        line = next(x for x in tracker.stderr if "refused" in x)
        assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} tracker: refused /meshnet.v1.Tracker/Heartbeat "
                            r"from 127.0.0.1: wrong join token \(logged once a minute per address\)\n", line), line
    finally:
        tracker.terminate()
        tracker.wait(30)
        tracker.stderr.close()
