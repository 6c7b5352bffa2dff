"""The API's per-choice text logic without a server: stop sequences with hold-back, log-prob release, and a
generation that ends at a chat turn marker."""

from __future__ import annotations

import asyncio
import random

import pytest

from meshnet.api.metrics import ApiMetrics
from meshnet.api.runner import ChoiceRun, ChoiceText, GenJob
from meshnet.contract import GREEDY, SampledToken, Status, StepResult


def _tok(i: int) -> SampledToken:
    return SampledToken(token_id=i, logprob=-float(i))


def _reference(pieces: list[str], stops: list[str]) -> tuple[str, str | None]:
    """What the client must get: the text up to the first stop match, found as soon as it is complete."""
    acc = ""
    for p in pieces:
        acc += p
        hits = [acc.find(s) for s in stops if s in acc]
        if hits:
            return acc[:min(hits)], "stop"
    return acc, None


def test_stop_split_across_pieces_is_never_released():
    ct = ChoiceText(["o w", "xyz"])
    out = [ct.add_token(_tok(i), p) for i, p in enumerate(["Hel", "lo", " ", "world"])]
    assert [p.text for p in out] == ["Hel", "l", "", ""]  # "o" and "o " are held back: they may become "o w"
    assert out[-1].finish_reason == "stop" and ct.text == "Hell"
    # tokens go out with their text; the token that completed the match started before the cut
    assert [t.token_id for p in out for t, _ in p.tokens] == [0, 1]
    assert [off for p in out for _, off in p.tokens] == [0, 3]


def test_held_back_text_is_released_when_it_stops_matching_or_at_the_end():
    ct = ChoiceText(["END"])
    assert ct.add_token(_tok(0), "the E").text == "the "
    assert ct.add_token(_tok(1), "N").text == ""
    assert ct.add_token(_tok(2), "d").text == "ENd"
    assert ct.add_token(_tok(3), " EN").text == " "
    last = ct.finish("length")
    assert last.text == "EN" and last.finish_reason == "length" and ct.text == "the ENd EN"
    assert [t.token_id for t, _ in last.tokens] == [3]


def test_tokens_of_a_split_character_are_released_with_it():
    ct = ChoiceText()
    first = ct.add_token(_tok(0), "")  # first half of a UTF-8 character: no text yet
    assert first.text == "" and first.tokens == []
    second = ct.add_token(_tok(1), "é")
    assert second.text == "é" and [(t.token_id, off) for t, off in second.tokens] == [(0, 0), (1, 0)]


@pytest.mark.parametrize("seed", range(40))
def test_random_texts_match_the_reference(seed):
    rng = random.Random(seed)
    alphabet = "ab é🌍"
    full = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
    pieces, i = [], 0
    while i < len(full):
        n = rng.randint(0, 4)
        pieces.append(full[i:i + n])
        i += n
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(0, 3))]
    expected, reason = _reference(pieces, stops)
    max_stop = max((len(s) for s in stops), default=0)
    ct = ChoiceText(stops)
    released, acc, got_reason = "", "", None
    for k, p in enumerate(pieces):
        acc += p
        piece = ct.add_token(_tok(k), p)
        released += piece.text
        assert expected.startswith(released)
        if piece.finish_reason:
            got_reason = piece.finish_reason
            break
        assert len(released) >= len(acc) - max(0, max_stop - 1)  # hold back no more than a stop's prefix
    if got_reason is None:
        released += ct.finish("length").text
    assert released == expected and (got_reason == "stop") == (reason == "stop")


# ---- a run that meets a turn marker (a control token that is not end-of-generation) ------------------


class _Script:
    """A client that answers a fixed token sequence and records releases."""

    def __init__(self, ids: list[int]) -> None:
        self.ids, self.released, self.cancelled = ids, [], []

    def step(self, req, decode):
        return StepResult(Status.OK, token=SampledToken(self.ids[min(req.step_id, len(self.ids) - 1)], -0.1))

    def cancel(self, sid):
        self.cancelled.append(sid)

    def release(self, sid):
        self.released.append(sid)


def test_chat_run_stops_at_a_turn_marker(smollm2_path):
    from meshnet.api.backend import ApiBackend
    from meshnet.tokenizer import GGUFTokenizer

    tok = GGUFTokenizer.from_gguf(str(smollm2_path))
    hi = tok.encode(" Hi")
    start = tok.token_id("<|im_start|>")
    assert start is not None and not tok.is_eog(start) and tok.is_control(start)
    script = _Script(hi + [start] + tok.encode("assistant\nmore"))
    backend = ApiBackend(lambda: script, tok, "m", 64)

    async def run(stop_at_control: bool):
        job = GenJob(tok.encode("x"), 8, GREEDY, (), stop_at_control)
        r = ChoiceRun(backend, job, asyncio.Semaphore(1), ApiMetrics(), 0.0)
        await r.start()
        try:
            pieces = await r.collect()
        finally:
            await r.aclose()
        return "".join(p.text for p in pieces), r

    text, r = asyncio.run(run(True))
    assert text == " Hi" and r.finish_reason == "stop" and r.completion_tokens == len(hi)
    assert script.cancelled and script.released  # stopped early: cancelled, then released
    text, r = asyncio.run(run(False))  # plain completions keep going (the marker renders as nothing)
    assert text.startswith(" Hiassistant") and r.completion_tokens == 8 and r.finish_reason == "length"


def test_api_command_line():
    import argparse

    from meshnet.api.server import add_api_parser, run_api

    parser = argparse.ArgumentParser(prog="meshnet")
    add_api_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["api", "--tracker", "10.0.0.1:7700", "--port", "9000", "--join-token", "t"])
    assert (args.tracker, args.model, args.host, args.port, args.join_token) == \
        ("10.0.0.1:7700", "smollm2", "127.0.0.1", 9000, "t")
    assert args.func is run_api
