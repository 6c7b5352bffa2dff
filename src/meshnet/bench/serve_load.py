"""A bounded load of concurrent streaming chat requests against one OpenAI-compatible server.

Every request is a streaming ``/v1/chat/completions`` with ``stream_options.include_usage``; a load sends
exactly ``n_requests``, at most ``concurrency`` at a time, and waits for all. Works against ``meshnet api``
and llama.cpp's ``llama-server`` alike (both speak the same protocol), which is what lets
``meshnet bench serve`` compare them request for request.

A load of requests with several choices (OpenAI's ``n``) also asks for ``ignore_eos`` (both servers take
it), so that every choice runs to ``max_tokens``, and counts a request's tokens choice by choice from the
stream (a choice cut by its budget holds ``max_tokens``): llama-server's ``usage`` counts one choice's
tokens for ``n`` > 1.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

# Short chat prompts, one per request in turn: the same for every server.
PROMPTS = (
    "Write a short story about a robot who learns to paint.",
    "Explain how a bicycle stays upright.",
    "List five uses for a paperclip.",
    "What is the capital of France, and why is it famous?",
    "Describe the water cycle to a child.",
    "Give me three tips for learning a new language.",
    "Why is the sky blue?",
    "Write a haiku about autumn leaves.",
)


@dataclass(frozen=True)
class LoadSpec:
    """What one load sends: ``n_requests`` requests, ``concurrency`` at a time, each with ``max_tokens``
    at ``temperature`` (0 = greedy) and ``choices`` choices, request ``i`` asking
    ``prompts[i % len(prompts)]``."""

    n_requests: int
    concurrency: int
    max_tokens: int = 128
    temperature: float = 0.0
    prompts: tuple[str, ...] = PROMPTS
    timeout_s: float = 900.0
    choices: int = 1


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile ``q`` (0..100) of ``values``; None when empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return round(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo), 4)


async def one_request(client, model: str, i: int, spec: LoadSpec) -> dict:
    """One streaming chat request. Returns ``{"ok", "ttft_s", "latency_s", "prompt_tokens",
    "completion_tokens", "decode_tokens_per_s"}`` (tokens of every choice; TTFT: the first token of any;
    decode: the tokens after each choice's first over the time after the request's first) or
    ``{"ok": False, "error"}``; never raises."""
    body = {"model": model, "messages": [{"role": "user", "content": spec.prompts[i % len(spec.prompts)]}],
            "max_tokens": spec.max_tokens, "temperature": spec.temperature, "seed": i, "stream": True,
            "stream_options": {"include_usage": True}}
    if spec.choices > 1:
        body.update(n=spec.choices, ignore_eos=True)
    t0 = time.perf_counter()
    ttft = usage = None
    pieces: dict[int, int] = {}  # choice index -> chunks with content
    finished: dict[int, str] = {}  # choice index -> finish_reason
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
                    if ch.get("delta", {}).get("content"):
                        pieces[ch.get("index", 0)] = pieces.get(ch.get("index", 0), 0) + 1
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                    if ch.get("finish_reason"):
                        finished[ch.get("index", 0)] = ch["finish_reason"]
            if not done:
                return {"ok": False, "error": "the stream ended without [DONE]"}
    except Exception as e:  # a failed request is counted and reported, not fatal to the run
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    total = time.perf_counter() - t0
    if spec.choices > 1:  # each choice cut by its budget holds max_tokens; one that ended sooner, its chunks
        n = sum(spec.max_tokens if finished.get(c) == "length" else pieces.get(c, 0) for c in range(spec.choices))
    else:
        n = usage["completion_tokens"] if usage else 0
    decode = ((n - spec.choices) / (total - ttft) if ttft is not None and n > spec.choices and total > ttft
              else None)
    return {"ok": True, "ttft_s": ttft, "latency_s": total, "completion_tokens": n,
            "prompt_tokens": usage.get("prompt_tokens", 0) if usage else 0, "decode_tokens_per_s": decode}


async def run_load(url: str, model: str, spec: LoadSpec,
                   headers: dict[str, str] | None = None) -> tuple[list[dict], float]:
    """Send the load (``headers`` with every request); returns each request's result (in request order)
    and the wall time in seconds."""
    import httpx

    limits = httpx.Limits(max_connections=spec.concurrency, max_keepalive_connections=spec.concurrency)
    sem = asyncio.Semaphore(spec.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=spec.timeout_s, limits=limits, headers=headers) as client:
        async def bounded(i: int) -> dict:
            async with sem:
                return await one_request(client, model, i, spec)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(bounded(i) for i in range(spec.n_requests)))
        return list(results), time.perf_counter() - t0


def summarize(results: list[dict], wall_s: float) -> dict:
    """Aggregate tokens/s (completion tokens over the wall time), per-stream decode tokens/s p50, TTFT
    p50/p95 and latency p50/p95 in seconds, and the errors with a few samples."""
    ok = [r for r in results if r["ok"]]
    errors = [r["error"] for r in results if not r["ok"]]
    ttfts = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    tokens = sum(r["completion_tokens"] for r in ok)
    return {
        "requests": len(results), "completed": len(ok), "errors": len(errors), "error_samples": errors[:5],
        "wall_s": round(wall_s, 3), "completion_tokens": tokens,
        "prompt_tokens": sum(r["prompt_tokens"] for r in ok),
        "tokens_per_s": round(tokens / wall_s, 2) if wall_s > 0 else None,
        "decode_tokens_per_s_p50": percentile([r["decode_tokens_per_s"] for r in ok
                                               if r["decode_tokens_per_s"] is not None], 50),
        "ttft_s": {"p50": percentile(ttfts, 50), "p95": percentile(ttfts, 95)},
        "latency_s": {"p50": percentile([r["latency_s"] for r in ok], 50),
                      "p95": percentile([r["latency_s"] for r in ok], 95)},
    }
