"""The node side of the step data plane: one selector thread for every connection, a bounded step pool.

The port is open to whoever can reach it, so nothing a peer announces is trusted before it has shown the
join token (the rules each message must meet: :mod:`meshnet.wire.data_plane_conn`); after it, a message's
bytes are buffered only as they arrive, up to ``max_message_bytes`` per frame and ``max_request_bytes`` per
request, and the client requests still arriving on all connections within a
:class:`~meshnet.wire.request_budget.RequestBudget` (a frame's announced length counts from its header
until its request completes or its connection closes). Silent connections are closed
(``auth_timeout_s`` to authenticate, ``read_timeout_s`` of silence inside a request, ``idle_timeout_s``
between requests), and at most ``max_connections`` are open at once: a new one beyond that replaces the
oldest connection that has not authenticated yet, or is refused when every connection has; a quarter of
them stays out of reach of any one address's authenticated connections. Steps run on
``workers`` threads (:mod:`meshnet.wire.data_plane_steps`); reading and writing never block the selector
thread, whose loop costs no thread per connection.

A connection streaming one-way FORWARD steps is not read while ``max_pending_forwards`` of its steps wait
or run (TCP backpressure on the sender). A connection awaiting a forwarded step's outcome (AWAIT) stays
watched: the client hanging up, or sending anything before its answer, closes it and drops the await, so
abandoned awaits hold no connection slot.

With a TLS context every accepted connection is TLS: the handshake runs on the selector thread without
blocking and must finish, with the join token, within ``auth_timeout_s``. Bytes TLS has already decrypted
wait in the socket's TLS layer, where the selector cannot see them, so connections holding such bytes are
read again on the next turn without waiting.

Counters (``DataPlaneServer.stats``): ``accepted``, ``refused`` (over the cap, all authenticated, or over
its address's share), ``evicted`` (an unauthenticated connection replaced by a newer one), ``busy`` (past
the budget), ``held_back`` (a forwarded frame waiting for room in it), ``timed_out``, ``unauthenticated``
(wrong token or not an AUTH message first), ``too_large`` and ``malformed`` (protocol violations after
authentication), ``steps`` (requests handed to a worker).
"""

from __future__ import annotations

import collections
import hmac
import logging
import selectors
import socket
import ssl
import threading
import time
from typing import Callable

from google.protobuf.message import DecodeError

from meshnet.proto import meshnet_pb2 as pb
from meshnet.wire.data_plane import AUTH, AWAIT, ENVELOPE, ERROR, FORWARD, HEADER, MAX_MESSAGE_BYTES, encode_error
from meshnet.wire.data_plane_conn import (FRAME_CHARGE, Conn, Refuse, WaitingRoom, accept_connections,
                                         over_address_share, send_at_once, send_now)
from meshnet.wire.data_plane_steps import StepPool, encode_outcome
from meshnet.wire.envelope import session_id_problem
from meshnet.wire.request_budget import RequestBudget

log = logging.getLogger("meshnet.data_plane")

# All frames of one request: a later stage's prefill input is n_tokens x n_embd f32 hidden states,
# e.g. 16k tokens x 4096 = 256 MiB.
MAX_REQUEST_BYTES = 256 << 20
_RECV_CHUNK = 256 << 10  # bytes read per call: memory grows with what has arrived, in these steps
_TICK_S = 0.25  # how often deadlines are checked
# Forwarded steps of one connection waiting or running at most before it is not read any more.
MAX_PENDING_FORWARDS = 32


class DataPlaneServer:
    """Serves steps on a TCP port with ``run_step(frames) -> StepOutcome`` (see NodeService.run_step).

    Args:
        host, port: where to listen (port 0 picks one; the bound port is ``self.port``).
        run_step: runs one request's frames (``list[pb.Envelope]``); called on a worker thread.
        run_forward: runs the frames of a step another node forwarded (FORWARD messages), answering
            nothing on the connection, which keeps being read meanwhile; None refuses FORWARD.
        start_step: ``start_step(frames, answer) -> bool`` may start a request without a worker thread,
            calling ``answer(StepOutcome)`` (from any thread, once) with what ``run_step`` would return;
            False: it started nothing, and the request runs on a worker. None: every request takes one.
        start_forward: ``start_forward(frames, done) -> bool`` may start a forwarded step without a worker
            thread, calling ``done()`` (from any thread) once it has run; False: it started nothing, and
            the step runs on a worker as ``run_forward``. None: every forwarded step takes a worker.
        run_await: ``run_await(pb.AwaitStep, answer)`` arranges for ``answer(StepOutcome)`` to be called
            at most once, from any thread, with the awaited step's outcome, and may return a function
            that withdraws the await (called when the client hangs up first); None refuses AWAIT.
        join_token: the secret every connection's AUTH message must carry (None: any AUTH message will do).
        tls: a server context (:func:`meshnet.wire.security.server_ssl_context`): every connection
            speaks TLS; None: plain TCP.
        max_message_bytes: largest frame message accepted, bytes (header excluded).
        max_request_bytes: largest request (all its frames' messages together), bytes.
        budget: the node's bytes of requests still arriving (shared with its gRPC port); default its own.
        max_connections: open connections at most (>= 1).
        max_pending_forwards: forwarded steps of one connection waiting or running at most before the
            connection is not read (>= 1).
        workers: steps running at once (>= 1); further complete requests wait for a worker.
        auth_timeout_s, read_timeout_s, idle_timeout_s: seconds a connection may take to authenticate,
            stay silent inside a request, and stay silent between requests.
    Raises:
        ValueError: a limit below 1 (or a timeout <= 0).
        OSError: the address cannot be bound.
    """

    def __init__(self, host: str, port: int, run_step: Callable, join_token: str | None = None, *,
                 run_forward: Callable | None = None, run_await: Callable | None = None,
                 start_step: Callable | None = None, start_forward: Callable | None = None,
                 tls: ssl.SSLContext | None = None,
                 max_message_bytes: int = MAX_MESSAGE_BYTES, max_request_bytes: int = MAX_REQUEST_BYTES,
                 budget: RequestBudget | None = None, max_connections: int = 256, max_pending_forwards: int = MAX_PENDING_FORWARDS,
                 workers: int = 8, auth_timeout_s: float = 10.0,
                 read_timeout_s: float = 30.0, idle_timeout_s: float = 300.0) -> None:
        for name, value in (("max_message_bytes", max_message_bytes), ("max_request_bytes", max_request_bytes),
                            ("max_connections", max_connections), ("workers", workers),
                            ("max_pending_forwards", max_pending_forwards),
                            ("auth_timeout_s", auth_timeout_s), ("read_timeout_s", read_timeout_s),
                            ("idle_timeout_s", idle_timeout_s)):
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        self._token = (join_token or "").encode()
        self._tls = tls
        self._unread: set[Conn] = set()  # TLS connections with decrypted bytes not read yet
        self._run_await = run_await
        self._start_step = start_step
        self._start_forward = start_forward if run_forward is not None else None
        # message kinds accepted after authentication
        self._kinds = frozenset({ENVELOPE} | ({FORWARD} if run_forward is not None else set())
                                | ({AWAIT} if run_await is not None else set()))
        self.max_message_bytes, self.max_request_bytes = max_message_bytes, max_request_bytes
        self.budget = budget if budget is not None else RequestBudget()
        self._room = WaitingRoom(self.budget)
        self.max_connections, self.max_pending_forwards = max_connections, max_pending_forwards
        self.auth_timeout_s, self.read_timeout_s, self.idle_timeout_s = auth_timeout_s, read_timeout_s, idle_timeout_s
        self.stats: collections.Counter[str] = collections.Counter()
        # IPv6 for an address with a colon, as the gRPC server binds it (create_server's default family is
        # IPv4 alone: a node on --host ::1 served gRPC and then failed to open its data plane).
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=1024, reuse_port=False)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, "accept")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._conns: dict[int, Conn] = {}  # by id(); insertion order = age, for eviction
        self._steps = StepPool(workers, run_step, run_forward, read_timeout_s, self._wake)
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="data-plane", daemon=True)

    @property
    def open_connections(self) -> int:
        """Connections open now (authenticated or not, a step running or not)."""
        return len(self._conns)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._steps.shutdown()
        for c in list(self._conns.values()):
            c.sock.close()
        self._conns.clear()
        for s in (self._listener, self._wake_r, self._wake_w):
            s.close()
        self._sel.close()

    # ---- the selector thread ---------------------------------------------------------------------

    def _loop(self) -> None:
        next_sweep = time.monotonic() + _TICK_S
        while not self._stopping:
            for key, _ in self._sel.select(timeout=0 if self._unread else _TICK_S):
                if key.data == "accept":
                    self._accept()
                elif key.data == "wake":
                    self._drain_wake()
                else:
                    self._unread.discard(key.data)
                    self._read(key.data)
            if self._steps.forwards_done:  # finished without waking this thread (see StepPool.forward_finished)
                self._take_finished_forwards()
            if self._room:
                for c in self._room.admit(lambda c: id(c) in self._conns):
                    if c.forwards < self.max_pending_forwards:
                        self._resume(c)
            for c in list(self._unread):
                self._unread.discard(c)
                if id(c) in self._conns and not c.busy and not c.paused:
                    self._read(c)
            now = time.monotonic()
            if now >= next_sweep:
                self._sweep(now)
                next_sweep = now + _TICK_S

    def _accept(self) -> None:
        for c in accept_connections(self._listener, self._conns, self.max_connections, self._tls,
                                    time.monotonic() + self.auth_timeout_s, self.stats, self._close):
            self._conns[id(c)] = c
            self._sel.register(c.sock, selectors.EVENT_READ, c)

    def _read(self, c: Conn) -> None:
        if c.cancel_await is not None:
            self._read_awaiting(c)
            return
        if c.handshaking:
            try:
                c.sock.do_handshake()
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                return  # more of the handshake to come (a stalled one meets the auth deadline)
            except (OSError, ValueError):  # not TLS, or a certificate/protocol failure
                self.stats["unauthenticated"] += 1
                self._close(c)
                return
            c.handshaking = False
        try:
            for _ in range(8):  # at most 8 chunks per event: other connections get their turn
                if c.body is None:
                    data = c.sock.recv(HEADER.size - len(c.header))
                else:
                    data = c.sock.recv(min(_RECV_CHUNK, c.need - len(c.body)))
                if not data:
                    self._close(c)
                    return
                if c.authed:  # silence is measured from the last byte; authentication has a fixed deadline
                    c.deadline = time.monotonic() + self.read_timeout_s
                if c.body is None:
                    c.header += data
                    if len(c.header) == HEADER.size:
                        c.start_message(self._kinds, self.max_message_bytes, self.max_request_bytes)
                        # A frame is held until its request is complete: a client's is refused past the
                        # budget, a forwarded step's waits for room (see WaitingRoom).
                        if c.kind == ENVELOPE:
                            c.hold(self.budget, max(c.need, FRAME_CHARGE))
                        elif c.kind == FORWARD and not self._room.hold(c, max(c.need, FRAME_CHARGE)):
                            self.stats["held_back"] += 1
                            c.paused = True
                            self._sel.unregister(c.sock)
                            return
                else:
                    c.body += data
                if c.body is not None and len(c.body) == c.need and self._finish_message(c):
                    return  # handed to a worker
            self._mark_unread(c)
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            pass
        except Refuse as e:
            self.stats[e.stat] += 1
            send_now(c.sock, ERROR, encode_error(e.code, e.message, e.retry_after_s))
            self._close(c)
        except OSError:
            self._close(c)

    def _read_awaiting(self, c: Conn) -> None:
        """A client awaiting an outcome sends nothing until it is answered: end of stream means it gave
        up; bytes break the protocol. Either way the await is withdrawn with the connection."""
        try:
            data = c.sock.recv(1)
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return
        except OSError:
            data = b""
        if data:
            self.stats["malformed"] += 1
            send_now(c.sock, ERROR, encode_error("INVALID_ARGUMENT", "a message arrived before the awaited "
                                                                      "step's outcome was answered"))
        self._close(c)

    def _finish_message(self, c: Conn) -> bool:
        """A whole message is in ``c.body``; returns True when a complete request went to a worker."""
        body, c.body = bytes(c.body), None
        if not c.authed:
            # A node without a join token serves anyone, whatever token they bring (as its gRPC port does).
            if self._token and not hmac.compare_digest(body, self._token):
                raise Refuse("unauthenticated", "UNAUTHENTICATED", "missing or wrong join token")
            if (over := over_address_share(self._conns.values(), c, self.max_connections)) is not None:
                raise Refuse("refused", "RESOURCE_EXHAUSTED", over)
            c.authed = True
            c.deadline = time.monotonic() + self.idle_timeout_s
            if not send_now(c.sock, AUTH, b""):
                raise OSError("could not answer the authentication")
            return False
        if c.kind == AWAIT:
            try:
                awaited = pb.AwaitStep.FromString(body)
            except DecodeError as e:
                raise Refuse("malformed", "INVALID_ARGUMENT", f"undecodable await: {e}") from None
            if (problem := session_id_problem(awaited.session_id)) is not None:
                raise Refuse("malformed", "INVALID_ARGUMENT", f"await: {problem}")
            # Still read meanwhile (see _read_awaiting); the answer is sent once the selector thread
            # has taken the connection back from the await.
            c.cancel_await = lambda: None
            c.deadline = time.monotonic() + self.idle_timeout_s
            cancel = self._run_await(awaited, lambda out: self._steps.answered(c, out))
            if c.cancel_await is not None and callable(cancel):
                c.cancel_await = cancel
            return True
        frames = c.take_frame(body)
        if frames is None:
            return False
        c.hold(self.budget, -c.charged)
        self.stats["steps"] += 1
        if c.kind == FORWARD:
            # One way: the connection goes on being read, so the sender can stream the next step at once,
            # until too many of its steps wait.
            c.forwards += 1
            if self._start_forward is None or not self._start_forward(frames, lambda: self._steps.forward_finished(c)):
                self._steps.forward(c, frames)
            if c.forwards >= self.max_pending_forwards:
                c.paused = True
                self._sel.unregister(c.sock)
                return True
            return False
        self._hand_over(c)
        if self._start_step is None or not self._start_step(frames, lambda out: self._steps.send_answer(c, out)):
            self._steps.serve(c, frames)
        return True

    def _hand_over(self, c: Conn) -> None:
        """A worker owns ``c`` until its answer is sent: not read meanwhile."""
        c.busy = True
        self._sel.unregister(c.sock)

    def _sweep(self, now: float) -> None:
        for c in [c for c in self._conns.values() if not c.busy and not c.paused and c.deadline <= now]:
            self.stats["timed_out"] += 1
            self._close(c)

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        self._take_finished_forwards()
        while self._steps.answers:
            c, out = self._steps.answers.popleft()
            if c.cancel_await is None or id(c) not in self._conns:
                continue  # the client hung up meanwhile: nobody to answer
            c.cancel_await = None
            try:
                data = encode_outcome(out)
            except Exception:  # noqa: BLE001 - a bad outcome must not stop this thread
                log.exception("data plane answer failed")
                self._close(c)
                continue
            sent = send_at_once(c.sock, data)
            if sent == len(data):
                c.deadline = time.monotonic() + self.idle_timeout_s
                continue
            self._hand_over(c)
            try:
                self._steps.answer(c, data[sent:])
            except RuntimeError:  # the server is stopping
                pass
        while self._steps.done:
            c, keep = self._steps.done.popleft()
            c.busy = False
            if not keep:
                self._close(c)
                continue
            c.deadline = time.monotonic() + self.idle_timeout_s
            self._sel.register(c.sock, selectors.EVENT_READ, c)
            self._mark_unread(c)

    def _take_finished_forwards(self) -> None:
        """Count the forwarded steps that finished; a connection paused for too many is read again."""
        while self._steps.forwards_done:
            c = self._steps.forwards_done.popleft()
            c.forwards -= 1
            if c.paused and not c.waits_for and c.forwards < self.max_pending_forwards and id(c) in self._conns:
                self._resume(c)

    def _resume(self, c: Conn) -> None:
        """Read ``c`` again, paused for its forwarded steps or for room in the budget."""
        c.paused = False
        c.deadline = time.monotonic() + self.idle_timeout_s
        self._sel.register(c.sock, selectors.EVENT_READ, c)
        self._mark_unread(c)

    def _mark_unread(self, c: Conn) -> None:
        """Read ``c`` again on the next turn if its TLS layer holds decrypted bytes."""
        if isinstance(c.sock, ssl.SSLSocket) and not c.handshaking and c.sock.pending():
            self._unread.add(c)

    def _close(self, c: Conn) -> None:
        c.hold(self.budget, -c.charged)
        self._conns.pop(id(c), None)
        self._unread.discard(c)
        if c.cancel_await is not None:
            cancel, c.cancel_await = c.cancel_await, None
            cancel()
        if not c.busy and not c.paused:
            try:
                self._sel.unregister(c.sock)
            except (KeyError, ValueError):
                pass
        c.sock.close()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except (BlockingIOError, OSError):
            pass  # a wake-up is already pending (or the server is closing)
