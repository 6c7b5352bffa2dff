"""``meshnet bench serve``'s llama.cpp split (llama-server --rpc over ggml-rpc-servers): the launcher script
run with stand-in binaries, and the mesh's ratios to it. (The serve bench's other tests are in test_api.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from meshnet.bench.llama_rpc import rpc_split_server_argv
from meshnet.bench.served import free_port

# A stand-in ggml-rpc-server: writes its argv, listens on -p after a moment (the launcher must wait for it).
FAKE_RPC = textwrap.dedent("""\
    import json, socket, sys, time
    args = sys.argv[1:]
    port = int(args[args.index("-p") + 1])
    open(f"{OUT}/rpc-{port}.json", "w").write(json.dumps(args))
    time.sleep(0.3)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen()
    while True:
        s.accept()[0].close()
""")

# A stand-in llama-server: records its argv and whether every --rpc endpoint accepted a connection.
FAKE_SERVER = textwrap.dedent("""\
    import json, socket, sys
    args = sys.argv[1:]
    ready = []
    for ep in args[args.index("--rpc") + 1].split(","):
        host, port = ep.rsplit(":", 1)
        try:
            socket.create_connection((host, int(port)), timeout=2).close()
            ready.append(True)
        except OSError:
            ready.append(False)
    open(f"{OUT}/server.json", "w").write(json.dumps({"args": args, "ready": ready}))
""")


def _fake(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(f"#!{sys.executable}\nOUT = {str(tmp_path)!r}\n{body}")
    path.chmod(0o755)
    return path


def test_rpc_split_starts_every_rpc_server_before_llama_server(tmp_path):
    rpc, server = _fake(tmp_path, "rpc", FAKE_RPC), _fake(tmp_path, "srv", FAKE_SERVER)
    ports, http_port = [free_port() for _ in range(3)], free_port()
    argv = rpc_split_server_argv(server, rpc, "m.gguf", "12/13/6", ports, http_port, 8, 1024)
    proc = subprocess.Popen(argv, start_new_session=True)
    try:
        assert proc.wait(30) == 0
        got = json.loads((tmp_path / "server.json").read_text())
    finally:
        os.killpg(proc.pid, 9)  # the stand-in RPC servers are in its process group
    assert got["ready"] == [True, True, True]  # it ran only once all three listened
    args = got["args"]
    assert args[args.index("--rpc") + 1] == ",".join(f"127.0.0.1:{p}" for p in ports)
    for flag, value in (("-m", "m.gguf"), ("-ts", "12/13/6"), ("-ngl", "99"), ("-t", "1"), ("-tb", "1"),
                        ("-fa", "on"), ("-np", "8"), ("-c", "8192"), ("--host", "127.0.0.1"),
                        ("--port", str(http_port))):
        assert args[args.index(flag) + 1] == value, flag
    for p in ports:
        assert json.loads((tmp_path / f"rpc-{p}.json").read_text()) == ["-H", "127.0.0.1", "-p", str(p), "-t", "1"]


def test_rpc_split_gives_up_when_an_rpc_server_never_listens(tmp_path):
    rpc = _fake(tmp_path, "rpc", "import sys\nsys.exit(3)\n")
    server = _fake(tmp_path, "srv", FAKE_SERVER)
    argv = rpc_split_server_argv(server, rpc, "m.gguf", "1/1", [free_port(), free_port()], free_port(), 8, 1024,
                                 wait_s=0.5)
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert r.returncode == 1
    assert "did not listen within 0.5 s" in r.stderr
    assert not (tmp_path / "server.json").exists()


def test_rpc_split_stops_its_rpc_servers_when_one_never_listens(tmp_path):
    rpc = _fake(tmp_path, "rpc", "import os, time\nopen(f'{OUT}/pid-{os.getpid()}', 'w').close()\ntime.sleep(60)\n")
    argv = rpc_split_server_argv(_fake(tmp_path, "srv", FAKE_SERVER), rpc, "m.gguf", "1/1", [free_port(), free_port()],
                                 free_port(), 8, 1024, wait_s=0.5)
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "did not listen within 0.5 s" in r.stderr
    pids = [int(p.name.split("-")[1]) for p in tmp_path.glob("pid-*")]
    assert len(pids) == 2
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids):  # stopped by the launcher, not left behind
        assert time.monotonic() < deadline
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (killed, not yet reaped by init) counts as gone
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_mesh_is_compared_with_llama_cpp_split():
    from meshnet.bench.serve_bench import _ratios

    got = _ratios({"meshnet": {"8": {"tokens_per_s": 200.0, "cpu_ms_per_token": 10.0}},
                   "mesh": {"8": {"tokens_per_s": 110.0, "decode_tokens_per_s_p50": 15.0, "ttft_s": {"p50": 0.25},
                                  "cpu_ms_per_token": 18.0}},
                   "llama-rpc": {"8": {"tokens_per_s": 88.0, "decode_tokens_per_s_p50": 12.0,
                                       "ttft_s": {"p50": 0.8}, "cpu_ms_per_token": 20.0}}})["8"]
    assert got["mesh_vs_llama_rpc"] == 1.25 and got["mesh_decode_vs_llama_rpc"] == 1.25
    assert got["mesh_ttft_vs_llama_rpc"] == 0.312 and got["mesh_cpu_vs_llama_rpc"] == 0.9
    assert got["mesh_vs_meshnet"] == 0.55 and got["meshnet_aggregate_vs_llama"] is None


def test_llama_cpp_split_is_measured_last_and_alone(tmp_path):
    import argparse

    from meshnet.bench import serve_bench

    run = serve_bench._Run({"meshnet": None, "mesh": None}, tmp_path / "llama-server", "m.gguf",
                           argparse.Namespace(threads=2), tmp_path, {}, 1000, side_by_side=True,
                           rpc=(tmp_path / "llama-server", tmp_path / "ggml-rpc-server"))
    assert run.names == ["llama-server", "meshnet", "mesh", "llama-rpc"]
    assert run.paired == ["llama-server", "meshnet"]


def test_llama_rpc_target_holds_the_mesh_ranges(tmp_path):
    from meshnet.bench.serve_targets import llama_rpc_server
    from meshnet.model.bundled import resolve_model

    try:
        model = str(resolve_model("smollm2"))
    except (FileNotFoundError, ValueError) as e:
        pytest.skip(f"the bundled model is not installed: {e}")
    srv = llama_rpc_server((Path("/bin/llama-server"), Path("/bin/ggml-rpc-server")), model, 32, tmp_path)
    script = srv.argv[2]
    assert srv.argv[:2] == ["bash", "-c"] and srv.name == "llama-rpc-np32"
    assert script.count("/bin/ggml-rpc-server -H 127.0.0.1 -p ") == 3
    assert "-ts 12/13/6 -ngl 99 -t 1 -tb 1 -fa on -np 32 -c 32768" in script  # SmolLM2's 0:12, 12:25, 25:30
    assert f"--port {srv.port}" in script


@pytest.mark.slow  # about 5 s
@pytest.mark.parametrize("when", ["loading", "measured"])
def test_sigterm_stops_the_server_it_started(tmp_path, when):
    """SIGTERM (`timeout`, `kill`) ended the bench on the spot and left the server it measured running (in a
    session of its own, which no signal to the bench's process group reaches). Now it takes Ctrl-C's way
    out, while the server loads (before the bench has it to stop) or serves the load: the server is
    stopped, exit 143, one line."""
    import signal

    from mesh_util import left_running, sigterm_bench

    log = tmp_path / "serve-logs" / "meshnet.log"

    def api_started(tree):
        if not any("api" in argv for argv in tree.values()):
            return False
        return when == "loading" or "[meshnet api] serving" in log.read_text()

    out = tmp_path / "serve.json"
    proc, err, tree = sigterm_bench(["serve", "--targets", "meshnet", "--concurrency", "1", "--max-tokens", "2",
                                     "--out", str(out)], api_started)
    assert left_running(tree, grace_s=5) == []
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.splitlines()[-1] == "meshnet bench serve: stopped by SIGTERM" and "Traceback" not in err
    assert not out.exists()


def test_a_running_server_is_asked_for_its_model_once(tmp_path, monkeypatch):
    """``--url`` asked /v1/models before writing anything (so that nothing answering there is one line), then
    again each time a load "started" the server: 1 + C values x rounds requests. Now once."""
    import httpx

    from meshnet.bench import serve_bench
    from meshnet.cli import main

    asked = []

    def get(url, **kw):
        asked.append(url)
        return httpx.Response(200, json={"object": "list", "data": [{"id": "m"}]}, request=httpx.Request("GET", url))

    async def load(url, model, spec, headers=None):  # every request answered: 2 tokens in a second
        row = {"ok": True, "ttft_s": 0.1, "latency_s": 1.0, "completion_tokens": 2, "prompt_tokens": 5,
               "decode_tokens_per_s": 1.1}
        return [row] * spec.n_requests, 1.0

    monkeypatch.setattr(httpx, "get", get)
    monkeypatch.setattr(serve_bench, "run_load", load)
    out = tmp_path / "serve.json"
    assert main(["bench", "serve", "--url", "http://127.0.0.1:9", "--concurrency", "1,2", "--rounds", "2",
                 "--out", str(out)]) == 0
    assert asked == ["http://127.0.0.1:9/v1/models"]
    report = json.loads(out.read_text())
    assert [report["results"]["url"][c]["completed"] for c in ("1", "2")] == [8, 8]
    assert not (tmp_path / "serve-logs").exists()  # nothing started here logs


def test_an_api_key_without_url_is_refused_before_anything_starts(tmp_path, capsys):
    """The servers the bench starts ask for no key: ``--api-key`` without ``--url`` was taken and ignored."""
    from meshnet.cli import main

    out = tmp_path / "serve.json"
    assert main(["bench", "serve", "--api-key", "k3y", "--targets", "meshnet", "--out", str(out)]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == ("error: --api-key is the key of the server --url names; "
                                                        "the servers this bench starts ask for none")
    assert not out.exists() and not (tmp_path / "serve-logs").exists()
