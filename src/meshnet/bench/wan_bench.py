"""``meshnet bench wan``: decode tokens/s and TTFT across emulated wide-area links, for each way of running
a 3-stage pipeline, at each RTT, in one run.

The client, the tracker and each stage run in network namespaces of their own, every connection through
the user-space link emulator (:mod:`meshnet.netem.netns_mesh`), every link the same RTT (changed between
rounds for open connections too). Stages are ``meshnet node`` processes (1 thread each) serving the
model's balanced ranges (SmolLM2: ``0:12, 12:25, 25:30``); for llama.cpp's RPC mode a
``ggml-rpc-server`` beside each node holds the same ranges (:mod:`meshnet.bench.llama_rpc`).

Modes (``--modes``): ``client-orchestrated`` (every hop through the client), ``node-to-node`` (stages
forward to each other), ``node-to-node+ngram`` (the same with n-gram drafts verified in one round),
``llama.cpp-rpc`` (skipped, with the reason, when its binaries are missing). Two chat prompts: a
repetitive one (copy a JSON object with one field changed) and free prose; greedy, ``--max-tokens``
tokens each, not stopping at end-of-generation; the modes take turns run by run (llama.cpp's RPC
generation test too: one ``llama-bench -r 1`` after each round of the meshnet modes). Beside each
figure, the latency model (:mod:`meshnet.bench.wan_model`). Needs root and ``ip netns``; exits 2 saying
why otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Callable

from meshnet.arg_types import generated_tokens, positive_int, positive_number, refusing, results_file
from meshnet.bench import llama_rpc
from meshnet.bench.wan_model import LLAMA_RPC, MESHNET_MODES, NGRAM, parse_modes, parse_rtts, tensor_split
from meshnet.bench.wan_report import analyze, format_table, rtt_key

PROMPTS = {
    # A config edit, laid out as the model lays JSON out: SmolLM2 copies it line for line (the same object on
    # one line it re-indents, which leaves prompt lookup a few tokens a line).
    "repetitive": ("Repeat this JSON object exactly, changing only the value of \"port\" to 8081:\n"
                   + json.dumps({"name": "edge-proxy", "host": "10.0.0.12", "port": 8080, "protocol": "https",
                                 "timeout_ms": 3000, "retries": 3, "log_level": "info", "cache": True,
                                 "region": "eu-west-1", "owner": "platform-team"}, indent=2)),
    "prose": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def add_wan_bench_parser(bench_subparsers) -> None:
    """Add ``wan`` to ``meshnet bench``'s subcommands."""
    p = bench_subparsers.add_parser("wan", help="3 stages in network namespaces over emulated WAN links: decode "
                                                "tokens/s and TTFT per mode and RTT, with the latency model")
    p.add_argument("--rtt-ms", type=refusing(parse_rtts), default="0,10,25,50",
                   help="comma-separated RTTs of every link, milliseconds (include 0: the model's compute time "
                        "comes from it)")
    p.add_argument("--modes", type=refusing(parse_modes),
                   default="client-orchestrated,node-to-node,node-to-node+ngram,llama.cpp-rpc")
    p.add_argument("--max-tokens", type=generated_tokens, default=64, help="tokens generated per run")
    p.add_argument("--repeats", type=positive_int, default=3, help="runs per figure; the median is reported")
    p.add_argument("--stages", type=positive_int, default=3)
    p.add_argument("--bandwidth-mbit", type=positive_number, default=None,
                   help="each link's bandwidth per direction (default: unlimited)")
    p.add_argument("--in-process-engine", action="store_true",
                   help="run each meshnet node's engine in the node process (meshnet node --in-process-engine: "
                        "no engine worker to hand steps to) rather than in its supervised worker")
    p.add_argument("--out", type=results_file, default="bench-results/wan.json")
    p.set_defaults(func=run_wan_bench)


def _prompt_ids(model: str) -> dict[str, list[int]]:
    from meshnet.chat_template import chat_prompt_ids
    from meshnet.tokenizer import GGUFTokenizer

    tok = GGUFTokenizer.from_gguf(model)
    return {name: chat_prompt_ids(tok, [{"role": "user", "content": text}]) for name, text in PROMPTS.items()}


def _median_figure(runs: list[dict]) -> dict:
    fig = {"decode_tokens_per_s": round(statistics.median(r["decode_tokens_per_s"] for r in runs), 2),
           "ttft_s": round(statistics.median(r["ttft_s"] for r in runs), 4),
           "decode_runs": [round(r["decode_tokens_per_s"], 2) for r in runs],
           "ttft_runs": [round(r["ttft_s"], 4) for r in runs],
           "failovers": sum(r["failovers"] for r in runs), "ids": runs[-1]["ids"]}
    if all("tokens_per_round" in r for r in runs):  # reported by a speculative client
        fig["tokens_per_round"] = statistics.median(r["tokens_per_round"] for r in runs)
        fig["drafted"], fig["accepted"] = sum(r["drafted"] for r in runs), sum(r["accepted"] for r in runs)
    return fig


def _measure_meshnet(mesh, modes: list[str], prompts: dict[str, list[int]], rtt_ms: float, args,
                     between_rounds: Callable[[int], None] | None = None) -> dict:
    """Figures of each meshnet mode on each prompt at this RTT: ``args.repeats`` rounds, each one run of
    every (mode, prompt) in turn, then ``between_rounds(round)`` (llama.cpp's run of that round), so that
    drift in the machine's speed (a shared VM's host takes cycles for tens of seconds) falls on every
    mode alike rather than on whichever ran last."""
    runs: dict[tuple[str, str], list[dict]] = {(m, name): [] for m in modes for name in prompts}
    # Generous: every token can cost the slowest mode's six legs at this RTT, plus compute.
    timeout_s = 120 + args.max_tokens * (0.2 + 0.004 * rtt_ms)
    for r in range(args.repeats):
        for m in modes:
            for name, ids in prompts.items():
                runs[m, name] += mesh.agent.ask("measure", timeout_s, mode=m, prompt_ids=ids, n=args.max_tokens,
                                                repeats=1, link=rtt_ms)["runs"]
        if between_rounds is not None:
            between_rounds(r)
    out: dict[str, dict] = {m: {} for m in modes}
    for (m, name), rs in runs.items():
        out[m][name] = fig = _median_figure(rs)
        print(f"[bench wan] RTT {rtt_ms:g} ms {m} {name}: {fig['decode_tokens_per_s']:.1f} tok/s, "
              f"TTFT {fig['ttft_s'] * 1000:.0f} ms", file=sys.stderr)
    return out


class _LlamaRounds:
    """llama.cpp's RPC split measured in the meshnet modes' rounds: in each, one ``llama-bench`` generation
    test of one run (``-r 1``), so a drift of the machine's speed falls on it as on them (five runs of its
    own back to back at 0 ms gave 57 to 75 tokens/s in one hour, the gap to meshnet moving with it); the
    prompt tests (TTFT) once, in the first round, with ``args.repeats`` runs."""

    def __init__(self, mesh, tools, endpoints: list[str], split: str, model: str, prompts: dict[str, list[int]],
                 args) -> None:
        self.mesh, self.prompts, self.tests = mesh, prompts, []
        self.lens = sorted({len(ids) for ids in prompts.values()})
        depth = round(statistics.mean(self.lens))  # meshnet decodes after its prompt; llama-bench after `depth` cells
        self.n_gen = args.max_tokens

        def argvs(repeats: int) -> list[list[str]]:
            return llama_rpc.llama_bench_argvs(tools[1], model, endpoints, split, self.lens, self.n_gen, depth,
                                               repeats, threads=1)

        self.prompt_argv, self.gen_argv = argvs(args.repeats)[0], argvs(1)[1]

    def __call__(self, round_: int) -> None:
        argvs = [self.prompt_argv, self.gen_argv] if round_ == 0 else [self.gen_argv]
        self.tests += llama_rpc.run_llama_bench(self.mesh, argvs, timeout_s=900)

    def figures(self, rtt_ms: float) -> dict:
        """The figures of this RTT's rounds, one per prompt (its TTFT at its length, the decode median);
        the rounds' tests are cleared for the next RTT."""
        s = llama_rpc.summarize(self.tests, self.lens, self.n_gen)
        self.tests = []
        print(f"[bench wan] RTT {rtt_ms:g} ms {LLAMA_RPC}: {s['decode_tokens_per_s']:.1f} tok/s", file=sys.stderr)
        return {name: {"decode_tokens_per_s": round(s["decode_tokens_per_s"], 2),
                       "ttft_s": round(s["ttft_s"][len(ids)], 4),
                       "decode_runs": [round(x, 2) for x in s["decode_runs"]], "depth": s["depth"]}
                for name, ids in self.prompts.items()}


def run_wan_bench(args: argparse.Namespace) -> int:
    """Run every mode at every RTT, write ``args.out`` (JSON) and print the table. Returns 0, or 2 when
    network namespaces are unavailable here (the reason on stderr)."""
    from meshnet.local_mesh import plan_ranges
    from meshnet.model.bundled import resolve_model
    from meshnet.netem.namespaces import NetnsUnavailable, probe, remove_stale
    from meshnet.netem.netns_mesh import NetMesh

    rtts, modes = args.rtt_ms, args.modes  # lists: parse_rtts and parse_modes are the flags' types
    model = str(resolve_model("smollm2"))
    ranges = plan_ranges(model, args.stages)  # a stage count the model cannot split into fails here, first
    try:
        probe()
    except NetnsUnavailable as e:
        print(f"error: meshnet bench wan needs network namespaces: {e}", file=sys.stderr)
        return 2
    remove_stale()
    stage_hosts = [f"stage{i}" for i in range(len(ranges))]
    prompts = _prompt_ids(model)
    result = {"benchmark": "wan", "model": "smollm2", "stages": len(ranges),
              "layers": [f"{r.start}:{r.end}" for r in ranges], "rtt_ms": rtts, "max_tokens": args.max_tokens,
              "repeats": args.repeats, "bandwidth_mbit": args.bandwidth_mbit, "threads_per_stage": 1,
              "prefix_cache": 0, "in_process_engine": args.in_process_engine,
              "prompts": {n: {"text": PROMPTS[n], "tokens": len(ids)} for n, ids in prompts.items()},
              "modes": {m: {"rtts": {}} for m in modes}}
    tools = llama_rpc.rpc_tools() if LLAMA_RPC in modes else None
    if isinstance(tools, str):
        result["modes"][LLAMA_RPC] = {"skipped": tools}
    link = {"rate_bps": None if args.bandwidth_mbit is None else args.bandwidth_mbit * 125_000}
    with tempfile.TemporaryDirectory(prefix="meshnet-wan-") as tmp:
        extra = {h: [llama_rpc.RPC_PORT] for h in stage_hosts}
        mesh = NetMesh(["tracker", "client", *stage_hosts], Path(tmp), [sys.executable, "-m", "meshnet.bench.wan_agent"],
                       heartbeat_s=2.0, link=link, extra_ports=extra)
        try:
            # No prefix reuse: every TTFT is a whole prefill, as llama-bench's prompt test is.
            mesh.start_nodes([(h, f"{r.start}:{r.end}") for h, r in zip(stage_hosts, ranges)], threads=1,
                             node_args=["--prefix-cache", "0", *(["--in-process-engine"] if args.in_process_engine
                                                                 else [])])
            live = [m for m in modes if "rtts" in result["modes"][m]]
            for m in live:
                for ids in prompts.values() if m in MESHNET_MODES else ():
                    # Connections, the graphs of each prompt's shape and the client's step deadlines warm up.
                    mesh.agent.ask("measure", 120, mode=m, prompt_ids=ids, n=4, repeats=1)
            llama = None
            if LLAMA_RPC in live:
                endpoints = llama_rpc.start_rpc_servers(mesh, tools[0], stage_hosts, threads=1)
                split = tensor_split([(r.start, r.end) for r in ranges], ranges[-1].end)
                llama = _LlamaRounds(mesh, tools, endpoints, split, model, prompts, args)
            for rtt in rtts:
                mesh.set_all_links(delay_s=rtt / 2000.0, **link)
                if NGRAM in live:  # as a server that has been running: its drafting knows these links' step costs
                    mesh.agent.ask("measure", 60 + 0.1 * rtt, mode=NGRAM, prompt_ids=prompts["repetitive"], n=8,
                                   repeats=1, link=rtt)
                ours = [m for m in live if m in MESHNET_MODES]
                figs = _measure_meshnet(mesh, ours, prompts, rtt, args, llama)
                if llama is not None:
                    figs[LLAMA_RPC] = llama.figures(rtt)
                for m, fig in figs.items():
                    result["modes"][m]["rtts"][rtt_key(rtt)] = fig
        finally:
            mesh.close()
    analyze(result)
    result["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(format_table(result))
    print(f"[bench wan] wrote {out}", file=sys.stderr)
    return 0
