"""``meshnet bench api``: a bounded load of concurrent streaming chat requests against the HTTP API.

By default it starts the API in this process over an in-process chain of the bundled model; ``--url``
points it at a running server instead (``meshnet api`` / ``meshnet up --api-port``). Every request is a
streaming ``/v1/chat/completions`` with ``stream_options.include_usage``; the run sends exactly
``--requests`` of them, at most ``--concurrency`` at a time, and waits for all of them to finish.

Written JSON (``--out``): time to first token (TTFT: request sent to first content chunk) p50/p95/max in
seconds, whole-request latency p50/p95, aggregate generated tokens per second (all completion tokens
over the wall time), the per-request decode rate median, and the error count with a few samples. The
exit code is 1 when any request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import time
from pathlib import Path

DEFAULT_PROMPT = "Write a short story about a robot who learns to paint."


def add_api_bench_parser(bench_subparsers) -> None:
    """Add ``api`` to ``meshnet bench``'s subcommands."""
    p = bench_subparsers.add_parser("api", help="concurrent streaming chat requests against the HTTP API: "
                                               "TTFT p50/p95, tokens/s, errors")
    p.add_argument("--url", default=None,
                   help="base URL of a running API, e.g. http://127.0.0.1:8000 (default: start one in this "
                        "process over the bundled model)")
    p.add_argument("--model", default="smollm2", help="in-process model: GGUF path or bundled name")
    p.add_argument("--stages", type=int, default=1, help="in-process layer ranges")
    p.add_argument("--threads", type=int, default=2, help="in-process CPU threads per stage")
    p.add_argument("--n-ctx", type=int, default=1024, help="in-process context length per session")
    p.add_argument("--max-sessions", type=int, default=16,
                   help="in-process sessions per stage (the API's concurrency; more requests queue)")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight at once")
    p.add_argument("--requests", type=int, default=None, help="requests in all (default: --concurrency)")
    p.add_argument("--max-tokens", type=int, default=32, help="max_tokens of each request")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--timeout", type=float, default=900.0, help="per-request timeout, seconds")
    p.add_argument("--out", default="bench-results/api.json")
    p.set_defaults(func=run_api_bench)


def _pct(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile ``q`` (0..100) of ``values``; None when empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return round(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo), 4)


async def _one(client, model: str, i: int, args: argparse.Namespace) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": args.prompt}], "max_tokens": args.max_tokens,
            "temperature": args.temperature, "seed": i, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft = None
    usage = None
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                return {"ok": False, "error": f"HTTP {r.status_code}: {text[:300]}"}
            done = False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    return {"ok": False, "error": event["error"].get("message", str(event["error"]))}
                if event.get("usage"):
                    usage = event["usage"]
                for ch in event.get("choices", ()):
                    if ttft is None and ch.get("delta", {}).get("content"):
                        ttft = time.perf_counter() - t0
            if not done:
                return {"ok": False, "error": "the stream ended without [DONE]"}
    except Exception as e:  # a failed request is counted and reported, not fatal to the run
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    total = time.perf_counter() - t0
    n = usage["completion_tokens"] if usage else 0
    decode = (n - 1) / (total - ttft) if ttft is not None and n > 1 and total > ttft else None
    return {"ok": True, "ttft_s": ttft, "latency_s": total, "completion_tokens": n, "decode_tokens_per_s": decode}


async def _load(url: str, model: str, args: argparse.Namespace, n_requests: int) -> tuple[list[dict], float]:
    import httpx

    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    sem = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout, limits=limits) as client:
        async def bounded(i: int) -> dict:
            async with sem:
                return await _one(client, model, i, args)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(bounded(i) for i in range(n_requests)))
        return list(results), time.perf_counter() - t0


def run_api_bench(args: argparse.Namespace) -> int:
    """Run the load and write the JSON report to ``args.out``. Returns 0, or 1 when a request failed."""
    import httpx

    n_requests = args.requests or args.concurrency
    if n_requests < 1 or args.concurrency < 1 or args.max_tokens < 1:
        print("error: --requests, --concurrency and --max-tokens must be >= 1", file=sys.stderr)
        return 2
    server = thread = backend = None
    url = args.url
    try:
        if url is None:
            from meshnet.api.backend import local_backend
            from meshnet.api.server import start_api_in_thread

            backend = local_backend(args.model, stages=args.stages, n_threads=args.threads, n_ctx=args.n_ctx,
                                    max_sessions=args.max_sessions, progress=sys.stderr.isatty())
            server, thread = start_api_in_thread(backend, "127.0.0.1", 0)
            url = f"http://127.0.0.1:{server.config.port}"
            where = f"in-process API over {args.model} ({args.stages} stage(s), {args.threads} thread(s) each)"
        else:
            where = url
        model = httpx.get(url.rstrip("/") + "/v1/models", timeout=30).json()["data"][0]["id"]
        print(f"[bench api] {n_requests} streaming chat requests, {args.concurrency} at a time, "
              f"max_tokens {args.max_tokens}, against {where}", file=sys.stderr, flush=True)
        results, wall = asyncio.run(_load(url, model, args, n_requests))
    finally:
        if server is not None:
            from meshnet.api.server import stop_api

            stop_api(server, thread)

    ok = [r for r in results if r["ok"]]
    errors = [r["error"] for r in results if not r["ok"]]
    ttfts = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    tokens = sum(r["completion_tokens"] for r in ok)
    report = {
        "bench": "api",
        "target": where,
        "model": model,
        "requests": n_requests,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "completed": len(ok),
        "errors": len(errors),
        "error_samples": errors[:5],
        "wall_s": round(wall, 3),
        "completion_tokens": tokens,
        "tokens_per_s": round(tokens / wall, 2) if wall > 0 else None,
        "ttft_s": {"p50": _pct(ttfts, 50), "p95": _pct(ttfts, 95), "max": _pct(ttfts, 100)},
        "latency_s": {"p50": _pct([r["latency_s"] for r in ok], 50),
                      "p95": _pct([r["latency_s"] for r in ok], 95)},
        "decode_tokens_per_s_per_request_p50": _pct(
            [r["decode_tokens_per_s"] for r in ok if r["decode_tokens_per_s"] is not None], 50),
        "machine": {"python": platform.python_version(), "cpus": _cpus()},
    }
    if backend is not None:
        report["in_process"] = {"stages": args.stages, "threads_per_stage": args.threads, "n_ctx": args.n_ctx,
                                "max_concurrency": backend.max_concurrency}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    print(f"[bench api] wrote {out}", file=sys.stderr)
    return 1 if errors else 0


def _cpus() -> int | None:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
