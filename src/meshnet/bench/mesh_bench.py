"""``meshnet bench mesh``: what running a model as a mesh of processes costs, and what pipelining buys.

One run measures, on the same prompt ids (:func:`~meshnet.bench.engine_bench.bench_prompt_ids`), greedy,
the median of ``--repeats`` runs after one warm-up run:

1. **single process** — one in-process stage holding every layer (``--threads`` threads): TTFT (the
   prompt's prefill, seconds) and decode tokens/s.
2. **mesh** — a tracker in this process and ``--stages`` ``meshnet node`` processes on loopback, driven
   by :class:`~meshnet.client.mesh_client.MeshClient`: TTFT and decode tokens/s, plus per-hop latency
   of decode steps. Each hop's RPC is timed on the client (envelope encode + gRPC round trip + reply
   decode); the node's own compute per decode step comes from its ``Metrics`` RPC (cumulative
   ``decode_seconds`` / ``decode_tokens``, read before and after the measured runs). Per-hop overhead
   (ms) = RPC time - mean compute time, reported as mean and p50 (the p50 subtracts the mean compute,
   since the node reports totals, not per-step times). For reference, the raw loopback gRPC unary round
   trip of a ``[1, n_embd]`` f32 payload (bytes echoed by a bare gRPC server in another process) and of
   the node's ``Health`` RPC.
3. **pipelining** — two nodes (layers split in half), each pinned to its own CPU with one thread,
   serving two concurrent sessions (two client threads): aggregate decode tokens/s; versus one session
   on one node holding all layers, pinned to one CPU with one thread. The client orchestrates the hops,
   so while session A is on node 2, session B can run on node 1.

Speed is only measured and written here, never asserted in tests. Every process started here is
stopped on every exit path (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Callable

import grpc

from meshnet.arg_types import positive_int, results_file, thread_count
from meshnet.bench.engine_bench import RunTiming, bench_prompt_ids, greedy_run
from meshnet.bench.node_procs import (NodeSpec, decode_compute_s, decode_concurrently, node_metrics, node_stubs,
                                      start_mesh, stop_process)
from meshnet.client.mesh_client import MeshClient
from meshnet.contract import LayerRange, StepRequest
from meshnet.local_mesh import plan_ranges
from meshnet.proto import meshnet_pb2 as pb
from meshnet.proto import meshnet_pb2_grpc as pb_grpc
from meshnet.wire.security import SERVER_OPTIONS, open_channel

GOAL_MESH_VS_SINGLE_DECODE = 0.85
GOAL_PIPELINE_SPEEDUP = 1.6
RTT_CALLS = 300  # loopback round trips per reference figure
_ECHO_METHOD = "/meshnet.bench.Echo/Echo"


def add_mesh_bench_parser(bench_subparsers) -> None:
    """Add ``mesh`` to ``meshnet bench``'s subcommands."""
    p = bench_subparsers.add_parser(
        "mesh", help="single process vs N node processes on loopback (TTFT, decode tokens/s, per-hop "
                     "overhead) and two-session pipelining on two pinned cores")
    p.add_argument("--model", default="smollm2", help="GGUF path or bundled name")
    p.add_argument("--stages", type=positive_int, default=3, help="node processes in the loopback mesh")
    p.add_argument("--threads", type=thread_count, default=1, help="CPU threads per stage (single process and mesh)")
    p.add_argument("--prompt-tokens", type=positive_int, default=128)
    p.add_argument("--decode-tokens", type=positive_int, default=64)
    p.add_argument("--repeats", type=positive_int, default=3, help="runs per figure after a warm-up; the median is reported")
    p.add_argument("--out", type=results_file, default="bench-results/mesh.json")
    p.set_defaults(func=run_mesh_bench)


# ---- timing one greedy session ----------------------------------------------------------------------

def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


def _summary(runs: list[RunTiming]) -> dict:
    """Medians over measured runs: TTFT (seconds) and decode tokens/s, plus every run's figures."""
    return {"ttft_s": round(statistics.median(r.ttft_s for r in runs), 4),
            "decode_tokens_per_s": round(statistics.median(r.decode_tokens_per_s() for r in runs), 2),
            "ttft_runs_s": [round(r.ttft_s, 4) for r in runs],
            "decode_runs_tokens_per_s": [round(r.decode_tokens_per_s(), 2) for r in runs],
            # In-process stages compute here; through a mesh this is the client's own CPU cost.
            "process_cpu_ms_per_decode_token": _ms(statistics.median(r.decode_cpu_s / len(r.step_s) for r in runs))}


# ---- instrumented mesh client -----------------------------------------------------------------------

class TimedMeshClient(MeshClient):
    """A MeshClient that records each hop's decode RPC time, seconds, per node id in ``hop_decode_s``.

    The timing wraps the decode steps of ``RemoteStage.step`` (envelope encode, the call, reply decode)
    on the stage objects this client creates; the client's step loop itself is unchanged. Its steps are
    client-orchestrated: a forwarded step has no per-hop call to time.
    """

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, forwarding=False, **kw)
        self.hop_decode_s: dict[str, list[float]] = {}
        self.router.on_stage = self._timed

    def _timed(self, stage):
        times = self.hop_decode_s.setdefault(stage.node_id, [])
        inner = stage.step

        def step(req: StepRequest, decode: bool, timeout_s: float | None = None):
            t0 = time.perf_counter()
            try:
                return inner(req, decode, timeout_s)
            finally:
                if decode:
                    times.append(time.perf_counter() - t0)

        stage.step = step  # an instance attribute shadows the method for this stage only
        return stage


# ---- loopback round-trip reference ------------------------------------------------------------------

def _echo_child() -> None:
    """Child process: a bare gRPC server whose one unary method returns the request bytes unchanged
    (no protobuf, no envelope); prints ``ECHO_READY address=...`` and serves until stdin closes."""
    from concurrent import futures

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=SERVER_OPTIONS)
    echo = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("meshnet.bench.Echo", {"Echo": echo}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"ECHO_READY address=127.0.0.1:{port}", flush=True)
    sys.stdin.read()  # EOF when the parent closes our stdin or exits
    server.stop(grace=0)


def _time_calls(fn: Callable[[], object], n: int) -> dict:
    """Mean and p50 (ms) of ``n`` calls of ``fn`` after 20 warm-up calls."""
    for _ in range(20):
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"mean_ms": _ms(statistics.fmean(times)), "p50_ms": _ms(statistics.median(times)), "calls": n}


def loopback_rtt(stack: ExitStack, n_embd: int, node_address: str) -> dict:
    """Raw loopback gRPC unary round trips (ms): ``n_embd * 4`` bytes echoed by a bare server in another
    process, and the node's ``Health`` RPC (protobuf, no payload, no engine work)."""
    proc = subprocess.Popen([sys.executable, "-c", "from meshnet.bench.mesh_bench import _echo_child; _echo_child()"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    def stop() -> None:
        try:
            proc.stdin.close()  # the child's signal to stop serving
        except OSError:
            pass
        stop_process(proc, timeout_s=5)

    stack.callback(stop)
    line = proc.stdout.readline()
    if not line.startswith("ECHO_READY"):
        raise RuntimeError(f"echo server did not start: {line!r}")
    address = line.split("address=", 1)[1].strip()
    payload = bytes(n_embd * 4)  # one f32 hidden-state row, the size of a decode step's activations
    echo_ch = open_channel(address)
    stack.callback(echo_ch.close)
    echo = echo_ch.unary_unary(_ECHO_METHOD)
    node_ch = open_channel(node_address)
    stack.callback(node_ch.close)
    node = pb_grpc.NodeStub(node_ch)
    out = {"echo_payload_bytes": len(payload), "echo": _time_calls(lambda: echo(payload, timeout=5), RTT_CALLS),
           "health": _time_calls(lambda: node.Health(pb.Empty(), timeout=5), RTT_CALLS)}
    stop()
    return out


# ---- the three measurements -------------------------------------------------------------------------

def bench_single_process(model_path: str, n_layer: int, threads: int, n_ctx: int, prompt_ids: list[int],
                         n_decode: int, repeats: int) -> tuple[dict, list[int]]:
    """One in-process stage [0, n_layer): median TTFT (s) and decode tokens/s; also the greedy tokens."""
    from meshnet.local_mesh import load_local_chain

    chain = load_local_chain(model_path, [LayerRange(0, n_layer)], n_threads=threads, n_ctx=n_ctx, progress=False,
                             prefix_cache=0)
    greedy_run(chain, prompt_ids, n_decode)  # warm-up: graphs and caches
    engine = chain.stages[0]
    before = engine.metrics()
    runs = [greedy_run(chain, prompt_ids, n_decode) for _ in range(repeats)]
    after = engine.metrics()
    compute = (after.decode_seconds - before.decode_seconds) / max(1, after.decode_tokens - before.decode_tokens)
    return {"layers": [f"0:{n_layer}"], "threads": threads, **_summary(runs),
            "compute_mean_ms": _ms(compute)}, runs[-1].tokens


def bench_loopback_mesh(stack: ExitStack, model_path: str, n_layer: int, n_embd: int, ranges: list[LayerRange],
                        threads: int, n_ctx: int, prompt_ids: list[int], n_decode: int, repeats: int) -> dict:
    """A node process per range of ``ranges`` on loopback, through a MeshClient: median TTFT (s), decode
    tokens/s, and per-hop decode RPC time, compute time and overhead (ms); plus the loopback round-trip
    reference."""
    specs = [NodeSpec(f"bench-{i}-{r.start}-{r.end}", r, threads) for i, r in enumerate(ranges)]
    tracker, nodes = start_mesh(stack, model_path, n_ctx, specs)
    client = TimedMeshClient(tracker)
    stack.callback(client.close)
    stubs = node_stubs(stack, nodes)

    greedy_run(client, prompt_ids, n_decode)  # warm-up: graphs, caches, channels
    for times in client.hop_decode_s.values():
        times.clear()
    # Counters after the warm-up; prefill and decode are counted apart, so the difference after the
    # measured runs is exactly their decode (and prefill) work on each node.
    before = [node_metrics(s) for s in stubs]
    runs = [greedy_run(client, prompt_ids, n_decode) for _ in range(repeats)]
    after = [node_metrics(s) for s in stubs]

    per_hop, hop_total = [], 0.0
    for i, (n, b, a) in enumerate(zip(nodes, before, after)):
        rpc = client.hop_decode_s.get(n.spec.node_id, [])
        steps = a.decode_tokens - b.decode_tokens
        compute = decode_compute_s(b, a)
        rpc_mean = statistics.fmean(rpc) if rpc else 0.0
        hop_total += rpc_mean
        per_hop.append({
            "hop": i, "node_id": n.spec.node_id, "layers": str(n.spec.layers), "decode_steps": steps,
            "rpc_mean_ms": _ms(rpc_mean), "rpc_p50_ms": _ms(statistics.median(rpc)) if rpc else 0.0,
            "compute_mean_ms": _ms(compute),
            "overhead_mean_ms": _ms(rpc_mean - compute),
            "overhead_p50_ms": _ms(statistics.median(rpc) - compute) if rpc else 0.0,
            "prefill_compute_s": round((a.prefill_seconds - b.prefill_seconds) / max(1, repeats), 4),
        })
    step_mean = statistics.fmean(s for r in runs for s in r.step_s)
    result = {
        "layers": [str(r) for r in ranges], "threads": threads, **_summary(runs),
        "per_hop": per_hop,
        # Where a decode step's time goes (ms): the nodes' compute, the hops' overhead, and what the
        # client spends outside the hops' RPCs (building requests, recording each step for failover).
        "decode_step_breakdown_ms": {
            "step_mean": _ms(step_mean),
            "compute_sum": round(sum(h["compute_mean_ms"] for h in per_hop), 3),
            "hop_overhead_sum": round(sum(h["overhead_mean_ms"] for h in per_hop), 3),
            "client_loop": _ms(step_mean - hop_total),
        },
        "tokens": runs[-1].tokens,
    }
    result["loopback_rtt"] = loopback_rtt(stack, n_embd, nodes[0].address)
    return result


def bench_pipeline(model_path: str, n_layer: int, n_ctx: int, prompt_ids: list[int], n_decode: int,
                   repeats: int) -> dict:
    """Two sessions on two pinned one-thread nodes (the layers split in two by decode cost, as
    ``meshnet up --stages 2`` would) vs one session on one pinned one-thread node holding all layers:
    median decode tokens/s of each and their ratio."""
    usable = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    cpus = (usable + usable)[:2] if usable else [None, None]  # one usable CPU: both nodes share it
    halves = plan_ranges(model_path, 2)
    out: dict = {"sessions": 2, "threads_per_node": 1, "cpus": cpus, "layers": [str(r) for r in halves]}
    with ExitStack() as stack:
        specs = [NodeSpec(f"pipe-{i}-{r.start}-{r.end}", r, 1, cpu) for i, (r, cpu) in enumerate(zip(halves, cpus))]
        tracker, nodes = start_mesh(stack, model_path, n_ctx, specs)
        clients = [MeshClient(tracker), MeshClient(tracker)]  # one per session thread, like two users
        for c in clients:
            stack.callback(c.close)
        stubs = node_stubs(stack, nodes)
        decode_concurrently(clients, prompt_ids, n_decode)  # warm-up
        before = [node_metrics(s) for s in stubs]
        runs2 = [decode_concurrently(clients, prompt_ids, n_decode) for _ in range(repeats)]
        after = [node_metrics(s) for s in stubs]
    agg = [tps for tps, _ in runs2]
    out["aggregate_tokens_per_s"] = round(statistics.median(agg), 2)
    out["aggregate_runs_tokens_per_s"] = [round(x, 2) for x in agg]
    # Compute per decode token on each node while both sessions run: contention for memory bandwidth,
    # caches and the cores the client also needs shows up here.
    out["node_compute_mean_ms"] = [_ms(decode_compute_s(b, a)) for b, a in zip(before, after)]
    out["client_cpu_ms_per_token"] = _ms(statistics.median(cpu for _, cpu in runs2))
    with ExitStack() as stack:  # the first mesh is fully stopped: nothing else competes for the cores
        spec = NodeSpec(f"whole-0-{n_layer}", LayerRange(0, n_layer), 1, cpus[0])
        tracker, nodes = start_mesh(stack, model_path, n_ctx, [spec])
        client = MeshClient(tracker)
        stack.callback(client.close)
        stub, = node_stubs(stack, nodes)
        greedy_run(client, prompt_ids, n_decode)  # warm-up
        before = node_metrics(stub)
        runs = [greedy_run(client, prompt_ids, n_decode) for _ in range(repeats)]
        after = node_metrics(stub)
    single = statistics.median(r.decode_tokens_per_s() for r in runs)
    out["single"] = {"sessions": 1, "layers": [f"0:{n_layer}"], "cpu": cpus[0], "threads": 1,
                     "decode_tokens_per_s": round(single, 2),
                     "decode_runs_tokens_per_s": [round(r.decode_tokens_per_s(), 2) for r in runs],
                     "node_compute_mean_ms": _ms(decode_compute_s(before, after)),
                     "client_cpu_ms_per_token": _ms(statistics.median(r.decode_cpu_s / len(r.step_s) for r in runs))}
    return out


# ---- the command ------------------------------------------------------------------------------------

def run_mesh_bench(args: argparse.Namespace) -> int:
    """Run all three measurements and write ``args.out`` (JSON); print the ratios on stderr. Returns 0."""
    from meshnet.model.bundled import resolve_model
    from meshnet.model.gguf_file import open_gguf, sha256_file
    from meshnet.model.hparams import ModelConfig

    model = str(resolve_model(args.model))
    cfg = ModelConfig.from_reader(open_gguf(model))
    ranges = plan_ranges(model, args.stages)  # the split `meshnet up` would use; a bad count fails before any run
    prompt_ids = bench_prompt_ids(model, args.prompt_tokens)
    # The same context size everywhere, so every configuration allocates the same KV cache.
    n_ctx = 512 if args.prompt_tokens + args.decode_tokens + 1 <= 512 else 0
    result: dict = {
        "benchmark": "mesh", "model": args.model, "path": model, "sha256": sha256_file(model),
        "n_layer": cfg.n_layer, "n_embd": cfg.n_embd, "stages": args.stages, "threads": args.threads,
        "prompt_tokens": len(prompt_ids), "decode_tokens": args.decode_tokens, "repeats": args.repeats,
        "n_ctx": n_ctx,
        "machine": {"cpus": os.cpu_count(),
                    "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
                    "platform": platform.platform(), "python": platform.python_version(),
                    "load_average_at_start": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg")
                    else None},
    }
    single, single_tokens = bench_single_process(model, cfg.n_layer, args.threads, n_ctx, prompt_ids,
                                                 args.decode_tokens, args.repeats)
    result["single_process"] = single
    print(f"[bench mesh] single process: {single['ttft_s']} s TTFT, {single['decode_tokens_per_s']} tok/s",
          file=sys.stderr)
    with ExitStack() as stack:
        mesh = bench_loopback_mesh(stack, model, cfg.n_layer, cfg.n_embd, ranges, args.threads, n_ctx,
                                   prompt_ids, args.decode_tokens, args.repeats)
    mesh["outputs_match_single_process"] = mesh.pop("tokens") == single_tokens
    result["mesh"] = mesh
    print(f"[bench mesh] {args.stages} nodes: {mesh['ttft_s']} s TTFT, {mesh['decode_tokens_per_s']} tok/s, "
          f"per-hop overhead " + ", ".join(f"{h['overhead_mean_ms']} ms" for h in mesh["per_hop"]),
          file=sys.stderr)
    pipe = bench_pipeline(model, cfg.n_layer, n_ctx, prompt_ids, args.decode_tokens, args.repeats)
    result["pipeline"] = pipe
    print(f"[bench mesh] pipeline: {pipe['aggregate_tokens_per_s']} tok/s for 2 sessions on 2 nodes vs "
          f"{pipe['single']['decode_tokens_per_s']} tok/s for 1 session on 1 node", file=sys.stderr)
    result["ratios"] = {
        "mesh_vs_single_decode": round(mesh["decode_tokens_per_s"] / single["decode_tokens_per_s"], 3),
        "mesh_vs_single_ttft": round(mesh["ttft_s"] / single["ttft_s"], 3),
        "pipeline_speedup": round(pipe["aggregate_tokens_per_s"] / pipe["single"]["decode_tokens_per_s"], 3),
    }
    result["goals"] = {"mesh_vs_single_decode": GOAL_MESH_VS_SINGLE_DECODE, "pipeline_speedup": GOAL_PIPELINE_SPEEDUP}
    result["notes"] = [
        "Medians of --repeats runs after one warm-up run; same prompt ids and greedy sampling everywhere.",
        "ttft_s: seconds from sending the prompt to receiving the first sampled token (the prompt's prefill).",
        "decode tokens/s: single-token greedy steps after the prompt, divided by the decode loop's wall time.",
        "mesh_vs_single_decode = mesh decode tokens/s / single-process decode tokens/s (higher is better); "
        "mesh_vs_single_ttft = mesh TTFT / single-process TTFT (lower is better).",
        "per_hop: rpc_* is the client-side time of each decode hop (envelope encode, the call over the node's "
        "raw-TCP data plane, reply decode); compute_mean_ms is the node's own decode compute per step from its Metrics RPC "
        "(decode_seconds / decode_tokens over the measured runs); overhead = rpc - compute (the p50 subtracts "
        "the mean compute, as nodes report totals only).",
        "decode_step_breakdown_ms: step_mean = compute_sum (nodes) + hop_overhead_sum + client_loop (the "
        "client's work outside the hops' RPCs). single_process.compute_mean_ms is the same engine compute "
        "for all layers in one stage, so compute_sum - that = the cost of splitting the layers.",
        "process_cpu_ms_per_decode_token / client_cpu_ms_per_token: CPU time of the benchmark process (all "
        "threads) per decode token; through a mesh that is the client's cost, which shares the CPUs with "
        "the nodes.",
        "loopback_rtt.echo: a bare gRPC server in another process echoing n_embd*4 bytes (no protobuf, no "
        "envelope): the floor of one hop's overhead on this machine. health: the node's Health RPC.",
        "pipeline: the client orchestrates hops (it sends each step to hop 0, passes the hidden states to hop "
        "1, ...), so while session A is on node 2, session B runs on node 1; each node is pinned to its own "
        "CPU with one thread. pipeline_speedup = aggregate tokens/s of 2 concurrent sessions on the 2 nodes / "
        "tokens/s of 1 session on 1 node holding all layers, pinned to 1 CPU with 1 thread (ideal 2.0).",
        "The client (this process) is not pinned and shares the CPUs with the nodes.",
    ]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["ratios"]), file=sys.stderr)
    print(f"[bench mesh] wrote {out}", file=sys.stderr)
    return 0
