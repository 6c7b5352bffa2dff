"""`meshnet generate --tracker` ended by a signal mid-answer: Ctrl-C (SIGINT) and SIGTERM (`timeout`, `kill`,
systemd, docker stop) release the session on every node, exit 130 and 143, and --json still ends with the
object."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

from solo_reference import PROMPTS


def test_sigint_and_sigterm_release_the_session_on_every_node_and_json_ends_with_the_object(mesh, solo):
    """A SIGTERM killed generate on the spot (143, from the kernel): its session stayed open on every node,
    its KV cells reserved until the nodes' idle timeout, and --json's last line was the answer's partial
    text. Ctrl-C released the session but printed no object either."""
    nodes = mesh.start_nodes([("a-head", "0:15"), ("b-tail", "15:30")])
    for sig, code in ((signal.SIGTERM, 143), (signal.SIGINT, 130)):
        proc = subprocess.Popen([sys.executable, "-m", "meshnet.cli", "generate", "--tracker", mesh.tracker,
                                 "--temperature", "0", "--json", "--ignore-eos", "--max-tokens", "400", PROMPTS[0]],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0)  # read(1): one byte
        try:
            first = proc.stdout.read(1)
            assert first, proc.stderr.read().decode()  # the answer has begun
            assert [n.active_sessions() for n in nodes] == [1, 1]
            proc.send_signal(sig)
            out, err = proc.communicate(timeout=60)
            out, err = (first + out).decode(), err.decode()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == code, (sig.name, proc.returncode, err[-2000:])
        assert "Traceback" not in err, err[-2000:]
        if sig == signal.SIGTERM:  # as a bench stopped by it says
            assert err.splitlines()[-1] == "meshnet generate: stopped by SIGTERM", err[-2000:]
        # released before the process ended, on every node: not left to their 300 s idle timeout
        assert [n.active_sessions() for n in nodes] == [0, 0], sig.name
        line = out.splitlines()[-1]
        last = json.loads(line)
        assert out.endswith("\n" + line + "\n")  # the text's line ended first: the object has a line of its own
        assert (last["finish_reason"], last["signal"]) == ("interrupted", sig.name)
        ids = last["generated_token_ids"]
        assert 1 <= len(ids) < 400 and ids[:64] == solo.greedy(0)[:len(ids)]
        assert last["text"] == out[:-len(line) - 2]  # what was printed before the signal
        assert last["prompt_token_ids"] == solo.prompt_ids(0)
        assert last["layers"] == [f"{n.node_id}@{n.address}" for n in nodes] and last["failovers"] == 0
        assert last["timings"]["ttft_s"] > 0
