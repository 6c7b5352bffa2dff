"""Speculative decoding through a mesh of node processes (forwarded steps): greedy output equals
plain in-process decoding token for token, also when a node dies in the middle of a speculative run and
the client replays the session's steps, verification and rollback steps included, onto a spare."""

from __future__ import annotations

from meshnet.chat_template import chat_prompt_ids
from meshnet.contract import GREEDY, LayerRange
from meshnet.generation import Generation, generate
from meshnet.local_mesh import load_local_chain
from meshnet.speculative import Speculation
from test_speculative_ggml import JSON_EDIT, PROSE


def test_speculative_mesh_equals_plain_also_across_a_killed_node(mesh, tok, smollm2_path):
    prompts = {name: chat_prompt_ids(tok, [{"role": "user", "content": text}])
               for name, text in (("json", JSON_EDIT), ("prose", PROSE))}
    local = load_local_chain(str(smollm2_path), [LayerRange(0, 30)], n_threads=2, progress=False)
    want = {name: generate(local, tok, ids, 64, GREEDY, stop_at_eog=False).generated_token_ids
            for name, ids in prompts.items()}
    head, mid, spare, tail = mesh.start_nodes([("a-head", "0:12"), ("b-mid", "12:25"), ("c-spare", "12:25"),
                                               ("d-tail", "25:30")])
    client = mesh.client(failover_deadline_s=30.0)
    prose = generate(client, tok, prompts["prose"], 64, GREEDY, stop_at_eog=False, speculation=Speculation(6, adaptive=False))
    assert prose.generated_token_ids == want["prose"] and prose.verify_steps > 0
    assert client.failovers == 0

    _, route = client.route()
    victim = mid if mid.node_id in {h.node_id for h in route} else spare
    gen = Generation(client, tok, prompts["json"], 64, GREEDY, stop_at_eog=False, speculation=Speculation(6, adaptive=False))
    for i, _ in enumerate(gen):
        if i + 1 == 24:
            # by now the session's log holds verification steps and rollbacks: the replay must redo both
            assert gen.result.drafted > gen.result.accepted > 0
            victim.kill()
    r = gen.result
    assert r.generated_token_ids == want["json"]
    assert client.failovers == 1
    assert r.accepted > 16, (r.drafted, r.accepted)
    client.close()
    survivors = [n for n in (head, mid, spare, tail) if n is not victim]
    assert [n.active_sessions() for n in survivors] == [0, 0, 0]
