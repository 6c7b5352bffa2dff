"""argparse types of the command line's values: each refuses a bad value with argparse's one-line
error naming the flag (exit status 2), before anything starts.

A value the program would take and misbehave on (a port it wraps, a timeout of 0 that frees every
session at once, an address with a scheme gRPC cannot resolve and retries forever) is refused here.
"""

from __future__ import annotations

import argparse
import functools
import ipaddress
import math
import os
import re
import socket
from typing import Callable, TypeVar

from meshnet.membership.identity import NODE_ID_CHARS, NODE_ID_MAX_CHARS
from meshnet.wire.addresses import check_address

# The heartbeat intervals allowed, seconds: nodes beat at most every MIN_HEARTBEAT_S (a tracker asking
# for less would drop them before their next beat), and a node silent for three intervals is gone (an
# hour is already unusable).
MIN_HEARTBEAT_S, MAX_HEARTBEAT_S = 0.05, 3600.0
# The longest duration any flag takes, seconds (a year: "never"); beyond, deadlines overflow.
MAX_SECONDS = 365 * 86400.0

T = TypeVar("T")


def port_number(text: str) -> int:
    """A TCP port to listen on, 0 (any free one) to 65535."""
    port = _parse(text, int, "a port number")
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 0..65535 (0 = any free port), got {port}")
    return port


def positive_seconds(text: str) -> float:
    """A duration that must be finite and > 0 (an idle timeout of 0 would free every session as soon as
    its step ended, and its client would replay it forever)."""
    value = _seconds(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return _at_most_a_year(value, text)


def heartbeat_seconds(text: str) -> float:
    """A heartbeat interval: MIN_HEARTBEAT_S to MAX_HEARTBEAT_S."""
    value = _seconds(text)
    if not MIN_HEARTBEAT_S <= value <= MAX_HEARTBEAT_S:
        raise argparse.ArgumentTypeError(f"must be {MIN_HEARTBEAT_S:g} to {MAX_HEARTBEAT_S:g} seconds, got {text}")
    return value


def seconds(text: str) -> float:
    """A finite duration >= 0."""
    value = _seconds(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return _at_most_a_year(value, text)


def positive_number(text: str) -> float:
    """A finite number > 0 (a size limit)."""
    value = _parse(text, float, "a number")
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def positive_int(text: str) -> int:
    """A count >= 1."""
    return _whole_number(text, 1)


def generated_tokens(text: str) -> int:
    """Tokens a benchmark generates to time decoding: >= 2. The first comes from the prefill (timed as the
    time to first token), so one times no decoding at all, and its speed of 0 was divided by."""
    return _whole_number(text, 2, why=" (the first token comes from the prefill)")


def draft_token_count(text: str) -> int:
    """Draft tokens per speculative round, 1 to ``MAX_DRAFT_TOKENS`` (the bound a Speculation takes)."""
    from meshnet.contract import MAX_DRAFT_TOKENS  # numpy: only when the flag is given

    return _whole_number(text, 1, MAX_DRAFT_TOKENS)


def load_setting(setting: str) -> Callable[[str], int]:
    """The type of a flag that sets LoadSpec's integer execution setting ``setting`` (``"n_ctx"``,
    ``"max_sessions"``, ...): a whole number within ``LOAD_SETTING_LEAST`` and ``LOAD_SETTING_MOST``. The
    load refused a value outside them only once it ran, in words that named no flag ("bad load settings:
    n_threads=0 (>= 1)"), after the model had loaded on the way."""
    def typed(text: str) -> int:
        from meshnet.load_spec import LOAD_SETTING_LEAST, LOAD_SETTING_MOST  # numpy: only when the flag is given

        return _whole_number(text, LOAD_SETTING_LEAST[setting], LOAD_SETTING_MOST.get(setting))

    typed.__name__ = setting
    return typed


def thread_count(text: str) -> int:
    """CPU threads of a compute, within the load setting's bounds (``LOAD_SETTING_MOST``: ggml's
    GGML_MAX_N_THREADS; beyond, OpenMP fails to start them and the process dies: 100000 was a
    segmentation fault)."""
    return load_setting("n_threads")(text)


def counts(text: str) -> list[int]:
    """Comma-separated counts >= 1 (``1,2,4``: a bench's concurrencies), in the order given; one at least.
    A bad one was ``invalid literal for int()``, or a bench's own error naming no flag."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    try:
        values = [int(part) for part in parts]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers >= 1, e.g. 1,2,4, got {text!r}")
    return values


def refusing(parse: Callable[[str], T]) -> Callable[[str], T]:
    """``parse`` as an argparse type: the ValueError it raises, saying what is wrong with the text, becomes
    argparse's error naming the flag (for parsers that live beside what they parse, e.g. a bench's list of
    modes). Without it argparse says only "invalid parse_rtts value: 'abc'"."""
    @functools.wraps(parse)
    def typed(text: str) -> T:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return typed


def count(text: str) -> int:
    """A count >= 0."""
    return _whole_number(text, 0)


def host_port(text: str) -> str:
    """An address to dial, ``HOST:PORT`` (no scheme: ``127.0.0.1:7700``, ``[::1]:7700``)."""
    try:
        check_address(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


# The port a tracker listens on unless told otherwise (`meshnet tracker`'s and `meshnet up`'s).
TRACKER_PORT = 7700


def tracker_address(text: str) -> str:
    """A tracker's ``HOST:PORT``; a bare host (``localhost``, ``10.0.0.5``, ``[::1]``) is given the
    tracker's default :data:`TRACKER_PORT`, as the tracker listens on it unless told otherwise."""
    if text and ":" not in text or (text.startswith("[") and text.endswith("]")):
        text = f"{text}:{TRACKER_PORT}"
    return host_port(text)


TRACKER_HELP = f"HOST[:PORT] of the tracker (port {TRACKER_PORT} when not given)"


def add_tracker_query_arg(p: argparse.ArgumentParser) -> None:
    """``--tracker HOST:PORT`` of a command that asks a tracker (``meshnet nodes``, ``meshnet ledger``): by
    default the one on this machine's :data:`TRACKER_PORT`."""
    p.add_argument("--tracker", type=tracker_address, default=f"127.0.0.1:{TRACKER_PORT}",
                   help=f"{TRACKER_HELP}; default %(default)s: meshnet up's and meshnet tracker's")


def http_url(text: str) -> str:
    """An HTTP server's base URL, ``http://HOST:PORT`` or ``https://...`` (a bare ``HOST:PORT`` was
    a traceback from the HTTP client)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 - raises ValueError for a port out of range
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"bad URL {text!r}: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"expected an http:// or https:// URL with a host, e.g. "
                                         f"http://127.0.0.1:8000, got {text!r}")
    return text


def results_file(text: str) -> str:
    """A file a benchmark writes its JSON to, checked before the run (an empty path or a folder failed only
    after the whole run, its figures lost): not empty, not a folder."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a file path for the results, got ''")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a folder; give a file path, e.g. "
                                         f"{os.path.join(text, 'bench.json')}")
    return text


def listen_host(text: str) -> str:
    """A ``--host`` to listen on: a name or address, not empty (gRPC logged "host must not be empty" from its
    core, then the tracker blamed a taken port) and without spaces. An IPv6 address may come in brackets,
    as an address to dial writes it (``[::1]``); it is returned without them (``::1``): gRPC took the
    brackets, but the data plane, the API and the dashboard could not resolve them as a host name.

    Raises:
        argparse.ArgumentTypeError: empty, spaces, or brackets around anything but an IPv6 address.
    """
    if not text.strip() or any(c.isspace() for c in text):
        raise argparse.ArgumentTypeError(f"expected a host name or address to listen on (e.g. 127.0.0.1, or "
                                         f"0.0.0.0 for every interface), got {text!r}")
    if text.startswith("[") or text.endswith("]"):
        inner = text[1:-1] if text.startswith("[") and text.endswith("]") else ""
        try:
            ipaddress.IPv6Address(inner)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"brackets go around an IPv6 address only (e.g. [::1]), got {text!r}") from None
        return inner
    return text


def advertised_address(text: str) -> str:
    """An address others dial to reach this machine, ``HOST:PORT``, not a wildcard (0.0.0.0 names no
    machine). Whether the name resolves is :func:`unresolved_host`'s warning: a name only the peers resolve
    (split DNS, a pod's name published once it is ready) is fine."""
    host_port(text)
    host = text.rpartition(":")[0].strip("[]")
    if host in ("0.0.0.0", "::"):
        raise argparse.ArgumentTypeError(f"{host} is where a server listens on every interface, not an address "
                                         "others can dial; give this machine's address")
    return text


def unresolved_host(address: str) -> str | None:
    """Why the host of ``address`` (``HOST:PORT``) does not resolve here, or None: a node advertising a name
    nobody can resolve registers fine, and every client then fails on it first."""
    host = address.rpartition(":")[0].strip("[]")
    try:
        socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError) as e:
        return e.strerror if isinstance(e, socket.gaierror) else str(e)
    return None


def node_id(text: str) -> str:
    """A node id: 1 to NODE_ID_MAX_CHARS of NODE_ID_CHARS (ASCII letters, digits, ``.``, ``_``, ``-``)."""
    if not 1 <= len(text) <= NODE_ID_MAX_CHARS:
        raise argparse.ArgumentTypeError(f"must be 1 to {NODE_ID_MAX_CHARS} characters, got {len(text)}")
    if not re.fullmatch(f"[{NODE_ID_CHARS}]+", text):
        raise argparse.ArgumentTypeError(f"may hold only ASCII letters, digits, '.', '_' and '-', got {text!r}")
    return text


def utf8_text(text: str) -> str:
    """Text that is valid UTF-8. Python hands undecodable bytes of an argument on as lone surrogates
    (``"caf\\udce9"`` for Latin-1 ``caf\\xe9``), which nothing downstream can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = ord(text[e.start])
        byte = f"byte 0x{bad - 0xDC00:02x}" if 0xDC80 <= bad <= 0xDCFF else f"U+{bad:04X}"
        raise argparse.ArgumentTypeError(f"is not valid UTF-8 ({byte} at character {e.start}); convert it, "
                                         f"e.g. with iconv -f latin1 -t utf-8") from None
    return text


def name_text(text: str) -> str:
    """A non-empty name in valid UTF-8 (see :func:`utf8_text`)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return utf8_text(text)


def model_ref(text: str) -> str:
    """A model named to a tracker (``--model-id``, ``--fetch``): its id, 8+ hex digits of it, its
    ``general.name`` or a bundled name, in valid UTF-8. Not empty: the tracker answers an empty name with
    its only model, and an API given an empty variable served whatever model the mesh had.

    Raises:
        argparse.ArgumentTypeError: empty, or not valid UTF-8.
    """
    if not text.strip():
        from meshnet.model.bundled import BUNDLED

        raise argparse.ArgumentTypeError("must not be empty; give the model's id (or 8+ hex digits of it), its "
                                         f"general.name or a bundled name ({', '.join(BUNDLED)})")
    return utf8_text(text)


# The longest client id the tracker's ledger and dashboard take (meshnet.ledger.store.MAX_ID_CHARS).
CLIENT_ID_MAX_CHARS = 256


def client_id(text: str) -> str:
    """A name the ledger charges a client's tokens to: non-empty UTF-8 of at most CLIENT_ID_MAX_CHARS."""
    text = name_text(text)
    if len(text) > CLIENT_ID_MAX_CHARS:
        raise argparse.ArgumentTypeError(f"has {len(text)} characters; at most {CLIENT_ID_MAX_CHARS}")
    return text


def add_client_id_arg(p: argparse.ArgumentParser) -> None:
    """``--client-id NAME``: who a running mesh's ledger charges for the tokens this process receives."""
    p.add_argument("--client-id", type=client_id, default=None, metavar="NAME",
                   help="with --tracker: the name the mesh's ledger charges the tokens this process receives to "
                        "(meshnet ledger lists clients by it); default a random client-... id per process")


def _parse(text: str, convert, what: str):
    try:
        return convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None


def _whole_number(text: str, least: int, most: int | None = None, why: str = "") -> int:
    """``text`` as a whole number from ``least`` to ``most`` (None: none); ``why`` follows the bound."""
    value = _parse(text, int, "a whole number")
    if value < least or (most is not None and value > most):
        bound = f">= {least}" if most is None else f"{least} to {most}"
        raise argparse.ArgumentTypeError(f"must be {bound}{why}, got {value}")
    return value


def _seconds(text: str) -> float:
    value = _parse(text, float, "seconds")
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds, got {text}")
    return value


def _at_most_a_year(value: float, text: str) -> float:
    if value > MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_SECONDS:.0f} seconds (a year), got {text}")
    return value


# The settings of stages run in this process (``meshnet generate`` and ``meshnet api`` without
# ``--tracker``), by argparse dest, with the defaults their parsers give them: a mesh's nodes have their own.
LOCAL_STAGE_DEFAULTS = {"threads": 2, "n_ctx": 0, "max_sessions": 16, "kv_tokens": 0, "prefix_cache": 4,
                        "huge_pages": True}


def mode_problem(args: argparse.Namespace, client_flags: dict[str, object]) -> str | None:
    """Why flags given do nothing in the mode ``--tracker`` picks, or None: ``client_flags`` (flag ->
    its value; a truthy one was given) serve only a running mesh's client, ``--stages`` / ``--layers``
    and the settings of :data:`LOCAL_STAGE_DEFAULTS` given another value only stages in this process.
    For ``meshnet generate`` and ``meshnet api``, which run either way."""
    if not args.tracker:
        given = next((flag for flag, value in client_flags.items() if value), None)
        return given and (f"{given} needs --tracker (it applies to a running mesh's client; without "
                          "--tracker the stages run in this process)")
    if args.stages is not None or args.layers is not None:
        return (f"{'--stages' if args.stages is not None else '--layers'} splits the model in this process; "
                "with --tracker the mesh's nodes hold the layers")
    dest = next((d for d, default in LOCAL_STAGE_DEFAULTS.items() if getattr(args, d, default) != default), None)
    if dest is None:
        return None
    given = "--no-huge-pages" if dest == "huge_pages" else f"--{dest.replace('_', '-')}"
    return (f"{given} applies to stages in this process; with --tracker each node of the mesh has its own "
            f"(meshnet node {given})")
