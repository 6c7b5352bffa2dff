"""One step data-plane connection as the node's server sees it, and the rules each message it sends
must meet before its bytes are buffered, and how connections are let in (the server:
:mod:`meshnet.wire.data_plane_server`).

Before authentication a connection holds a 5-byte header buffer and at most ``MAX_AUTH_BYTES`` of
token. After it, every frame counts at least ``FRAME_CHARGE`` bytes toward the server's
``max_request_bytes`` (empty frames cost Python objects too), and a request's frames must all be of
one message kind.
"""

from __future__ import annotations

import collections
import logging
import socket
import ssl
from typing import Callable

from google.protobuf.message import DecodeError

from meshnet.proto import meshnet_pb2 as pb
from meshnet.wire.data_plane import AUTH, AWAIT, ERROR, HEADER, encode_error, encode_messages
from meshnet.wire.request_budget import RETRY_AFTER_S, RequestBudget

log = logging.getLogger("meshnet.data_plane")

MAX_AUTH_BYTES = 4096  # a join token is a short secret; nothing longer is read before it is checked
# Bytes a frame counts toward max_request_bytes at least: a request announcing 2**30 chunks of empty
# frames is refused after max_request_bytes / FRAME_CHARGE of them (real frames carry up to 1 MiB).
FRAME_CHARGE = 4096
# An AWAIT message is a session id (at most 256 characters) and two integers; one is not budgeted while it
# arrives, and the tail keeps it as long as its connection waits: 150 awaits of 8 MB held 1.2 GB.
MAX_AWAIT_BYTES = 1024
# The part of a data plane's connections kept from any one address's authenticated connections (1/4: 64 of
# 256): a join-token holder that opened connections (and awaits) up to the limit locked every new client and
# node out of the node for the connections' idle timeout (300 s).
RESERVED_FOR_OTHERS = 4


class Conn:
    """One connection's state; touched only by the selector thread, or by the one worker running its step."""

    __slots__ = ("sock", "authed", "header", "body", "need", "kind", "frames", "n_frames", "request_bytes",
                 "charged", "waits_for", "deadline", "busy", "cancel_await", "forwards", "paused", "handshaking",
                 "peer")

    def __init__(self, sock: socket.socket, deadline: float, peer: str = "") -> None:
        self.sock = sock
        self.peer = peer  # the host it connected from
        self.authed = False
        self.header = bytearray()
        self.body: bytearray | None = None  # the message being read, once its header is known
        self.need = 0
        self.kind = 0  # of the message being read
        self.frames: list[pb.Envelope] = []
        self.n_frames = 1
        self.request_bytes = 0
        self.charged = 0  # bytes of its request still arriving held against the node's RequestBudget
        self.waits_for = 0  # bytes its next frame waits to hold (see WaitingRoom); 0: it waits for none
        self.deadline = deadline
        self.busy = False  # a worker owns the socket (its step runs, or its reply is being sent)
        # Awaiting a forwarded step's outcome: drops the await (None: not awaiting). The socket stays
        # registered meanwhile, so a hang-up is seen at once.
        self.cancel_await: Callable[[], None] | None = None
        self.forwards = 0  # its forwarded steps waiting for or on a worker
        self.paused = False  # not read until fewer than max_pending_forwards of them are left
        self.handshaking = isinstance(sock, ssl.SSLSocket)  # the TLS handshake has not finished yet

    def start_message(self, kinds: frozenset[int], max_message_bytes: int, max_request_bytes: int) -> None:
        """The 5-byte header is in ``self.header``: check it and get ready to buffer the message.

        Args:
            kinds: the message kinds accepted after authentication (ENVELOPE, and FORWARD / AWAIT where
                the server runs them).
            max_message_bytes, max_request_bytes: the server's limits per frame and per request, bytes.
        Raises:
            Refuse: not AUTH first, a token over ``MAX_AUTH_BYTES``, a kind not in ``kinds`` or unlike the
                request's earlier frames, or a frame or request over its limit.
        """
        n, kind = HEADER.unpack(self.header)
        self.header = bytearray()
        if not self.authed:
            if kind != AUTH or n > MAX_AUTH_BYTES:
                raise Refuse("unauthenticated", "UNAUTHENTICATED", "missing or wrong join token")
        elif kind not in kinds or (self.frames and kind != self.kind):
            raise Refuse("malformed", "INVALID_ARGUMENT", f"expected an envelope frame, got message kind {kind}")
        elif kind == AWAIT and n > MAX_AWAIT_BYTES:
            raise Refuse("too_large", "INVALID_ARGUMENT",
                         f"an await of {n} bytes exceeds the limit of {MAX_AWAIT_BYTES} bytes")
        elif n > max_message_bytes:
            raise Refuse("too_large", "INVALID_ARGUMENT",
                         f"a frame of {n} bytes exceeds the data plane's limit of {max_message_bytes} "
                         f"bytes per frame (max_message_bytes); send smaller frames")
        elif self.request_bytes + max(n, FRAME_CHARGE) > max_request_bytes:
            raise Refuse("too_large", "INVALID_ARGUMENT",
                         f"the request reaches {self.request_bytes + max(n, FRAME_CHARGE)} bytes (each frame "
                         f"counting at least {FRAME_CHARGE}), over the data plane's limit of "
                         f"{max_request_bytes} bytes per request (max_request_bytes)")
        self.body, self.need, self.kind = bytearray(), n, kind

    def take_frame(self, body: bytes) -> list[pb.Envelope] | None:
        """Add one envelope frame (its serialized bytes); the request's frames once all ``n_chunks`` of
        them are here (and the connection is ready for the next request), else None.

        Raises:
            Refuse: the frame does not decode.
        """
        try:
            f = pb.Envelope.FromString(body)
        except DecodeError as e:
            raise Refuse("malformed", "INVALID_ARGUMENT", f"undecodable envelope frame: {e}") from None
        if not self.frames:
            self.n_frames = max(1, f.n_chunks)
        if f.chunk_index != len(self.frames) or max(1, f.n_chunks) != self.n_frames:
            # the frames of a request come in order: a frame out of place is refused now, not after the
            # connection has waited for frames that will not come
            raise Refuse("malformed", "INVALID_ARGUMENT",
                         f"envelope frame {f.chunk_index} of {f.n_chunks} arrived where frame {len(self.frames)} "
                         f"of {self.n_frames} was expected")
        self.frames.append(f)
        self.request_bytes += max(len(body), FRAME_CHARGE)
        if len(self.frames) < self.n_frames:
            return None
        frames, self.frames, self.request_bytes = self.frames, [], 0
        return frames


    def hold(self, budget: RequestBudget, n: int) -> None:
        """Hold ``n`` more bytes (negative: give back) of this connection's request still arriving against
        the node's ``budget``.

        Raises:
            Refuse: RESOURCE_EXHAUSTED, with a retry-after, past the budget.
        """
        if n > 0 and not budget.take(n):
            raise Refuse("busy", "RESOURCE_EXHAUSTED", budget.refusal(), RETRY_AFTER_S)
        if n < 0:
            budget.give_back(-n)
        self.charged += n


class WaitingRoom:
    """Connections whose next frame waits for room in the node's RequestBudget, first come first in: a
    forwarded step's sender reads no answer, so such a frame is not refused (the step would be lost without
    a word) but not read until there is room, its sender waiting on TCP meanwhile."""

    def __init__(self, budget: RequestBudget) -> None:
        self.budget = budget
        self._line: collections.deque[Conn] = collections.deque()

    def __bool__(self) -> bool:
        return bool(self._line)

    def hold(self, c: Conn, n: int) -> bool:
        """Hold ``n`` more bytes of ``c``'s request when the budget has room and nobody waits before it;
        else False, and ``c`` waits in line for them (the caller stops reading it)."""
        if not self._line and self.budget.take(n):
            c.charged += n
            return True
        c.waits_for = n
        self._line.append(c)
        return False

    def admit(self, is_open: Callable[[Conn], bool]) -> list[Conn]:
        """The connections at the front of the line that the budget now has room for, their bytes held
        (closed ones, ``not is_open(c)``, leave the line)."""
        out = []
        while self._line:
            c = self._line[0]
            if is_open(c) and not self.budget.take(c.waits_for):
                break
            self._line.popleft()
            if is_open(c):
                c.charged, c.waits_for = c.charged + c.waits_for, 0
                out.append(c)
        return out


class Refuse(Exception):
    """Close the connection after sending ``code``/``message`` (and ``retry_after_s``) as an ERROR; ``stat``
    names the counter."""

    def __init__(self, stat: str, code: str, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.stat, self.code, self.message, self.retry_after_s = stat, code, message, retry_after_s


def over_address_share(conns, c: Conn, max_connections: int) -> str | None:
    """Why ``c``, authenticating now, may not stay: the authenticated connections of its address already
    number the most one address may hold (``max_connections`` less a ``RESERVED_FOR_OTHERS``-th of it, kept
    for other addresses); None when it may stay. ``conns``: the server's open connections."""
    most = max_connections - max_connections // RESERVED_FOR_OTHERS
    held = sum(1 for o in conns if o.authed and o.peer == c.peer)
    if held < most:
        return None
    return (f"{c.peer} holds {held} of this data plane's connections, the most one address may ({most} of "
            f"max_connections {max_connections}): close idle ones")


def accept_connections(listener: socket.socket, conns: dict[int, Conn], max_connections: int,
                       tls: ssl.SSLContext | None, auth_deadline: float, stats: collections.Counter[str],
                       close: Callable[[Conn], None]) -> list[Conn]:
    """Accept the connections waiting on ``listener`` (at most 64, so that a flood of them does not starve
    reads on those already open); the new ones, to be registered by the caller.

    ``conns`` (by ``id()``, oldest first) holds at most ``max_connections``: past it a newcomer replaces
    the oldest connection that has not authenticated yet (``close(oldest)``), or is refused
    RESOURCE_EXHAUSTED when every one has. With ``tls`` each socket is wrapped for a handshake the
    selector thread drives. Counts ``accepted``, ``refused`` and ``evicted`` in ``stats``.
    """
    out: list[Conn] = []
    for _ in range(64):
        try:
            sock, addr = listener.accept()
        except (BlockingIOError, InterruptedError):
            break
        except OSError:  # e.g. out of file descriptors: try again on the next event
            log.warning("data plane accept failed", exc_info=True)
            break
        stats["accepted"] += 1
        if len(conns) + len(out) >= max_connections:
            oldest = next((c for c in (*conns.values(), *out) if not c.authed), None)
            if oldest is None:
                stats["refused"] += 1
                send_now(sock, ERROR, encode_error(
                    "RESOURCE_EXHAUSTED", f"the data plane is at its limit of {max_connections} "
                                          f"connections (max_connections)"))
                sock.close()
                continue
            stats["evicted"] += 1
            if oldest in out:
                out.remove(oldest)
                oldest.sock.close()
            else:
                close(oldest)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls is not None:
            try:
                sock = tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
            except (OSError, ValueError):
                sock.close()
                continue
        out.append(Conn(sock, auth_deadline, addr[0] if isinstance(addr, tuple) else str(addr)))
    return out


def send_now(sock: socket.socket, kind: int, payload: bytes) -> bool:
    """Send one small message without blocking; False when it did not fit the socket's buffer at once."""
    data = encode_messages(kind, (payload,))
    try:
        return sock.send(data) == len(data)
    except OSError:
        return False


def send_at_once(sock: socket.socket, data: bytes) -> int:
    """Bytes of ``data`` sent on ``sock`` without blocking (0 when none could be): a small answer fits an
    empty socket buffer, and sending it from the selector thread saves waking a worker for it. 0 under
    TLS, whose writes may not be split between this thread and a worker that sends the rest."""
    if isinstance(sock, ssl.SSLSocket):
        return 0
    try:
        return sock.send(data)
    except OSError:  # BlockingIOError too; on a broken socket the worker's send meets it and closes
        return 0
