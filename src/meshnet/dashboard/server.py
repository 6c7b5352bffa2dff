"""The tracker's web dashboard over HTTP: one static page (``dashboard.html``, plain JS and inline SVG,
no build step) and the state it draws.

* ``GET /``: the page.
* ``GET /api/state``: the state as JSON (:func:`meshnet.dashboard.state.dashboard_state`).
* ``GET /api/events``: the same state as server-sent events: a ``data:`` line whenever the map, the
  nodes' liveness, the sessions or the ledger change (checked every :data:`TICK_S`), and at least once
  a second; the page falls back to polling ``/api/state`` when the stream breaks.

The state is read from the tracker's service in process (its registry, ledger and clients' activity), at
most once per :data:`TICK_S` however many pages are open.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass
from importlib import resources
from typing import Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse

from meshnet import __version__
from meshnet.dashboard.state import dashboard_state

TICK_S = 0.1  # how often the event stream looks for changes, seconds
REFRESH_S = 1.0  # an event at least this often, seconds (heartbeat ages and charts move on)


def tracker_state(service) -> dict:
    """The dashboard state of a running :class:`~meshnet.tracker.service.TrackerService`, read through
    the same mappers as ``meshnet nodes --json`` and ``meshnet ledger --json``."""
    from meshnet.ledger.cli import ledger_dict
    from meshnet.ledger.wire import ledger_reply
    from meshnet.membership.cli import nodes_dict

    registry = service.registry
    return dashboard_state(nodes_dict(service.node_list()), service.activity.snapshot(),
                           ledger_dict(ledger_reply(service.ledger)),
                           {"version": __version__, "heartbeat_interval_s": registry.heartbeat_interval_s,
                            "ttl_s": registry.ttl_s, "time": time.time()})


class _Cached:
    """``read()`` at most once per ``max_age_s`` seconds; callers in between share the last result."""

    def __init__(self, read: Callable[[], dict], max_age_s: float) -> None:
        self._read, self.max_age_s = read, max_age_s
        self._lock = threading.Lock()
        self._value: dict | None = None
        self._at = 0.0

    def __call__(self) -> dict:
        with self._lock:
            if self._value is None or time.monotonic() - self._at >= self.max_age_s:
                self._value, self._at = self._read(), time.monotonic()
            return self._value


def _fingerprint(state: dict) -> str:
    """What a change in deserves an event at once (not the heartbeat ages or the clock)."""
    return json.dumps([state["maps"], [(n["node_id"], n["late"], n["active_sessions"]) for n in state["nodes"]],
                       [(s["session_id"], s["epoch"], s["tokens"]) for s in state["sessions"]], state["ledger"]])


def create_dashboard_app(read_state: Callable[[], dict], stopping: threading.Event | None = None) -> FastAPI:
    """The dashboard's ASGI app over ``read_state`` (returns :func:`dashboard_state`'s object; called
    from worker threads). ``stopping``: once set, open event streams end (so a server stops at once)."""
    app = FastAPI(title="meshnet dashboard", docs_url=None, redoc_url=None, openapi_url=None)
    state = _Cached(read_state, TICK_S)
    stopping = stopping or threading.Event()
    page = resources.files("meshnet.dashboard").joinpath("dashboard.html").read_text(encoding="utf-8")

    @app.get("/", response_class=HTMLResponse)
    def index() -> HTMLResponse:
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    @app.get("/api/state")
    def api_state() -> JSONResponse:
        return JSONResponse(state(), headers={"Cache-Control": "no-store"})

    @app.get("/api/events")
    async def api_events(request: Request) -> StreamingResponse:
        async def stream():
            sent, sent_at = None, 0.0
            while not stopping.is_set() and not await request.is_disconnected():
                current = await run_in_threadpool(state)
                mark = _fingerprint(current)
                if mark != sent or time.monotonic() - sent_at >= REFRESH_S:
                    sent, sent_at = mark, time.monotonic()
                    yield f"data: {json.dumps(current)}\n\n"
                await asyncio.sleep(TICK_S)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    return app


@dataclass
class Dashboard:
    """A dashboard being served; :meth:`stop` ends it."""

    server: uvicorn.Server
    thread: threading.Thread
    stopping: threading.Event
    url: str

    def stop(self, timeout_s: float = 5.0) -> None:
        from meshnet.api.server import stop_api

        self.stopping.set()
        stop_api(self.server, self.thread, timeout_s)


def start_dashboard(service, host: str = "127.0.0.1", port: int = 0) -> Dashboard:
    """Serve the dashboard of tracker ``service`` on ``host:port`` (0 = any free port) in a daemon thread.

    Raises:
        OSError: the address cannot be bound (e.g. the port is in use).
        RuntimeError: the server did not start.
    """
    from meshnet.api.server import serve_app_in_thread
    from meshnet.wire.addresses import format_address, this_machine_address

    stopping = threading.Event()
    server, thread = serve_app_in_thread(create_dashboard_app(lambda: tracker_state(service), stopping), host,
                                         port, name="meshnet-dashboard")
    # Bound to every interface, it is named by an address another machine can open (0.0.0.0 is none).
    url = f"http://{format_address(this_machine_address(host), server.config.port)}/"
    return Dashboard(server, thread, stopping, url)

