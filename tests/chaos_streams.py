"""The chaos soak's load: streamed ``/v1/completions`` requests over HTTP, each recorded with what came
back (text, tokens, finish reason or error, gaps between chunks) and judged against the solo run."""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass, field

import httpx

# Error codes the API gives a generation the mesh could not finish: a clear answer, not a crash.
MESH_ERRORS = {"mesh_unavailable", "mesh_error"}


@dataclass
class StreamOutcome:
    """One streamed request. ``tokens``: tokens the stream carried (its logprobs entries); ``gaps_s``:
    seconds between consecutive chunks; ``error``: the error object (an SSE error event, an error
    status's body, or ``{"transport": ...}`` when the connection broke)."""

    prompt: int
    max_tokens: int
    status: int = 0
    text: str = ""
    tokens: int = 0
    finish: str | None = None
    error: dict | None = None
    done: bool = False
    started_s: float = 0.0  # time.monotonic() at the request
    seconds: float = 0.0
    gaps_s: list[float] = field(default_factory=list)


def stream_completion(api_url: str, prompt_ids: list[int], prompt: int, max_tokens: int,
                      timeout_s: float = 120.0) -> StreamOutcome:
    """POST a greedy streamed completion of ``prompt_ids`` and read it to the end. Never raises."""
    out = StreamOutcome(prompt, max_tokens)
    t0 = last = out.started_s = time.monotonic()
    body = {"prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0, "stream": True, "logprobs": 0}
    try:
        with httpx.stream("POST", f"{api_url}/v1/completions", json=body, timeout=timeout_s) as r:
            out.status = r.status_code
            if r.status_code != 200:
                out.error = json.loads(r.read()).get("error")
                return out
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                now = time.monotonic()
                out.gaps_s.append(now - last)
                last = now
                data = line[len("data: "):]
                if data == "[DONE]":
                    out.done = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    out.error = event["error"]
                    continue
                for choice in event["choices"]:
                    out.text += choice["text"]
                    out.tokens += len((choice.get("logprobs") or {}).get("tokens") or [])
                    out.finish = choice.get("finish_reason") or out.finish
    except (httpx.HTTPError, ValueError) as e:
        out.error = {"transport": f"{type(e).__name__}: {e}"}
    finally:
        out.seconds = time.monotonic() - t0
    return out


def judge(out: StreamOutcome, want_text: str, want_tokens: int) -> str:
    """"finished" (the whole solo text, every token once), "failed" (a clear mesh error, and what came
    before it is a prefix of the solo text), or a description of what is wrong."""
    if out.done and out.error is None:
        if out.text == want_text and out.tokens == want_tokens and out.finish in ("length", "stop"):
            return "finished"
        return (f"finished wrong: {out.tokens} tokens (want {want_tokens}), finish {out.finish}, "
                f"text {out.text!r} (want {want_text!r})")
    code = (out.error or {}).get("code")
    if code in MESH_ERRORS and out.status in (200, 503) and (out.error or {}).get("message") and not out.done:
        if want_text.startswith(out.text):
            return "failed"
        return f"failed after wrong text {out.text!r} (want a prefix of {want_text!r})"
    return f"bad ending: status {out.status}, error {out.error}, done {out.done}, text {out.text!r}"


class StreamLoad:
    """``n_streams`` threads, each sending one streamed request after another until :meth:`stop`; the
    prompt (an index into ``prompts``) and ``max_tokens`` (from ``budgets``) drawn from ``seed``."""

    def __init__(self, api_url: str, prompts: dict[int, list[int]], budgets: tuple[int, ...], seed: int,
                 n_streams: int = 8) -> None:
        self.api_url, self.prompts, self.budgets = api_url, prompts, budgets
        self.outcomes: list[StreamOutcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(random.Random(seed * 1000 + i),), daemon=True)
                         for i in range(n_streams)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self, timeout_s: float = 180.0) -> bool:
        """No new requests; wait for those in flight. Returns whether every thread ended in time."""
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    def _run(self, rng: random.Random) -> None:
        while not self._stop.is_set():
            i = rng.choice(sorted(self.prompts))
            out = stream_completion(self.api_url, self.prompts[i], i, rng.choice(self.budgets))
            with self._lock:
                self.outcomes.append(out)
            if out.status == 503 and out.error and out.error.get("code") in MESH_ERRORS:
                time.sleep(0.5)  # what Retry-After asks for, shortened: keep the load on
