"""Render a GGUF's ``tokenizer.chat_template`` (Hugging Face Jinja conventions) into prompt text/ids.

Templates run in jinja2's ``ImmutableSandboxedEnvironment`` with the globals and filters Hugging Face
chat templates rely on: ``raise_exception``, ``strftime_now``, a ``tojson`` that keeps non-ASCII text,
``trim_blocks``/``lstrip_blocks`` and the ``loopcontrols`` extension.
"""

from __future__ import annotations

import datetime
import functools
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

if TYPE_CHECKING:  # imported lazily at run time: rendering alone needs no GGUF machinery
    from meshnet.tokenizer import GGUFTokenizer

__all__ = ["ChatTemplateError", "render_chat", "chat_prompt_ids", "normalize_messages"]


class ChatTemplateError(ValueError):
    """The template does not compile, fails while rendering, or called ``raise_exception``."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja2's built-in tojson escapes HTML characters and sorts keys; HF templates expect plain JSON
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template does not compile: {e}") from e


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Validate chat messages and flatten list-of-parts content to a string.

    Args:
        messages: non-empty sequence of mappings, each with a non-empty string ``role`` and a
            ``content`` that is a string or a list of ``{"type": "text", "text": str}`` parts.
            Text parts are joined with ``"\\n"`` (as llama.cpp's server does).  Other keys
            (``name``, ``tool_calls``, ...) are passed through; ``content`` may be ``None`` only on a
            message that has ``tool_calls``.

    Returns:
        New message dicts whose ``content`` is a ``str`` (or ``None`` for tool-call-only messages).

    Raises:
        ValueError: the list is empty, a message is not a mapping, lacks ``role``/``content``, or
            has content parts of a type other than ``"text"`` (the message names them).
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of message dicts, not {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty: a chat prompt needs at least one message")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise ValueError(f"message {i} must be a dict, not {type(msg).__name__}")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"message {i} has no 'role' (a non-empty string)")
        if "content" not in msg:
            raise ValueError(f"message {i} (role {role!r}) has no 'content'")
        content = msg["content"]
        if content is None and isinstance(msg.get("refusal"), str):
            content = msg["refusal"]  # an earlier answer that refused, sent back as OpenAI returns it
        if content is None:
            if not msg.get("tool_calls"):
                raise ValueError(f"message {i} (role {role!r}) has content None and no tool_calls")
        elif isinstance(content, list):
            content = join_text_parts(content, i)
        elif not isinstance(content, str):
            raise ValueError(f"message {i} content must be a string or a list of parts, "
                             f"not {type(content).__name__}")
        norm = dict(msg)
        norm["content"] = content
        out.append(norm)
    return out


def join_text_parts(parts: list[Any], index: int) -> str:
    """The text of message ``index``'s content parts, joined by newlines: ``text`` parts, and the
    ``refusal`` parts of an earlier answer sent back. Raises ValueError naming any other part type."""
    texts = []
    unsupported = []
    for part in parts:
        if not isinstance(part, Mapping):
            raise ValueError(f"message {index} content parts must be dicts, not {type(part).__name__}")
        kind = part.get("type")
        if kind not in ("text", "refusal"):
            unsupported.append(repr(kind))
            continue
        text = part.get(kind)
        if not isinstance(text, str):
            raise ValueError(f"message {index} has a {kind} part without a string {kind!r}")
        texts.append(text)
    if unsupported:
        raise ValueError(f"message {index} has unsupported content part type(s) "
                         f"{', '.join(sorted(set(unsupported)))}; only 'text' (and 'refusal') parts are supported")
    return "\n".join(texts)


def render_chat(template: str, messages: list[dict], *, bos_token: str, eos_token: str,
                add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
    """Render a Hugging Face style chat template.

    Args:
        template: Jinja source, e.g. a GGUF's ``tokenizer.chat_template``.
        messages: chat messages, validated and flattened by :func:`normalize_messages`.
        bos_token, eos_token: texts exposed to the template as ``bos_token`` / ``eos_token``.
        add_generation_prompt: ask the template to open the assistant's turn.
        tools: OpenAI-shaped tools, exposed to the template as ``tools`` (templates that support tool
            calling render them); None leaves ``tools`` undefined.

    Returns:
        The prompt text (control tokens still spelled out, e.g. ``"<|im_start|>"``).

    Raises:
        ValueError: invalid messages (see :func:`normalize_messages`).
        ChatTemplateError (a ValueError): the template does not compile, fails, or calls
            ``raise_exception``.
    """
    if not isinstance(template, str) or not template:
        raise ValueError("chat template is empty")
    msgs = normalize_messages(messages)
    compiled = _compile(template)
    try:
        extra = {} if tools is None else {"tools": tools}
        return compiled.render(messages=msgs, bos_token=bos_token, eos_token=eos_token,
                               add_generation_prompt=add_generation_prompt, **extra)
    except ChatTemplateError:
        raise
    except (jinja2.TemplateError, TypeError, ArithmeticError, LookupError, AttributeError) as e:
        # Python errors too: the template's own operations on the messages ('+' on a null content)
        raise ChatTemplateError(f"chat template failed to render: {e}") from e


def template_has_tools(template: str | None) -> bool:
    """Whether a chat template reads the ``tools`` variable (so it renders tools itself)."""
    if not template:
        return False
    return "tools" in jinja2.meta.find_undeclared_variables(_compile(template).environment.parse(template))


def chat_prompt_ids(tok: "GGUFTokenizer", messages: list[dict], *, template: str | None = None,
                    add_generation_prompt: bool = True, tools: list[dict] | None = None) -> list[int]:
    """Render ``messages`` with the model's chat template and tokenize the result.

    Control-token text the template writes (``"<|im_start|>"``, ``"<start_of_turn>"``) becomes those
    tokens (``parse_special=True``); in the messages it stays text, as OpenAI's API keeps it: a user's
    ``"<|im_end|>"`` does not end their turn (llama-server and Hugging Face's ``apply_chat_template`` let
    it). Messages without such text tokenize exactly as the whole rendering would.  BOS handling follows
    llama.cpp's ``common_chat_templates_apply``: when the model adds BOS, a BOS the template wrote at the
    very start is dropped from the text and the tokenizer adds the single BOS, so the ids start with
    exactly one BOS.  When the model does not add BOS, none is added (templates that do not write
    ``bos_token`` produce no BOS).

    Args:
        tok: the model's tokenizer.
        messages: chat messages (see :func:`normalize_messages`).
        template: Jinja source overriding ``tok.chat_template``.
        add_generation_prompt: open the assistant's turn at the end.
        tools: OpenAI-shaped tools for a template that renders them (see :func:`render_chat`).

    Returns:
        Prompt token ids.

    Raises:
        ValueError: no template (the GGUF has none and none was given), invalid messages, or a
            template error (:class:`ChatTemplateError`).
    """
    template = template if template is not None else tok.chat_template
    if not template:
        raise ValueError("this GGUF has no tokenizer.chat_template; pass template=...")
    bos_text = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
    eos_text = tok.token_text(tok.eos_id) if tok.eos_id is not None else ""
    messages, literals = normalize_messages(messages), []
    if (pattern := _literal_pattern(tok, messages, tools)) is not None:
        messages = _mark_literals(messages, pattern, literals)
        tools = _mark_literals(tools, pattern, literals)  # their descriptions are text too
    text = render_chat(template, messages, bos_token=bos_text, eos_token=eos_text,
                       add_generation_prompt=add_generation_prompt, tools=tools)
    if tok.add_bos and bos_text and text.startswith(bos_text):
        text = text[len(bos_text):]
    if not literals:
        return tok.encode(text, add_bos=tok.add_bos, parse_special=True, add_eos=False)
    # The template's text around the markers parses control tokens; each marker becomes its text again.
    parts = _MARKER.split(text)
    pieces = [(part, True) if k % 2 == 0 else (literals[int(part)], False) for k, part in enumerate(parts)]
    return tok.encode_pieces(pieces, add_bos=tok.add_bos, add_eos=False)


# Stands for the k-th literal text in a message while the template renders it (private-use characters,
# which messages' own text is marked for too, so a message cannot spell a marker).
_MARKER = re.compile("\ue000([0-9]+)\ue001")


def _strings(value: Any) -> Iterator[str]:
    """Every string in ``value`` (messages or tools), recursively, keys included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def _literal_pattern(tok: "GGUFTokenizer", *values: Any) -> re.Pattern | None:
    """What must stay literal text in ``values``' strings: the control-token texts and marker characters
    they hold (longest texts first), looked for in one scan of them all; None when they hold none."""
    joined = "\n".join(s for value in values for s in _strings(value))
    found = tok.control_texts_in(joined) + [c for c in ("\ue000", "\ue001") if c in joined]
    return re.compile("|".join(map(re.escape, found))) if found else None


def _mark_literals(value: Any, pattern: re.Pattern, literals: list[str]) -> Any:
    """``value`` (the messages or tools, recursively, keys included) with each ``pattern`` match in its
    strings replaced by a marker for it, appended to ``literals``."""
    if isinstance(value, str):
        def mark(m: re.Match) -> str:
            literals.append(m.group(0))
            return f"\ue000{len(literals) - 1}\ue001"

        return pattern.sub(mark, value)
    if isinstance(value, Mapping):
        return {_mark_literals(k, pattern, literals): _mark_literals(v, pattern, literals) for k, v in value.items()}
    if isinstance(value, list):
        return [_mark_literals(v, pattern, literals) for v in value]
    return value
