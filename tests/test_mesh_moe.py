"""The tiny MoE models over real node processes on loopback: tiny-qwen3moe split into 2, 3 and 4 stages
(every layer boundary cut at least once), tiny-deepseek2 (MLA, a leading dense layer, grouped sigmoid
routing, shared experts) and tiny-deepseek4 (hyper-connections, hash routing, compressed caches) into 2
and 4, and a middle node killed mid-generation with a spare taking over,
forwarded node to node and orchestrated by the client. Every run gives llama.cpp's greedy ids and the
in-process run's."""

from __future__ import annotations

import pytest

from conftest import golden_exact, load_golden, moe_model_path
from golden_check import assert_greedy_matches
from meshnet.contract import GREEDY
from meshnet.generation import Generation
from meshnet.membership.cli import node_load
from meshnet.model.gguf_file import open_gguf
from meshnet.tokenizer import GGUFTokenizer
from solo_reference import SoloReference

N_GEN = 64


@pytest.fixture(scope="module")
def moe_models():
    """``get(name) -> (path, tokenizer, the in-process one-stage run of the golden prompts)``, what every
    mesh run of that model must equal; each computed once for the module."""
    cache = {}

    def get(name: str):
        if name not in cache:
            path = moe_model_path(name)
            tok = GGUFTokenizer.from_gguf(str(path))
            cache[name] = path, tok, SoloReference(path, tok)
        return cache[name]

    return get


def _generate(client, tok, prompt_ids, n: int = N_GEN, kill=None, after: int = 10) -> list[int]:
    """``n`` greedy ids through ``client``; ``kill()`` runs after token ``after``."""
    gen = Generation(client, tok, prompt_ids, n, GREEDY, stop_at_eog=False)
    for i, _ in enumerate(gen):
        if kill is not None and i + 1 == after:
            kill()
    return gen.result.generated_token_ids


# Each layer boundary (1, 2, 3) is cut by at least one split, and the 4-stage one cuts them all; steps are
# forwarded node to node (the client's default) except in the one orchestrated by the client hop by hop.
# deepseek2 runs the two splits that cut every boundary between them (its layer 0 is the dense one).
SPLITS = [
    pytest.param("tiny-qwen3moe", ["0:2", "2:4"], True, id="qwen3moe-2-stage-forwarded"),
    pytest.param("tiny-qwen3moe", ["0:1", "1:3", "3:4"], True, id="qwen3moe-3-stage-forwarded"),
    pytest.param("tiny-qwen3moe", ["0:1", "1:3", "3:4"], False, id="qwen3moe-3-stage-orchestrated"),
    pytest.param("tiny-qwen3moe", ["0:1", "1:2", "2:3", "3:4"], True, id="qwen3moe-4-stage-forwarded"),
    pytest.param("tiny-deepseek2", ["0:2", "2:4"], True, id="deepseek2-2-stage-forwarded"),
    pytest.param("tiny-deepseek2", ["0:1", "1:2", "2:3", "3:4"], True, id="deepseek2-4-stage-forwarded"),
    # deepseek4: hash-routed blocks 0-2 past the head (their stages get the token ids), the compressed
    # blocks 2 (ratio 4) and 3 (ratio 128) on either side of a cut, 4 streams across every boundary
    pytest.param("tiny-deepseek4", ["0:2", "2:4"], True, id="deepseek4-2-stage-forwarded", marks=pytest.mark.long),
    pytest.param("tiny-deepseek4", ["0:1", "1:2", "2:3", "3:4"], True, id="deepseek4-4-stage-forwarded",
                 marks=pytest.mark.long),
]


def _range_bytes(path, start: int, end: int, n_layer: int = 4) -> int:
    """Bytes of the GGUF's tensors a stage over ``[start, end)`` holds: its layers' ``blk.*``, the token
    embedding on the head, the output norm and head on the tail."""
    total = 0
    for t in open_gguf(path).tensors:
        if t.name.startswith("blk."):
            held = start <= int(t.name.split(".")[1]) < end
        else:
            held = (t.name == "token_embd.weight" and start == 0) or (t.name.startswith("output") and end == n_layer)
        total += int(t.n_bytes) if held else 0
    return total


@pytest.mark.parametrize("name, ranges, forwarding", SPLITS)
def test_moe_mesh_split_equals_golden_and_in_process(mesh, moe_models, name, ranges, forwarding):
    """64 greedy ids of every golden prompt through a mesh of node processes: the in-process run's, id for
    id, and llama.cpp's (every id with goldens made on these CPU features, else the golden's rule 3)."""
    path, moe_tok, moe_solo = moe_models(name)
    golden = load_golden(name)
    nodes = mesh.start_nodes([(f"{chr(97 + i)}-{r.replace(':', '-')}", r) for i, r in enumerate(ranges)],
                             str(path))
    client = mesh.client(forwarding=forwarding)
    for i, p in enumerate(golden["prompts"]):
        assert p["prompt_ids"] == moe_solo.prompt_ids(i)
        out = _generate(client, moe_tok, p["prompt_ids"])
        assert out == moe_solo.greedy(i), f"prompt {i}"
        assert_greedy_matches(golden, i, out, golden_exact())
    assert client.failovers == 0
    client.close()
    assert [n.active_sessions() for n in nodes] == [0] * len(ranges)
    # What `meshnet nodes` shows per node: the bytes of its own range's tensors, no more.
    loads = [node_load(n.address, None, None, timeout_s=5) for n in nodes]
    want = [_range_bytes(path, *map(int, r.split(":"))) for r in ranges]
    assert [x["weight_bytes"] for x in loads] == want
    assert sum(want) == sum(int(t.n_bytes) for t in open_gguf(path).tensors)


@pytest.mark.parametrize("name, forwarding", [
    pytest.param(name, fwd, id=f"{'forwarded' if fwd else 'orchestrated'}-{name}",
                 marks=[pytest.mark.long] if (name, fwd) == ("tiny-deepseek4", False) else [])
    for name in ("tiny-qwen3moe", "tiny-deepseek2", "tiny-deepseek4") for fwd in (True, False)])
def test_moe_kill_middle_node_with_spare_equals_uninterrupted_run(mesh, moe_models, name, forwarding):
    """A 3-stage mesh 0:1, 1:3, 3:4 with a spare for 1:3: the middle node in the route dies after token 10;
    the client fails over to the spare, replays the session (deepseek2: its latent KV cells; deepseek4:
    the K=V cells, and block 2's compressor cells, compressed rows and indexer rows, which the spare
    rebuilds from the replayed steps), and the 64 ids equal the uninterrupted run."""
    path, moe_tok, moe_solo = moe_models(name)
    golden = load_golden(name)
    nodes = mesh.start_nodes([("a-head", "0:1"), ("b-mid", "1:3"), ("c-spare", "1:3"), ("d-tail", "3:4")],
                             str(path))
    head, mid, spare, tail = nodes
    client = mesh.client(forwarding=forwarding)
    _, route = client.route()
    victim = mid if mid.node_id in {h.node_id for h in route} else spare
    prompt = 1  # the long prompt: the replay re-runs its prefill on the spare
    out = _generate(client, moe_tok, moe_solo.prompt_ids(prompt), kill=victim.kill)
    assert out == moe_solo.greedy(prompt)
    assert_greedy_matches(golden, prompt, out, golden_exact())
    assert client.failovers == 1
    client.close()
    assert [n.active_sessions() for n in nodes if n is not victim] == [0, 0, 0]
