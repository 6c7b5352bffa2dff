"""Counts out of range, a bench's and ``--draft-tokens``, are argparse's error naming the flag (exit status
2), before anything starts: they took any integer, and failed once the bench ran (a division by a decode
speed of 0, a message naming no flag), or only after it had loaded its model."""

from __future__ import annotations

import pytest

from meshnet.cli import build_parser


@pytest.mark.parametrize("argv,message", [
    (["bench", "speculative", "--draft-tokens", "0"], "argument --draft-tokens: must be 1 to 16, got 0"),
    (["bench", "speculative", "--draft-tokens", "17"], "argument --draft-tokens: must be 1 to 16, got 17"),
    (["bench", "speculative", "--decode-tokens", "1"],  # plain decode 0 tok/s: the ratio divided by it
     "argument --decode-tokens: must be >= 2 (the first token comes from the prefill), got 1"),
    (["bench", "speculative", "--threads", "0"], "argument --threads: must be 1 to 512, got 0"),
    (["bench", "hostile", "--connections", "-1"], "argument --connections: must be >= 1, got -1"),
    (["bench", "scale", "--parity-tokens", "0"], "argument --parity-tokens: must be >= 1, got 0"),
    (["bench", "wan", "--max-tokens", "1"],  # refused only once the bench ran
     "argument --max-tokens: must be >= 2 (the first token comes from the prefill), got 1"),
    (["bench", "wan", "--max-tokens", "many"], "argument --max-tokens: expected a whole number, got 'many'"),
    (["bench", "structured", "--threads", "0"], "argument --threads: must be 1 to 512, got 0"),
])
def test_a_bench_count_out_of_range_is_refused_naming_its_flag(argv, message, capsys):
    _assert_refused(argv, f"meshnet {' '.join(argv[:2])}: error: {message}", capsys)


@pytest.mark.parametrize("command", ["generate", "up", "api"])
def test_a_draft_count_out_of_range_is_refused_naming_the_flag(command, capsys):
    """It was "draft_tokens must be in [1, 16], got 0", naming no flag, from meshnet up only once its model
    was planned."""
    _assert_refused([command, "--draft-tokens", "0"],
                    f"meshnet {command}: error: argument --draft-tokens: must be 1 to 16, got 0", capsys)


def _assert_refused(argv: list[str], line: str, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser(argv).parse_args(argv)
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == line
