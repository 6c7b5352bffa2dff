"""``meshnet bench worker``: what running a node's engine in a supervised worker process costs.

Each round starts two fresh nodes one after the other, each serving the whole model with ``--threads``
threads behind a tracker in this process: one with its engine in a worker process (the default) and one
with ``--in-process-engine``; the order alternates between rounds so drift in the machine's load falls on
both. On each node, ``C`` greedy sessions (for every ``--concurrency`` value) prefill the same prompt ids
and then decode ``--decode-tokens`` tokens each at once, through
:class:`~meshnet.client.mesh_client.MeshClient`; aggregate decode tokens/s = all sessions' decode steps
over the span from the first decode to the last. Medians over rounds, and worker / in-process ratios.
Speed is only measured and written here, never asserted in tests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from contextlib import ExitStack
from pathlib import Path

from meshnet.arg_types import counts, positive_int, results_file, thread_count
from meshnet.bench.engine_bench import bench_prompt_ids
from meshnet.bench.node_procs import NodeSpec, decode_concurrently, start_mesh
from meshnet.client.mesh_client import MeshClient
from meshnet.contract import LayerRange

# The bound on the worker boundary's cost: worker decode tokens/s >= 0.95x in-process.
GOAL_WORKER_VS_IN_PROCESS = 0.95
MODES = {"worker": (), "in_process": ("--in-process-engine",)}


def add_worker_bench_parser(bench_subparsers) -> None:
    p = bench_subparsers.add_parser("worker", help="decode tokens/s of a node with its engine in a worker "
                                                   "process vs in the node process")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--threads", type=thread_count, default=2)
    p.add_argument("--concurrency", type=counts, default="1,8", help="comma-separated session counts")
    p.add_argument("--prompt-tokens", type=positive_int, default=32)
    p.add_argument("--decode-tokens", type=positive_int, default=64)
    p.add_argument("--rounds", type=positive_int, default=3, help="rounds; each measures both modes")
    p.add_argument("--out", type=results_file, default="bench-results/worker.json")
    p.set_defaults(func=run_worker_bench)


def _measure(model: str, mode: str, threads: int, n_layer: int, prompt_ids: list[int], cs: list[int],
             n_decode: int) -> dict[int, float]:
    """Aggregate decode tokens/s per concurrency on a fresh node in ``mode``."""
    n_ctx = 512
    spec = NodeSpec(f"bench-{mode}", LayerRange(0, n_layer), threads, extra_args=MODES[mode])
    out = {}
    with ExitStack() as stack:
        tracker, _ = start_mesh(stack, model, n_ctx, [spec])
        clients = [MeshClient(tracker, report_deliveries=False) for _ in range(max(cs))]
        for c in clients:
            stack.callback(c.close)
        decode_concurrently(clients[:1], prompt_ids, 4)  # warm-up: graphs for these shapes
        for c in cs:
            out[c] = round(decode_concurrently(clients[:c], prompt_ids, n_decode)[0], 2)
    return out


def run_worker_bench(args: argparse.Namespace) -> int:
    """Run the rounds, write ``args.out`` (JSON) and print a table. Returns 0."""
    from meshnet.model.bundled import resolve_model
    from meshnet.model.gguf_file import open_gguf
    from meshnet.model.hparams import ModelConfig

    cs = list(dict.fromkeys(args.concurrency))  # counts >= 1 (the flag's type), each measured once
    model = str(resolve_model(args.model))
    n_layer = ModelConfig.from_reader(open_gguf(model)).n_layer
    prompt_ids = bench_prompt_ids(model, args.prompt_tokens)
    runs: dict[str, dict[int, list[float]]] = {m: {c: [] for c in cs} for m in MODES}
    for r in range(args.rounds):
        for mode in (list(MODES) if r % 2 == 0 else list(MODES)[::-1]):
            got = _measure(model, mode, args.threads, n_layer, prompt_ids, cs, args.decode_tokens)
            for c, v in got.items():
                runs[mode][c].append(v)
            print(f"[bench worker] round {r + 1}: {mode}: " + ", ".join(f"C={c} {v} tok/s" for c, v in got.items()),
                  file=sys.stderr)
    medians = {m: {c: round(statistics.median(v), 2) for c, v in per.items()} for m, per in runs.items()}
    ratios = {c: round(medians["worker"][c] / medians["in_process"][c], 3) for c in cs}
    result = {
        "benchmark": "worker", "model": args.model, "threads": args.threads, "prompt_tokens": len(prompt_ids),
        "decode_tokens": args.decode_tokens, "rounds": args.rounds,
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        "runs": runs, "medians_tokens_per_s": medians, "worker_vs_in_process": ratios,
        "goal_worker_vs_in_process": GOAL_WORKER_VS_IN_PROCESS,
        "notes": ["aggregate decode tokens/s of C concurrent greedy sessions on one node serving every layer; "
                  "medians over rounds, modes alternating; ratio = worker / in-process (1.0 = free)."],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'C':>3} {'worker tok/s':>13} {'in-process tok/s':>17} {'ratio':>6}")
    for c in cs:
        print(f"{c:>3} {medians['worker'][c]:>13} {medians['in_process'][c]:>17} {ratios[c]:>6}")
    print(f"[bench worker] wrote {out}", file=sys.stderr)
    return 0
