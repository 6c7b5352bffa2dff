"""The ``meshnet`` command line: where a user's request enters.

Subcommands: ``generate`` (complete a prompt, in process or through a running mesh), ``up`` (a whole
local mesh), ``api`` (the OpenAI-compatible HTTP API), ``tracker``, ``node``, ``backends`` (which
compute backends this machine has built and proved), ``ledger``, ``nodes`` and ``bench``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# gRPC's C core writes a line to stderr for every failed TLS handshake (a plaintext client, a port
# scanner: `meshnet bench hostile` opens a thousand) unless told otherwise before it loads; what a user
# must know of such a failure our own messages say.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

# Only the standard library at the top: a Ctrl-C while meshnet's modules load (grpc, numpy, ggml take a
# second or two on a busy machine) then lands in main's handler instead of a traceback. Each subcommand's
# parser and code live in its own module (see _COMMANDS); ``generate`` in meshnet.generate_cli.


# Exit statuses of a run ended by Ctrl-C (SIGINT) and by SIGTERM (a bench's or generate's): 128 + the signal,
# as a shell reports a process the signal killed.
EXIT_INTERRUPTED, EXIT_TERMINATED = 130, 143
# The commands a SIGTERM stops as Ctrl-C does (see _main); the servers (up, api, node, tracker) stop on it
# themselves, as they always end, and exit 0.
_SIGTERM_AS_INTERRUPT = ("generate", "bench")


def package_version() -> str:
    """The installed package's version (its metadata); ``meshnet.__version__`` when run from a source
    tree that was never installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("meshnet")
    except PackageNotFoundError:
        from meshnet import __version__

        return __version__


# Where each subcommand's parser comes from (its module and the function that adds it), in the order
# `meshnet --help` lists them after generate and bench. A command line that names a subcommand builds only
# that one's parser: building all of them imports gRPC, numpy, FastAPI and ggml, a second or more before
# `meshnet node --port 70000` could say what is wrong.
_COMMANDS = {
    "up": ("meshnet.up", "add_up_parser"),
    "api": ("meshnet.api.server", "add_api_parser"),
    "tracker": ("meshnet.tracker.cli", "add_tracker_parser"),
    "node": ("meshnet.node.cli", "add_node_parser"),
    "backends": ("meshnet.backends.cli", "add_backends_parser"),
    "ledger": ("meshnet.ledger.cli", "add_ledger_parser"),
    "nodes": ("meshnet.membership.cli", "add_nodes_parser"),
}
_BENCHES = {
    "engine": ("meshnet.bench.engine_bench", "add_engine_bench_parser"),
    "mesh": ("meshnet.bench.mesh_bench", "add_mesh_bench_parser"),
    "serve": ("meshnet.bench.serve_bench", "add_serve_bench_parser"),
    "worker": ("meshnet.bench.worker_bench", "add_worker_bench_parser"),
    "hostile": ("meshnet.bench.hostile_bench", "add_hostile_bench_parser"),
    "wan": ("meshnet.bench.wan_bench", "add_wan_bench_parser"),
    "speculative": ("meshnet.bench.spec_bench", "add_spec_bench_parser"),
    "scale": ("meshnet.bench.scale_bench", "add_scale_bench_parser"),
    "structured": ("meshnet.bench.structured_bench", "add_structured_bench_parser"),
}


def _named(argv: list[str], names) -> str | None:
    """The subcommand ``argv`` names (its first argument that is not an option), when it is one of ``names``
    and no help is asked for before it (``meshnet -h node`` lists every subcommand)."""
    for a in argv:
        if a in ("-h", "--help"):
            return None
        if not a.startswith("-"):
            return a if a in names else None
    return None


def _add_command(sub: argparse._SubParsersAction, name: str, module: str, adder: str, named: str | None) -> None:
    """Add subcommand ``name``: its whole parser when no subcommand is named or it is the one, else only its
    name (so that argparse still knows it)."""
    if named is None or named == name:
        getattr(importlib.import_module(module), adder)(sub)
    else:
        sub.add_parser(name)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The ``meshnet`` parser; for a command line ``argv`` (default: none) that names a subcommand, with only
    that subcommand's arguments (see :data:`_COMMANDS`)."""
    argv = list(argv or ())
    named = _named(argv, {"generate", "bench", *_COMMANDS})
    parser = argparse.ArgumentParser(prog="meshnet", description="Run one GGUF language model across several "
                                     "machines, each serving a range of its layers.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_command(sub, "generate", "meshnet.generate_cli", "add_generate_parser", named)
    if named in (None, "bench"):
        _add_bench_parser(sub, _named(argv[argv.index("bench") + 1:], _BENCHES) if named else None)
    else:
        sub.add_parser("bench")
    for name, (module, adder) in _COMMANDS.items():
        _add_command(sub, name, module, adder, named)
    return parser


def _add_bench_parser(sub: argparse._SubParsersAction, named_bench: str | None) -> None:
    """``meshnet bench`` and its benchmarks: all of them, or only ``named_bench`` (see :func:`_add_command`)."""
    bench = sub.add_parser("bench", help="benchmarks that write JSON")
    bsub = bench.add_subparsers(dest="bench", required=True)
    for name, (module, adder) in _BENCHES.items():
        _add_command(bsub, name, module, adder, named_bench)


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; its exit code. Ctrl-C at any point, while the modules load included, exits
    130 without a traceback: also where a library turned the KeyboardInterrupt into an error of its own
    (pydantic-core reports one raised while it builds a validator as a ``SchemaError``). A SIGTERM to a
    bench or to generate takes the same way out (a bench's children stopped, generate's session released
    on every node) and exits 143, saying so in one line."""
    import signal
    import threading

    interrupted = False

    def on_sigint(signum, frame):
        nonlocal interrupted
        interrupted = True
        raise KeyboardInterrupt

    previous = None
    # Only over Python's own handler: a SIGINT ignored (a shell's background job) stays ignored.
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
        previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        return _main(argv)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BaseException:
        if interrupted:
            return EXIT_INTERRUPTED
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _main(argv: list[str] | None) -> int:
    for name in ("stdout", "stderr"):
        if getattr(sys, name) is None:
            # Closed by the caller (`>&-`): what would go there goes nowhere, rather than raising (a
            # traceback; uvicorn's logging could not be configured). The lowest free descriptor is the
            # closed one, so child processes find /dev/null there too.
            setattr(sys, name, open(os.devnull, "w"))
    from meshnet.secret_args import secrets_from_env
    from meshnet.client.router import MeshUnavailable
    from meshnet.model.bundled import ModelNotFound
    from meshnet.supervisor import Terminated, sigterm_as_interrupt, stdout_to_devnull

    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args, extras = parser.parse_known_args(argv)
    if extras:
        _unrecognized(parser, args, extras)
    secrets_from_env(args, _innermost(parser, args).error)
    try:
        if args.command not in _SIGTERM_AS_INTERRUPT:
            return args.func(args)
        # A bench starts node processes, servers and network namespaces and stops them in its finally
        # blocks, and generate releases its session on every node in its own: Ctrl-C runs those, and a
        # plain SIGTERM (`timeout`, `kill`, systemd, docker stop) skipped them. The processes were left
        # behind, and the session held its nodes' KV cells until their idle timeout.
        with sigterm_as_interrupt():
            return args.func(args)
    except Terminated:
        name = f"bench {args.bench}" if args.command == "bench" else args.command
        print(f"meshnet {name}: stopped by SIGTERM", file=sys.stderr)
        return EXIT_TERMINATED
    except (ModelNotFound, ValueError, FileNotFoundError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except MeshUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # The reader went away (e.g. `| head`): not an error of ours. Point stdout at /dev/null so the
        # interpreter's final flush does not raise again.
        stdout_to_devnull()
        return 0
    except OSError as e:
        # Often the output could not be written (a full disk: `> /dev/full`): then the final flush of what
        # stdout still buffers would fail again, and it goes nowhere. Otherwise what it holds is written.
        print(f"error: {e.strerror or e}{f': {e.filename}' if e.filename else ''}", file=sys.stderr)
        try:
            sys.stdout.flush()
        except OSError:
            stdout_to_devnull()
        return 1


def _innermost(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the innermost subcommand ``args`` names (``meshnet bench serve``'s), for errors
    under its usage."""
    sub = parser
    for dest in ("command", "bench"):
        action = next((a for a in sub._actions if isinstance(a, argparse._SubParsersAction)), None)
        if action is None or getattr(args, dest, None) not in action.choices:
            break
        sub = action.choices[getattr(args, dest)]
    return sub


def _unrecognized(parser: argparse.ArgumentParser, args: argparse.Namespace, extras: list[str]) -> None:
    """Exit 2 naming ``extras`` under the usage of the subcommand they were given to (argparse names
    them under ``meshnet``'s own), with the option each misspelled flag is closest to."""
    import difflib

    sub = _innermost(parser, args)
    flags = [o for a in sub._actions for o in a.option_strings if o.startswith("--")]
    hints = [f"{x} (did you mean {near[0]}?)" if (near := difflib.get_close_matches(x.split("=")[0], flags, 1))
             else x for x in extras]
    # Bare words left over are a prompt of several words, unless a flag was not known: then they may be its
    # value, and the prompt taken was another word (--temprature 0 Hi: the prompt is "0").
    quote = ("; put a prompt of several words in quotes" if getattr(args, "command", None) == "generate"
             and not any(x.startswith("-") for x in extras) else "")
    sub.error(f"unrecognized arguments: {' '.join(hints)}{quote}")


def run() -> None:
    """The ``meshnet`` command: :func:`main`, then exit with its code. After a Ctrl-C (or a SIGTERM to a
    bench or generate) the interpreter is not finalized: the ``atexit`` handlers run (a client's last ledger
    report) and the process ends there. A stage's scheduler thread can still be inside a ggml graph then (cancel takes
    effect at its next micro-batch), and finalizing freed the memory it computed in: 7 of 20 interrupted
    prefills of ``meshnet generate`` ended in a segmentation fault."""
    code = main()
    if code not in (EXIT_INTERRUPTED, EXIT_TERMINATED):
        sys.exit(code)
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    run()
