"""``meshnet bench scale``: a model where the weights dominate (by default the 7B-class random-weight llama of
:mod:`meshnet.bench.dense_model`), as one process, as node processes on loopback and as llama.cpp.

One run, the same prompt ids everywhere (:func:`~meshnet.bench.engine_bench.bench_prompt_ids`), greedy,
the median of ``--repeats`` runs after one warm-up:

1. **one process**: a child process loads every layer in process (load seconds), runs the greedy
   timings (prefill tokens/s = prompt tokens / time to the first token; decode tokens/s) and then
   ``--parity-tokens`` greedy steps with their top log-probabilities; it reports its resident memory.
2. **mesh**: a tracker here and ``--stages`` ``meshnet node`` processes (each with its engine worker),
   started one after another so each one's load time is its own (process start to ready: imports, the
   file's sha256, mapping the range, the speed probe), driven by a ``MeshClient``.
3. **llama-bench** on the same file and threads (:mod:`meshnet.bench.llama_bench`, default repacking).
4. **llama.cpp greedy**: ``llama-server``'s ids and top log-probabilities for the same prompt
   (:mod:`meshnet.bench.greedy_parity`; ``--no-repack`` unless ``--reference-repack``), compared with 1.

Resident memory (bytes, from ``/proc/<pid>/status``) is split as the kernel counts it: ``RssFile`` (pages
of the memory-mapped GGUF a process has touched: its weights) and ``RssAnon`` (the interpreter, the KV
cache's touched pages and ggml's compute buffers); the engine's own ``kv_bytes`` and ``weight_bytes``
(what its range maps) come beside them. A node's figure is its process plus its engine worker's.
Processes run one configuration at a time, so none competes with another for the cores.
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

from meshnet.arg_types import positive_int, results_file, thread_count
from meshnet.bench.engine_bench import bench_prompt_ids, greedy_run

GOALS = {"node_rss_vs_single_max": 0.4, "mesh_vs_single_decode_min": 0.9, "single_vs_llama_bench_min": 0.95,
         "greedy_ids_equal": True}
_STATUS_KEYS = ("VmRSS", "VmHWM", "RssAnon", "RssFile")


def add_scale_bench_parser(bench_subparsers) -> None:
    """Add ``scale`` to ``meshnet bench``'s subcommands."""
    p = bench_subparsers.add_parser(
        "scale", help="a 7B-class model: load time and RSS per stage, tokens/s of 1 process, N nodes and "
                      "llama-bench, greedy ids against llama.cpp")
    p.add_argument("--model", help="GGUF path (default: the 7B-class random llama, written on first use)")
    p.add_argument("--stages", type=positive_int, default=3, help="node processes in the loopback mesh")
    p.add_argument("--threads", type=thread_count, default=2, help="CPU threads everywhere")
    p.add_argument("--prompt-tokens", type=positive_int, default=128)
    p.add_argument("--decode-tokens", type=positive_int, default=32)
    p.add_argument("--parity-tokens", type=positive_int, default=32, help="greedy ids compared with llama.cpp's")
    p.add_argument("--repeats", type=positive_int, default=2, help="runs per figure after a warm-up; the median")
    p.add_argument("--no-llama-cpp", action="store_true", help="skip llama-bench and llama.cpp's greedy ids")
    p.add_argument("--reference-repack", action="store_true",
                   help="let llama-server repack weights for the greedy reference (default --no-repack)")
    p.add_argument("--out", type=results_file, default="bench-results/scale.json")
    p.set_defaults(func=run_scale_bench)


def proc_memory(pid: int) -> dict:
    """``{"VmRSS", "VmHWM", "RssAnon", "RssFile"}`` of process ``pid`` in bytes (0 where unreadable)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return dict.fromkeys(_STATUS_KEYS, 0)
    vals = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in _STATUS_KEYS:
            vals[key] = int(rest.split()[0]) * 1024
    return {k: vals.get(k, 0) for k in _STATUS_KEYS}


def tree_memory(pid: int) -> dict:
    """:func:`proc_memory` summed over ``pid`` and its descendants (a node and its engine worker), with
    ``processes``: each one's figures by pid."""
    pids, i = [pid], 0
    while i < len(pids):
        try:
            kids = Path(f"/proc/{pids[i]}/task/{pids[i]}/children").read_text().split()
        except OSError:
            kids = []
        pids += [int(k) for k in kids]
        i += 1
    each = {p: proc_memory(p) for p in pids}
    return {**{k: sum(m[k] for m in each.values()) for k in _STATUS_KEYS}, "processes": each}


def _timings(runs) -> dict:
    prefill = [len_ / r.ttft_s for len_, r in runs]
    decode = [r.decode_tokens_per_s() for _, r in runs]
    return {"prefill_tokens_per_s": round(statistics.median(prefill), 2),
            "decode_tokens_per_s": round(statistics.median(decode), 2),
            "prefill_runs": [round(x, 2) for x in prefill], "decode_runs": [round(x, 2) for x in decode]}


def _single_child(model: str, threads: int, n_ctx: int, prompt_ids: list[int], n_decode: int, repeats: int,
                  parity_tokens: int) -> None:
    """Child process: the one-process figures of the module doc, printed as one JSON line."""
    from meshnet.bench.greedy_parity import stages_greedy
    from meshnet.local_mesh import load_local_chain, plan_ranges
    from meshnet.tokenizer import GGUFTokenizer

    before = proc_memory(os.getpid())
    t0 = time.perf_counter()
    ranges = plan_ranges(model, 1)
    chain = load_local_chain(model, ranges, n_threads=threads, n_ctx=n_ctx, progress=False,
                             prefix_cache=0)
    load_s = time.perf_counter() - t0
    greedy_run(chain, prompt_ids, n_decode)  # warm-up: graphs and caches
    runs = [(len(prompt_ids), greedy_run(chain, prompt_ids, n_decode)) for _ in range(repeats)]
    engine = chain.stages[0]
    # llama_cpp_greedy's server ignores end-of-generation tokens; so does the comparison's side here
    parity = stages_greedy([engine.stage], prompt_ids, parity_tokens,
                           never=sorted(GGUFTokenizer.from_gguf(model).eog_ids))
    m = engine.metrics()
    print(json.dumps({"layers": [str(r) for r in ranges], "threads": threads, "load_s": round(load_s, 3),
                      **_timings(runs), "tokens": runs[-1][1].tokens, "parity": parity,
                      "memory": {**proc_memory(os.getpid()), "before_load": before, "weight_bytes": m.weight_bytes,
                                 "kv_bytes": m.kv_bytes}}))


def bench_single(model: str, threads: int, n_ctx: int, prompt_ids: list[int], n_decode: int, repeats: int,
                 parity_tokens: int) -> dict:
    """Run :func:`_single_child` in a fresh interpreter; returns its figures. Raises RuntimeError when it
    fails (with its stderr's tail)."""
    code = ("import json, sys; from meshnet.bench.scale_bench import _single_child; "
            "_single_child(*json.loads(sys.argv[1]))")
    args = json.dumps([model, threads, n_ctx, list(prompt_ids), n_decode, repeats, parity_tokens])
    out = subprocess.run([sys.executable, "-c", code, args], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"the one-process run failed (exit {out.returncode}): {out.stderr.strip()[-1500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_nodes(model: str, stages: int, threads: int, n_ctx: int, prompt_ids: list[int], n_decode: int,
                repeats: int) -> dict:
    """``stages`` node processes on loopback (see the module doc): per node its layers, load seconds,
    memory (:func:`tree_memory`; the engine's weight and KV bytes from its Metrics RPC); the mesh's
    prefill and decode tokens/s and its greedy ids."""
    from meshnet.bench.node_procs import NodeSpec, node_metrics, node_stubs, start_mesh
    from meshnet.client.mesh_client import MeshClient
    from meshnet.local_mesh import plan_ranges

    ranges = plan_ranges(model, stages)
    specs = [NodeSpec(f"scale-{i}-{r.start}-{r.end}", r, threads) for i, r in enumerate(ranges)]
    with ExitStack() as stack:
        tracker, nodes = start_mesh(stack, model, n_ctx, specs, one_at_a_time=True)
        client = MeshClient(tracker)
        stack.callback(client.close)
        stubs = node_stubs(stack, nodes)
        greedy_run(client, prompt_ids, n_decode)  # warm-up: graphs, caches, channels
        runs = [(len(prompt_ids), greedy_run(client, prompt_ids, n_decode)) for _ in range(repeats)]
        per_node = []
        for n, stub in zip(nodes, stubs):
            m = node_metrics(stub)
            mem = tree_memory(n.proc.pid)
            mem["processes"] = {str(k): v for k, v in mem["processes"].items()}
            per_node.append({"node_id": n.spec.node_id, "layers": str(n.spec.layers), "load_s": n.ready_s,
                             "memory": {**mem, "weight_bytes": m.weight_bytes, "kv_bytes": m.kv_bytes}})
    return {"layers": [str(r) for r in ranges], "threads": threads, "nodes": per_node, **_timings(runs),
            "tokens": runs[-1][1].tokens}


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def ratios(result: dict) -> dict:
    """The goal ratios of a result: each node's RSS over the one process's, mesh over one process
    (decode, prefill), one process over llama-bench (decode, prefill), greedy ids equal."""
    one, mesh = result["single_process"], result["mesh"]
    out = {"node_rss_vs_single": [_ratio(n["memory"]["VmRSS"], one["memory"]["VmRSS"]) for n in mesh["nodes"]],
           "mesh_vs_single_decode": _ratio(mesh["decode_tokens_per_s"], one["decode_tokens_per_s"]),
           "mesh_vs_single_prefill": _ratio(mesh["prefill_tokens_per_s"], one["prefill_tokens_per_s"]),
           "mesh_tokens_equal_single": mesh["tokens"] == one["tokens"]}
    ref = result.get("llama_bench", {})
    if "decode_tokens_per_s" in ref:
        out["single_vs_llama_bench_decode"] = _ratio(one["decode_tokens_per_s"], ref["decode_tokens_per_s"])
        out["single_vs_llama_bench_prefill"] = _ratio(one["prefill_tokens_per_s"], ref["prefill_tokens_per_s"])
    parity = result.get("greedy_parity", {})
    if "equal_ids" in parity:
        out["greedy_ids_equal"] = f"{parity['equal_ids']}/{parity['of']}"
    return out


def format_table(result: dict) -> str:
    """A result as plain text: one row per configuration (load s, RSS MiB, prefill and decode tokens/s,
    ratios to the one process), then the ratios and the greedy comparison."""
    mib = 1 << 20
    one = result["single_process"]
    rows = [("1 process " + ",".join(one["layers"]), one["load_s"], one["memory"]["VmRSS"], one)]
    rows += [(f"node {n['layers']}", n["load_s"], n["memory"]["VmRSS"], None) for n in result["mesh"]["nodes"]]
    rows.append((f"{len(result['mesh']['nodes'])} nodes (mesh)", None, None, result["mesh"]))
    ref = result.get("llama_bench", {})
    if "decode_tokens_per_s" in ref:
        rows.append(("llama-bench", None, None, ref))
    lines = [f"{'':26} {'load s':>7} {'RSS MiB':>8} {'RSS x1':>7} {'prefill t/s':>12} {'decode t/s':>11} "
             f"{'prefill x1':>10} {'decode x1':>9}"]
    for name, load, rss, r in rows:
        cells = [f"{load:7.1f}" if load is not None else f"{'':7}",
                 f"{rss / mib:8.0f}" if rss else f"{'':8}",
                 f"{rss / one['memory']['VmRSS']:7.3f}" if rss else f"{'':7}"]
        if r is not None:
            cells += [f"{r['prefill_tokens_per_s']:12.2f}", f"{r['decode_tokens_per_s']:11.2f}",
                      f"{r['prefill_tokens_per_s'] / one['prefill_tokens_per_s']:10.3f}",
                      f"{r['decode_tokens_per_s'] / one['decode_tokens_per_s']:9.3f}"]
        lines.append(f"{name:26} " + " ".join(cells))
    if "skipped" in ref:
        lines.append(f"llama-bench skipped: {ref['skipped']}")
    parity = result.get("greedy_parity", {})
    if "equal_ids" in parity:
        lines.append(f"greedy ids vs llama.cpp: {parity['equal_ids']}/{parity['of']} equal, max |d logprob| "
                     f"{parity['max_abs_logprob_diff']}; smallest margin {parity['min_margin']:.2f} logits")
    elif "skipped" in parity:
        lines.append(f"greedy ids vs llama.cpp skipped: {parity['skipped']}")
    lines.append("ratios: " + json.dumps(result["ratios"]))
    return "\n".join(lines)


def run_scale_bench(args: argparse.Namespace) -> int:
    """Run every part of the module doc, write ``args.out`` (JSON) and print the table. Returns 0.

    Raises:
        ValueError: counts below 1, more stages than the model has layers, or more parity tokens than a
            run generates. RuntimeError: a process failed (the message has its stderr's tail).
    """
    from meshnet.bench.greedy_parity import compare_greedy, llama_cpp_greedy
    from meshnet.bench.llama_bench import llama_bench_reference
    from meshnet.local_mesh import plan_ranges
    from meshnet.model.bundled import resolve_model
    from meshnet.model.gguf_file import open_gguf, sha256_file
    from meshnet.model.hparams import ModelConfig

    if args.model:
        model = str(resolve_model(args.model))
    else:
        from meshnet.bench.dense_model import default_path, ensure_llama_model

        if not default_path().exists():
            print(f"[bench scale] writing the 7B-class model to {default_path()}", file=sys.stderr, flush=True)
        model = str(ensure_llama_model())
    cfg = ModelConfig.from_reader(open_gguf(model))
    plan_ranges(model, args.stages)  # a count the model cannot split into failed after the 1-process part
    prompt_ids = bench_prompt_ids(model, args.prompt_tokens)
    n_ctx = 512 if len(prompt_ids) + max(args.decode_tokens, args.parity_tokens) + 1 <= 512 else 0
    result: dict = {
        "benchmark": "scale", "path": model, "sha256": sha256_file(model), "bytes": os.path.getsize(model),
        "architecture": cfg.architecture, "n_layer": cfg.n_layer, "n_embd": cfg.n_embd,
        "stages": args.stages, "threads": args.threads, "prompt_tokens": len(prompt_ids),
        "decode_tokens": args.decode_tokens, "parity_tokens": args.parity_tokens, "repeats": args.repeats,
        "n_ctx": n_ctx,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "load_average_at_start": [round(x, 2) for x in os.getloadavg()]},
    }
    say = lambda msg: print(f"[bench scale] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    one = bench_single(model, args.threads, n_ctx, prompt_ids, args.decode_tokens, args.repeats, args.parity_tokens)
    parity = one.pop("parity")
    result["single_process"] = one
    say(f"1 process: load {one['load_s']} s, {one['prefill_tokens_per_s']} / {one['decode_tokens_per_s']} tok/s")
    result["mesh"] = bench_nodes(model, args.stages, args.threads, n_ctx, prompt_ids, args.decode_tokens,
                                 args.repeats)
    say(f"{args.stages} nodes: {result['mesh']['prefill_tokens_per_s']} / {result['mesh']['decode_tokens_per_s']} tok/s")
    if args.no_llama_cpp:
        result["llama_bench"] = result["greedy_parity"] = {"skipped": "--no-llama-cpp"}
    else:
        result["llama_bench"] = llama_bench_reference(model, len(prompt_ids), args.decode_tokens, args.threads,
                                                      args.repeats)
        ref = llama_cpp_greedy(model, prompt_ids, args.parity_tokens, args.threads, n_ctx or 4096,
                               repack=args.reference_repack)
        if "skipped" in ref:
            result["greedy_parity"] = ref
        else:
            result["greedy_parity"] = {**compare_greedy(parity, ref), "min_margin": round(min(parity["margins"]), 3),
                                       "repack": args.reference_repack, "meshnet": parity, "llama_cpp": ref}
    result["ratios"] = ratios(result)
    result["goals"] = GOALS
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(format_table(result))
    say(f"wrote {out}")
    return 0
