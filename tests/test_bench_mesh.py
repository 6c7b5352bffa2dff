"""``meshnet bench mesh`` end to end with tiny settings: real node processes, a JSON with real figures.

Speed is machine- and load-dependent, so only the structure and the sanity of the values are checked,
never the ratios against their goals.
"""

from __future__ import annotations

import argparse
import json

import pytest

from meshnet.bench.mesh_bench import add_mesh_bench_parser, run_mesh_bench
from meshnet.model.bundled import ModelNotFound, resolve_model


def _parser() -> argparse.ArgumentParser:
    """``meshnet bench``'s parser with the mesh benchmark; skips the test without the bundled model."""
    try:
        resolve_model("smollm2")
    except ModelNotFound as e:
        pytest.skip(str(e))
    parser = argparse.ArgumentParser()
    add_mesh_bench_parser(parser.add_subparsers())
    return parser


def test_bench_mesh_writes_figures(tmp_path):
    parser = _parser()
    out = tmp_path / "mesh.json"
    args = parser.parse_args(["mesh", "--stages", "2", "--prompt-tokens", "16", "--decode-tokens", "4",
                              "--repeats", "1", "--out", str(out)])
    assert args.func is run_mesh_bench
    assert run_mesh_bench(args) == 0

    d = json.loads(out.read_text())
    assert d["benchmark"] == "mesh" and d["stages"] == 2 and d["prompt_tokens"] == 16
    assert d["machine"]["cpus"] >= 1 and d["machine"]["platform"]

    single, mesh, pipe = d["single_process"], d["mesh"], d["pipeline"]
    for fig in (single, mesh):
        assert fig["ttft_s"] > 0 and fig["decode_tokens_per_s"] > 0
    # The split `meshnet up --stages 2` uses: by decode cost, the tail's output projection included.
    assert mesh["layers"] == ["0:19", "19:30"]
    # Same prompt, greedy, same kernels and batch shapes: the mesh must generate what one process does.
    assert mesh["outputs_match_single_process"] is True

    hops = mesh["per_hop"]
    assert len(hops) == 2
    for i, h in enumerate(hops):
        assert h["hop"] == i and h["layers"] == mesh["layers"][i]
        assert h["decode_steps"] == 4  # one decode per measured step reached every node
        assert h["rpc_mean_ms"] > 0 and h["rpc_p50_ms"] > 0 and h["compute_mean_ms"] > 0
        assert h["overhead_mean_ms"] == pytest.approx(h["rpc_mean_ms"] - h["compute_mean_ms"], abs=0.002)
    rtt = mesh["loopback_rtt"]
    assert rtt["echo_payload_bytes"] == d["n_embd"] * 4
    assert rtt["echo"]["mean_ms"] > 0 and rtt["health"]["p50_ms"] > 0

    assert pipe["sessions"] == 2 and len(pipe["layers"]) == 2
    assert pipe["aggregate_tokens_per_s"] > 0
    assert pipe["single"]["decode_tokens_per_s"] > 0 and pipe["single"]["layers"] == ["0:30"]

    ratios = d["ratios"]
    assert set(ratios) == {"mesh_vs_single_decode", "mesh_vs_single_ttft", "pipeline_speedup"}
    assert all(v > 0 for v in ratios.values())
    assert any("while session A is on node 2, session B runs on node 1" in n for n in d["notes"])


def test_a_stage_count_the_model_cannot_split_into_fails_before_anything_runs(tmp_path, capsys):
    """`--stages 99` ran the single-process measurement first and failed only when it came to the mesh."""
    parser = _parser()
    args = parser.parse_args(["mesh", "--stages", "99", "--out", str(tmp_path / "mesh.json")])
    with pytest.raises(ValueError, match=r"^--stages 99: the model has 30 layers, so give 1 to 30 stages$"):
        run_mesh_bench(args)
    assert "[bench mesh] single process" not in capsys.readouterr().err
    assert not (tmp_path / "mesh.json").exists()


def test_the_bench_nodes_do_not_take_a_join_token_from_the_environment(monkeypatch):
    """A bench's tracker and client run in its own process without a token; its nodes took
    $MESHNET_JOIN_TOKEN from the environment and refused them (UNAUTHENTICATED, then MeshUnavailable)."""
    from contextlib import ExitStack

    from meshnet.bench.engine_bench import greedy_run
    from meshnet.bench.node_procs import NodeSpec, start_mesh
    from meshnet.client.mesh_client import MeshClient
    from meshnet.contract import LayerRange

    try:
        model = str(resolve_model("smollm2"))
    except ModelNotFound as e:
        pytest.skip(str(e))
    monkeypatch.setenv("MESHNET_JOIN_TOKEN", "secret")
    with ExitStack() as stack:
        tracker, nodes = start_mesh(stack, model, 256, [NodeSpec("n0", LayerRange(0, 30), 1,
                                                                  extra_args=("--engine", "fake"))])
        client = MeshClient(tracker)
        stack.callback(client.close)
        run = greedy_run(client, [1, 2, 3, 4], 3)
    assert len(run.tokens) == 4  # the prefill's token and 3 decoded, through the node
