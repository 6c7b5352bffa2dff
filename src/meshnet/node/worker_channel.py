"""The node's end of the pipe to one engine worker process: concurrent calls matched to their replies.

Many node threads call at once (gRPC handlers, the data plane, the relay, the membership loop); each
call gets an id, its thread waits for the reply with that id, and one reader thread hands replies out.
When the pipe closes (the worker died or was killed) every waiting call raises
:class:`~meshnet.node.worker_wire.EngineUnavailable` at once, and so does every later call.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
from typing import Any, Callable

from meshnet.node import worker_wire as ww

log = logging.getLogger("meshnet.node")

# Extra seconds a ping's answer is waited for after its deadline (see WorkerChannel.ping).
_PING_GRACE_S = 0.5


class EngineCallFailed(RuntimeError):
    """The engine raised inside the worker (a bug, or the fake engine's ``raise`` crash); the message
    is the worker's ``"ExceptionType: message"``."""


class _Pending:
    __slots__ = ("call_id", "done", "kind", "meta", "method", "on_done", "payload")

    def __init__(self, call_id: int, method: str = "", on_done: Callable[[Any], None] | None = None) -> None:
        self.call_id = call_id
        self.method = method
        self.on_done = on_done  # None: the caller waits on ``done``
        self.done = threading.Event()
        self.kind: ww.Kind | None = None  # None when the pipe closed first
        self.meta = self.payload = b""


class WorkerChannel:
    """Calls into one worker over ``sock`` (already past LOAD/READY). Thread-safe.

    ``lost`` is set once the pipe has closed; ``lost_reason`` then says why: the reason given to
    :meth:`close`, else what ``explain()`` says (e.g. the worker's exit status), else "the pipe closed".
    """

    def __init__(self, sock: socket.socket, explain: Callable[[], str] | None = None) -> None:
        self._sock = sock
        self._explain = explain
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)
        self.lost = threading.Event()
        self.lost_reason = ""
        self._reader = threading.Thread(target=self._read, daemon=True, name="engine-worker-reader")
        self._reader.start()

    def call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        """Run ``engine.method(*args)`` in the worker and return its result.

        Raises:
            EngineUnavailable: the worker died (or was killed) before answering, or ``timeout_s``
                (seconds; None = no limit) passed first.
            EngineCallFailed: the engine raised.
        """
        pending = self._request(ww.Kind.CALL, *ww.encode_call(method, args))
        if not pending.done.wait(timeout_s):
            with self._lock:
                self._pending.pop(pending.call_id, None)
            raise ww.EngineUnavailable(f"engine worker did not answer {method} within {timeout_s:.1f} s")
        if pending.kind is None:
            raise ww.EngineUnavailable(f"engine worker died during {method} ({self.lost_reason})")
        if pending.kind is ww.Kind.RAISED:
            raise EngineCallFailed(ww.decode(pending.meta, pending.payload))
        return ww.decode(pending.meta, pending.payload)

    def call_async(self, method: str, *args: Any, on_done: Callable[[Any], None]) -> None:
        """Start ``engine.method(*args)`` in the worker without a thread waiting for it: ``on_done`` gets
        the result, or the exception :meth:`call` would raise (EngineUnavailable, EngineCallFailed),
        exactly once, on this channel's reading thread, which hands out every other reply meanwhile:
        it must not block for long.

        Raises:
            EngineUnavailable: the worker is gone already (``on_done`` is then never called).
        """
        self._request(ww.Kind.CALL, *ww.encode_call(method, args), method=method, on_done=on_done)

    def ping(self, timeout_s: float) -> bool:
        """Whether the worker's reading thread answers within ``timeout_s`` seconds (its Python runs). A ping
        that cannot be sent within ``timeout_s``, behind a call's message that fills the pipe of a worker
        that stopped reading (a prefill's megabytes to a stopped worker), is not answered: the watchdog
        waited on the pipe for good, and the hung worker was never killed."""
        try:
            pending = self._request(ww.Kind.PING, lock_timeout_s=timeout_s)
        except ww.EngineUnavailable:
            return False
        # The grace covers this process having been stopped itself (SIGSTOP, a frozen VM): on waking, the
        # wait may time out before the reader thread hands over the answer that arrived meanwhile.
        answered = pending.done.wait(timeout_s) or pending.done.wait(_PING_GRACE_S)
        return answered and pending.kind is ww.Kind.PONG

    def close(self, reason: str = "") -> None:
        """Close the pipe; waiting calls fail with ``reason`` (what happened to the worker)."""
        if reason and not self.lost.is_set():
            self.lost_reason = reason
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._reader.join(5)
        self._sock.close()

    def _request(self, kind: ww.Kind, meta: bytes = b"", payload: bytes = b"", method: str = "",
                 on_done: Callable[[Any], None] | None = None, lock_timeout_s: float | None = None) -> _Pending:
        with self._lock:
            if self.lost.is_set():
                raise ww.EngineUnavailable(f"engine worker is gone ({self.lost_reason})")
            call_id = next(self._ids)
            pending = self._pending[call_id] = _Pending(call_id, method, on_done)
        try:
            ww.send(self._sock, self._send_lock, kind, call_id, meta, payload, lock_timeout_s)
        except OSError:
            with self._lock:
                self._pending.pop(call_id, None)
            raise ww.EngineUnavailable(f"engine worker is gone ({self.lost_reason or 'pipe closed'})") from None
        return pending

    def _read(self) -> None:
        try:
            while True:
                kind, call_id, meta, payload = ww.receive(self._sock)
                with self._lock:
                    pending = self._pending.pop(call_id, None)
                if pending is None:
                    continue
                if pending.on_done is not None:
                    _hand_out(pending, kind, meta, payload)
                    continue
                pending.kind, pending.meta, pending.payload = kind, meta, payload
                pending.done.set()
        except (EOFError, OSError):
            pass
        reason = self.lost_reason or (self._explain() if self._explain else "") or "the pipe closed"
        with self._lock:
            self.lost_reason = reason
            self.lost.set()
            waiting, self._pending = self._pending, {}
        for pending in waiting.values():
            if pending.on_done is not None:
                _call(pending, ww.EngineUnavailable(f"engine worker died during {pending.method} ({reason})"))
            else:
                pending.done.set()  # kind None: the worker is gone


def _hand_out(pending: _Pending, kind: ww.Kind, meta: bytes, payload: bytes) -> None:
    """Give an asynchronous call's answer to its ``on_done``."""
    try:
        out = ww.decode(meta, payload)
        if kind is ww.Kind.RAISED:
            out = EngineCallFailed(out)
    except Exception as e:  # noqa: BLE001 - an answer that does not decode fails its call alone
        out = EngineCallFailed(f"{type(e).__name__}: {e}")
    _call(pending, out)


def _call(pending: _Pending, out: Any) -> None:
    try:
        pending.on_done(out)
    except Exception:  # a failing callback must not stop the replies of every other call
        log.exception("handling the engine worker's answer to %s failed", pending.method)
