"""The step data plane: envelope frames over a plain TCP connection.

gRPC in Python costs about 0.5 ms per unary round trip on loopback, and more on a busy machine; a
token crosses every hop of a route twice, so for a small model that is a large share of decode time.
Steps therefore travel over persistent TCP connections (``TCP_NODELAY``) carrying the *same* protobuf
envelope frames and replies as the gRPC ``Step`` call, each message prefixed by a 5-byte header.
Control calls (capabilities, health, cancel, release) and everything when TLS is on stay on gRPC.

Message: ``<u32 length><u8 kind><payload>``; kinds below. A connection starts with one AUTH message
carrying the join token (empty when none). A request is one or more ENVELOPE frames (``n_chunks``
says how many); the answer is REPLY messages (as many as the reply's own ``n_chunks``, one with a
token) or one ERROR message ``"<CODE>\\n<retry-after-s or empty>\\n<message>"``.
"""

from __future__ import annotations

import hmac
import logging
import socket
import socketserver
import struct
import threading
from typing import Callable, Iterator

from meshnet.proto import meshnet_pb2 as pb

log = logging.getLogger("meshnet.data_plane")

AUTH, ENVELOPE, REPLY, ERROR = 1, 2, 3, 4
_HEADER = struct.Struct("<IB")
# Larger than any frame (1 MiB payload plus headers): anything bigger is a protocol error.
MAX_MESSAGE_BYTES = 8 << 20


class DataPlaneError(Exception):
    """The connection broke or carried something that is not this protocol."""


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise DataPlaneError("connection closed")
        got += k
    return bytes(buf)


def send_message(sock: socket.socket, kind: int, payload: bytes) -> None:
    sock.sendall(_HEADER.pack(len(payload), kind) + payload)


def recv_message(sock: socket.socket) -> tuple[int, bytes]:
    n, kind = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if n > MAX_MESSAGE_BYTES:
        raise DataPlaneError(f"message of {n} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    return kind, _recv_exact(sock, n)


def encode_error(code: str, message: str, retry_after_s: float | None = None) -> bytes:
    retry = "" if retry_after_s is None else f"{retry_after_s:.3f}"
    return f"{code}\n{retry}\n{message}".encode()


def decode_error(payload: bytes) -> tuple[str, float | None, str]:
    code, retry, message = payload.decode("utf-8", "replace").split("\n", 2)
    return code, (float(retry) if retry else None), message


# ---- node side ---------------------------------------------------------------------------------------

class DataPlaneServer:
    """Serves steps on a TCP port with ``run_step(frames) -> StepOutcome`` (see NodeService.run_step).

    One thread per connection; a client keeps its connections open across steps.
    """

    def __init__(self, host: str, port: int, run_step: Callable, join_token: str | None = None) -> None:
        token = (join_token or "").encode()

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                sock: socket.socket = self.request
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                try:
                    kind, payload = recv_message(sock)
                    if kind != AUTH or not hmac.compare_digest(payload, token):
                        send_message(sock, ERROR, encode_error("UNAUTHENTICATED", "missing or wrong join token"))
                        return
                    send_message(sock, AUTH, b"")
                    while True:
                        frames = list(_read_frames(sock))
                        out = run_step(frames)
                        if out.code != "OK":
                            send_message(sock, ERROR, encode_error(out.code, out.message, out.retry_after_s))
                            continue
                        sock.sendall(b"".join(_HEADER.pack(len(b), REPLY) + b
                                              for b in (r.SerializeToString() for r in out.replies)))
                except (DataPlaneError, ConnectionError, OSError):
                    return  # the client went away; nothing to clean up per connection
                except Exception:  # a malformed message must not kill the server
                    log.exception("data plane connection failed")

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server((host, port), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _read_frames(sock: socket.socket) -> Iterator[pb.Envelope]:
    """The frames of one request: reads until the first frame's ``n_chunks`` have arrived."""
    n = 1
    i = 0
    while i < n:
        kind, payload = recv_message(sock)
        if kind != ENVELOPE:
            raise DataPlaneError(f"expected an envelope frame, got message kind {kind}")
        f = pb.Envelope.FromString(payload)
        if i == 0:
            n = max(1, f.n_chunks)
        yield f
        i += 1


# ---- client side -------------------------------------------------------------------------------------

class DataPlaneConnection:
    """One client connection to a node's data plane. Not shared between threads at the same time."""

    def __init__(self, address: str, join_token: str | None, timeout_s: float) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        send_message(self.sock, AUTH, (join_token or "").encode())
        kind, payload = recv_message(self.sock)
        if kind == ERROR:
            code, _, message = decode_error(payload)
            raise DataPlaneError(f"{code}: {message}")

    def call(self, frames: list[pb.Envelope], timeout_s: float | None = None
             ) -> tuple[list[pb.StepReply] | None, tuple[str, float | None, str] | None]:
        """Send one request; returns (replies, None) or (None, (code, retry_after_s, message)).

        ``timeout_s`` bounds each send and receive on the socket this call (default: the connection's
        timeout). Raises OSError (``socket.timeout`` when the node stays silent that long; the
        connection is then out of step with the node and must be closed) or DataPlaneError."""
        if timeout_s is not None:
            self.sock.settimeout(timeout_s)
        self.sock.sendall(b"".join(_HEADER.pack(len(b), ENVELOPE) + b
                                   for b in (f.SerializeToString() for f in frames)))
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
        return replies, None

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class ConnectionPool:
    """Idle connections to one node, reused by whichever thread runs the next step there."""

    def __init__(self, address: str, join_token: str | None, timeout_s: float) -> None:
        self.address, self.join_token, self.timeout_s = address, join_token, timeout_s
        self._idle: list[DataPlaneConnection] = []
        self._lock = threading.Lock()

    def acquire(self, timeout_s: float | None = None) -> DataPlaneConnection:
        """An idle connection, or a new one whose connect and handshake take at most ``timeout_s``
        seconds (default the pool's). Raises OSError or DataPlaneError."""
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return DataPlaneConnection(self.address, self.join_token, timeout_s or self.timeout_s)

    def release(self, conn: DataPlaneConnection) -> None:
        with self._lock:
            self._idle.append(conn)

    def close(self) -> None:
        with self._lock:
            for c in self._idle:
                c.close()
            self._idle.clear()
