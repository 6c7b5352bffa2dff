"""The pipe between a node and its engine worker process: framed messages over a Unix stream socket.

A message is a 17-byte header (``<QIIB``: call id u64, meta length u32, payload length u32, kind u8),
then ``meta`` (a pickle of small objects: a call's method name and arguments, or its result, with any
hidden states taken out) and ``payload`` (those hidden states' raw little-endian bytes, sent as they
are: a decode step's ``[1, n_embd]`` f32 is 2.3 KB for SmolLM2, a prefill's up to a few MB). Headers,
meta and payload leave in one ``sendmsg`` without being joined; the payload arrives as one ``bytes``.

Both ends are processes of the same installation that share a socket pair nobody else holds, so
unpickling what arrives is no more trusting than importing the code.
"""

from __future__ import annotations

import dataclasses
import enum
import pickle
import socket
import struct
import threading
from typing import Any

from meshnet.contract import NamedTensor

_HEADER = struct.Struct("<QIIB")


class Kind(enum.IntEnum):
    """What a message is. Node to worker: LOAD (once, first), CALL, PING. Worker to node: READY or
    LOAD_FAILED (once, answering LOAD), REPLY or RAISED (answering a CALL by its id), PONG."""

    LOAD = 1
    READY = 2
    LOAD_FAILED = 3
    CALL = 4
    REPLY = 5
    RAISED = 6
    PING = 7
    PONG = 8


class EngineUnavailable(RuntimeError):
    """The engine worker is not there to answer: it died during the call, or is being restarted.
    The node answers such a step UNAVAILABLE (the client fails over or retries)."""


def encode(obj: Any) -> tuple[bytes, bytes]:
    """``(meta, payload)`` for ``obj``: a tuple of values, or one value. A dataclass value (a
    StepRequest, a StepResult) whose ``hidden`` is a NamedTensor travels without it in ``meta``, its
    bytes as ``payload``; at most one such value per message."""
    items = obj if isinstance(obj, tuple) else (obj,)
    for i, item in enumerate(items):
        hidden = getattr(item, "hidden", None)
        if isinstance(hidden, NamedTensor) and dataclasses.is_dataclass(item):
            stripped = items[:i] + (dataclasses.replace(item, hidden=None),) + items[i + 1:]
            meta = pickle.dumps((stripped, isinstance(obj, tuple), i, hidden.name, hidden.shape, hidden.dtype), 5)
            return meta, hidden.data
    return pickle.dumps((items, isinstance(obj, tuple), -1, None, None, None), 5), b""


def decode(meta: bytes, payload: bytes) -> Any:
    """The value :func:`encode` was given (hidden states put back, their bytes not copied again)."""
    items, was_tuple, at, name, shape, dtype = pickle.loads(meta)
    if at >= 0:
        item = dataclasses.replace(items[at], hidden=NamedTensor(name, shape, dtype, payload))
        items = items[:at] + (item,) + items[at + 1:]
    return items if was_tuple else items[0]


def encode_call(method: str, args: tuple) -> tuple[bytes, bytes]:
    """``(meta, payload)`` of a CALL of ``engine.method(*args)``: a step's request is one of the values of the
    message, so its hidden states leave as the payload (nested inside an argument tuple, they were pickled
    into ``meta``: a prefill's whole ``[n_tokens, n_embd]`` copied twice more on its way to the worker)."""
    return encode((method, *args))


def decode_call(meta: bytes, payload: bytes) -> tuple[str, tuple]:
    """``(method, args)`` of a CALL :func:`encode_call` encoded."""
    method, *args = decode(meta, payload)
    return method, tuple(args)


def send(sock: socket.socket, lock: threading.Lock, kind: Kind, call_id: int, meta: bytes = b"",
         payload: bytes = b"", lock_timeout_s: float | None = None) -> None:
    """Send one message; ``lock`` keeps messages of concurrent senders whole. Raises OSError when the
    other end is gone, TimeoutError (an OSError) when another sender held ``lock`` for ``lock_timeout_s``
    seconds (None: waits as long as it takes): its message is stuck in a pipe nobody reads."""
    parts = [_HEADER.pack(call_id, len(meta), len(payload), kind), meta, payload]
    total = sum(len(p) for p in parts)
    if not lock.acquire(timeout=-1 if lock_timeout_s is None else lock_timeout_s):
        raise TimeoutError(f"another message held the pipe for {lock_timeout_s:g} s")
    try:
        sent = sock.sendmsg(parts)
        if sent < total:  # a large payload may leave in several pieces
            sock.sendall(b"".join(parts)[sent:])
    finally:
        lock.release()


def receive(sock: socket.socket) -> tuple[Kind, int, bytes, bytes]:
    """``(kind, call_id, meta, payload)`` of the next message. Raises EOFError when the other end
    closed (between messages or inside one), OSError on a broken socket."""
    call_id, n_meta, n_payload, kind = _HEADER.unpack(_receive_exact(sock, _HEADER.size))
    meta = _receive_exact(sock, n_meta) if n_meta else b""
    payload = _receive_exact(sock, n_payload) if n_payload else b""
    return Kind(kind), call_id, meta, payload


def _receive_exact(sock: socket.socket, n: int) -> bytes:
    data = sock.recv(n, socket.MSG_WAITALL)
    if len(data) == n:
        return data
    buf = bytearray(data)  # a signal interrupted the wait, or the peer closed
    while len(buf) < n:
        more = sock.recv(n - len(buf), socket.MSG_WAITALL)
        if not more:
            raise EOFError("engine worker pipe closed")
        buf += more
    return bytes(buf)
