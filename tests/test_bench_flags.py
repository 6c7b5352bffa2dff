"""Counts out of range, a bench's, ``--draft-tokens`` and a stage's load settings (``--threads``, ``--n-ctx``,
``--max-sessions``, ...), are argparse's error naming the flag (exit status 2), before anything starts: they
took any integer, and failed once the bench ran (a division by a decode speed of 0, a message naming no flag),
or only after it had loaded its model."""

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
    (["bench", "engine", "--threads", "513"], "argument --threads: must be 1 to 512, got 513"),
    (["bench", "mesh", "--threads", "0"], "argument --threads: must be 1 to 512, got 0"),
    (["bench", "hostile", "--threads", "0"], "argument --threads: must be 1 to 512, got 0"),
    (["bench", "worker", "--threads", "0"], "argument --threads: must be 1 to 512, got 0"),
])
def test_a_bench_count_out_of_range_is_refused_naming_its_flag(argv, message, capsys):
    _assert_refused(argv, f"meshnet {' '.join(argv[:2])}: error: {message}", capsys)


@pytest.mark.parametrize("command", ["generate", "up", "api"])
def test_a_draft_count_out_of_range_is_refused_naming_the_flag(command, capsys):
    """It was "draft_tokens must be in [1, 16], got 0", naming no flag, from meshnet up only once its model
    was planned."""
    _assert_refused([command, "--draft-tokens", "0"],
                    f"meshnet {command}: error: argument --draft-tokens: must be 1 to 16, got 0", capsys)


# The flags of each command that set a stage's load settings (LoadSpec), with a value below and one above
# each setting's bounds (None: it has no upper bound) and the line argparse refuses them with.
_LOAD_FLAGS = {"--threads": ("0", "513", "must be 1 to 512"), "--n-ctx": ("-1", "16777217", "must be 0 to 16777216"),
               "--max-sessions": ("0", "65537", "must be 1 to 65536"), "--kv-tokens": ("-1", None, "must be >= 0"),
               "--prefix-cache": ("-1", "65537", "must be 0 to 65536"), "--decode-groups": ("-1", None, "must be >= 0")}
_COMMAND_LOAD_FLAGS = {"generate": ("--threads", "--n-ctx"),
                       "api": ("--threads", "--n-ctx", "--max-sessions", "--kv-tokens", "--prefix-cache"),
                       "node": tuple(_LOAD_FLAGS), "up": tuple(_LOAD_FLAGS)}


@pytest.mark.parametrize("command,flag,value,bound", [
    (command, flag, value, _LOAD_FLAGS[flag][2]) for command, flags in _COMMAND_LOAD_FLAGS.items()
    for flag in flags for value in _LOAD_FLAGS[flag][:2] if value is not None])
def test_a_load_setting_out_of_range_is_refused_naming_its_flag(command, flag, value, bound, capsys):
    """`generate --threads 0` and `node --max-sessions 0` said "bad load settings: n_threads=0 (>= 1)", naming
    no flag, once the model was resolved (a node's after its worker started); `up` named the flag, in an error
    of its own."""
    _assert_refused([command, flag, value, *(["hi"] if command == "generate" else [])],
                    f"meshnet {command}: error: argument {flag}: {bound}, got {value}", capsys)


@pytest.mark.parametrize("command", list(_COMMAND_LOAD_FLAGS))
def test_a_load_setting_at_its_bounds_is_taken(command):
    """The least and the most each setting takes parse to that number."""
    for flag in _COMMAND_LOAD_FLAGS[command]:
        low, high = (str(int(_LOAD_FLAGS[flag][0]) + 1), None if _LOAD_FLAGS[flag][1] is None
                     else str(int(_LOAD_FLAGS[flag][1]) - 1))
        for value in filter(None, (low, high)):
            argv = [command, flag, value, *(["hi"] if command == "generate" else [])]
            args = build_parser(argv).parse_args(argv)
            assert getattr(args, flag[2:].replace("-", "_")) == int(value), (flag, value)


def _assert_refused(argv: list[str], line: str, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser(argv).parse_args(argv)
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == line
