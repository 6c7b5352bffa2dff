"""Errors in OpenAI's JSON shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from fastapi.responses import JSONResponse

# OpenAI's error ``type`` for each status the API answers with.
_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
          413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable",
          500: "server_error"}


class ApiError(Exception):
    """An error answer. ``status`` is the HTTP status; ``param`` names the offending request field;
    ``retry_after_s`` adds a ``Retry-After`` header (seconds, rounded up to an integer)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, int(-(-self.retry_after_s // 1))))
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def model_not_found(model: str, served: str) -> ApiError:
    """The 404 for a request naming a model other than the one served (OpenAI's ``model_not_found``)."""
    return ApiError(404, f"model {model!r} is not served here; this server serves {served!r}", param="model",
                    code="model_not_found")


def internal_error(e: BaseException) -> ApiError:
    """The 500 for a bug inside a request: names the exception's type, not its text (which may hold
    internals); the details go to the server's log."""
    return ApiError(500, f"internal error: {type(e).__name__}", code="internal_error")


# OpenAI's endpoints this server does not serve, by path prefix: a 404 there names what the client asked for.
_UNSERVED = {"/v1/embeddings": "embeddings", "/v1/audio": "audio", "/v1/images": "images",
             "/v1/moderations": "moderations"}


def no_such_endpoint(method: str, path: str) -> ApiError:
    """The 404 for a path nothing serves; for one of OpenAI's endpoints this server lacks, it says so
    (``unsupported_endpoint``) and names those it has. A stored response asked for by id
    (``/v1/responses/{id}``, its ``input_items``, its cancel) is not found: none is ever kept."""
    if path.startswith("/v1/responses/") and len(path) > len("/v1/responses/"):
        response_id = path[len("/v1/responses/"):].split("/", 1)[0]
        return ApiError(404, f"no response {response_id!r}: this server keeps no responses (each answer is "
                             "returned once, whatever store says)", code="response_not_found")
    known = next((what for prefix, what in _UNSERVED.items() if path == prefix or path.startswith(prefix + "/")),
                 None)
    if known is None:
        return ApiError(404, f"no such endpoint: {method} {path}")
    return ApiError(404, f"no such endpoint: {method} {path} ({known} are not served here: this server generates "
                         "text with /v1/chat/completions and /v1/completions)", code="unsupported_endpoint")
