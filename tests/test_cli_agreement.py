"""The command-line front ends agree: the same mistake gets the same exit status (2 for a usage error or a bad
model, 1 when the mesh refuses) and one line naming the flag or file, whichever command it is given to."""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import sys
from unittest import mock

import pytest

from meshnet.arg_types import listen_host

CLI = [sys.executable, "-m", "meshnet.cli"]


def meshnet(*args: str, prefix: list[str] | None = None, env: dict | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``meshnet ARGS``; with ``prefix`` (a command taking one shell line, as capsh does) through it."""
    cmd = [*prefix, shlex.join([*CLI, *args])] if prefix else [*CLI, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=None if env is None else {**os.environ, **env})


def _unreadable_prefix(path) -> list[str]:
    """Make ``path`` unreadable (mode 000); the command prefix under which it is so: none for a user, capsh
    dropping the capabilities by which root reads any file. Skips the test where neither works."""
    path.chmod(0)
    if os.geteuid() != 0:
        return []
    capsh = shutil.which("capsh")
    if capsh is None:
        pytest.skip("running as root without capsh: every file is readable")
    prefix = [capsh, "--drop=cap_dac_override,cap_dac_read_search", "--", "-c"]
    if subprocess.run([*prefix, f"cat {shlex.quote(str(path))}"], capture_output=True).returncode == 0:
        pytest.skip("capsh could not drop root's file-permission override here")
    return prefix


@pytest.mark.parametrize("command", [["generate", "hi"], ["api", "--port", "0"], ["backends", "--certify"]])
def test_an_unreadable_model_exits_2_naming_it_as_a_missing_one_does(tmp_path, command):
    """It said a bare "Permission denied" and exited 1 (the node exited 2)."""
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    r = meshnet(*command, "--model", str(model), prefix=_unreadable_prefix(model))
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1] == f"error: model '{model}' cannot be read: Permission denied"
    assert r.stderr.count("error:") == 1 and "Traceback" not in r.stderr


@pytest.mark.parametrize("command", [["generate", "hi"], ["node", "--engine", "fake"], ["nodes"],
                                     ["api", "--port", "0"]])
def test_a_tracker_refusing_the_join_token_exits_1_from_every_command(token_tracker, command):
    """The mesh refused, not the command line: the API exited 2 where generate, node and nodes exit 1."""
    r = meshnet(*command, "--tracker", token_tracker, timeout=60)
    assert r.returncode == 1, r.stderr
    assert r.stderr.count("error:") == 1 and "missing join token" in r.stderr and "Traceback" not in r.stderr
    assert "no route" not in r.stderr  # a refused token is no routing problem


@pytest.mark.parametrize("flag,message", [
    ("--port", "error: cannot listen on 127.0.0.1:{port}: Address already in use; pass another --port or --host"),
    # asyncio's words named the address a second time: "(while attempting to bind on address (...))"
    ("--data-port", "error: cannot listen on 127.0.0.1:{port} (the data plane): Address already in use; pass "
                    "another --data-port"),
])
def test_a_node_on_a_taken_port_names_it_once(flag, message):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = meshnet("node", "--engine", "fake", flag, str(port))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == message.format(port=port)
    assert r.stderr.count("error:") == 1 and r.stderr.count(str(port)) == 1


def test_a_node_given_one_port_for_grpc_and_the_data_plane_is_refused_naming_both():
    """gRPC took the port, and the data plane, once the model had loaded, blamed it as taken."""
    r = meshnet("node", "--engine", "fake", "--port", "15599", "--data-port", "15599", timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1] == ("error: --port and --data-port are both 15599: gRPC and the data "
                                                 "plane each need a port of their own")
    assert r.stderr.count("error:") == 1 and "cannot listen" not in r.stderr


@pytest.mark.parametrize("command,flag", [
    (["generate", "hi", "--tracker", "127.0.0.1:9", "--model-id", ""], "--model-id"),
    (["api", "--tracker", "127.0.0.1:9", "--model-id", ""], "--model-id"),  # it served the tracker's model
    (["node", "--tracker", "127.0.0.1:9", "--layers", "0:10", "--fetch", ""], "--fetch"),  # it served smollm2
])
def test_an_empty_model_name_for_the_tracker_is_refused(command, flag):
    r = meshnet(*command, timeout=60)
    assert r.returncode == 2
    assert f"error: argument {flag}: must not be empty; give the model's id" in r.stderr


def test_a_bracketed_ipv6_host_is_the_address_inside():
    assert listen_host("[::1]") == "::1" and listen_host("::1") == "::1" and listen_host("0.0.0.0") == "0.0.0.0"
    for bad in ("[::1", "[localhost]", "[]"):
        with pytest.raises(Exception, match=r"brackets go around an IPv6 address only \(e.g. \[::1\]\)"):
            listen_host(bad)


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
def test_a_dashboard_and_a_node_listen_on_a_bracketed_ipv6_host():
    """--host [::1] bound gRPC but not the node's data plane; --dashboard-host [::1] only warned."""
    tracker = subprocess.Popen([*CLI, "tracker", "--port", "0", "--ledger", "sqlite://", "--dashboard-port", "0",
                                "--dashboard-host", "[::1]"], stderr=subprocess.PIPE, text=True)
    try:
        line = next(x for x in tracker.stderr if "dashboard" in x)
        assert line.startswith("tracker: dashboard on http://[::1]:"), line
    finally:
        tracker.terminate()
        tracker.wait(30)
        tracker.stderr.close()
    node = subprocess.Popen([*CLI, "node", "--engine", "fake", "--host", "[::1]"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for x in node.stdout:
            lines.append(x)
            if "data plane" in x or "error:" in x:
                break
        assert " data plane [::1]:" in lines[-1], "".join(lines)
    finally:
        node.terminate()
        node.wait(30)
        node.stdout.close()


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
def test_up_on_an_ipv6_host_names_a_taken_port_in_brackets():
    """``meshnet up --host ::1`` said "cannot listen on ::1:PORT", which reads as host ::1:PORT's default port."""
    from meshnet.up import _node_ports_problem

    with socket.socket(socket.AF_INET6) as taken:
        taken.bind(("::1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = meshnet("up", "--host", "::1", "--port", "0", "--api-port", str(port), "--dashboard-port", "-1",
                    timeout=60)
        assert r.returncode == 2, r.stderr
        assert r.stderr == (f"error: the API cannot listen on [::1]:{port} (Address already in use); pass another "
                            "--api-port (0 = any free port, -1 = no API) or --host\n")
        assert _node_ports_problem("::1", [(0, 0), (port - 1, port)]) == (
            f"node 1 cannot listen on [::1]:{port} (Address already in use); pass another --node-ports (0 = any "
            "free ports)")


@pytest.mark.parametrize("args,message", [
    (["node", "--engine", "fake", "--no-data-plane", "--data-port", "9"],
     "meshnet node: error: argument --data-port: not allowed with argument --no-data-plane"),
    (["backends", "--threads", "4"], "error: --threads needs --certify (it sets the self-test, which only --certify "
                                     "runs); add --certify or drop --threads"),
    (["backends", "--lane", "cpu"], "error: --lane needs --certify"),
])
def test_flags_that_would_be_ignored_are_refused_naming_both(args, message):
    r = meshnet(*args, timeout=60)
    assert r.returncode == 2 and message in r.stderr and r.stderr.count("error:") == 1


def test_a_bad_join_token_variable_fails_only_runs_that_use_a_token(smollm2_path):
    bad = {"MESHNET_JOIN_TOKEN": "p\u00e4ss"}
    local = meshnet("generate", "--model", str(smollm2_path), "--max-tokens", "1", "hi", env=bad)
    assert local.returncode == 0, local.stderr
    for command in (["generate", "hi", "--tracker", "127.0.0.1:9"], ["api", "--tracker", "127.0.0.1:9"],
                    ["nodes", "--tracker", "127.0.0.1:9"]):
        r = meshnet(*command, env=bad, timeout=60)
        assert r.returncode == 2, r.stderr
        assert (f"meshnet {command[0]}: error: argument --join-token: may hold only printable ASCII characters "
                "(gRPC carries it as metadata), got '\u00e4' at character 1 (from $MESHNET_JOIN_TOKEN)") in r.stderr


def test_a_bad_api_key_variable_fails_only_runs_that_use_a_key():
    """A bench that starts its own servers sends no key (they do not get the variable): a malformed
    $MESHNET_API_KEY failed it at parse time all the same, as it still fails a server and ``bench serve --url``."""
    from meshnet.cli import build_parser
    from meshnet.secret_args import secrets_from_env

    def parsed(argv: list[str]):
        parser = build_parser(argv)
        args = parser.parse_args(argv)
        errors = []
        secrets_from_env(args, errors.append)
        return args, errors

    env = {"MESHNET_API_KEY": "two words"}
    with mock.patch.dict(os.environ, env):
        args, errors = parsed(["bench", "serve", "--targets", "meshnet"])
        assert (args.api_key, errors) == (None, [])
        for argv in (["bench", "serve", "--url", "http://127.0.0.1:9"], ["api"], ["up"]):
            args, errors = parsed(argv)
            assert errors == ["argument --api-key: may hold only printable ASCII characters without spaces "
                              "(clients send it in a header), got ' ' at character 3 (from $MESHNET_API_KEY)"], argv
    with mock.patch.dict(os.environ, {"MESHNET_API_KEY": "k3y"}):
        assert parsed(["bench", "serve", "--url", "http://127.0.0.1:9"])[0].api_key == "k3y"
        assert parsed(["api", "--api-key", "given"])[0].api_key == "given"
        assert parsed(["bench", "serve"])[0].api_key is None
    with mock.patch.dict(os.environ, {"MESHNET_API_KEY": ""}):  # empty: no key
        assert parsed(["api"])[0].api_key is None


def test_commands_that_ask_a_tracker_nothing_answers_at_say_what_to_check():
    """`meshnet generate --tracker` with nothing at the address added "is it running, and is that its
    address?"; `meshnet nodes` and `meshnet ledger` printed gRPC's words alone."""
    from mesh_util import free_port

    address = f"127.0.0.1:{free_port()}"
    for command in ("nodes", "ledger"):
        r = meshnet(command, "--tracker", address, timeout=60)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.startswith(f"error: tracker {address}: UNAVAILABLE: "), r.stderr
        assert r.stderr.rstrip().endswith(f"(no tracker answers at {address}: is it running, and is that its "
                                          "address (--tracker HOST:PORT)?)"), r.stderr
