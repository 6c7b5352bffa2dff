"""Request bodies into the API's schemas, and pydantic's complaints into one OpenAI-style 400 that names the
parameter (``messages.0.content``) and what is wrong with it; the checks of sampling fields that need more
than a type and a range (aliases, ``logit_bias``, stop sequences), and the request's sampling parameters
and token budget."""

from __future__ import annotations

import math
import re
from typing import Any

from pydantic import BaseModel, ValidationError

from meshnet.api.errors import ApiError, bad_request
from meshnet.api.schemas import MAX_STOP
from meshnet.sampling_params import F32_TINY, LOGIT_BIAS_LIMIT, MAX_LOGIT_BIAS, Grammar, SamplingParams, as_float32

_TOKEN_KEY = re.compile(r"[0-9]{1,10}")


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
        msg = err.get("msg", "")
        if "recursion limit" in msg:  # pydantic's parser nests at most 255 levels deep
            return bad_request(f"the request body nests arrays and objects too deeply to read ({msg})", None,
                               "invalid_json")
        if "hex escape" in msg or "surrogate" in msg:
            # \ud800 alone is JSON's grammar but no character: the parser's "unexpected end of hex escape"
            # reads as a typo in the escape.
            msg += (" (a string holds an unpaired UTF-16 surrogate escape such as \\ud800: a character beyond "
                    "U+FFFF is written as a pair, \\ud83d\\ude00, or as itself in UTF-8)")
        return bad_request(f"the request body is not valid JSON: {msg}", None, "invalid_json")
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
        # The value has one alternative's shape (an array where a string or an array of parts is asked
        # for): that alternative's own error says what is wrong inside it.
        value = next((e.get("input") for e in same if len([x for x in e["loc"] if x != "body"]) == tag_at + 1),
                     err.get("input"))
        shaped = [e for e, t in zip(same, tags) if _has_shape(value, t)]
        if len(shaped) == 1:
            inner = [x for x in shaped[0]["loc"] if x != "body" and not _is_type_tag(x)]
            where = ".".join(str(x) for x in inner)
            code = "invalid_type" if shaped[0]["type"].endswith("_type") else "invalid_value"
            return bad_request(f"invalid value for {where}: {shaped[0]['msg']}", where, code)
        forms = " or ".join(dict.fromkeys(tags))
        got = _json_type(value)
        if isinstance(value, list) and value:  # which kinds the array mixes
            got = f"an array holding {' and '.join(dict.fromkeys(_json_type(v) for v in value))}"
        return bad_request(f"invalid value for {param}: expected {forms}, got {got}", param, "invalid_type")
    code = "invalid_type" if kind.endswith("_type") else "invalid_value"
    return bad_request(f"invalid value for {param}: {err.get('msg', 'invalid')}", param, code)


def _is_type_tag(part: Any) -> bool:
    """Pydantic names union alternatives in error locations (``str``, ``list[int]``, ``TextPart``)."""
    return isinstance(part, str) and (part in {"str", "int", "float", "bool", "none", "TextPart", "StreamOptions"}
                                      or "[" in part or part.startswith("function-"))


def _has_shape(value: Any, tag: str) -> bool:
    """Whether JSON ``value`` is of the kind union alternative ``tag`` names (``list[...]`` an array, a
    model or ``dict[...]`` an object, ``str`` a string)."""
    if isinstance(value, list):
        return tag.startswith("list[")
    if isinstance(value, dict):
        return tag.startswith("dict[") or tag[:1].isupper()
    return tag == {str: "str", bool: "bool", int: "int", float: "float"}.get(type(value))


def _json_type(value: Any) -> str:
    return {str: "a string", int: "an integer", float: "a number", bool: "a boolean", list: "an array",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)


def repetition_penalty(req: Any) -> float | None:
    """The request's repetition penalty under either name: ``repetition_penalty`` (vLLM, HF) or llama-server's
    ``repeat_penalty``; None when neither is given.

    Raises:
        ApiError: 400 naming both when both are given and differ.
    """
    a, b = req.repetition_penalty, req.repeat_penalty
    if a is not None and b is not None and a != b:
        raise bad_request(f"repeat_penalty ({b}) and repetition_penalty ({a}) are two names for one "
                          "setting and differ; give one", "repeat_penalty")
    return a if a is not None else b


def logit_bias(raw: dict[str, float] | None, n_vocab: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` (token id as a decimal string -> bias) as the ``(token_id, bias)`` pairs of
    :attr:`meshnet.sampling_params.SamplingParams.logit_bias`, ids ascending; ``()`` for None or ``{}``.

    Args:
        raw: the request's map; values are numbers (the schema checked their type).
        n_vocab: the model's vocabulary size; ids must lie in ``[0, n_vocab)``.
    Raises:
        ApiError: 400 with ``param`` ``logit_bias``: a key that is not a token id in the vocabulary, a bias
            outside [-100, 100] (or not finite), more than ``MAX_LOGIT_BIAS`` entries, or every token banned.
    """
    if not raw:
        return ()
    if len(raw) > MAX_LOGIT_BIAS:
        raise bad_request(f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got {len(raw)}", "logit_bias")
    pairs: dict[int, float] = {}
    for key, bias in raw.items():
        if not _TOKEN_KEY.fullmatch(key) or int(key) >= n_vocab:
            raise bad_request(f"logit_bias key {key!r} is not a token id: keys are token ids in "
                              f"[0, {n_vocab}) written as strings", "logit_bias", "invalid_token")
        if not (math.isfinite(bias) and -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT):
            raise bad_request(f"logit_bias[{key!r}] must be a number in [-{LOGIT_BIAS_LIMIT:g}, "
                              f"{LOGIT_BIAS_LIMIT:g}], got {bias}", "logit_bias")
        if int(key) in pairs:  # "7" and "007"
            raise bad_request(f"logit_bias names token {int(key)} twice", "logit_bias")
        pairs[int(key)] = float(bias)
    if sum(b <= -LOGIT_BIAS_LIMIT for b in pairs.values()) >= n_vocab:
        raise bad_request("logit_bias bans every token of the vocabulary", "logit_bias")
    return tuple(sorted(pairs.items()))


def stop_sequences(stop: str | list[str] | None) -> list[str]:
    """The request's ``stop`` as a list without empty strings. Raises ApiError (400) beyond MAX_STOP."""
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > MAX_STOP:
        raise bad_request(f"at most {MAX_STOP} stop sequences are allowed, got {len(stops)}", "stop")
    return [s for s in stops if s]


def answer_stops(stop: str | list[str] | None, grammar: Grammar | None) -> tuple[str, ...]:
    """The stop sequences a generation ends at: the request's (:func:`stop_sequences`), none where a grammar
    constrains the whole answer (a ``response_format`` schema, a required or named tool call). The grammar
    ends such an answer where its document ends; a stop sequence found inside the document cut it into
    JSON that does not parse, reported as a finished answer (``finish_reason`` "stop"). Raises ApiError
    (400) beyond MAX_STOP."""
    return () if grammar is not None else tuple(stop_sequences(stop))


def sampling_params(req, n_vocab: int, n_top: int, index: int, grammar: Grammar | None = None, *,
                    logprobs: bool) -> SamplingParams:
    """SamplingParams for choice ``index`` of ``req`` (seeded choices use ``seed + index``); OpenAI's
    defaults for absent fields (temperature 1, no filters, no penalties). ``logprobs``: the response
    reports each token's log-prob (otherwise the tail need not compute it). Raises ApiError (400)."""
    def pick(value, default):
        return default if value is None else value

    def carried(value: float, least: float) -> float:
        """A value below the least 32-bit float the steps carry as ``least``, which does the same: a top_p
        that small keeps the top token alone (F32_TINY), a penalty that small is none (0)."""
        return value if value == 0 or as_float32(value) != 0 else least

    # Choice i draws from seed + i, wrapped into int64 as the wire holds it (seed 2**63 - 1 with n = 2).
    seed = None if req.seed is None else (req.seed + index + (1 << 63)) % (1 << 64) - (1 << 63)
    sp = SamplingParams(temperature=pick(req.temperature, 1.0), top_k=pick(req.top_k, 0),
                        top_p=carried(pick(req.top_p, 1.0), F32_TINY), min_p=pick(req.min_p, 0.0),
                        repetition_penalty=pick(repetition_penalty(req), 1.0),
                        presence_penalty=carried(pick(req.presence_penalty, 0.0), 0.0),
                        frequency_penalty=carried(pick(req.frequency_penalty, 0.0), 0.0),
                        seed=seed, n_top_logprobs=n_top,
                        logit_bias=logit_bias(req.logit_bias, n_vocab), grammar=grammar, logprobs=logprobs)
    problem = sp.validate()
    if problem:
        field = problem.split(" ", 1)[0]  # the messages name the field first
        raise bad_request(problem, field if field in _SAMPLING_FIELDS else None)
    return sp


# Request fields of the same name as SamplingParams' (whose problems name the field first).
_SAMPLING_FIELDS = frozenset({"temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                              "frequency_penalty", "logit_bias"})


def token_budget(n_ctx: int, prompt_ids: list[int], max_tokens: int | None, param: str) -> int:
    """Generated-token budget: ``max_tokens`` capped by what a context of ``n_ctx`` tokens still holds.
    A prompt that does not fit (or is empty) is refused here (400 naming ``param``), before any node is
    asked for anything."""
    if not prompt_ids:
        raise bad_request("the prompt is empty", param, "empty_prompt")
    if len(prompt_ids) > n_ctx:
        raise bad_request(f"This model's maximum context length is {n_ctx} tokens, but the prompt has "
                          f"{len(prompt_ids)} tokens. Shorten the prompt.", param, "context_length_exceeded")
    # The last generated token is never fed back, so positions 0 .. n_ctx - 1 allow one extra token.
    room = n_ctx - len(prompt_ids) + 1
    return room if max_tokens is None else min(max_tokens, room)
