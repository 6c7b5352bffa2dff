"""The HTTP connection protocol the API and the dashboard serve with: uvicorn's httptools protocol, with a
deadline on a request's headers.

uvicorn bounds the wait between requests (``timeout_keep_alive``) and our middleware the wait for a body,
but nothing bounded a request's headers: a connection that sent ``POST ... HTTP/1.1`` and then a byte every
few seconds stayed open for good, and 20,000 of them took every file descriptor of the process (a
``/health`` check then failed). A connection now has :data:`HEADERS_S` from connecting, or from its last
response, to finish a request's headers; past it, it is closed.
"""

from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# Seconds a connection has to send a whole request's headers (the body has its own 30 s, see middleware).
HEADERS_S = 30.0


class HeaderDeadlineProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline on each request's headers (:data:`HEADERS_S`)."""

    _headers_timer = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request's headers, if it sends one (uvicorn's keep-alive ends an idle one)

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._headers_timer = self.loop.call_later(HEADERS_S, self._headers_late)

    def _disarm(self) -> None:
        if self._headers_timer is not None:
            self._headers_timer.cancel()
            self._headers_timer = None

    def _headers_late(self) -> None:
        self._headers_timer = None
        if self.cycle is None or self.cycle.response_complete:  # no request under way: its headers are late
            self.transport.close()
