"""The data plane's step pool: runs a connection's steps on worker threads and queues the connection's
way back to the selector thread (the server: :mod:`meshnet.wire.data_plane_server`).

Workers never touch the selector: what they finish waits in ``done``, ``answers`` or ``forwards_done``,
and ``wake()`` has the selector thread take it.
"""

from __future__ import annotations

import collections
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from meshnet.proto import meshnet_pb2 as pb
from meshnet.wire.data_plane import ERROR, REPLY, encode_error, encode_messages
from meshnet.wire.data_plane_conn import Conn

log = logging.getLogger("meshnet.data_plane")


class StepPool:
    """``workers`` threads running requests, forwarded steps and answers to awaits.

    Args:
        run_step, run_forward: as :class:`meshnet.wire.data_plane_server.DataPlaneServer` takes them.
        read_timeout_s: how long sending an answer may block.
        wake: wakes the selector thread (callable from any thread).
    """

    def __init__(self, workers: int, run_step: Callable, run_forward: Callable | None, read_timeout_s: float,
                 wake: Callable[[], None]) -> None:
        self._run_step, self._run_forward = run_step, run_forward
        self._read_timeout_s = read_timeout_s
        self._wake = wake
        self.done: collections.deque[tuple[Conn, bool]] = collections.deque()  # (conn, keep) from workers
        self.answers: collections.deque[tuple[Conn, object]] = collections.deque()  # awaits answered
        self.forwards_done: collections.deque[Conn] = collections.deque()  # a forwarded step of conn ran
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="data-plane-step")

    def serve(self, c: Conn, frames: list[pb.Envelope]) -> None:
        """Run a request's ``frames`` and answer on ``c``, which the worker owns until then."""
        self._pool.submit(self._serve, c, frames)

    def forward(self, c: Conn, frames: list[pb.Envelope]) -> None:
        """Run a forwarded step's ``frames``; nothing is answered on ``c``."""
        self._pool.submit(self._forwarded, c, frames)

    def answer(self, c: Conn, data: bytes) -> None:
        """Send the encoded answer ``data`` (see :func:`encode_outcome`) on ``c`` from a worker
        (RuntimeError: the pool is shut down)."""
        self._pool.submit(self._send, c, data)

    def answered(self, c: Conn, out) -> None:
        """The awaited outcome is here (any thread): the selector thread sends it, unless the client left."""
        self.answers.append((c, out))
        self._wake()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- a worker thread -------------------------------------------------------------------------

    def _serve(self, c: Conn, frames: list[pb.Envelope]) -> None:
        try:
            out = self._run_step(frames)
        except Exception:  # a failing step must not kill the server
            log.exception("data plane step failed")
            self.done.append((c, False))
            self._wake()
            return
        self.send_answer(c, out)

    def _forwarded(self, c: Conn, frames: list[pb.Envelope]) -> None:
        try:
            self._run_forward(frames)
        except Exception:
            log.exception("forwarded step failed")
        finally:
            self.forward_finished(c)

    def forward_finished(self, c: Conn) -> None:
        """A forwarded step of ``c`` has run (any thread). The selector thread counts it on its next turn;
        it is woken only when ``c`` is paused, waiting for this (a wake-up per step would cost a decode
        hop two more thread switches). The selector pauses a connection before it takes what finished,
        so a step finishing meanwhile is either taken then or sees the pause."""
        self.forwards_done.append(c)
        if c.paused:
            self._wake()

    def send_answer(self, c: Conn, out) -> None:
        """Send ``out`` (a StepOutcome) on ``c`` from this thread (which owns ``c`` until then: a worker,
        or the thread that finished a step started without one) and hand the connection back to the
        selector thread."""
        try:
            data = encode_outcome(out)
        except Exception:
            log.exception("data plane answer failed")
            self.done.append((c, False))
            self._wake()
            return
        self._send(c, data)

    def _send(self, c: Conn, data: bytes) -> None:
        keep = False
        try:
            # The worker owns the socket until it hands it back: a blocking send, bounded like a read.
            c.sock.settimeout(self._read_timeout_s)
            c.sock.sendall(data)
            c.sock.setblocking(False)
            keep = True
        except OSError:
            pass  # the client went away or stopped reading
        except Exception:
            log.exception("data plane answer failed")
        self.done.append((c, keep))
        self._wake()


def encode_outcome(out) -> bytes:
    """The bytes that answer a request with ``out`` (a StepOutcome): its REPLY frames, or an ERROR."""
    if out.code != "OK":
        return encode_messages(ERROR, (encode_error(out.code, out.message, out.retry_after_s),))
    return encode_messages(REPLY, (r.SerializeToString() for r in out.replies))
