"""An API server over an in-process backend, on a free loopback port, with an ``httpx`` client and the
official ``openai`` client pointed at it (both imported by the caller's ``importorskip``)."""

from __future__ import annotations

from contextlib import contextmanager

from meshnet.api.server import start_api_in_thread, stop_api


@contextmanager
def served_api(backend, timeout_s: float = 120):
    """Yield ``(backend, http, client)`` while the server runs; stops it after."""
    import httpx
    import openai

    server, thread = start_api_in_thread(backend, "127.0.0.1", 0)
    base = f"http://127.0.0.1:{server.config.port}"
    try:
        with httpx.Client(base_url=base, timeout=timeout_s) as http:
            yield backend, http, openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0,
                                               timeout=timeout_s)
    finally:
        stop_api(server, thread)
