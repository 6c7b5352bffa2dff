"""``meshnet bench wan``: its latency model, plan and report with plain data, and one short run across
network namespaces (skipped, saying why, where namespaces cannot be made)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from meshnet.bench.llama_rpc import llama_bench_argvs, summarize
from meshnet.bench.wan_model import CLIENT, FORWARDING, LLAMA_RPC, NGRAM, client_options, decode_legs, \
    fitted_legs, parse_modes, parse_rtts, predict, tensor_split, ttft_legs
from meshnet.bench.wan_report import analyze, format_table


def test_rtts_and_modes_parse_and_refuse_nonsense():
    assert parse_rtts("0, 10,25,50") == [0.0, 10.0, 25.0, 50.0]
    for bad in ("", "-5", "10,10"):
        with pytest.raises(ValueError):
            parse_rtts(bad)
    assert parse_modes("llama.cpp-rpc,client-orchestrated") == [CLIENT, LLAMA_RPC]
    with pytest.raises(ValueError, match="unknown mode"):
        parse_modes("client-orchestrated,carrier-pigeon")


def test_client_options_select_forwarding_for_the_node_to_node_modes():
    assert client_options(CLIENT) == {"forwarding": False}
    assert client_options(FORWARDING) == client_options(NGRAM) == {"forwarding": True}
    with pytest.raises(ValueError, match="llama"):
        client_options(LLAMA_RPC)


def test_legs_per_mode_for_three_stages():
    assert [decode_legs(m, 3) for m in (CLIENT, FORWARDING, NGRAM, LLAMA_RPC)] == [6, 4, 4, 6]
    assert [ttft_legs(m, 3) for m in (CLIENT, FORWARDING, NGRAM, LLAMA_RPC)] == [8, 6, 6, 6]
    assert decode_legs(CLIENT, 1) == 2 and decode_legs(FORWARDING, 1) == 2


def test_prediction_adds_legs_times_the_one_way_delay():
    # 50 tok/s alone is 20 ms a token; 6 legs of 12.5 ms add 75 ms: 95 ms, 10.53 tok/s.
    p = predict(25.0, 6, 8, base_tokens_per_s=50.0, base_ttft_s=0.1)
    assert p.tokens_per_s == pytest.approx(1 / 0.095)
    assert p.ttft_s == pytest.approx(0.2)
    assert predict(0.0, 6, 8, 50.0, 0.1).tokens_per_s == pytest.approx(50.0)
    # Four tokens accepted per speculative round pay the round's legs once.
    assert predict(50.0, 4, 6, 50.0, 0.1, tokens_per_round=4).tokens_per_s == pytest.approx(1 / 0.045)


def test_fitted_legs_recover_the_slope():
    points = [(rtt, 0.017 + 6 * rtt / 2000) for rtt in (0, 10, 25, 50)]
    assert fitted_legs(points) == pytest.approx(6.0)
    assert fitted_legs([(25, 0.1), (25, 0.2)]) is None


def _llama_layer_devices(split: str, n_layer: int) -> list[int]:
    """llama.cpp's rule (llama_model_base::load_tensors), float32 as there: layer il -> the first device
    whose cumulative split fraction exceeds il / (n_layer + 1)."""
    w = np.array([float(x) for x in split.split("/")], dtype=np.float32)
    cum = np.cumsum(w, dtype=np.float32) / np.float32(w.sum())
    act = n_layer + 1
    return [int(np.searchsorted(cum, np.float32(il) / np.float32(act), side="right")) for il in range(act)]


@pytest.mark.parametrize("ranges,n_layer", [([(0, 12), (12, 25), (25, 30)], 30),
                                            ([(0, 10), (10, 20), (20, 30)], 30),
                                            ([(0, 7), (7, 18)], 18), ([(0, 5), (5, 9), (9, 20), (20, 26)], 26)])
def test_tensor_split_puts_each_range_and_the_output_on_its_device(ranges, n_layer):
    split = tensor_split(ranges, n_layer)
    devices = _llama_layer_devices(split, n_layer)
    want = [i for i, (s, e) in enumerate(ranges) for _ in range(s, e)] + [len(ranges) - 1]  # output: last
    assert devices == want
    if ranges[-1] == (25, 30):
        assert split == "12/13/6"


def test_tensor_split_refuses_ranges_that_do_not_tile():
    with pytest.raises(ValueError):
        tensor_split([(0, 12), (13, 30)], 30)
    with pytest.raises(ValueError):
        tensor_split([(0, 12), (12, 25)], 30)


def test_llama_bench_runs_and_summary():
    argvs = llama_bench_argvs("llama-bench", "m.gguf", ["10.78.0.3:50052", "10.78.0.4:50052"], "12/19",
                              [46, 138], 64, 92, 3, 1)
    assert len(argvs) == 2
    assert argvs[0][argvs[0].index("--rpc") + 1] == "10.78.0.3:50052,10.78.0.4:50052"
    assert argvs[0][argvs[0].index("-p") + 1] == "46,138" and argvs[0][argvs[0].index("-n") + 1] == "0"
    assert argvs[1][argvs[1].index("-d") + 1] == "92" and argvs[1][argvs[1].index("-n") + 1] == "64"
    tests = [{"n_prompt": 46, "n_gen": 0, "n_depth": 0, "avg_ns": 2.0e8, "avg_ts": 230.0},
             {"n_prompt": 138, "n_gen": 0, "n_depth": 0, "avg_ns": 5.5e8, "avg_ts": 250.0},
             {"n_prompt": 0, "n_gen": 64, "n_depth": 92, "avg_ns": 6.4e8, "avg_ts": 100.0, "samples_ts": [99.0, 101.0]}]
    s = summarize(tests, [46, 138], 64)
    assert s == {"ttft_s": {46: 0.2, 138: 0.55}, "decode_tokens_per_s": 100.0, "decode_runs": [99.0, 101.0],
                 "depth": 92}
    with pytest.raises(ValueError, match="32-token"):
        summarize(tests, [46, 138], 32)
    # one generation test a round: the median of their tokens/s, every run kept in order
    rounds = tests + [{"n_prompt": 0, "n_gen": 64, "n_depth": 92, "avg_ns": 8.0e8, "avg_ts": 80.0, "samples_ts": [80.0]},
                      {"n_prompt": 0, "n_gen": 64, "n_depth": 92, "avg_ns": 5.8e8, "avg_ts": 110.0, "samples_ts": [110.0]}]
    s = summarize(rounds, [46, 138], 64)
    assert s["decode_tokens_per_s"] == 100.0 and s["decode_runs"] == [99.0, 101.0, 80.0, 110.0]


def _measured() -> dict:
    fig = lambda rate, ttft, ids=None: {"decode_tokens_per_s": rate, "ttft_s": ttft,  # noqa: E731
                                        **({} if ids is None else {"ids": ids})}
    return {"stages": 3, "rtt_ms": [0.0, 25.0], "prompts": {"prose": {"tokens": 46}},
            "modes": {CLIENT: {"rtts": {"0": {"prose": fig(50.0, 0.1, [1, 2, 3])},
                                        "25": {"prose": fig(10.0, 0.21, [1, 2, 3])}}},
                      FORWARDING: {"rtts": {"0": {"prose": fig(50.0, 0.1, [1, 2, 3])},
                                            "25": {"prose": fig(15.0, 0.18, [1, 2, 4])}}},
                      NGRAM: {"skipped": "no speculative option"},
                      LLAMA_RPC: {"rtts": {"0": {"prose": fig(100.0, 0.2)}, "25": {"prose": fig(11.0, 0.3)}}}}}


def test_report_puts_the_model_beside_each_figure_and_checks_greedy_identity():
    r = analyze(_measured())
    client = r["modes"][CLIENT]
    assert client["legs"] == 6 and client["ttft_legs"] == 8
    assert client["rtts"]["25"]["prose"]["model"] == {"decode_tokens_per_s": round(1 / 0.095, 2), "ttft_s": 0.2}
    assert client["fitted_legs"]["prose"] == pytest.approx((0.1 - 0.02) / 0.0125, abs=0.01)
    assert client["fitted_ttft_legs"]["prose"] == pytest.approx(8.8, abs=0.01)
    assert client["rtts"]["25"]["prose"]["ids_match"] is True
    assert r["modes"][FORWARDING]["rtts"]["25"]["prose"]["ids_match"] is False
    assert "ids_match" not in r["modes"][LLAMA_RPC]["rtts"]["25"]["prose"]
    assert r["ratios"]["25"]["prose"] == {"node-to-node/client-orchestrated": 1.5, "ngram/node-to-node": None,
                                          "meshnet-best/llama.cpp-rpc": round(15 / 11, 3)}
    table = format_table(r)
    assert "node-to-node+ngram: skipped: no speculative option" in table
    row = next(line for line in table.splitlines() if line.split()[:2] == ["25", CLIENT])
    assert row.split()[3:8] == ["10.0", "(10.5)", "210", "(200)", "6/8"]
    assert "NO" in next(line for line in table.splitlines() if line.split()[:2] == ["25", FORWARDING])
    assert "(goal node-to-node >= 1.3x)" in table



def test_meshnet_modes_take_turns_run_by_run_and_each_gets_its_median():
    from argparse import Namespace
    from types import SimpleNamespace

    from meshnet.bench.wan_bench import _measure_meshnet

    asked = []

    def ask(op, timeout_s, mode, prompt_ids, n, repeats, link):
        asked.append((mode, prompt_ids[0]))
        speed = 10.0 * len(asked)  # the machine's speed drifts up run by run
        return {"runs": [{"ttft_s": 0.1, "decode_tokens_per_s": speed, "ids": [7], "failovers": 0}]}

    mesh = SimpleNamespace(agent=SimpleNamespace(ask=ask))
    figs = _measure_meshnet(mesh, [CLIENT, FORWARDING], {"a": [1], "b": [2]}, 25.0,
                            Namespace(repeats=3, max_tokens=8), lambda r: asked.append((LLAMA_RPC, r)))
    assert asked == [(CLIENT, 1), (CLIENT, 2), (FORWARDING, 1), (FORWARDING, 2), (LLAMA_RPC, 0),
                     (CLIENT, 1), (CLIENT, 2), (FORWARDING, 1), (FORWARDING, 2), (LLAMA_RPC, 1),
                     (CLIENT, 1), (CLIENT, 2), (FORWARDING, 1), (FORWARDING, 2), (LLAMA_RPC, 2)]
    assert figs[CLIENT]["a"]["decode_runs"] == [10.0, 60.0, 110.0]
    assert figs[FORWARDING]["b"]["decode_runs"] == [40.0, 90.0, 140.0]
    assert figs[FORWARDING]["b"]["decode_tokens_per_s"] == 90.0


def test_llama_cpp_runs_one_generation_test_a_round_and_its_prompt_tests_once(monkeypatch):
    from argparse import Namespace

    from meshnet.bench import llama_rpc
    from meshnet.bench.wan_bench import _LlamaRounds

    ran = []

    def run(mesh, argvs, timeout_s):
        ran.append([(a[a.index("-n") + 1], a[a.index("-r") + 1]) for a in argvs])
        tests = []
        for a in argvs:
            if a[a.index("-n") + 1] == "0":
                tests += [{"n_prompt": 4, "n_gen": 0, "avg_ns": 1e8, "avg_ts": 40.0},
                          {"n_prompt": 6, "n_gen": 0, "avg_ns": 2e8, "avg_ts": 30.0}]
            else:
                tests.append({"n_prompt": 0, "n_gen": 8, "n_depth": 5, "avg_ns": 1e8, "avg_ts": 50.0 + 10 * len(ran),
                              "samples_ts": [50.0 + 10 * len(ran)]})
        return tests

    monkeypatch.setattr(llama_rpc, "run_llama_bench", run)
    llama = _LlamaRounds(object(), ("rpc-server", "llama-bench"), ["10.78.0.3:50052"], "30", "m.gguf",
                         {"a": [1, 2, 3, 4], "b": [1, 2, 3, 4, 5, 6]}, Namespace(repeats=3, max_tokens=8))
    for r in range(3):
        llama(r)
    assert ran == [[("0", "3"), ("8", "1")], [("8", "1")], [("8", "1")]]
    figs = llama.figures(25.0)
    assert figs["a"] == {"decode_tokens_per_s": 70.0, "ttft_s": 0.1, "decode_runs": [60.0, 70.0, 80.0], "depth": 5}
    assert figs["b"]["ttft_s"] == 0.2 and llama.tests == []  # the next RTT starts from its own rounds


@pytest.mark.netns
@pytest.mark.long  # 17 s; the netns mesh tests cover forwarding across namespaces in the default run
def test_wan_bench_runs_across_namespaces_and_the_rtt_costs_the_legs(tmp_path):
    from meshnet.netem.namespaces import NetnsUnavailable, probe

    try:
        probe()
    except NetnsUnavailable as e:
        pytest.skip(f"network namespaces unavailable: {e}")
    from meshnet.cli import main

    out = tmp_path / "wan.json"
    assert main(["bench", "wan", "--rtt-ms", "0,40", "--modes", "client-orchestrated,node-to-node",
                 "--max-tokens", "8", "--repeats", "1", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    client = r["modes"][CLIENT]
    fast, slow = (client["rtts"][k]["prose"]["decode_tokens_per_s"] for k in ("0", "40"))
    # Six 20 ms legs a token: at most 1/0.12 tok/s at 40 ms RTT, whatever the compute.
    assert slow < 1 / 0.12 < fast
    assert 5.0 <= client["fitted_legs"]["prose"] <= 9.0
    assert all(client["rtts"][k][p]["ids_match"] for k in ("0", "40") for p in r["prompts"])
    assert r["modes"][FORWARDING].get("skipped") or r["modes"][FORWARDING]["rtts"]["40"]["prose"]["ids_match"]



@pytest.mark.netns
@pytest.mark.slow  # about 10 s: three nodes load before the signal
def test_sigterm_stops_every_process_and_removes_the_namespaces(tmp_path):
    """SIGTERM (`timeout`, `kill`) ended the bench on the spot: its nodes ran on, in namespaces left behind.
    Now it cleans up as Ctrl-C does: exit 143, one line, no process of its tree and no namespace left."""
    import signal
    import subprocess

    from mesh_util import left_running, sigterm_bench

    from meshnet.netem.namespaces import NetnsUnavailable, probe, remove_stale

    try:
        probe()
    except NetnsUnavailable as e:
        pytest.skip(f"network namespaces unavailable: {e}")

    def nodes_up(tree):  # each of the 3 nodes and its engine worker process run
        return sum("--node-id" in argv for argv in tree.values()) == 3 and \
            sum("meshnet.node.engine_worker" in argv for argv in tree.values()) == 3

    out = tmp_path / "wan.json"
    proc, err, tree = sigterm_bench(["wan", "--rtt-ms", "0", "--modes", "node-to-node", "--repeats", "1",
                                     "--max-tokens", "4", "--out", str(out)], nodes_up)
    # The engine workers end on their own once their node is gone (SIGTERM from the kernel, then a drain).
    left = left_running(tree, grace_s=10)
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    remove_stale()  # a failure here leaves no namespace behind either
    assert left == []
    assert [n for n in names if n.startswith(f"mnet-{proc.pid}-")] == []
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.splitlines()[-1] == "meshnet bench wan: stopped by SIGTERM" and "Traceback" not in err
    assert not out.exists()
