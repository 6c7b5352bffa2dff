"""Request bodies into the API's schemas, and pydantic's complaints into one OpenAI-style 400 that names the
parameter (``messages.0.content``) and what is wrong with it."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from meshnet.api.errors import ApiError, bad_request


def parse_body(model: type[BaseModel], body: bytes) -> Any:
    """The request ``body`` (JSON bytes) as a ``model``. Raises ApiError (400) naming what is wrong."""
    if not body.strip():
        raise bad_request("the request body is empty; send a JSON object", None, "invalid_json")
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e.errors()) from None


def validation_error(errors: list[dict]) -> ApiError:
    """One 400 naming the first problem's parameter (``messages.0.content``) and what is wrong with it."""
    if not errors:
        return bad_request("invalid request")
    err = errors[0]
    kind = err.get("type", "")
    loc = [x for x in err.get("loc", ()) if x != "body"]
    if kind == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {err.get('msg', '')}", None, "invalid_json")
    if kind == "model_type" and not loc:
        return bad_request("the request body must be a JSON object", None, "invalid_json")
    param = ".".join(str(x) for x in loc if not _is_type_tag(x)) or None
    if kind == "extra_forbidden":
        return bad_request(f"unrecognized request argument: {param}", param, "unknown_parameter")
    if kind == "missing":
        return bad_request(f"missing required parameter: {param}", param, "missing_required_parameter")
    # A union (``prompt``: string or list ...) reports one error per alternative, each tagged with the
    # alternative's type: name the accepted forms once instead.
    tag_at = next((i for i, x in enumerate(loc) if _is_type_tag(x)), None)
    if tag_at is not None:
        prefix = tuple(loc[:tag_at])
        same = [e for e in errors if tuple(x for x in e.get("loc", ()) if x != "body")[:tag_at] == prefix]
        tags = [str(e["loc"][tag_at + ("body" in e["loc"])]) for e in same]
        param = ".".join(str(x) for x in prefix) or None
    if tag_at is not None and len(same) > 1:
        forms = " or ".join(dict.fromkeys(tags))
        return bad_request(f"invalid value for {param}: expected {forms}, got {_json_type(err.get('input'))}",
                           param, "invalid_type")
    code = "invalid_type" if kind.endswith("_type") else "invalid_value"
    return bad_request(f"invalid value for {param}: {err.get('msg', 'invalid')}", param, code)


def _is_type_tag(part: Any) -> bool:
    """Pydantic names union alternatives in error locations (``str``, ``list[int]``, ``TextPart``)."""
    return isinstance(part, str) and (part in {"str", "int", "float", "bool", "none", "TextPart", "StreamOptions"}
                                      or "[" in part or part.startswith("function-"))


def _json_type(value: Any) -> str:
    return {str: "a string", int: "an integer", float: "a number", bool: "a boolean", list: "an array",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)
