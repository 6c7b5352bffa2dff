"""How the tracker's handlers refuse a call: raise :class:`Refusal` inside a handler wrapped in :func:`rpc`,
and the caller gets its status (and retry-after), any other exception becoming INTERNAL with a message,
never a trace."""

from __future__ import annotations

import functools
import logging
import threading
import time

import grpc

from meshnet.wire.call_problems import abort_call

log = logging.getLogger("meshnet.tracker")

# An internal error is logged once a minute per method and message: a node retries its registration every
# second, and a tracker whose ledger cannot be written answered each with INTERNAL and logged nothing.
_LOG_EVERY_S = 60.0
_logged: dict[tuple[str, str], float] = {}
_logged_lock = threading.Lock()


class Refusal(Exception):
    """Raised inside a handler to answer with a gRPC status instead of a result."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s  # sent as trailing metadata RETRY_AFTER_METADATA (seconds)


# gRPC sends a status's message as a header, percent-encoding what is not printable ASCII (3 characters a
# byte), and a client refuses headers past 16 KiB ("metadata size exceeds hard limit"): a refusal that quoted
# 100 kB of a request reached its caller as neither. 4 KiB of UTF-8 stays under it however encoded.
_MAX_MESSAGE_BYTES = 4096


def bounded(message: str) -> str:
    """``message``, cut to :data:`_MAX_MESSAGE_BYTES` of UTF-8 with how much was left out."""
    data = message.encode()
    if len(data) <= _MAX_MESSAGE_BYTES:
        return message
    kept = data[:_MAX_MESSAGE_BYTES].decode(errors="ignore")
    return f"{kept}... ({len(message) - len(kept)} more characters)"


def rpc(method):
    """Turn Refusal into its status and any other exception into INTERNAL, never a bare trace; the
    message is bounded (:func:`bounded`)."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except Refusal as r:
            code, message, retry = r.code, r.message, r.retry_after_s
        except Exception as e:  # noqa: BLE001 - a bug must not take the tracker down or leak a trace
            code, message, retry = (grpc.StatusCode.INTERNAL,
                                    f"tracker error in {method.__name__}: {type(e).__name__}: {e}", None)
            _log_internal(method.__name__, message, e)
        abort_call(context, code, bounded(message), retry)

    return wrapper


def _log_internal(method: str, message: str, e: Exception) -> None:
    now = time.monotonic()
    with _logged_lock:
        if now - _logged.get((method, message), -_LOG_EVERY_S) < _LOG_EVERY_S:
            return
        if len(_logged) > 1000:  # messages carry ids: keep the map bounded
            _logged.clear()
        _logged[(method, message)] = now
    log.error("%s", bounded(message), exc_info=e)
