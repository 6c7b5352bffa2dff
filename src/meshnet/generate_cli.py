"""``meshnet generate``: complete a prompt in this process (the stages loaded here) or through a running
mesh (``--tracker``), streaming the text to stdout; with ``--json`` a last line of token ids and timings."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshnet.contract import SamplingParams


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
    from meshnet.arg_types import LOCAL_STAGE_DEFAULTS, load_setting, thread_count
    from meshnet.load_spec import NO_HUGE_PAGES_HELP
    from meshnet.model.bundled import DEFAULT_MODEL

    source = p.add_mutually_exclusive_group()
    source.add_argument("--model", default=DEFAULT_MODEL,
                        help="a GGUF path or a bundled name (smollm2, gemma3-270m); default %(default)s")
    split = p.add_mutually_exclusive_group()
    split.add_argument("--stages", type=int, default=None,
                       help="split the layers into N ranges of about equal decode cost")
    split.add_argument("--layers", default=None, help='explicit half-open ranges, e.g. "0:10,10:20,20:30"')
    p.add_argument("--threads", type=thread_count, default=LOCAL_STAGE_DEFAULTS["threads"], help="CPU threads per stage (default %(default)s)")
    p.add_argument("--n-ctx", type=load_setting("n_ctx"), default=LOCAL_STAGE_DEFAULTS["n_ctx"],
                   help="context length (0 = model's, capped at 4096)")
    p.add_argument("--no-huge-pages", dest="huge_pages", action="store_false", help=NO_HUGE_PAGES_HELP)
    return source


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    from meshnet.arg_types import TRACKER_HELP, add_client_id_arg, model_ref, seconds, tracker_address, utf8_text
    from meshnet.secret_args import add_join_token_arg

    gen = sub.add_parser("generate", help="complete a prompt, streaming the text to stdout")
    gen.add_argument("prompt", type=utf8_text)
    source = _add_model_args(gen)
    _add_sampling_args(gen)
    gen.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default %(default)s)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the GGUF's chat template")
    gen.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-generation tokens")
    gen.add_argument("--json", action="store_true",
                     help="after the text, print one JSON object with token ids, text and timings")
    gen.add_argument("--tracker", type=tracker_address, default=None,
                     help=f"{TRACKER_HELP}; default: run the stages in this process")
    from meshnet.model.bundled import BUNDLED

    source.add_argument("--model-id", type=model_ref, default=None, metavar="ID_OR_NAME",
                        help="with --tracker, instead of a local --model: the model's id (or 8+ hex digits of "
                             f"it), general.name or bundled name ({', '.join(BUNDLED)}); the tokenizer and chat "
                             "template come from the tracker's manifest")
    gen.add_argument("--wait", type=seconds, default=0.0,
                     help="with --tracker: seconds to wait for a complete route before giving up (default 0: "
                          "give up at once)")
    add_join_token_arg(gen, local_without_tracker=True)
    add_client_id_arg(gen)
    gen.add_argument("--tls-ca", default=None, help="CA/cert to verify TLS tracker and nodes")
    gen.add_argument("--client-orchestrated", action="store_true",
                     help="every step through the client, hop by hop (default: nodes forward hidden states to the next node themselves where the route allows)")
    from meshnet.speculative import add_speculation_args

    add_speculation_args(gen)
    gen.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    from meshnet.arg_types import mode_problem
    from meshnet.model.bundled import resolve_model
    from meshnet.local_mesh import plan_ranges
    from meshnet.speculative import speculation_from_args
    from meshnet.tokenizer import GGUFTokenizer

    if args.max_tokens < 1:
        print(f"error: --max-tokens must be >= 1, got {args.max_tokens}", file=sys.stderr)
        return 2
    sampling = _sampling_from(args)
    problem = sampling.validate()
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    model_id = None
    problem = mode_problem(args, {"--wait": args.wait, "--tls-ca": args.tls_ca, "--client-id": args.client_id,
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
    speculation = speculation_from_args(args, path, args.model_id)  # ValueError: exit status 2
    ranges = plan_ranges(path, args.stages, args.layers)
    tok = GGUFTokenizer.from_gguf(path)
    if args.chat and not tok.chat_template:
        print(f"error: --chat: the model ({args.model_id or args.model}) has no chat template (its GGUF holds no "
              "tokenizer.chat_template: a base model); run without --chat to complete the prompt as text",
              file=sys.stderr)
        return 2
    if args.chat:
        from meshnet.chat_template import chat_prompt_ids
        prompt_ids = chat_prompt_ids(tok, [{"role": "user", "content": args.prompt}])
    else:
        prompt_ids = tok.encode(args.prompt)
    if not prompt_ids:
        print("error: the prompt has no tokens; give some text", file=sys.stderr)
        return 2
    progress = _Progress(prompt_ids, [] if args.tracker else ranges)
    try:
        return _complete(args, progress, path, tok, sampling, speculation, model_id)
    except KeyboardInterrupt as e:  # Ctrl-C, or a SIGTERM (meshnet.cli makes it one): the session is released
        progress.interrupted(args, e)
        raise


class _Progress:
    """How far ``generate`` got (its route, the result and the text so far), for what it prints when a
    signal ends it early."""

    def __init__(self, prompt_ids: list[int], ranges: list) -> None:
        from meshnet.generation import GenerationResult

        self.result = GenerationResult(prompt_token_ids=list(prompt_ids))
        self.ranges, self.chain, self.streamed = ranges, None, []

    def interrupted(self, args: argparse.Namespace, e: KeyboardInterrupt) -> None:
        """End the text's line, and with --json print the object: scripts read the last line, and after a
        Ctrl-C or SIGTERM (``timeout``, ``kill``) it was the answer's partial text."""
        from meshnet.supervisor import Terminated

        text = "".join(self.streamed)
        with contextlib.suppress(OSError):  # what follows (the object, a log line) starts a line of its own
            if text:
                sys.stdout.write("\n")
            if args.json:
                print(_json_line(args, self.result, self.ranges, self.chain, text,
                                 stopped_by="SIGTERM" if isinstance(e, Terminated) else "SIGINT"))
            sys.stdout.flush()


def _complete(args: argparse.Namespace, progress: _Progress, path: str, tok, sampling: SamplingParams,
              speculation, model_id: str | None) -> int:
    """Open the stages (a mesh's route, or the layers loaded here), then generate, streaming the text;
    the exit code. ``progress`` follows it."""
    from meshnet.client.router import MeshUnavailable
    from meshnet.generation import Generation, GenerationError
    from meshnet.local_mesh import load_local_chain

    prompt_ids = progress.result.prompt_token_ids
    ranges = progress.ranges
    if args.tracker:
        from meshnet.client.mesh_client import MeshClient
        from meshnet.model.manifest import model_manifest
        from meshnet.up import wait_for_route

        chain = progress.chain = MeshClient(args.tracker, model_sha256=model_id or model_manifest(path).id,
                                            join_token=args.join_token, tls_ca=args.tls_ca,
                                            forwarding=not args.client_orchestrated, client_id=args.client_id)
        try:
            if args.wait:
                try:
                    wait_for_route(args.tracker, args.wait, args.join_token, progress=sys.stderr.isatty(),
                                   tls_ca=args.tls_ca)
                except TimeoutError as e:  # no route, as without --wait: exit status 1, not a usage error's 2
                    raise MeshUnavailable(str(e)) from None
            _, hops, n_ctx = chain.route_with_context()
        except MeshUnavailable as e:
            if "; models served: " in str(e) and "; models served: none" not in str(e):
                e = MeshUnavailable(f"{e} (--model-id NAME or ID asks for one of those, --model FILE for a file "
                                    "of it here)")
            elif not args.wait and str(e).startswith("no route: GetRoute:") and "(excluded: " not in str(e):
                e = MeshUnavailable(f"{e} (nodes still loading? --wait SECONDS waits for a complete route)")
            if args.json:  # the last line is the object, also when no token came
                print(_json_line(args, progress.result, [], chain, "", error=str(e)))
            raise e from None
        ranges = progress.ranges = [f"{h.node_id}@{h.address}" for h in hops]
    else:
        chain = load_local_chain(path, ranges, n_threads=args.threads, n_ctx=args.n_ctx,
                                 progress=sys.stderr.isatty(), huge_pages=args.huge_pages)
        n_ctx = chain.stages[0].capabilities().n_ctx
    if len(prompt_ids) > n_ctx:
        raise_it = "the nodes' --n-ctx (meshnet node --n-ctx)" if args.tracker else "--n-ctx"
        print(f"error: the prompt has {len(prompt_ids)} tokens but the context holds {n_ctx}; "
              f"shorten it or raise {raise_it}", file=sys.stderr)
        return 2
    print(f"[meshnet] {args.model_id or args.model}: {len(ranges)} stage(s) {', '.join(str(r) for r in ranges)}, "
          f"{len(prompt_ids)} prompt tokens", file=sys.stderr)
    stepper = chain
    if args.tracker:
        from meshnet.api.backend import ADMISSION_WAIT_S, AdmissionRetry

        # A stage at its session or KV limit (nodes shared with others) is waited for, as the API does: it
        # answered at once with RESOURCE_EXHAUSTED, which a user could only retry by hand.
        stepper = AdmissionRetry(chain, wait_s=ADMISSION_WAIT_S)
    # As the API's budget: the last generated token is never fed back, so a context of n_ctx holds one more.
    gen = Generation(stepper, tok, prompt_ids, min(args.max_tokens, n_ctx - len(prompt_ids) + 1), sampling,
                     stop_at_eog=not args.ignore_eos, speculation=speculation)
    progress.result = gen.result
    events = iter(gen)
    streamed = progress.streamed
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
    finally:
        events.close()  # on Ctrl-C and SIGTERM too: the session is released on every stage now, not at exit
    r = gen.result
    sys.stdout.write("\n")
    print(f"[meshnet] {len(r.generated_token_ids)} tokens, finish_reason={r.finish_reason}, "
          f"prefill {r.prefill_tokens_per_s:.1f} tok/s, decode {r.decode_tokens_per_s:.1f} tok/s",
          file=sys.stderr)
    if args.json:
        print(_json_line(args, r, ranges, chain, r.text))
    return 0


# --json's finish_reason when a signal (Ctrl-C, SIGTERM) ended the generation early.
FINISH_INTERRUPTED = "interrupted"


def _json_line(args: argparse.Namespace, r, ranges: list, chain, text: str, error: str | None = None,
               stopped_by: str | None = None) -> str:
    """``generate --json``'s last line: ids, text, finish reason, the stages (over a mesh the route the
    generation ended on, a failover moving it, with how often it moved and how often onto a node that
    computes otherwise: within tolerance, not bit for bit), timings; with ``error``, what came before it;
    with ``stopped_by`` (the signal's name), what came before the signal."""
    extra: dict = {}
    finish = r.finish_reason
    if args.tracker:  # no chain yet: the signal came while the client was being made
        ranges = [f"{h.node_id}@{h.address}" for h in getattr(chain, "last_hops", ())] or ranges
        extra = {"failovers": getattr(chain, "failovers", 0),
                 "failovers_not_bit_exact": getattr(chain, "unlike_failovers", 0)}
    if error is not None:
        finish, extra["error"] = "error", error
    elif stopped_by is not None:
        finish, extra["signal"] = FINISH_INTERRUPTED, stopped_by
    return json.dumps({"prompt_token_ids": r.prompt_token_ids, "generated_token_ids": r.generated_token_ids,
                       "text": text, "finish_reason": finish, "layers": [str(x) for x in ranges],
                       "timings": r.timings(), **extra}, ensure_ascii=False)
