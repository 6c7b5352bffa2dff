"""A generation whose token budget ends inside a multi-byte UTF-8 character: the incomplete bytes are held
back, never rendered as U+FFFD, in the generation loop and in every form of the OpenAI API answer.

The tokens are the golden mixed-script prompt's own ids ("... then 北京欢迎你 🙂"): SmolLM2's byte-level
BPE splits 北 (``e5 8c 97``) across three tokens, so some prefixes of the ids end mid-character.
"""

from __future__ import annotations

import pytest

from conftest import load_golden
from meshnet.contract import GREEDY
from meshnet.generation import Generation
from test_api_text import _Script
from test_tokenizer import MIXED_SCRIPT, _is_complete_utf8


@pytest.fixture(scope="module")
def cut(tok):
    """(tokenizer, ids, n): ``ids[:n]`` ends one byte into 北 (3 UTF-8 bytes), ``ids[:n - 1]`` is whole text."""
    ids = [t for t in load_golden("SmolLM2-135M-Instruct.Q4_1")["prompts"][MIXED_SCRIPT]["prompt_ids"]
           if t != tok.bos_id]
    raw = [b"".join(tok.token_bytes(t) for t in ids[:k]) for k in range(len(ids) + 1)]
    n = next(k for k in range(1, len(ids) + 1) if not _is_complete_utf8(raw[k]))
    assert raw[n].endswith(b" \xe5") and _is_complete_utf8(raw[n - 1])  # 北 is e5 8c 97
    return tok, ids, n


def test_generation_holds_back_the_cut_character(cut):
    tok, ids, n = cut
    whole = tok.decode(ids[:n - 1])  # everything before the token that starts 北
    assert tok.decode(ids[:n]) == whole + " \ufffd"  # what a naive flush shows
    gen = Generation(_Script(ids), tok, [1, 2], max_tokens=n, sampling=GREEDY)
    events = list(gen)
    assert len(events) == n and [e.token.token_id for e in events] == ids[:n]
    assert "".join(e.text for e in events) == whole + " "  # the space before 北 is a whole character
    assert gen.result.text == whole + " " and "\ufffd" not in gen.result.text
    assert gen.result.finish_reason == "length" and gen.result.generated_token_ids == ids[:n]
    # One more token completes 北 (its last byte is still to come: the text stays whole).
    longer = Generation(_Script(ids), tok, [1, 2], max_tokens=n + 2, sampling=GREEDY)
    list(longer)
    assert longer.result.text == tok.decode(ids[:n + 2]) and longer.result.text.endswith(" 北")


@pytest.fixture(scope="module")
def api(cut):
    openai = pytest.importorskip("openai")
    from meshnet.api.backend import ApiBackend
    from meshnet.api.server import start_api_in_thread, stop_api

    tok, ids, _ = cut
    backend = ApiBackend(lambda: _Script(ids), tok, "cut", 512)
    server, thread = start_api_in_thread(backend, "127.0.0.1", 0)
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{server.config.port}/v1", api_key="unused", max_retries=0,
                        timeout=60)
    stop_api(server, thread)


def test_api_completion_holds_back_the_cut_character(api, cut):
    tok, ids, n = cut
    want = tok.decode(ids[:n - 1]) + " "
    whole = api.completions.create(model="cut", prompt="x", max_tokens=n, temperature=0)
    assert whole.choices[0].text == want and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == n
    chunks = list(api.completions.create(model="cut", prompt="x", max_tokens=n, temperature=0, stream=True))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == want and not any("\ufffd" in t for t in texts)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_api_chat_holds_back_the_cut_character(api, cut):
    tok, ids, n = cut
    want = tok.decode(ids[:n - 1]) + " "
    msgs = [{"role": "user", "content": "hi"}]
    whole = api.chat.completions.create(model="cut", messages=msgs, max_tokens=n, temperature=0)
    assert whole.choices[0].message.content == want and whole.choices[0].finish_reason == "length"
    chunks = list(api.chat.completions.create(model="cut", messages=msgs, max_tokens=n, temperature=0,
                                              stream=True))
    texts = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(texts) == want and not any("\ufffd" in t for t in texts)
