"""The ``meshnet`` command as a user runs it (a subprocess), on a tiny model and on SmolLM2."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from conftest import GOLDEN_DIR, golden_exact, load_golden
from golden_check import assert_greedy_matches
from solo_reference import PROMPTS

TINY = GOLDEN_DIR / "models" / "tiny-qwen2-q4_0.gguf"


def meshnet(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshnet.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def _json_line(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not TINY.is_file(), reason="tiny models not found")
def test_generate_json_on_tiny_model_matches_llama_cpp():
    golden = load_golden("tiny-qwen2-q4_0")
    out = _json_line(meshnet("generate", "--model", str(TINY), "--layers", "0:1,1:3,3:4", "--temperature", "0",
                             "--max-tokens", "64", "--ignore-eos", "--json", golden["prompts"][3]["prompt"]))
    assert out["prompt_token_ids"] == golden["prompts"][3]["prompt_ids"]
    assert len(out["generated_token_ids"]) == 64
    assert_greedy_matches(golden, 3, out["generated_token_ids"], golden_exact())
    assert out["layers"] == ["0:1", "1:3", "3:4"]
    assert out["finish_reason"] == "length"


def test_generate_bundled_model_three_stages(solo):
    proc = meshnet("generate", "--stages", "3", "--temperature", "0", "--max-tokens", "12", "--json", PROMPTS[0])
    out = _json_line(proc)
    assert out["generated_token_ids"] == solo.greedy(0, 12)
    assert out["text"].startswith(" Paris.")
    assert proc.stdout.startswith(" Paris.")  # streamed before the JSON line
    assert out["timings"]["decode_tokens_per_s"] > 0


def test_chat_stops_at_end_of_turn(smollm2_path):
    out = _json_line(meshnet("generate", "--chat", "--temperature", "0", "--max-tokens", "200", "--json",
                             "Say hello."))
    assert out["finish_reason"] == "stop"
    assert 2 not in out["generated_token_ids"]  # <|im_end|> ends the reply and is not part of it
    assert "<|im" not in out["text"]


@pytest.mark.parametrize("args, message", [
    (["--model", "/no/such/model.gguf"], "neither a file nor a bundled model"),
    (["--layers", "0:10,12:30"], "must tile [0, 30)"),
    (["--layers", "0:10,10:30,"], "--layers '0:10,10:30,' has an empty range between its commas"),
    (["--stages", "31"], "error: --stages 31: the model has 30 layers, so give 1 to 30 stages"),
    (["--stages", "0"], "error: --stages 0: the model has 30 layers, so give 1 to 30 stages"),
    (["--max-tokens", "0"], "--max-tokens must be >= 1"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--n-ctx", "8"], "the prompt has"),
])
def test_bad_arguments_are_named(smollm2_path, args, message):
    proc = meshnet("generate", *args, "The capital of France is, as everyone knows,")
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_full_context_holds_one_generated_token_more_than_its_cells_as_the_api_does(smollm2_path):
    """The last generated token is never fed back: with --n-ctx 8 a 5-token prompt gets 4 tokens (it got 3,
    where the API's budget gives 4) and an 8-token prompt 1 (it was refused)."""
    for prompt, n_gen in (("The capital of France is", 4), ("The capital of France is, as every", 1)):
        # greedy: sampled at the default temperature, an end-of-text token could end it early
        proc = meshnet("generate", "--n-ctx", "8", "--max-tokens", "50", "--temperature", "0", "--json", prompt)
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout.splitlines()[-1])
        assert len(out["generated_token_ids"]) == n_gen and out["finish_reason"] == "length", (out, proc.stderr)
        assert len(out["prompt_token_ids"]) + n_gen == 9


def test_an_empty_prompt_is_refused_before_any_layer_loads(smollm2_path):
    proc = meshnet("generate", "")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == "error: the prompt has no tokens; give some text"
    assert "stage(s)" not in proc.stderr  # nothing was loaded


@pytest.mark.skipif(sys.platform == "darwin", reason="metal is a real lane on macOS")
def test_bench_engine_refuses_an_unproved_backend(tmp_path):
    proc = meshnet("bench", "engine", "--backend", "metal", "--out", str(tmp_path / "x.json"))
    assert proc.returncode == 2
    assert f"backend metal is not usable here: platform {sys.platform} is not darwin" in proc.stderr
    assert not (tmp_path / "x.json").exists()


def test_generate_without_a_running_mesh_is_a_clear_error(smollm2_path):
    port = 1  # nothing listens on port 1 on loopback
    proc = meshnet("generate", "--tracker", f"127.0.0.1:{port}", "Hello")
    assert proc.returncode == 1
    assert "error: no route:" in proc.stderr and "Traceback" not in proc.stderr
    proc = meshnet("generate", "--tracker", f"127.0.0.1:{port}", "--wait", "0.5", "Hello")  # it said 2
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "error: no complete route after 0.5 s: failed to connect" in proc.stderr, proc.stderr
    proc = meshnet("generate", "--tracker", "127.0.0.1:", "Hello")
    assert proc.returncode == 2 and "expected HOST:PORT" in proc.stderr


def test_a_tracker_named_without_a_port_is_the_one_on_the_default_port():
    """`--tracker localhost` was refused (HOST:PORT expected) although the tracker listens on 7700 unless
    told otherwise; a bare host now means that port, in every command that takes --tracker."""
    from meshnet.arg_types import tracker_address

    assert [tracker_address(a) for a in ("localhost", "10.0.0.5", "[::1]", "node-7:7811", "[::1]:80")] == [
        "localhost:7700", "10.0.0.5:7700", "[::1]:7700", "node-7:7811", "[::1]:80"]
    for bad in ("", "::1", "localhost:0", "http://localhost"):
        with pytest.raises(argparse.ArgumentTypeError):
            tracker_address(bad)
    from meshnet.cli import build_parser

    for command in ("generate", "node", "api", "nodes", "ledger"):
        parser = build_parser([command])
        args = parser.parse_args([command, "--tracker", "tracker-host"] + (["hi"] if command == "generate" else []))
        assert args.tracker == "tracker-host:7700", command


def test_a_second_server_on_a_busy_port_fails_to_start():
    from meshnet.tracker.server import serve_tracker

    first, port = serve_tracker("127.0.0.1", 0)
    try:
        with pytest.raises(RuntimeError, match="cannot listen"):
            serve_tracker("127.0.0.1", port)
    finally:
        first.stop(0).wait()


def test_a_reader_that_goes_away_is_not_a_traceback():
    """`meshnet backends --json | head -1`: the reader closes the pipe before the output is written."""
    proc = subprocess.Popen([sys.executable, "-m", "meshnet.cli", "backends", "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 0
    assert "Traceback" not in err and "BrokenPipeError" not in err


def test_a_command_line_builds_only_the_parser_of_the_subcommand_it_names():
    """Every subcommand's parser at once imported gRPC, numpy, FastAPI and ggml: 0.8 s before `meshnet
    tracker --port 99999` could refuse the port. The others stay known by name, and `--help` lists them all."""
    probe = ("import sys, json; from meshnet.cli import build_parser; "
             "build_parser(sys.argv[1:]).parse_args(sys.argv[1:]); "
             "print(json.dumps(sorted(m for m in ('fastapi', 'numpy', 'meshnet.bench.mesh_bench', "
             "'meshnet.node.runner', 'meshnet.api.server') if m in sys.modules)))")
    loaded = subprocess.run([sys.executable, "-c", probe, "ledger", "--tracker", "127.0.0.1:1"],
                            capture_output=True, text=True, timeout=60)
    assert loaded.returncode == 0, loaded.stderr
    assert json.loads(loaded.stdout) == []
    proc = meshnet("nodez")
    assert proc.returncode == 2
    assert ("invalid choice: 'nodez' (choose from 'generate', 'bench', 'up', 'api', 'tracker', 'node', "
            "'backends', 'ledger', 'nodes')") in proc.stderr
    proc = meshnet("bench", "wann")
    assert proc.returncode == 2
    assert ("invalid choice: 'wann' (choose from 'engine', 'mesh', 'serve', 'worker', 'hostile', 'wan', "
            "'speculative', 'scale', 'structured')") in proc.stderr
    helped = meshnet("--help")
    assert helped.returncode == 0
    assert "serve a layer range of a model and join a tracker" in helped.stdout  # node's, from its module
    for argv in (["-h", "node"], ["bench", "-h", "wan"]):  # help before a subcommand lists every one
        helped = meshnet(*argv)
        assert helped.returncode == 0
        assert ("run the tracker" in helped.stdout) if argv[0] == "-h" else ("meshnet api vs llama-server" in helped.stdout)
    proc = meshnet("tracker", "--port", "99999")
    assert proc.returncode == 2 and "--port" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("stream, sig", [(True, "SIGINT"), (False, "SIGINT"), (True, "SIGTERM")])
def test_ctrl_c_on_the_api_ends_open_requests_with_a_503_and_no_traceback(stream, sig, tmp_path):
    """Ctrl-C with a request in flight: uvicorn waited its 5 s grace, then cancelled the generation
    mid-step ("Exception in ASGI application", a CancelledError traceback, a plain-text 500 or a stream
    cut without an end). Now the request ends at its next token with the API's own 503. SIGTERM, which
    uvicorn raised again once stopped, killed the process (-15) before it closed its backend."""
    import signal
    import socket
    import time

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "meshnet.cli", "api", "--model", "smollm2", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        body = {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True, "stream": stream,
                "temperature": 0}
        url = f"http://127.0.0.1:{port}/v1/completions"
        if stream:
            with httpx.Client(timeout=60) as http, http.stream("POST", url, json=body) as r:
                lines = r.iter_lines()
                assert r.status_code == 200 and next(line for line in lines if line.startswith("data: {"))
                proc.send_signal(getattr(signal, sig))
                last = [line for line in lines if line.startswith("data: ")][-1]
                assert json.loads(last[6:])["error"]["code"] == "server_shutdown"
        else:  # its answer comes whole, at the end: asked on a thread of its own
            import concurrent.futures

            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                answer = pool.submit(httpx.post, url, json=body, timeout=60)
                time.sleep(1.5)  # the generation is under way (2000 tokens take 10 s or more)
                proc.send_signal(signal.SIGINT)
                r = answer.result(timeout=30)
            assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutdown"
        started = time.monotonic()
        _, err = proc.communicate(timeout=30)
        assert time.monotonic() - started < 4  # within uvicorn's 5 s grace: nothing was cancelled
        assert proc.returncode == (130 if sig == "SIGINT" else 0), (proc.returncode, err)
        assert "Traceback" not in err and "ASGI" not in err, err
        assert err.count("[meshnet api] stopping: 1 open request(s) end now (server_shutdown)\n") == 1, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_up_on_every_interface_of_a_machine_without_a_default_route_names_the_fix(monkeypatch, capsys):
    """Without a default route there is no address of this machine to give others: `up --host 0.0.0.0`
    ran, its nodes registered 127.0.0.1 and its ready line named 0.0.0.0, and nothing warned."""
    import meshnet.up
    from meshnet.cli import main

    monkeypatch.setattr(meshnet.up, "this_machine_address", lambda host: host)  # as with no default route
    assert main(["up", "--host", "0.0.0.0", "--port", "0", "--api-port", "0", "--dashboard-port", "-1"]) == 2
    assert capsys.readouterr().err == ("error: --host 0.0.0.0: this machine has no default route, so there is no "
                                       "address of it to give other machines; pass --host with its address on "
                                       "the network they share\n")


def test_an_api_beyond_loopback_without_a_key_says_so_and_a_bad_key_is_refused(tmp_path):
    """`meshnet api --host 0.0.0.0` served anyone who reached it without a word; a key that cannot travel in
    a header is an argparse error."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "MESHNET_API_KEY"}
    r = subprocess.run([sys.executable, "-m", "meshnet.cli", "api", "--api-key", "two words"], capture_output=True,
                       text=True, timeout=60, env=env)
    assert r.returncode == 2 and ("argument --api-key: may hold only printable ASCII characters without spaces "
                                  "(clients send it in a header), got ' ' at character 3") in r.stderr
    proc = subprocess.Popen([sys.executable, "-m", "meshnet.cli", "api", "--host", "0.0.0.0", "--port", "0"],
                            stderr=subprocess.PIPE, text=True, env={**env, "HOME": str(tmp_path)})
    try:
        lines = []
        while not any("no API key" in line for line in lines):
            lines.append(proc.stderr.readline())
            assert lines[-1] or proc.poll() is None, lines
        serving = next(line for line in lines if "serving 'smollm2'" in line)
        port = int(serving.split(":")[2].split("/")[0])
        # named by the address others reach it at, as `meshnet up` names its API (0.0.0.0 where none is known)
        from meshnet.wire.addresses import this_machine_address

        assert f"on http://{this_machine_address('0.0.0.0')}:{port}/v1 " in serving, serving
        assert lines[-1] == (f"[meshnet api] no API key: anyone who reaches port {port} can run generations on "
                             "this model (pass --api-key, or set $MESHNET_API_KEY)\n")
    finally:
        proc.terminate()
        proc.wait(60)
