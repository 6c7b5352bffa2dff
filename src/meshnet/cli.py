"""The ``meshnet`` command line: where a user's request enters.

Subcommands: ``generate`` (complete a prompt, in process or through a running mesh), ``up`` (a whole
local mesh), ``api`` (the OpenAI-compatible HTTP API), ``tracker``, ``node``, ``backends`` (which
compute backends this machine has built and proved), ``ledger``, ``nodes`` and ``bench``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
from typing import TYPE_CHECKING

# gRPC's C core writes a line to stderr for every failed TLS handshake (a plaintext client, a port
# scanner: `meshnet bench hostile` opens a thousand) unless told otherwise before it loads; what a user
# must know of such a failure our own messages say.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

# Only the standard library at the top: a Ctrl-C while meshnet's modules load (grpc, numpy, ggml take a
# second or two on a busy machine) then lands in main's handler instead of a traceback.
if TYPE_CHECKING:
    from meshnet.contract import SamplingParams


def package_version() -> str:
    """The installed package's version (its metadata); ``meshnet.__version__`` when run from a source
    tree that was never installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("meshnet")
    except PackageNotFoundError:
        from meshnet import __version__

        return __version__


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (llama.cpp's defaults; --temperature 0 is greedy)")
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-k", type=int, default=40, help="0 = off")
    g.add_argument("--top-p", type=float, default=0.95, help="1 = off")
    g.add_argument("--min-p", type=float, default=0.05, help="0 = off")
    g.add_argument("--repeat-penalty", type=float, default=1.0, help="1 = off")
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None, help="makes sampled runs reproducible")


def _sampling_from(args: argparse.Namespace) -> SamplingParams:
    from meshnet.contract import SamplingParams

    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          repetition_penalty=args.repeat_penalty, presence_penalty=args.presence_penalty,
                          frequency_penalty=args.frequency_penalty, seed=args.seed)


def _add_model_args(p: argparse.ArgumentParser):
    """Add the model and split arguments; returns the group ``--model`` is in (other ways of naming the
    model join it, so that giving two is refused)."""
    from meshnet.arg_types import LOCAL_STAGE_DEFAULTS
    from meshnet.load_spec import NO_HUGE_PAGES_HELP
    from meshnet.model.bundled import DEFAULT_MODEL

    source = p.add_mutually_exclusive_group()
    source.add_argument("--model", default=DEFAULT_MODEL,
                        help="a GGUF path or a bundled name (smollm2, gemma3-270m); default %(default)s")
    split = p.add_mutually_exclusive_group()
    split.add_argument("--stages", type=int, default=None,
                       help="split the layers into N ranges of about equal decode cost")
    split.add_argument("--layers", default=None, help='explicit half-open ranges, e.g. "0:10,10:20,20:30"')
    p.add_argument("--threads", type=int, default=LOCAL_STAGE_DEFAULTS["threads"], help="CPU threads per stage")
    p.add_argument("--n-ctx", type=int, default=LOCAL_STAGE_DEFAULTS["n_ctx"],
                   help="context length (0 = model's, capped at 4096)")
    p.add_argument("--no-huge-pages", dest="huge_pages", action="store_false", help=NO_HUGE_PAGES_HELP)
    return source


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
    "engine": (__name__, "_add_engine_bench_parser"),
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
    _add_command(sub, "generate", __name__, "_add_generate_parser", named)
    if named in (None, "bench"):
        _add_bench_parser(sub, _named(argv[argv.index("bench") + 1:], _BENCHES) if named else None)
    else:
        sub.add_parser("bench")
    for name, (module, adder) in _COMMANDS.items():
        _add_command(sub, name, module, adder, named)
    return parser


def _add_generate_parser(sub: argparse._SubParsersAction) -> None:
    from meshnet.arg_types import add_join_token_arg, host_port, utf8_text

    gen = sub.add_parser("generate", help="complete a prompt, streaming the text to stdout")
    gen.add_argument("prompt", type=utf8_text)
    source = _add_model_args(gen)
    _add_sampling_args(gen)
    gen.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default %(default)s)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the GGUF's chat template")
    gen.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-generation tokens")
    gen.add_argument("--json", action="store_true",
                     help="after the text, print one JSON object with token ids, text and timings")
    gen.add_argument("--tracker", type=host_port, default=None,
                     help="HOST:PORT of a running mesh's tracker (default: run the stages in this process)")
    source.add_argument("--model-id", default=None, metavar="ID_OR_NAME",
                        help="with --tracker, instead of a local --model: the model's id (or 8+ hex digits of "
                             "it), general.name or bundled name (smollm2); the tokenizer and chat template come "
                             "from the tracker's manifest")
    gen.add_argument("--wait", type=float, default=0.0,
                     help="with --tracker: seconds to wait for a complete route before giving up (default 0: "
                          "give up at once)")
    add_join_token_arg(gen)
    gen.add_argument("--tls-ca", default=None, help="CA/cert to verify TLS tracker and nodes")
    gen.add_argument("--client-orchestrated", action="store_true",
                     help="every step through the client, hop by hop (default: nodes forward hidden states to the next node themselves where the route allows)")
    from meshnet.speculative import add_speculation_args

    add_speculation_args(gen)
    gen.set_defaults(func=cmd_generate)


def _add_bench_parser(sub: argparse._SubParsersAction, named_bench: str | None) -> None:
    """``meshnet bench`` and its benchmarks: all of them, or only ``named_bench`` (see :func:`_add_command`)."""
    bench = sub.add_parser("bench", help="benchmarks that write JSON")
    bsub = bench.add_subparsers(dest="bench", required=True)
    for name, (module, adder) in _BENCHES.items():
        _add_command(bsub, name, module, adder, named_bench)


def _add_engine_bench_parser(bsub: argparse._SubParsersAction) -> None:
    from meshnet.model.bundled import DEFAULT_MODEL

    be = bsub.add_parser("engine", help="prefill/decode tokens/s for 1 and 3 stages, RSS per stage, llama.cpp")
    be.add_argument("--model", default=DEFAULT_MODEL)
    be.add_argument("--threads", type=int, default=2)
    be.add_argument("--stages", type=int, default=3, help="the multi-stage configuration to compare")
    be.add_argument("--prompt-tokens", type=int, default=128)
    be.add_argument("--decode-tokens", type=int, default=64)
    be.add_argument("--repeats", type=int, default=3, help="runs per figure; the median is reported")
    be.add_argument("--rounds", type=int, default=1,
                    help="measure the single stage and llama-bench this many times in turn; ratios are the "
                         "median of the rounds' (for machines whose speed drifts)")
    be.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp reference")
    be.add_argument("--backend", default="cpu", choices=["cpu", "cuda", "rocm", "vulkan", "metal"],
                    help="also measure this accelerator lane beside the CPU (it must be certified here)")
    be.add_argument("--out", default="bench-results/engine.json")
    be.set_defaults(func=_run_engine_bench)


def _run_engine_bench(args: argparse.Namespace) -> int:
    from meshnet.bench.engine_bench import run_engine_bench

    return run_engine_bench(args)


def cmd_generate(args: argparse.Namespace) -> int:
    from meshnet.arg_types import mode_problem
    from meshnet.client.router import MeshUnavailable
    from meshnet.generation import Generation, GenerationError
    from meshnet.model.bundled import resolve_model
    from meshnet.local_mesh import load_local_chain, plan_ranges
    from meshnet.speculative import speculation_from_args
    from meshnet.tokenizer import GGUFTokenizer

    if args.max_tokens < 1:
        print(f"error: --max-tokens must be >= 1, got {args.max_tokens}", file=sys.stderr)
        return 2
    if not args.wait >= 0:
        print(f"error: --wait must be a number of seconds >= 0, got {args.wait}", file=sys.stderr)
        return 2
    sampling = _sampling_from(args)
    problem = sampling.validate()
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    model_id = None
    problem = mode_problem(args, {"--wait": args.wait, "--tls-ca": args.tls_ca,
                                  "--client-orchestrated": args.client_orchestrated})
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.model_id is not None:
        if not args.tracker:
            print("error: --model-id needs --tracker (the tracker holds the model's manifest)", file=sys.stderr)
            return 2
        from meshnet.client.manifest_source import metadata_gguf

        path, model_id = metadata_gguf(args.tracker, args.model_id, args.join_token, args.tls_ca)
        path = str(path)
    else:
        path = str(resolve_model(args.model))
    speculation = speculation_from_args(args, path)  # ValueError: exit status 2
    ranges = plan_ranges(path, args.stages, args.layers)
    tok = GGUFTokenizer.from_gguf(path)
    if args.chat:
        from meshnet.chat_template import chat_prompt_ids
        prompt_ids = chat_prompt_ids(tok, [{"role": "user", "content": args.prompt}])
    else:
        prompt_ids = tok.encode(args.prompt)
    if not prompt_ids:
        print("error: the prompt has no tokens; give some text", file=sys.stderr)
        return 2
    if args.tracker:
        from meshnet.client.mesh_client import MeshClient
        from meshnet.generation import GenerationResult
        from meshnet.model.manifest import model_manifest
        from meshnet.up import wait_for_route

        chain = MeshClient(args.tracker, model_sha256=model_id or model_manifest(path).id, join_token=args.join_token,
                           tls_ca=args.tls_ca, forwarding=not args.client_orchestrated)
        try:
            if args.wait:
                try:
                    wait_for_route(args.tracker, args.wait, args.join_token, progress=sys.stderr.isatty(),
                                   tls_ca=args.tls_ca)
                except TimeoutError as e:  # no route, as without --wait: exit status 1, not a usage error's 2
                    raise MeshUnavailable(str(e)) from None
            _, hops, n_ctx = chain.route_with_context()
        except MeshUnavailable as e:
            if not args.wait and str(e).startswith("no route: GetRoute:") and "(excluded: " not in str(e):
                e = MeshUnavailable(f"{e} (nodes still loading? --wait SECONDS waits for a complete route)")
            if args.json:  # the last line is the object, also when no token came
                print(_json_line(args, GenerationResult(prompt_token_ids=list(prompt_ids)), [], chain, "",
                                 error=str(e)))
            raise e from None
        ranges = [f"{h.node_id}@{h.address}" for h in hops]
    else:
        chain = load_local_chain(path, ranges, n_threads=args.threads, n_ctx=args.n_ctx,
                                 progress=sys.stderr.isatty(), huge_pages=args.huge_pages)
        n_ctx = chain.stages[0].capabilities().n_ctx
    if len(prompt_ids) > n_ctx:
        print(f"error: the prompt has {len(prompt_ids)} tokens but the context holds {n_ctx}; "
              "shorten it or raise --n-ctx", file=sys.stderr)
        return 2
    print(f"[meshnet] {args.model_id or args.model}: {len(ranges)} stage(s) {', '.join(str(r) for r in ranges)}, "
          f"{len(prompt_ids)} prompt tokens", file=sys.stderr)
    # As the API's budget: the last generated token is never fed back, so a context of n_ctx holds one more.
    gen = Generation(chain, tok, prompt_ids, min(args.max_tokens, n_ctx - len(prompt_ids) + 1), sampling,
                     stop_at_eog=not args.ignore_eos, speculation=speculation)
    events = iter(gen)
    streamed: list[str] = []
    try:
        for ev in events:
            streamed.append(ev.text)
            sys.stdout.write(ev.text)
            sys.stdout.flush()
    except (GenerationError, RuntimeError) as e:  # MeshUnavailable too
        if streamed:  # the text's line ends on stdout too: the object gets a line of its own
            sys.stdout.write("\n")
        print(f"\nerror: {e}", file=sys.stderr)
        if args.json:  # the last line is still the object, saying what came before the failure
            print(_json_line(args, gen.result, ranges, chain, "".join(streamed), error=str(e)))
        return 1
    except KeyboardInterrupt:
        with contextlib.suppress(OSError):  # what is logged while exiting starts a line of its own
            sys.stdout.write("\n")
            sys.stdout.flush()
        raise
    finally:
        events.close()  # on Ctrl-C too: the session is released on every stage now, not at exit
    r = gen.result
    sys.stdout.write("\n")
    print(f"[meshnet] {len(r.generated_token_ids)} tokens, finish_reason={r.finish_reason}, "
          f"prefill {r.prefill_tokens_per_s:.1f} tok/s, decode {r.decode_tokens_per_s:.1f} tok/s",
          file=sys.stderr)
    if args.json:
        print(_json_line(args, r, ranges, chain, r.text))
    return 0


def _json_line(args: argparse.Namespace, r, ranges: list, chain, text: str, error: str | None = None) -> str:
    """``generate --json``'s last line: ids, text, finish reason, the stages (over a mesh the route the
    generation ended on, a failover moving it, with how often it moved and how often onto a node that
    computes otherwise: within tolerance, not bit for bit), timings; with ``error``, what came before it."""
    extra = {}
    if args.tracker:
        ranges = [f"{h.node_id}@{h.address}" for h in chain.last_hops] or ranges
        extra = {"failovers": chain.failovers, "failovers_not_bit_exact": chain.unlike_failovers}
    if error is not None:
        extra["error"] = error
    return json.dumps({"prompt_token_ids": r.prompt_token_ids, "generated_token_ids": r.generated_token_ids,
                       "text": text, "finish_reason": "error" if error is not None else r.finish_reason,
                       "layers": [str(x) for x in ranges], "timings": r.timings(), **extra}, ensure_ascii=False)


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; its exit code. Ctrl-C at any point, while the modules load included, exits
    130 without a traceback: also where a library turned the KeyboardInterrupt into an error of its own
    (pydantic-core reports one raised while it builds a validator as a ``SchemaError``)."""
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
        return 130
    except BaseException:
        if interrupted:
            return 130
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
    from meshnet.client.router import MeshUnavailable
    from meshnet.model.bundled import ModelNotFound
    from meshnet.supervisor import stdout_to_devnull

    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        return args.func(args)
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


if __name__ == "__main__":
    sys.exit(main())
