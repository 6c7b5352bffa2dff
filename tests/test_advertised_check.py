"""A node started with --advertise calls its own Health at that address once it serves, and warns when
nobody answers there or another process does (a wrong --advertise was silent without TLS)."""

import subprocess
import sys
import threading

from mesh_util import free_port


def _node(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "meshnet.cli", "node", "--engine", "fake", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _stderr_after_ready(proc: subprocess.Popen, until: str | None = None, wait_s: float = 0.5) -> str:
    """What the node wrote on stderr up to ``wait_s`` after its ready line, or until a line holding
    ``until`` (the check runs as the node starts serving, on loopback in milliseconds); the node is killed
    after it."""
    lines: list[str] = []
    seen = threading.Event()

    def read() -> None:
        for line in proc.stderr:
            lines.append(line)
            if until is not None and until in line:
                seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert proc.stdout.readline().startswith("MESHNET_NODE_READY"), "".join(lines)
        seen.wait(wait_s)
    finally:
        proc.kill()
        proc.wait(30)
        reader.join(10)
    return "".join(lines)


def test_a_node_warns_when_nothing_answers_at_its_advertised_address():
    nowhere = free_port()
    err = _stderr_after_ready(_node("--port", "0", "--advertise", f"127.0.0.1:{nowhere}"), "advertised", 10)
    assert (f"WARNING meshnet.node this node does not answer at its advertised address 127.0.0.1:{nowhere} "
            "from its own machine (UNAVAILABLE") in err, err
    assert "check --advertise HOST:PORT" in err


def test_a_node_warns_when_another_process_answers_at_its_advertised_address_and_not_when_it_does():
    port = free_port()
    first = _node("--port", str(port), "--advertise", f"127.0.0.1:{port}")
    try:
        assert first.stdout.readline().startswith("MESHNET_NODE_READY")
        err = _stderr_after_ready(_node("--port", "0", "--advertise", f"127.0.0.1:{port}"), "advertised", 10)
        assert (f"another meshnet process answers at this node's advertised address 127.0.0.1:{port}: clients "
                "and other nodes dial that address and reach it instead; check --advertise HOST:PORT") in err, err
    finally:
        first.kill()
        _, first_err = first.communicate(timeout=30)
    assert "advertised address" not in first_err, first_err  # it answers there itself


def test_a_tls_node_at_its_advertised_address_is_not_warned_about(tmp_path):
    """A node serving TLS answers its own check over TLS with its --tls-ca (without one, nothing verifies its
    certificate: no check, where it warned of the failed handshake); a join token is sent with it. A correct
    setup is not warned about; a wrong port still is."""
    from tls_util import self_signed_cert

    tls = self_signed_cert(tmp_path)
    for extra in ((), ("--tls-ca", tls.cert), ("--join-token", "s3cret")):
        port = free_port()
        err = _stderr_after_ready(_node("--port", str(port), "--advertise", f"127.0.0.1:{port}", "--tls-cert", tls.cert,
                                        "--tls-key", tls.key, *extra))
        assert "advertised address" not in err, (extra, err)
    nowhere = free_port()
    err = _stderr_after_ready(_node("--port", "0", "--advertise", f"127.0.0.1:{nowhere}", "--tls-cert", tls.cert,
                                    "--tls-key", tls.key, "--tls-ca", tls.cert, "--join-token", "s3cret"),
                              "advertised", 10)
    assert f"this node does not answer at its advertised address 127.0.0.1:{nowhere}" in err, err


def test_a_grpc_server_that_is_no_node_of_this_mesh_is_named_as_another_process_not_as_no_answer():
    """A tracker (UNIMPLEMENTED for Node.Health) or a node of a mesh with another join token
    (UNAUTHENTICATED) at the advertised address answered: "does not answer" sent users looking for a
    firewall, and UNAUTHENTICATED's details asked for a join token this node already has."""
    from concurrent import futures

    import grpc

    from meshnet.node.advertised_check import advertised_address_problem

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        problem = advertised_address_problem(f"127.0.0.1:{port}", "me", timeout_s=5)
    finally:
        server.stop(None)
    assert problem is not None and problem.startswith(
        f"another process answers at this node's advertised address 127.0.0.1:{port} (UNIMPLEMENTED"), problem
