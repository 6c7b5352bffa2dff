"""How long a stream stops when a failover replays 200 tokens of history: the 157-token golden prompt and
43 generated tokens, then the head node is killed, so the new head rebuilds the session (the prompt as one
prefill step, then 43 decode steps; the tail keeps its cache). The ids still equal the solo run; the pause
(from the token before the kill to the token after it) is printed as a figure, not asserted: the
machine is shared and timings are noisy."""

from __future__ import annotations

import time

import pytest

from meshnet.contract import GREEDY
from meshnet.generation import Generation

HISTORY = 200


@pytest.mark.slow
def test_failover_replaying_200_tokens_of_history_keeps_the_ids(mesh, tok, solo):
    prompt = solo.prompt_ids(1)
    kill_after = HISTORY - len(prompt) + 1  # tokens received: the KV then holds HISTORY positions
    nodes = mesh.start_nodes([("a-head", "0:15"), ("b-head", "0:15"), ("d-tail", "15:30")])
    client = mesh.client()
    _, route = client.route()
    victim = next(n for n in nodes if n.node_id == route[0].node_id)
    gen = Generation(client, tok, prompt, 64, GREEDY, stop_at_eog=False)
    stamps = []
    for i, _ in enumerate(gen, start=1):
        stamps.append(time.monotonic())
        if i == kill_after:
            victim.kill()
    assert gen.result.generated_token_ids == solo.greedy(1)
    assert client.failovers == 1
    steps = [b - a for a, b in zip(stamps, stamps[1:])]
    pause = steps[kill_after - 1]
    usual = sorted(steps)[len(steps) // 2]
    print(f"\nreplay of {HISTORY} tokens of history on the new head: the stream paused {pause:.2f}s "
          f"(a decode step takes {usual * 1000:.0f} ms here)")
    client.close()
    assert [n.active_sessions() for n in nodes if n is not victim] == [0, 0]
