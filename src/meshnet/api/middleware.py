"""ASGI middleware in front of the API: a limit on request bodies, a count of every answer, an
``x-request-id`` on it, a 500 for a request that fails inside the app, a refusal of requests that web pages
of other origins send, and of requests without the server's API key when it has one."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from urllib.parse import urlsplit

from meshnet.api.errors import ApiError, internal_error
from meshnet.api.metrics import ApiMetrics

log = logging.getLogger("meshnet.api")

# How long a request's body may go without a byte, and take in all, seconds. The server has no limit of
# its own: a client that sends headers and a few bytes of body would hold its connection and a task
# forever (a few hundred such clients, a server's worth of sockets). The largest body allowed (2 MiB)
# arrives within the cap on a 64 kbit/s link.
BODY_TIMEOUT_S = 30.0
BODY_TOTAL_S = 300.0


# A client's own X-Request-Id is answered back when it is this long at most and printable ASCII.
MAX_REQUEST_ID_CHARS = 128
_REQUEST_ID_CHARS = frozenset(range(0x21, 0x7F))


def request_id_of(scope) -> bytes:
    """The ``x-request-id`` every answer carries (as OpenAI's do, which the SDK shows as ``_request_id``): the
    request's own when it sent a sensible one (a proxy's, to match logs), else ``req_`` and 32 hex digits."""
    for k, v in scope.get("headers", ()):
        if k == b"x-request-id" and 0 < len(v) <= MAX_REQUEST_ID_CHARS and set(v) <= _REQUEST_ID_CHARS:
            return v
    return f"req_{uuid.uuid4().hex}".encode()


class BodyLimitAndMetrics:
    """Reads a request's whole body up front, refusing more than ``max_body_bytes`` with 413 (on the
    Content-Length header and on the bytes actually received) and a body whose bytes stop for
    :data:`BODY_TIMEOUT_S` (or that takes over :data:`BODY_TOTAL_S` in all) with 408, then replays it to
    the app; counts every
    answer by endpoint and status. An exception out of the app is logged and answered 500 here, not
    re-raised: Starlette's own handler would answer and then re-raise it to the server, which drops the
    client's keep-alive connection, failing its next request too.

    An answer is counted once, when it ends, so that a stream (sent with status 200 before its first
    token) counts how it ended: under its own status when its last byte went out, 499 when it ended
    before that (the client went away, or took nothing for :data:`~meshnet.api.sse.STALL_S`), 500 when
    the app raised meanwhile, and the status of the error event that ended it when it failed (see
    :func:`stream_failed`)."""

    def __init__(self, app, metrics: ApiMetrics, max_body_bytes: int) -> None:
        self.app, self.metrics, self.max_body_bytes = app, metrics, max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        endpoint = self.metrics.endpoint_label(scope.get("path", ""))
        status = {"code": 0, "counted": False}
        request_id = scope[_REQUEST_ID] = request_id_of(scope)

        def count(code: int) -> None:
            status["counted"] = True
            self.metrics.requests.labels(endpoint=endpoint, status=str(code)).inc()

        async def send_wrapper(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", request_id)]}
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                count(scope.get(_STREAM_FAILED, status["code"]))  # before the client can see the end
            await send(message)

        body = await self._read_body(scope, receive, send_wrapper)
        if body is None:
            return
        delivered = False

        async def replay() -> dict:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        ended = 499  # how an answer that started and never sent its last byte is counted
        try:
            await self.app(scope, replay, send_wrapper)
        except Exception as e:  # noqa: BLE001 - answered here; see the class docstring
            log.exception("internal error on %s (x-request-id %s)", scope.get("path", ""), request_id.decode())
            self.metrics.errors.labels(kind="internal_error").inc()
            if status["code"]:  # a stream already under way just ends
                ended = 500
            else:
                await internal_error(e).response()(scope, _no_receive, send_wrapper)
        finally:
            if status["code"] and not status["counted"]:
                count(ended)
            self.metrics.latency.labels(endpoint=endpoint).observe(time.perf_counter() - t0)

    async def _read_body(self, scope, receive, send) -> bytes | None:
        """The whole body, or None when an answer (413/408/415/400) was sent or the client left."""
        limit = self.max_body_bytes
        declared = None
        for k, v in scope.get("headers", ()):
            if k == b"content-length":
                try:
                    declared = int(v)
                except ValueError:
                    await self._reply(send, ApiError(400, "invalid Content-Length header", code="invalid_header"))
                    return None
            elif k == b"content-encoding" and v.strip().lower() not in (b"", b"identity"):
                # read as JSON it would be "not valid JSON", which hides why
                await self._reply(send, ApiError(415, f"Content-Encoding {v.decode('latin-1')!r} is not supported: "
                                                      "send the request body uncompressed",
                                                 code="unsupported_content_encoding"))
                return None
        too_big = declared is not None and declared > limit
        chunks, total = [], 0
        # Drain a moderately oversized body before answering, so the client gets its 413 instead of a
        # reset connection while it is still sending; a huge one is answered at once.
        drain = declared is None or declared <= 8 * limit
        if too_big and not drain:
            await self._reply(send, _too_large(limit, declared))
            return None
        start = time.monotonic()
        while True:
            now = time.monotonic()
            wait_s = min(BODY_TIMEOUT_S, start + BODY_TOTAL_S - now)
            try:
                message = await asyncio.wait_for(receive(), max(0.0, wait_s))
            except asyncio.TimeoutError:
                came = f"{total} of {declared if declared is not None else '?'} bytes came"
                why = (f"no byte of the request body came for {BODY_TIMEOUT_S:g} s ({came})" if wait_s == BODY_TIMEOUT_S
                       else f"the request body took over {BODY_TOTAL_S:g} s ({came})")
                await self._reply(send, ApiError(408, why, code="request_timeout"))
                return None
            if message["type"] == "http.disconnect":
                return None
            data = message.get("body", b"")
            total += len(data)
            if total > limit:
                too_big = True
                if total > 8 * limit:
                    break
            elif data:
                chunks.append(data)
            if not message.get("more_body", False):
                break
        if too_big:
            await self._reply(send, _too_large(limit, max(total, declared or 0)))
            return None
        return b"".join(chunks)

    async def _reply(self, send, err: ApiError) -> None:
        self.metrics.errors.labels(kind=err.code or str(err.status)).inc()
        resp = err.response()
        resp.headers["Connection"] = "close"
        await resp({"type": "http"}, _no_receive, send)


class SameOriginOnly:
    """Refuses (403) a request that a web page of another origin sent (its ``Origin`` header names
    another host and port than its ``Host``), but for GET, HEAD and OPTIONS. The API sends no CORS headers,
    so a browser already keeps such pages from reading its answers and from sending JSON; but a "simple"
    request (a ``text/plain`` or form body) is sent without asking, and the API reads any body as JSON: any
    page a user of an unauthenticated API visited could start generations on it. Clients that are not
    browsers send no ``Origin``."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope.get("method") not in ("GET", "HEAD", "OPTIONS"):
            headers = dict(scope.get("headers", ()))
            origin = headers.get(b"origin")
            if origin is not None and not _same_origin(origin, headers.get(b"host")):
                err = ApiError(403, f"a request from the web page at {origin.decode('latin-1')[:200]} is refused: "
                                    "this API serves only its own origin and clients that are not browsers",
                               code="cross_origin")
                await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


# The scope key under which ApiKeyOnly says whether a request to an open path carried the key: ``/health``
# shows the mesh's route (node ids, addresses) only to those that did.
AUTHORIZED = "meshnet.authorized"


class ApiKeyOnly:
    """Answers 401 (OpenAI's ``invalid_api_key``) to a request without ``Authorization: Bearer KEY``, the
    key compared in constant time, as OpenAI and ``llama-server --api-key`` do; ``/health`` stays open to
    load balancers' probes (its details only with the key: :data:`AUTHORIZED`). Without it anyone who
    reaches the port can run generations on the mesh."""

    OPEN_PATHS = frozenset({"/health"})

    def __init__(self, app, api_key: str) -> None:
        self.app, self._expected = app, api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = next((value for name, value in scope.get("headers", ()) if name == b"authorization"), b"")
        scheme, _, key = sent.strip().partition(b" ")
        authorized = scheme.lower() == b"bearer" and hmac.compare_digest(key.strip(), self._expected)  # any case
        if authorized or scope["path"] in self.OPEN_PATHS:
            scope[AUTHORIZED] = authorized  # in place: the outer middleware reads what the app leaves in scope
            await self.app(scope, receive, send)
            return
        err = ApiError(401, f"{'an incorrect' if sent else 'no'} API key: send the header 'Authorization: Bearer "
                            f"KEY' with the key this server was started with (--api-key)", code="invalid_api_key")
        response = err.response()
        response.headers["WWW-Authenticate"] = "Bearer"  # what a 401 names (RFC 9110)
        await response(scope, receive, send)


def _same_origin(origin: bytes, host: bytes | None) -> bool:
    """Whether an ``Origin`` header (``scheme://host[:port]``, or ``null``) names the ``Host`` the
    request was sent to."""
    if host is None:
        return False
    try:
        netloc = urlsplit(origin.decode("latin-1")).netloc
    except ValueError:
        return False
    return bool(netloc) and netloc.lower() == host.decode("latin-1").lower()


# The scope key under which a failed stream leaves its error's status for BodyLimitAndMetrics to count.
_STREAM_FAILED = "meshnet.stream_failed"
_REQUEST_ID = "meshnet.request_id"  # the answer's x-request-id, as bytes


def stream_failed(scope, error: ApiError) -> None:
    """Record that the answer to the request of ``scope``, a stream already under way (its HTTP status
    sent), ended with the error event of ``error``: it is counted under its status (and logged, see
    :func:`log_failure`)."""
    scope[_STREAM_FAILED] = error.status
    log_failure(scope, error)


def log_failure(scope, error: ApiError) -> None:
    """Log an answer of status 500 or more (the mesh unavailable, the server stopping, a bug) with its
    ``x-request-id``: the id a user quotes finds why their request failed (a mesh failure's message names
    its session, under whose id the client logs its failovers). A 4xx is the caller's, and not logged."""
    if error.status >= 500:
        request_id = scope.get(_REQUEST_ID, b"").decode("ascii", "replace")
        log.warning("%s %s (x-request-id %s) answered %d %s: %s", scope.get("method", ""), scope.get("path", ""),
                    request_id, error.status, error.code or "", error.message)


async def _no_receive() -> dict:
    return {"type": "http.disconnect"}


def _too_large(limit: int, size: int) -> ApiError:
    return ApiError(413, f"the request body has {size} bytes, more than the {limit}-byte limit",
                    code="request_too_large")
