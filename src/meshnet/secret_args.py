"""The command line's two secrets: the mesh's join token (``--join-token``, default ``$MESHNET_JOIN_TOKEN``)
and the OpenAI API's key (``--api-key``, default ``$MESHNET_API_KEY``): their flags, their checks, and their
environment variables.

A variable is read by :func:`secrets_from_env` once the command line is parsed, and only where the run uses
it: argparse checks a default read at parse time at every parse, so a malformed variable failed runs that
use no secret (a local ``meshnet generate``, a ``bench serve`` that starts its own servers).
"""

from __future__ import annotations

import argparse
import os

from meshnet.wire.security import JOIN_TOKEN_ENV

# A join token travels as gRPC metadata and in the data plane's hello: printable ASCII (gRPC refuses
# other bytes in a metadata value: "Invalid metadata"), within gRPC's 8 KiB of metadata with room to spare.
JOIN_TOKEN_MAX_CHARS = 4096
# Where ``meshnet api`` and ``meshnet up`` read their API key when ``--api-key`` is not given.
API_KEY_ENV = "MESHNET_API_KEY"
API_KEY_MAX_CHARS = 256


def _secret(text: str, env: str, least: int, most: int, spaces: bool, carried: str) -> str:
    """``text`` when it has ``least`` to ``most`` printable ASCII characters (a space among them only where
    ``spaces``); else argparse's error, saying how it travels (``carried``) and naming ``env`` when the
    value came from that variable."""
    source = f" (from ${env})" if text == os.environ.get(env) else ""
    if not least <= len(text) <= most:
        bound = f"at most {most}" if least == 0 else f"{least} to {most}"
        raise argparse.ArgumentTypeError(f"must be {bound} characters, got {len(text)}{source}")
    lowest = " " if spaces else "!"
    bad = next((i for i, c in enumerate(text) if not lowest <= c <= "~"), None)
    if bad is not None:
        kind = "printable ASCII characters" + ("" if spaces else " without spaces")
        raise argparse.ArgumentTypeError(f"may hold only {kind} ({carried}), got {text[bad]!r} at character "
                                         f"{bad}{source}")
    return text


def join_token(text: str) -> str:
    """The mesh's shared secret: 0 (none) to JOIN_TOKEN_MAX_CHARS printable ASCII characters."""
    return _secret(text, JOIN_TOKEN_ENV, 0, JOIN_TOKEN_MAX_CHARS, True, "gRPC carries it as metadata")


def api_key(text: str) -> str:
    """An API key: 1 to API_KEY_MAX_CHARS printable ASCII characters without spaces (a bearer token)."""
    return _secret(text, API_KEY_ENV, 1, API_KEY_MAX_CHARS, False, "clients send it in a header")


def add_join_token_arg(p: argparse.ArgumentParser, local_without_tracker: bool = False) -> None:
    """``--join-token``, the mesh's shared secret, for every command that calls a tracker or a node.
    ``local_without_tracker``: without ``--tracker`` the command runs in this process (generate, api) and
    uses no token, nor reads ``$MESHNET_JOIN_TOKEN``."""
    p.add_argument("--join-token", type=join_token, default=None,
                   help=f"the mesh's shared secret (default ${JOIN_TOKEN_ENV})")
    p.set_defaults(join_token_local_without_tracker=local_without_tracker)


def add_api_key_arg(p: argparse.ArgumentParser, help: str | None = None, only_with: str | None = None) -> None:
    """``--api-key``: the key HTTP clients of the OpenAI API send (``Authorization: Bearer KEY``). A server
    (``meshnet api``, ``meshnet up``) requires it; none: the API is open to whoever reaches its port.
    ``help``: the flag's help for a command that sends the key rather than asks for it; ``only_with``: the
    dest of the flag without which the command uses no key, nor reads ``$MESHNET_API_KEY``."""
    p.add_argument("--api-key", type=api_key, default=None, metavar="KEY",
                   help=help or f"require 'Authorization: Bearer KEY' on every API request but /health (default "
                                f"${API_KEY_ENV}; none: anyone who reaches the port may use the API)")
    p.set_defaults(api_key_only_with=only_with)


def secrets_from_env(args: argparse.Namespace, error) -> None:
    """Fill ``args.join_token`` from ``$MESHNET_JOIN_TOKEN`` and ``args.api_key`` from ``$MESHNET_API_KEY``
    where the command has the flag, it was not given, and the run uses the secret.

    Args:
        error: the subcommand parser's ``error``: called (it exits with status 2) with argparse's message
            for a malformed variable, ending "(from $VARIABLE)".
    """
    if not (getattr(args, "join_token_local_without_tracker", False) and not args.tracker):
        _from_env(args, "join_token", JOIN_TOKEN_ENV, join_token, error)
    only_with = getattr(args, "api_key_only_with", None)
    if only_with is None or getattr(args, only_with, None):
        _from_env(args, "api_key", API_KEY_ENV, api_key, error, empty_is_none=True)


def _from_env(args: argparse.Namespace, dest: str, env: str, check, error, empty_is_none: bool = False) -> None:
    """``args.<dest>`` = ``check($env)`` where the command has the flag and it was not given (an empty
    variable is no secret where ``empty_is_none``)."""
    text = os.environ.get(env)
    if text is None or (empty_is_none and not text) or getattr(args, dest, "") is not None:
        return
    try:
        setattr(args, dest, check(text))
    except argparse.ArgumentTypeError as e:
        error(f"argument --{dest.replace('_', '-')}: {e}")
