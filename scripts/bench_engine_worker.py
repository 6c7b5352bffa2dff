"""Decode tokens/s of one node serving the whole model, its engine in a worker process vs in the node
process, at C concurrent sessions; runs alternate between the two, medians and ratios at the end.

    .venv/bin/python scripts/bench_engine_worker.py [--rounds 3] [--concurrency 1,8] [--tokens 64]

Each run starts a fresh node (``meshnet node``, 2 threads) behind an in-process tracker and drives C
greedy sessions of golden prompt 0 through ``MeshClient`` (prefill, then ``--tokens`` decode steps
each); tokens/s = all sessions' decode steps / the wall time from the first decode to the last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from mesh_util import Mesh  # noqa: E402

from meshnet.client.mesh_client import MeshClient  # noqa: E402
from meshnet.contract import StepRequest  # noqa: E402


def decode_rate(tracker: str, c: int, n: int) -> float:
    client = MeshClient(tracker, report_deliveries=False)
    prompt = tuple(range(100, 140))
    barrier = threading.Barrier(c)
    spans: list[tuple[float, float]] = []

    def run(i: int) -> None:
        sid = f"b{i}-{time.monotonic_ns()}"
        tok = client.step(StepRequest(sid, 0, 0, prompt), False).token.token_id
        barrier.wait()
        t0 = time.perf_counter()
        for k in range(n):
            tok = client.step(StepRequest(sid, 0, len(prompt) + k, (tok,)), True).token.token_id
        spans.append((t0, time.perf_counter()))
        client.release(sid)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(c)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    client.close()
    return c * n / (max(e for _, e in spans) - min(s for s, _ in spans))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--tokens", type=int, default=64)
    args = p.parse_args()
    cs = [int(c) for c in args.concurrency.split(",")]
    results: dict[str, dict[int, list[float]]] = {m: {c: [] for c in cs} for m in ("worker", "in-process")}
    for r in range(args.rounds):
        for mode in (("worker", "in-process") if r % 2 == 0 else ("in-process", "worker")):
            mesh = Mesh()
            try:
                extra = ["--threads", "2"] + (["--in-process-engine"] if mode == "in-process" else [])
                proc = mesh.spawn_node("0:30", f"bench-{mode}", "smollm2", *extra, stderr=subprocess.DEVNULL)
                assert proc.stdout.readline().startswith("MESHNET_NODE_READY")
                mesh.wait_registered({f"bench-{mode}"})
                decode_rate(mesh.tracker, 1, 8)  # warm-up
                for c in cs:
                    rate = decode_rate(mesh.tracker, c, args.tokens)
                    results[mode][c].append(rate)
                    print(f"round {r} {mode:10s} C={c}: {rate:6.1f} tok/s", flush=True)
            finally:
                proc.kill()
                mesh.close()
    summary = {c: {m: statistics.median(results[m][c]) for m in results} for c in cs}
    for c in cs:
        w, i = summary[c]["worker"], summary[c]["in-process"]
        print(f"C={c}: worker {w:.1f} / in-process {i:.1f} tok/s (medians of {args.rounds}): ratio {w / i:.3f}")
    print(json.dumps({"runs": results, "medians": summary}))


if __name__ == "__main__":
    main()
