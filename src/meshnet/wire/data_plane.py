"""The step data plane: envelope frames over a plain TCP connection.

gRPC in Python costs about 0.5 ms per unary round trip on loopback, and more on a busy machine; a
token crosses every hop of a route twice, so for a small model that is a large share of decode time.
Steps therefore travel over persistent TCP connections (``TCP_NODELAY``) carrying the *same* protobuf
envelope frames and replies as the gRPC ``Step`` call, each message prefixed by a 5-byte header.
Control calls (capabilities, health, cancel, release) stay on gRPC. A node serving TLS serves its data
plane over TLS too (same certificate), and clients and forwarding nodes verify it with the mesh's CA.

Message: ``<u32 length><u8 kind><payload>``; kinds below. A connection starts with one AUTH message
carrying the join token (empty when none). A request is one or more ENVELOPE frames (``n_chunks``
says how many); the answer is REPLY messages (as many as the reply's own ``n_chunks``, one with a
token) or one ERROR message ``"<CODE>\\n<retry-after-s or empty>\\n<message>"``.

Node-to-node forwarding adds two kinds. FORWARD: the frames of a step one node sends the next node of
its route, one way: the receiver never answers them on that connection (a failure travels on to the
tail as a ``HopFailure`` envelope), so a node streams many sessions' steps down one connection. AWAIT:
a client's ``AwaitStep``; the tail answers it like a step (REPLY messages) once the forwarded step has
run there, or with the ``HopFailure`` that reached it instead.

This module is the protocol and the client; the node's server is :mod:`meshnet.wire.data_plane_server`.
"""

from __future__ import annotations

import select
import socket
import ssl
import struct
import threading
import time
from typing import Callable

from meshnet.proto import meshnet_pb2 as pb

try:
    import fcntl  # the send queue's depth (would_wait); a platform without it never waits
except ImportError:  # pragma: no cover - Windows
    fcntl = None

AUTH, ENVELOPE, REPLY, ERROR, FORWARD, AWAIT = 1, 2, 3, 4, 5, 6
# The longest answer to a connection's AUTH: an empty AUTH, or an ERROR of a code and a short message.
MAX_HANDSHAKE_REPLY_BYTES = 64 << 10
HEADER = struct.Struct("<IB")
# Larger than any frame (1 MiB payload plus headers): anything bigger is a protocol error.
MAX_MESSAGE_BYTES = 8 << 20
_RECV_CHUNK = 256 << 10
# A pooled connection idle this long is dropped rather than reused: the node closes connections idle
# for its idle_timeout_s (300 s by default), and a step sent into a closed one would look like a dead node.
POOL_MAX_IDLE_S = 60.0
# A connection still holding bytes this long after its last send is stalled, seconds: the peer, or the way
# to it, stopped taking them (unacknowledged, or not sent at all: no route), though the sends succeeded. A
# step's bytes are acknowledged within a round trip.
STALL_S = 1.0
# Connecting to a node's data plane, its TLS handshake and the join token's answer take at most this long,
# seconds, whatever a step's own timeout: across a link of 100 ms RTT they take well under a second, and a
# lost SYN is sent again after 1 s and 3 s. A port a firewall drops packets to answers nothing at all: with
# the step's 60 s for a connect, a client waited two minutes (its step, then its failover's replay) to
# learn that it cannot reach the node.
CONNECT_TIMEOUT_S = 5.0
# Linux's ioctl for the bytes a socket holds that the peer has not acknowledged, sent or not (TIOCOUTQ).
_TIOCOUTQ = 0x5411


class DataPlaneError(Exception):
    """The connection broke or carried something that is not this protocol."""


class Unanswered(TimeoutError):
    """The wait for a reply gave up before its first byte came; the message says after how long (the
    socket's own timeout says only "timed out")."""


class ConnectTimeout(ConnectionError):
    """A node's data plane did not let this process connect (or finish the handshake) within
    :data:`CONNECT_TIMEOUT_S`: a port closed by a firewall that drops packets, a host gone, or a node
    too busy to accept. An OSError, not a TimeoutError: the node never got a step to be silent about."""


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes. Memory grows in ``_RECV_CHUNK`` steps as bytes arrive, so a length that is
    announced and never sent does not become an allocation of that size."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(_RECV_CHUNK, n - len(buf)))
        if not chunk:
            raise DataPlaneError("connection closed")
        buf += chunk
    return bytes(buf)


def encode_messages(kind: int, payloads) -> bytes:
    """The wire bytes of one message of ``kind`` per payload: ``<u32 length><u8 kind><payload>`` each."""
    return b"".join(HEADER.pack(len(p), kind) + p for p in payloads)


def send_message(sock: socket.socket, kind: int, payload: bytes) -> None:
    sock.sendall(encode_messages(kind, (payload,)))


def recv_message(sock: socket.socket, max_bytes: int = MAX_MESSAGE_BYTES) -> tuple[int, bytes]:
    """One message: ``(kind, payload)``.

    Raises:
        DataPlaneError: the connection closed, or the header announces more than ``max_bytes``.
        OSError: the socket failed or timed out.
    """
    n, kind = HEADER.unpack(_recv_exact(sock, HEADER.size))
    if n > max_bytes:
        raise DataPlaneError(f"message of {n} bytes exceeds the {max_bytes}-byte limit")
    return kind, _recv_exact(sock, n)


def encode_error(code: str, message: str, retry_after_s: float | None = None) -> bytes:
    retry = "" if retry_after_s is None else f"{retry_after_s:.3f}"
    return f"{code}\n{retry}\n{message}".encode()


def decode_error(payload: bytes) -> tuple[str, float | None, str]:
    code, retry, message = payload.decode("utf-8", "replace").split("\n", 2)
    return code, (float(retry) if retry else None), message


# ---- client side -------------------------------------------------------------------------------------

class DataPlaneConnection:
    """One client connection to a node's data plane. Not shared between threads at the same time."""

    def __init__(self, address: str, join_token: str | None, timeout_s: float,
                 tls: ssl.SSLContext | None = None) -> None:
        """Connect, and authenticate with ``join_token``; over TLS when ``tls`` (a client context that
        checks the server's certificate against the host in ``address``) is given. ``timeout_s`` bounds
        each later send and receive; the connect and handshake take at most :data:`CONNECT_TIMEOUT_S` of
        it. Raises OSError (:class:`ConnectTimeout` when the node does not let this process connect,
        ``ssl.SSLError`` when the certificate does not verify) or DataPlaneError (a refused token)."""
        host, port = address.rsplit(":", 1)
        host = host.strip("[]")
        connect_s = min(timeout_s, CONNECT_TIMEOUT_S)
        try:
            sock = socket.create_connection((host, int(port)), timeout=connect_s)
        except TimeoutError:
            raise ConnectTimeout(f"cannot connect within {connect_s:g} s (is the port open to this "
                                 f"machine?)") from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if tls is not None:
                sock = tls.wrap_socket(sock, server_hostname=host)
            send_message(sock, AUTH, (join_token or "").encode())
            # A node answers AUTH (empty) or a short ERROR: anything else is another service, whose bytes
            # are not repeated (its first four, read as a length, named what served there to whoever
            # could have a node dial any address).
            n, kind = HEADER.unpack(_recv_exact(sock, HEADER.size))
            if kind not in (AUTH, ERROR) or n > MAX_HANDSHAKE_REPLY_BYTES:
                raise DataPlaneError("it does not answer as a meshnet node's data plane (another service "
                                     "at that port?)")
            payload = _recv_exact(sock, n)
        except TimeoutError:
            sock.close()
            raise ConnectTimeout(f"connected, but no handshake within {connect_s:g} s") from None
        except BaseException:
            sock.close()
            raise
        if kind == ERROR:
            sock.close()
            code, _, message = decode_error(payload)
            raise DataPlaneError(f"{code}: {message}")
        sock.settimeout(timeout_s)
        self.sock = sock
        self.tls = tls is not None
        self.last_used = time.monotonic()

    def reusable(self, max_idle_s: float = POOL_MAX_IDLE_S) -> bool:
        """Whether the connection can carry another step: used within ``max_idle_s`` seconds, and the
        node has neither closed it nor sent anything unasked (which would put replies out of step)."""
        if time.monotonic() - self.last_used > max_idle_s:
            return False
        timeout = self.sock.gettimeout()
        try:
            self.sock.setblocking(False)
            # A byte read here is never given back (TLS cannot peek), so the connection is dropped then.
            self.sock.recv(1)
            return False  # b"" (closed) or unexpected bytes
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return True  # nothing to read: open and quiet
        except OSError:
            return False
        finally:
            try:
                self.sock.settimeout(timeout)
            except OSError:
                pass

    def queued_bytes(self) -> int:
        """Bytes the socket holds that the peer has not acknowledged, sent or not yet (Linux ``TIOCOUTQ``;
        0 where the kernel does not say)."""
        if fcntl is None:
            return 0
        try:
            return struct.unpack("i", fcntl.ioctl(self.sock.fileno(), _TIOCOUTQ, b"\0" * 4))[0]
        except (OSError, ValueError):
            return 0

    def would_wait(self, n_bytes: int) -> bool:
        """Whether sending ``n_bytes`` more may block: the socket already holds more than half its send
        buffer unacknowledged (a slow or cut-off peer)."""
        try:
            return self.queued_bytes() + n_bytes > self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) // 2
        except OSError:
            return False

    def stalled(self, after_s: float = STALL_S) -> bool:
        """Whether bytes sent on it ``after_s`` seconds ago or more are still unacknowledged: retransmitted
        into a link that drops them, or never sent for want of a route."""
        return time.monotonic() - self.last_used >= after_s and self.queued_bytes() > 0

    def call(self, frames: list[pb.Envelope], timeout_s: float | None = None,
             still_alive: Callable[[], bool] | None = None, patience_s: float = 0.0,
             probe_s: float | None = None
             ) -> tuple[list[pb.StepReply] | None, tuple[str, float | None, str] | None]:
        """Send one request; returns (replies, None) or (None, (code, retry_after_s, message)).

        ``timeout_s`` bounds each send and receive on the socket this call (default: the connection's
        timeout). With ``still_alive``, a reply that has not begun after ``timeout_s`` (or ``probe_s``
        seconds, if fewer) is waited for again, as long again at a time and ``patience_s`` seconds in
        all, as long as ``still_alive()`` says the node answers otherwise (busy with other work, not
        hung). Raises OSError (``TimeoutError`` when the node stays silent; the connection is then out
        of step with the node and must be closed) or DataPlaneError."""
        self.send(ENVELOPE, (f.SerializeToString() for f in frames), timeout_s)
        return self.receive(timeout_s, still_alive, patience_s, probe_s=probe_s)

    def call_many(self, requests: list[list[pb.Envelope]], timeout_s: float
                  ) -> list[tuple[list[pb.StepReply] | None, tuple[str, float | None, str] | None]]:
        """Send ``requests`` back to back and read their answers in order: one round trip for them all
        (the node serves a connection's requests one after another), as a failover's replay needs.

        The requests go out from a thread of their own while this one reads, so that neither side's
        socket buffers can fill while it waits on the other. Reading stops after the first ERROR
        answer (the node still answers the requests after it: the connection must then be closed).
        ``timeout_s`` bounds each send and each answer. Raises OSError or DataPlaneError."""
        if self.tls:
            # One TLS connection must not be written by one thread while another reads it (OpenSSL's
            # objects are not safe for that): over TLS the requests take a round trip each.
            answers = []
            for frames in requests:
                answers.append(self.call(frames, timeout_s))
                if answers[-1][1] is not None:
                    break
            return answers
        failed: list[OSError] = []

        def send_all() -> None:
            try:
                for frames in requests:
                    self.sock.sendall(encode_messages(ENVELOPE, (f.SerializeToString() for f in frames)))
            except OSError as e:
                failed.append(e)

        self.sock.settimeout(timeout_s)
        sender = threading.Thread(target=send_all, name="meshnet-replay-send", daemon=True)
        sender.start()
        answers = []
        try:
            for _ in requests:
                answers.append(self.receive())
                if answers[-1][1] is not None:
                    break
        finally:
            sender.join(timeout_s)
        if failed and len(answers) < len(requests):
            raise failed[0]
        self.last_used = time.monotonic()
        return answers

    def send(self, kind: int, payloads, timeout_s: float | None = None) -> None:
        """Send one message of ``kind`` per payload, each send bounded by ``timeout_s`` (default the
        connection's). Raises OSError."""
        if timeout_s is not None:
            self.sock.settimeout(timeout_s)
        self.sock.sendall(encode_messages(kind, payloads))
        self.last_used = time.monotonic()

    def receive(self, timeout_s: float | None = None, still_alive: Callable[[], bool] | None = None,
                patience_s: float = 0.0, watch: tuple[float, Callable[[], None]] | None = None,
                probe_s: float | None = None
                ) -> tuple[list[pb.StepReply] | None, tuple[str, float | None, str] | None]:
        """The answer to the request sent last: see :meth:`call`. ``watch``: ``(every_s, check)``, where
        ``check()`` is called every ``every_s`` seconds while no byte of the answer has come, and may
        raise to stop waiting (the connection is then out of step with the node: close it)."""
        if timeout_s is not None:
            self.sock.settimeout(timeout_s)
        if still_alive is not None and timeout_s is not None:
            self._await_reply(timeout_s if probe_s is None else min(timeout_s, probe_s), still_alive, patience_s,
                              watch)
        replies: list[pb.StepReply] = []
        n = 1
        while len(replies) < n:
            kind, payload = recv_message(self.sock)
            if kind == ERROR:
                return None, decode_error(payload)
            if kind != REPLY:
                raise DataPlaneError(f"expected a reply, got message kind {kind}")
            r = pb.StepReply.FromString(payload)
            if not replies and not r.has_token:
                n = max(1, r.hidden.n_chunks)
            replies.append(r)
        self.last_used = time.monotonic()
        return replies, None

    def _await_reply(self, timeout_s: float, still_alive: Callable[[], bool], patience_s: float,
                     watch: tuple[float, Callable[[], None]] | None = None) -> None:
        """Block until the reply's first byte is readable, asking ``still_alive()`` every ``timeout_s``
        seconds; see :meth:`call` and :meth:`receive`. Raises Unanswered, or what ``watch`` raises."""
        start = time.monotonic()
        if self.tls and self.sock.pending():
            return  # already decrypted, waiting in the TLS layer where select() cannot see it
        every_s, check = watch if watch is not None else (timeout_s, None)
        next_probe = start + timeout_s
        while True:
            now = time.monotonic()
            if select.select([self.sock], [], [], max(0.0, min(every_s, next_probe - now)))[0]:
                return
            if check is not None:
                check()
            now = time.monotonic()
            if now >= next_probe:
                waited = now - start
                if waited >= patience_s or not still_alive():
                    raise Unanswered(f"no answer within {waited:.2f}s")
                next_probe = now + timeout_s

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class ConnectionPool:
    """Idle connections to one node, reused by whichever thread runs the next step there."""

    def __init__(self, address: str, join_token: str | None, timeout_s: float,
                 tls: ssl.SSLContext | None = None) -> None:
        self.address, self.join_token, self.timeout_s, self.tls = address, join_token, timeout_s, tls
        self._idle: list[DataPlaneConnection] = []
        self._lock = threading.Lock()

    def acquire(self, timeout_s: float | None = None, connect: bool = True) -> DataPlaneConnection | None:
        """An idle connection that is still usable (closing the stale ones found), else a new one whose
        connect and handshake take at most ``timeout_s`` seconds (default the pool's); with ``connect``
        False, None instead of a new one. Raises OSError or DataPlaneError."""
        while True:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                if not connect:
                    return None
                return DataPlaneConnection(self.address, self.join_token, timeout_s or self.timeout_s, self.tls)
            if conn.reusable():
                return conn
            conn.close()

    def release(self, conn: DataPlaneConnection) -> None:
        with self._lock:
            self._idle.append(conn)

    def idle_count(self) -> int:
        with self._lock:
            return len(self._idle)

    def stalled(self) -> bool:
        """Whether an idle connection's last bytes are still unacknowledged (:meth:`DataPlaneConnection.stalled`)."""
        with self._lock:
            idle = list(self._idle)
        return any(c.stalled() for c in idle)

    def close(self) -> None:
        with self._lock:
            for c in self._idle:
                c.close()
            self._idle.clear()
