"""`meshnet generate --tracker` in the seconds after a node died, while the tracker still lists it."""

from __future__ import annotations

import json

import pytest

from solo_reference import PROMPTS
from mesh_util import Mesh, run_generate



@pytest.fixture
def slow_mesh():
    """A mesh whose tracker keeps a dead node listed for 90 s (30 s heartbeats, three missed)."""
    m = Mesh(heartbeat_s=30.0)
    yield m
    m.close()


def test_generate_routes_around_a_dead_hop_the_tracker_still_lists(slow_mesh, solo):
    nodes = slow_mesh.start_nodes([("a-head", "0:10"), ("b-mid", "10:20"), ("c-spare", "10:20"),
                                   ("d-tail", "20:30")])
    client = slow_mesh.client()
    _, route = client.route()
    victim = next(n for n in nodes if n.node_id == route[1].node_id)
    victim.kill()
    assert victim.node_id in slow_mesh.registered()
    # The client reads the context length around the dead hop...
    _, hops, n_ctx = client.route_with_context()
    assert [h.node_id for h in hops] == ["a-head", ({"b-mid", "c-spare"} - {victim.node_id}).pop(), "d-tail"]
    assert n_ctx == hops[0].capabilities().n_ctx == 4096
    client.close()
    # ...and so does the command line, which then completes the prompt.
    proc = run_generate(slow_mesh.tracker, PROMPTS[0], "--max-tokens", "8")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["generated_token_ids"] == solo.greedy(0, 8)



def test_a_route_waits_for_a_dead_hop_restarted_under_its_id_at_its_own_address(slow_mesh, solo):
    """No spare: the middle node is killed and started again under the same id and ports while a new
    session looks for a route. The dead hop is excluded, and let back in once its new process has
    registered and answers (it was excluded for the whole wait, and the route failed)."""
    import threading

    from mesh_util import free_port

    ports = ("--port", str(free_port()), "--data-port", str(free_port()))
    head, mid, tail = slow_mesh.start_nodes([("a-head", "0:10"), ("b-mid", "10:20", ports), ("d-tail", "20:30")])
    mid.kill()
    restarted: list = []
    thread = threading.Thread(target=lambda: restarted.extend(slow_mesh.start_nodes([("b-mid", "10:20", ports)])))
    thread.start()
    client = slow_mesh.client(failover_deadline_s=60)
    try:
        _, hops, n_ctx = client.route_with_context()
    finally:
        thread.join(60)
        client.close()
    assert [(h.node_id, h.address) for h in hops] == [(n.node_id, n.address) for n in (head, restarted[0], tail)]
    assert restarted[0].address == mid.address and n_ctx == 4096
    proc = run_generate(slow_mesh.tracker, PROMPTS[0], "--max-tokens", "8")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["generated_token_ids"] == solo.greedy(0, 8)

def test_generate_without_a_replacement_reports_one_line(slow_mesh, smollm2_path):
    head, mid, tail = slow_mesh.start_nodes([("a-head", "0:10"), ("b-mid", "10:20"), ("d-tail", "20:30")])
    mid.kill()
    proc = run_generate(slow_mesh.tracker, "Hello", "--max-tokens", "4")
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "layers [10, 20)" in errors[0], proc.stderr


def test_generate_json_names_the_route_it_ended_on_after_a_failover(mesh, solo):
    import subprocess
    import sys
    import time

    nodes = mesh.start_nodes([("a-head", "0:10"), ("b-mid", "10:20"), ("c-spare", "10:20"), ("d-tail", "20:30")])
    mids = nodes[1:3]
    proc = subprocess.Popen([sys.executable, "-m", "meshnet.cli", "generate", "--tracker", mesh.tracker,
                             "--temperature", "0", "--json", "--max-tokens", "64", "--ignore-eos", PROMPTS[0]],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    victim = None
    while victim is None:  # the middle node the session opened on
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() else ""
        victim = next((n for n in mids if n.active_sessions() > 0), None)
        time.sleep(0.02)
    victim.kill()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["generated_token_ids"] == solo.greedy(0, 64)
    survivor = next(n for n in mids if n is not victim)
    assert result["failovers"] == 1
    assert result["layers"] == [f"{n.node_id}@{n.address}" for n in (nodes[0], survivor, nodes[3])]


def test_generate_json_still_ends_with_the_object_when_the_mesh_fails_mid_answer(mesh, solo):
    """The only middle node is killed mid-answer and no spare exists: exit 1 with the error on stderr, and
    --json's last line (which scripts read) is still the object: the ids and text so far, finish_reason
    "error" and the error. It was the answer's partial text."""
    import signal
    import subprocess
    import sys

    nodes = mesh.start_nodes([("a-head", "0:10"), ("b-mid", "10:20"), ("d-tail", "20:30")])
    proc = subprocess.Popen([sys.executable, "-m", "meshnet.cli", "generate", "--tracker", mesh.tracker,
                             "--temperature", "0", "--json", "--ignore-eos", "--max-tokens", "4000", PROMPTS[0]],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.read(1)  # the answer has begun
        nodes[1].kill()
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
    # the error names the node that failed, and how, not only the layers nothing serves now
    assert proc.returncode == 1 and f"a node failed (node b-mid at {nodes[1].address}: " in err, err[-2000:]
    assert ") and no replacement route exists (" in err
    line = out.splitlines()[-1]
    last = json.loads(line)
    assert out.endswith("\n" + line + "\n")  # on a line of its own: it followed the text on the text's last line
    assert last["finish_reason"] == "error" and "no replacement route exists" in last["error"]
    ids = last["generated_token_ids"]
    assert 1 <= len(ids) < 4000 and ids[:64] == solo.greedy(0)[:len(ids)]
    assert last["failovers"] == 0 and last["failovers_not_bit_exact"] == 0
    assert last["timings"]["decode_s"] > 0  # was 0.0, however many tokens had come


def test_generate_json_ends_with_the_object_also_when_no_route_exists(mesh):
    """No node has registered: exit 1 naming why, and --json's last line is still the object (it printed
    none when the failure came before the first token)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "meshnet.cli", "generate", "--tracker", mesh.tracker, "--json",
                        "--temperature", "0", "Hello"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.splitlines()[-1].startswith("error: no route")
    assert r.stderr.splitlines()[-1].endswith("(nodes still loading? --wait SECONDS waits for a complete route)")
    last = json.loads(r.stdout)
    assert (last["generated_token_ids"], last["text"], last["finish_reason"]) == ([], "", "error")
    assert last["error"].startswith("no route") and last["prompt_token_ids"] and last["layers"] == []
    assert last["failovers"] == 0


def test_generate_for_a_model_the_mesh_does_not_serve_names_the_one_it_does_and_how_to_ask_for_it(mesh):
    """A mesh of SmolLM2 asked for another model's route: the error named the served model by its whole
    sha256 and advised --wait, which cannot help (a new user's `meshnet up --model gemma3-270m` and then
    `meshnet generate --tracker ...`). It names the model as --model-id takes it, and says to."""
    import re

    from conftest import GOLDEN_DIR

    mesh.start_nodes([("a", "0:30")])
    r = run_generate(mesh.tracker, "Hello", "--model", str(GOLDEN_DIR / "models" / "tiny-llama-q8_0.gguf"))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    last = r.stderr.splitlines()[-1]
    assert re.search(r"no registered node serves this model; models served: \S.* \([0-9a-f]{12}\) \(--model-id NAME "
                     r"or ID asks for one of those, --model FILE for a file of it here\)$", last), last
    assert "--wait" not in last


def test_a_client_the_nodes_refuse_is_told_why_at_once(mesh):
    """The tracker asks for no join token but the node does, and the client has none: it routed around
    the refusing node for the whole failover deadline (8 s), then said the route was excluded. A refusal
    does not heal by waiting: it fails at once, naming it."""
    import subprocess
    import sys
    import time

    mesh.start_nodes([("a-guarded", "0:30", ("--join-token", "s3cret"))])
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "meshnet.cli", "generate", "--tracker", mesh.tracker,
                        "--temperature", "0", "Hello"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    last = r.stderr.splitlines()[-1]
    assert last.startswith("error: no route") and "node a-guarded at " in last and ": UNAUTHENTICATED: " in last
    assert time.monotonic() - t0 < 6.0  # the interpreter's start and the imports, not the 8 s deadline


def test_generate_waits_for_room_on_a_full_mesh_as_the_api_does(solo):
    """A stage at its session limit answered `meshnet generate --tracker` RESOURCE_EXHAUSTED at once: a
    user could only retry by hand. It now waits in line for room, as the API does, and completes."""
    import subprocess
    import sys
    import time

    from meshnet.contract import GREEDY, StepRequest

    mesh = Mesh()
    try:
        mesh.start_nodes([("a-head", "0:15"), ("d-tail", "15:30")], "smollm2", "--max-sessions", "1")
        holder = mesh.client(report_deliveries=False)
        ids = solo.prompt_ids(1)
        assert holder.step(StepRequest("held", 0, 0, tuple(ids), sampling=GREEDY), decode=False).ok
        proc = subprocess.Popen([sys.executable, "-m", "meshnet.cli", "generate", "--tracker", mesh.tracker,
                                 "--temperature", "0", "--json", "--max-tokens", "8", "--ignore-eos", PROMPTS[0]],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = proc.stderr.readline()  # "[meshnet] ...: 2 stage(s) ..., N prompt tokens": its prefill is next
        assert "prompt tokens" in line, line
        started = time.monotonic()
        time.sleep(2.0)  # refused meanwhile: before, it had exited 1 by now
        assert proc.poll() is None
        holder.release("held")
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert json.loads(out.splitlines()[-1])["generated_token_ids"] == solo.greedy(0, 8)
        assert time.monotonic() - started >= 2.0
        holder.close()
    finally:
        mesh.close()


def test_a_prompt_longer_than_the_meshs_context_names_the_nodes_setting(mesh):
    """Through a mesh the error said "raise --n-ctx", a flag generate refuses with --tracker."""
    mesh.start_nodes([("short-context", "0:30", ["--n-ctx", "32"])])
    r = run_generate(mesh.tracker, "word " * 60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "tokens but the context holds 32; shorten it or raise the nodes' --n-ctx (meshnet node --n-ctx)" \
        in r.stderr, r.stderr
