"""A request's prompt as token ids: a completion's ``prompt`` (text or ids, one or many) and a chat's
``messages`` rendered with the model's chat template, tools included."""

from __future__ import annotations

from typing import Any

from meshnet.api.errors import bad_request
from meshnet.api.schemas import ChatCompletionRequest
from meshnet.api.tools import ToolPlan, hermes_calls_text, tools_system_message
from meshnet.chat_template import join_text_parts
from meshnet.tokenizer import GGUFTokenizer


def refuse_beyond_context(tok: GGUFTokenizer, n_chars: int, n_ctx: int | None, param: str) -> None:
    """Refuse, before tokenizing it, a text of ``n_chars`` characters that no context of ``n_ctx`` tokens
    holds (see :attr:`GGUFTokenizer.max_token_chars`): tokenizing runs in Python, holding the interpreter
    lock, and a 1.3 MB prompt held every other request (and a running stream's tokens) for a second
    before it was refused. Raises ApiError (400 ``context_length_exceeded``); None ``n_ctx``: no check."""
    if n_ctx is not None and n_chars > n_ctx * tok.max_token_chars + 1:
        raise bad_request(f"This model's maximum context length is {n_ctx} tokens, but the prompt has {n_chars} "
                          f"characters, more than {n_ctx} tokens of its vocabulary hold (at most "
                          f"{tok.max_token_chars} characters a token). Shorten the prompt.", param,
                          "context_length_exceeded")


def completion_prompts(tok: GGUFTokenizer, prompt: Any, n_ctx: int | None = None) -> list[list[int]]:
    """The token ids of each prompt of a completion request.

    Args:
        tok: the model's tokenizer.
        prompt: the request's ``prompt``: a string, a list of strings, a list of token ids, or a list
            of such lists.
        n_ctx: the context length: a text prompt longer than it can hold is refused untokenized.
    Returns:
        One ``list[int]`` per prompt.
    Raises:
        ApiError: 400 ``empty_prompt`` for an empty prompt, ``invalid_token`` for an id outside
            ``[0, n_vocab)``, ``context_length_exceeded`` for a text no context of ``n_ctx`` holds.
    """
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise bad_request("prompt is empty", "prompt", "empty_prompt")
    if isinstance(prompt[0], int):
        prompt = [prompt]
    out = []
    for p in prompt:
        if isinstance(p, str):
            if not p:
                raise bad_request("prompt is empty", "prompt", "empty_prompt")
            refuse_beyond_context(tok, len(p), n_ctx, "prompt")
            # Control-token text in a raw prompt ("<|im_start|>") becomes those tokens, as llama.cpp's
            # server does, so hand-rendered chat prompts work.
            out.append(tok.encode(p, parse_special=True))
        else:
            bad = [t for t in p if not 0 <= t < tok.n_vocab]
            if bad:
                raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {tok.n_vocab})",
                                  "prompt", "invalid_token")
            out.append(list(p))
    return out


def chat_prompt(tok: GGUFTokenizer, req: ChatCompletionRequest, plan: ToolPlan, n_ctx: int | None = None) -> list[int]:
    """The token ids of a chat request's messages, rendered with the model's chat template (tools in
    the template when it reads them, else as a system message).

    Raises:
        ApiError: 400 ``invalid_messages`` for messages the template refuses, or a malformed earlier
            tool call; 400 ``model_has_no_chat_template`` when the model has no template; 400
            ``context_length_exceeded`` for messages whose text (or number) no context of ``n_ctx`` tokens
            holds, found before rendering them: rendering and tokenizing 50,000 messages held every stream
            for a second.
    """
    from meshnet.chat_template import chat_prompt_ids, template_has_tools

    if not tok.chat_template:  # a base model's GGUF (Gemma 3 270M's): nothing to render messages with
        raise bad_request("the served model has no chat template (its GGUF holds no tokenizer.chat_template), so "
                          "it cannot take messages: send the text as a prompt to /v1/completions",
                          "messages", "model_has_no_chat_template")
    if n_ctx is not None and len(req.messages) > n_ctx:  # each message renders to a token at least
        raise bad_request(f"This model's maximum context length is {n_ctx} tokens, but there are "
                          f"{len(req.messages)} messages, a token each at least. Shorten the conversation.",
                          "messages", "context_length_exceeded")
    refuse_beyond_context(tok, sum(len(m.content) if isinstance(m.content, str) else
                                   sum(len(p.text or "") for p in m.content) if m.content else 0
                                   for m in req.messages), n_ctx, "messages")
    tools = plan.prompt_tools()
    messages = []
    if tools and not template_has_tools(tok.chat_template):
        messages.append(tools_system_message(tools))
        tools = None
    # A template that never reads tool_calls (SmolLM2's) would drop an earlier call, or fail on its
    # null content: the call is shown as the Hermes block the tools' system message teaches.
    template_reads_tool_calls = "tool_calls" in (tok.chat_template or "")
    for i, m in enumerate(req.messages):
        # Only the assistant calls tools: calls on another message would be dropped without a word. (A tool's
        # answer without tool_call_id is taken, as llama-server and Ollama take it; OpenAI's API refuses it.)
        if m.tool_calls and m.role != "assistant":
            raise bad_request(f"messages[{i}] has role {m.role!r} and tool_calls: only an assistant message "
                              "calls tools", f"messages.{i}.tool_calls", "invalid_messages")
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role}
        if isinstance(m.content, list):
            d["content"] = [p.model_dump(exclude_none=True) for p in m.content]
        else:
            d["content"] = m.content
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(m, key) is not None:
                d[key] = getattr(m, key)
        if isinstance(refusal := (m.model_extra or {}).get("refusal"), str):
            d["refusal"] = refusal  # the text of an earlier answer that refused (see normalize_messages)
        if m.tool_calls:
            calls = hermes_calls_text(m.tool_calls, f"messages.{i}.tool_calls")  # checked either way
            if not template_reads_tool_calls:
                try:
                    text = join_text_parts(d["content"], i) if isinstance(d["content"], list) else d["content"]
                except ValueError as e:
                    raise bad_request(str(e), "messages", "invalid_messages") from None
                d["content"] = "\n".join(p for p in (text, calls) if p)
                del d["tool_calls"]
        messages.append(d)
    try:
        return chat_prompt_ids(tok, messages, tools=tools)
    except ValueError as e:  # invalid messages or a template error (ChatTemplateError)
        raise bad_request(str(e), "messages", "invalid_messages") from None
