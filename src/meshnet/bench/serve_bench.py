"""``meshnet bench serve``: meshnet's OpenAI API against llama.cpp's ``llama-server``, in one run.

Four servers, each its own process, measured alternately with the same load (short chat prompts,
streaming, greedy, ``max_tokens`` 128) at each concurrency C, each started for its turn and stopped
after it so that nothing else runs beside the one measured (``--side-by-side``: llama-server and meshnet
in process run side by side for a C and take turns a load at a time; the mesh still runs alone):

* ``llama-server``: same GGUF, 2 threads, ``-fa on``, ``-np 8`` for C <= 8 and ``-np 32`` above (C x n
  with ``--choices`` n: the sequences generated at once; meshnet's servers hold that many sessions),
  ``-c`` 1024 per slot (found on PATH or built once into a cache folder: :mod:`meshnet.bench.llama_server`;
  skipped with the reason when neither works);
* ``meshnet``: ``meshnet api`` with the model in process, 2 threads;
* ``mesh``: ``meshnet up --stages 3 --threads 1``: three node processes on loopback, the API beside them;
* ``llama-rpc``: llama.cpp's own split, the mesh's competitor: ``llama-server --rpc`` over three
  ``ggml-rpc-server`` s on loopback, 1 thread each, holding the mesh's layer ranges (``-ts``), slots as
  llama-server's (:func:`meshnet.bench.llama_rpc.rpc_split_server_argv`; skipped with the reason when
  the binaries are missing).

Per target and C: aggregate tokens/s, per-stream decode tokens/s (p50), TTFT p50/p95; for meshnet in
process also the KV pool's resident bytes per held token at the fullest moment and the process's peak
RSS growth; for llama-server the KV bytes it allocates per token held. Ratios to llama-server (the mesh's
also to llama-rpc) are in the JSON (``ratios``) and the printed table. With ``--rounds`` N > 1 every target
is measured N times at each C and each ratio is the median of the rounds' (every round's figures are in
``rounds``): on a machine whose speed drifts, a server measured minutes after another compares the
machine with itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from meshnet.arg_types import counts, http_url, positive_int, positive_seconds, results_file, thread_count
from meshnet.bench.serve_load import LoadSpec, run_load, summarize
from meshnet.bench.serve_targets import LLAMA_SLOT_CTX, llama_rpc_server, meshnet_targets, start_llama_server
from meshnet.bench.served import KvSampler, Server
from meshnet.secret_args import API_KEY_ENV, add_api_key_arg

# Requests per timed load at least: at C = 1, three 128-token requests last about 2.5 s, and on a small
# VM whose speed drifts their decode ratio to llama-server swung from 0.80 to 0.97 between rounds.
MIN_REQUESTS = 8
# Targets that may run side by side and take turns (``--side-by-side``, see _Run.measure_c): idle, neither
# wakes up (measured: an idle ``meshnet api`` used 0.05 s of CPU in 20 s, llama-server none), so a pair
# is measured seconds apart instead of a server start apart. On a 2-core VM that did not narrow the
# one-stream decode ratios' spread (0.75-1.04 side by side, 0.69-0.995 started per load).
SIDE_BY_SIDE = ("llama-server", "meshnet")


TARGETS = ("llama-server", "meshnet", "mesh", "llama-rpc")


def _targets(text: str) -> str:
    """``--targets``: a comma-separated list of :data:`TARGETS` (one at least)."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in names if t not in TARGETS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown target {unknown[0]!r}; choose from {', '.join(TARGETS)}"
                                         if unknown else f"name one target at least: {', '.join(TARGETS)}")
    return text


def add_serve_bench_parser(bench_subparsers) -> None:
    """Add ``serve`` to ``meshnet bench``'s subcommands."""
    p = bench_subparsers.add_parser("serve", help="meshnet api vs llama-server: C concurrent streams, tokens/s, "
                                                  "TTFT, KV bytes per token")
    p.add_argument("--model", default="smollm2", help="GGUF path or bundled name")
    p.add_argument("--concurrency", type=counts, default="1,2,4,8,16,32", help="comma-separated C values")
    p.add_argument("--max-tokens", type=positive_int, default=128)
    p.add_argument("--choices", type=positive_int, default=1,
                   help="choices per request (OpenAI's n); above 1 every choice runs to --max-tokens "
                        "(ignore_eos) and is counted from the stream")
    p.add_argument("--requests-per-stream", type=positive_int, default=2,
                   help=f"requests per concurrent stream at each C (at least {MIN_REQUESTS} requests in all)")
    p.add_argument("--threads", type=thread_count, default=2, help="threads of llama-server and of meshnet in process")
    p.add_argument("--rounds", type=positive_int, default=1,
                   help="measure every target at every C this many times in turn; the ratios are the medians "
                        "of the rounds' (for machines whose speed drifts)")
    p.add_argument("--targets", type=_targets, default="llama-server,meshnet,mesh,llama-rpc",
                   help="which of llama-server, meshnet, mesh, llama-rpc to run (comma-separated)")
    p.add_argument("--side-by-side", action="store_true",
                   help="run llama-server and meshnet in process side by side for a C and let them take turns "
                        "a load at a time (by default every target is started and stopped for each load)")
    p.add_argument("--url", type=http_url, default=None, help="measure only this running OpenAI-compatible server")
    add_api_key_arg(p, help=f"with --url: the key that server asks for (default ${API_KEY_ENV})", only_with="url")
    p.add_argument("--timeout", type=positive_seconds, default=900.0, help="per-request timeout, seconds")
    p.add_argument("--out", type=results_file, default="bench-results/serve.json")
    p.set_defaults(func=run_serve_bench)


def _kv_bytes_per_token(model_path: str) -> int:
    from meshnet.engine.kv_pool import KVPool
    from meshnet.model.gguf_file import open_gguf
    from meshnet.model.hparams import ModelConfig

    cfg = ModelConfig.from_reader(open_gguf(model_path))
    return KVPool.token_bytes(cfg.n_layer, cfg.n_embd_k_gqa, cfg.n_embd_v_gqa)


def _measure(server: Server, model: str, c: int, args, sample_kv: bool, neighbours: list[Server] = ()) -> dict:
    """One timed load at concurrency ``c``; with ``sample_kv``, then an untimed one (a request per stream)
    while :class:`KvSampler` polls ``/metrics``: reading the pool's resident bytes walks the process's
    memory map, and polling it every 0.2 s during the timed load cost meshnet 10-15% of its decode speed.
    ``neighbours``: servers idling beside this one, whose CPU seconds meanwhile the row records."""
    n = max(MIN_REQUESTS, c * args.requests_per_stream)
    spec = LoadSpec(n_requests=n, concurrency=c, max_tokens=args.max_tokens, timeout_s=args.timeout,
                    choices=args.choices)
    rss0 = server.rss_bytes()[0] if server.proc else 0
    cpu0, idle0 = server.cpu_seconds(), [s.cpu_seconds() for s in neighbours]
    results, wall = asyncio.run(run_load(server.url, model, spec, server.headers))
    cpu1, idle1 = server.cpu_seconds(), [s.cpu_seconds() for s in neighbours]
    row = summarize(results, wall)
    if server.proc:
        rss, hwm = server.rss_bytes()
        row["rss_bytes"] = {"before": rss0, "after": rss, "peak": hwm}
    if cpu0 is not None and cpu1 is not None and row["completion_tokens"]:
        # every process of the server (a mesh's nodes and engine workers too), not the load generator
        row["cpu_ms_per_token"] = round(1000 * (cpu1 - cpu0) / row["completion_tokens"], 3)
    if neighbours and None not in idle0 + idle1:
        row["neighbour_cpu_s"] = round(sum(b - a for a, b in zip(idle0, idle1)), 3)
    if sample_kv:
        with KvSampler(server.url) as kv:
            asyncio.run(run_load(server.url, model, LoadSpec(n_requests=c, concurrency=c, max_tokens=args.max_tokens,
                                                             timeout_s=args.timeout, choices=args.choices)))
        if kv.best[0]:
            row["kv"] = {"held_tokens": kv.best[0], "resident_bytes": kv.best[1],
                         "bytes_per_held_token": round(kv.best[1] / kv.best[0], 1)}
    return row


def run_serve_bench(args: argparse.Namespace) -> int:
    """Run every target at every C, alternately; write the JSON and print the table. Returns 0, or 1 when
    a request failed."""
    from meshnet.bench.llama_server import find_or_build, find_tool
    from meshnet.model.bundled import resolve_model

    if args.api_key and not args.url:  # the servers this bench starts ask for no key: it would go unused
        print("error: --api-key is the key of the server --url names; the servers this bench starts ask for "
              "none", file=sys.stderr)
        return 2
    cs = sorted(set(args.concurrency))  # counts >= 1: the flag's type refused anything else
    model_path = str(resolve_model(args.model))
    out = Path(args.out)
    log_dir = out.parent / "serve-logs"
    report: dict = {"bench": "serve", "model": model_path, "max_tokens": args.max_tokens, "temperature": 0.0,
                    "choices": args.choices,
                    "concurrency": cs, "threads": args.threads, "results": {}, "skipped": {},
                    "machine": {"python": platform.python_version(), "cpus": len(os.sched_getaffinity(0))}}
    if args.url:
        servers = {"url": Server.attach("url", args.url, args.api_key)}
        try:
            servers["url"].start()  # before anything is written: nothing answering there is one line
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        groups = [(None, cs)]
    else:
        log_dir.mkdir(parents=True, exist_ok=True)  # the servers started here log into it
        # sequences generated at once: each stream's request runs its choices side by side
        k = args.choices
        servers = meshnet_targets(args, log_dir, max(cs) * k)
        groups = [(8, [c for c in cs if c * k <= 8]), (32, [c for c in cs if c * k > 8])]
        groups = [(np_, g) for np_, g in groups if g]
    llama_bin, rpc, wanted = None, None, {t.strip() for t in args.targets.split(",")}
    if not args.url and wanted & {"llama-server", "llama-rpc"}:
        found, why = find_or_build()
        rpc_server = find_tool("ggml-rpc-server") if found is not None else None
        if found is not None and rpc_server is None:
            why = f"no ggml-rpc-server beside {found}: build it with `python -m meshnet.bench.llama_server`"
        llama_bin = found if "llama-server" in wanted else None
        rpc = (found, rpc_server) if rpc_server is not None and "llama-rpc" in wanted else None
        for name, ready in (("llama-server", found), ("llama-rpc", rpc_server)):
            if name in wanted and ready is None:
                report["skipped"][name] = why
                print(f"[bench serve] {name} skipped: {why}", file=sys.stderr)
    run = _Run(servers, llama_bin, model_path, args, log_dir, report, _kv_bytes_per_token(model_path),
               side_by_side=bool(getattr(args, "side_by_side", False)), rpc=rpc)
    report["side_by_side"] = run.paired
    failed = False
    rounds: list[dict] = [{} for _ in range(max(1, getattr(args, "rounds", 1)))]  # target -> C -> row
    for n_parallel, group in groups:
        for c in group:
            failed |= run.measure_c(c, n_parallel, rounds)
    report["results"] = rounds[-1]
    report["ratios"] = _median_ratios([_ratios(r) for r in rounds])
    if len(rounds) > 1:
        report["rounds"] = [{"results": r, "ratios": _ratios(r)} for r in rounds]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print_table(report)
    print(f"[bench serve] wrote {out}", file=sys.stderr)
    return 1 if failed else 0


@dataclass
class _Run:
    """What every C's measurement shares: the targets (name -> :class:`Server`), llama-server's binary (None:
    skipped), the GGUF, the command line's settings, the folder of the servers' logs, the report (where
    llama-server's flags are noted) and the model's KV bytes per token; ``repack``: whether llama-server
    still repacks its weights (see :func:`meshnet.bench.serve_targets.start_llama_server`); ``rpc``: the
    binaries of llama.cpp's split, ``(llama-server, ggml-rpc-server)`` (None: not measured)."""

    servers: dict
    llama_bin: Path | None
    model_path: str
    args: argparse.Namespace
    log_dir: Path
    report: dict
    kv_bytes_per_token: int
    repack: bool = True
    side_by_side: bool = False
    rpc: tuple[Path, Path] | None = None

    @property
    def names(self) -> list[str]:
        """Every target, in the order they are measured."""
        return ([] if self.llama_bin is None else ["llama-server"]) + list(self.servers) + \
            ([] if self.rpc is None else ["llama-rpc"])

    @property
    def paired(self) -> list[str]:
        """The targets run side by side (none unless ``side_by_side``)."""
        return [n for n in self.names if n in SIDE_BY_SIDE] if self.side_by_side else []

    def measure_c(self, c: int, n_parallel: int | None, rounds: list[dict]) -> bool:
        """Every target at ``c`` streams, every round, into ``rounds`` (one dict per round: target -> C ->
        row); llama-server with ``n_parallel`` slots. Returns whether a request failed.

        Rounds at one C follow each other. With ``side_by_side``, the targets that idle without waking
        (:data:`SIDE_BY_SIDE`) run side by side for the whole C and take turns a load at a time, in the
        order A B, then B A in the next round, so that a drift of the machine's speed within a pair
        cancels; each row records the CPU its idle neighbours used meanwhile (``neighbour_cpu_s``). Every
        other target (always the mesh, whose nodes heartbeat) is started for each of its loads and stopped
        after it, so that nothing else runs beside it: on two cores an idle mesh's wake-ups cost the
        measured server's compute threads a graph's progress (an idle mesh took the API from 76.5 to 68.7
        tokens/s)."""
        names, paired = self.names, self.paired
        failed = False
        if paired:
            started: dict = {}
            try:
                for name in paired:
                    started[name] = self._start(name, n_parallel)
                for r, results in enumerate(rounds):
                    for name in paired if r % 2 == 0 else paired[::-1]:
                        srv, model = started[name]
                        neighbours = [s for n, (s, _) in started.items() if n != name]
                        failed |= self._record(name, c, n_parallel, srv, model, results, neighbours)
            finally:
                for srv, _ in started.values():
                    if srv.proc is not None:
                        srv.stop()
        for results in rounds:
            for name in (n for n in names if n not in paired):
                srv, model = self._start(name, n_parallel)
                try:
                    failed |= self._record(name, c, n_parallel, srv, model, results, [])
                finally:
                    if srv.proc is not None:
                        srv.stop()
        return failed

    def _start(self, name: str, n_parallel: int | None) -> tuple[Server, str]:
        """Start target ``name`` and warm it up with one short request (graphs, caches); returns the server
        and the model id it serves."""
        if name == "llama-server":
            srv, model, self.repack = start_llama_server(self.llama_bin, self.model_path, self.args.threads,
                                                          n_parallel, self.log_dir, self.report, self.repack)
        elif name == "llama-rpc":
            print(f"[bench serve] starting llama-server --rpc -np {n_parallel}", file=sys.stderr, flush=True)
            srv = llama_rpc_server(self.rpc, self.model_path, n_parallel, self.log_dir)
            model = srv.start()
        else:
            srv = self.servers[name]
            print(f"[bench serve] starting {name}", file=sys.stderr, flush=True)
            model = srv.start()
        try:
            asyncio.run(run_load(srv.url, model, LoadSpec(1, 1, max_tokens=8), srv.headers))
        except BaseException:
            if srv.proc is not None:
                srv.stop()
            raise
        return srv, model

    def _record(self, name: str, c: int, n_parallel: int | None, srv: Server, model: str, results: dict,
                neighbours: list[Server]) -> bool:
        """One timed load of ``srv`` at ``c`` into ``results``; returns whether a request failed."""
        print(f"[bench serve] {name}: C={c}", file=sys.stderr, flush=True)
        row = _measure(srv, model, c, self.args, sample_kv=name == "meshnet", neighbours=neighbours)
        if name == "llama-server":
            # each choice holds the prompt in a slot of its own
            prompts = row["prompt_tokens"] * getattr(self.args, "choices", 1)
            held = min(c, row["requests"]) * (prompts + row["completion_tokens"]) / max(1, row["completed"])
            allocated = LLAMA_SLOT_CTX * n_parallel * self.kv_bytes_per_token
            row["kv"] = {"allocated_bytes": allocated,
                         "bytes_per_held_token": round(allocated / max(1.0, held), 1),
                         "n_parallel": n_parallel}
        results.setdefault(name, {})[str(c)] = row
        return row["errors"] > 0


def _median_ratios(per_round: list[dict]) -> dict:
    """Each ratio of :func:`_ratios`'s shape (C -> name -> value or None): the median of the rounds' values
    (None where no round has one)."""
    out: dict = {}
    for c in sorted({c for r in per_round for c in r}, key=int):
        out[c] = {}
        for k in sorted({k for r in per_round for k in r.get(c, {})}):
            vals = [r[c][k] for r in per_round if r.get(c, {}).get(k) is not None]
            out[c][k] = round(statistics.median(vals), 3) if vals else None
    return out


def _ratios(results: dict) -> dict:
    """Per C: meshnet and mesh over llama-server (aggregate and per-stream decode tokens/s; TTFT p50, where
    lower is better), mesh over meshnet in process and over llama.cpp's split (llama-rpc: aggregate, per-stream
    decode, TTFT), and the same pairs' CPU milliseconds per token (lower is better)."""
    out: dict = {}
    ref, ours, mesh = results.get("llama-server", {}), results.get("meshnet", {}), results.get("mesh", {})
    rpc = results.get("llama-rpc", {})

    def div(a, b):
        return round(a / b, 3) if a is not None and b else None

    for c in sorted({*ref, *ours, *mesh, *rpc}, key=int):
        r, o, m, s = ref.get(c, {}), ours.get(c, {}), mesh.get(c, {}), rpc.get(c, {})
        out[c] = {
            "meshnet_aggregate_vs_llama": div(o.get("tokens_per_s"), r.get("tokens_per_s")),
            "meshnet_decode_vs_llama": div(o.get("decode_tokens_per_s_p50"), r.get("decode_tokens_per_s_p50")),
            "meshnet_ttft_vs_llama": div((o.get("ttft_s") or {}).get("p50"), (r.get("ttft_s") or {}).get("p50")),
            "mesh_aggregate_vs_llama": div(m.get("tokens_per_s"), r.get("tokens_per_s")),
            "mesh_vs_meshnet": div(m.get("tokens_per_s"), o.get("tokens_per_s")),
            # CPU time a token costs (lower is better): steadier than throughput on a busy host
            "meshnet_cpu_vs_llama": div(o.get("cpu_ms_per_token"), r.get("cpu_ms_per_token")),
            "mesh_cpu_vs_meshnet": div(m.get("cpu_ms_per_token"), o.get("cpu_ms_per_token")),
            "mesh_vs_llama_rpc": div(m.get("tokens_per_s"), s.get("tokens_per_s")),
            "mesh_decode_vs_llama_rpc": div(m.get("decode_tokens_per_s_p50"), s.get("decode_tokens_per_s_p50")),
            "mesh_ttft_vs_llama_rpc": div((m.get("ttft_s") or {}).get("p50"), (s.get("ttft_s") or {}).get("p50")),
            "mesh_cpu_vs_llama_rpc": div(m.get("cpu_ms_per_token"), s.get("cpu_ms_per_token")),
        }
    return out


def _ratio_cells(ratios: dict, keys: tuple[str, ...]) -> str:
    """The ``keys`` of one C's ratios, space-separated, "-" for those missing."""
    return " ".join(f"{ratios.get(k) if ratios.get(k) is not None else '-'}" for k in keys)


def print_table(report: dict) -> None:
    res = report["results"]
    names = [n for n in ("llama-server", "meshnet", "mesh", "llama-rpc", "url") if n in res]
    cols = "  ".join(f"{n + ' tok/s agg|stream|TTFT':>36}" for n in names)
    ratios = "ratios (meshnet/llama agg, decode, TTFT; mesh/meshnet; mesh/llama-rpc agg, TTFT)"
    print(f"{'C':>3}  {cols}  {ratios:>40}")
    for c in report["concurrency"]:
        cells = []
        for n in names:
            r = res[n].get(str(c))
            if r is None:
                cells.append(f"{'-':>36}")
                continue
            cells.append(f"{r['tokens_per_s'] or 0:>14.1f} {r['decode_tokens_per_s_p50'] or 0:>9.1f} "
                         f"{(r['ttft_s']['p50'] or 0):>10.3f}s")
        q = report.get("ratios", {}).get(str(c), {})
        ratio = _ratio_cells(q, ("meshnet_aggregate_vs_llama", "meshnet_decode_vs_llama", "meshnet_ttft_vs_llama",
                                 "mesh_vs_meshnet", "mesh_vs_llama_rpc", "mesh_ttft_vs_llama_rpc"))
        print(f"{c:>3}  {'  '.join(cells)}  {ratio:>40}")
    if any(r.get("cpu_ms_per_token") is not None for n in names for r in res[n].values()):
        print(f"{'C':>3}  " + "  ".join(f"{n + ' CPU ms/token':>24}" for n in names)
              + f"  {'ratios (meshnet/llama; mesh/meshnet; mesh/llama-rpc)':>38}")
        for c in report["concurrency"]:
            cells = [f"{(res[n].get(str(c)) or {}).get('cpu_ms_per_token') or '-':>24}" for n in names]
            q = report.get("ratios", {}).get(str(c), {})
            ratio = _ratio_cells(q, ("meshnet_cpu_vs_llama", "mesh_cpu_vs_meshnet", "mesh_cpu_vs_llama_rpc"))
            print(f"{c:>3}  {'  '.join(cells)}  {ratio:>38}")
    if report.get("choices", 1) > 1:
        print(f"({report['choices']} choices a request: tokens/s count every choice's, TTFT a request's first)")
    if "rounds" in report:
        print(f"(figures of the last of {len(report['rounds'])} rounds; ratios: the medians of the rounds')")
