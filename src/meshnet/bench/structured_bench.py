"""``meshnet bench structured``: how many ``json_schema`` answers parse and validate, and what constraining
costs in decode speed.

An API server over an in-process chain of the bundled model (``--stages``) gets ``--requests`` chat requests
with ``response_format`` ``json_schema`` (:data:`PERSON`: required string, integer, enum and a bounded array),
``max_tokens`` 300, ``--concurrency`` at a time: the first half greedy, the rest sampled (temperature 1, seed
= request index), over prompts that vary the person asked for. Each answer is parsed with ``json`` and
validated with ``jsonschema``. Then ``--rounds`` pairs of in-process generations on one prompt, constrained
and not (alternating, so load on the machine hits both alike), give the median decode tokens/s of each.
Figures are written as JSON to ``--out`` and printed as a table; nothing is asserted.
"""

from __future__ import annotations

import json
import statistics
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from meshnet.arg_types import positive_int, results_file, thread_count

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 32},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
_WHO = ["teacher", "doctor", "farmer", "pilot", "painter", "chef", "sailor", "student", "baker", "nurse"]
_WHERE = ["Paris", "Tokyo", "Lagos", "Lima", "Oslo"]
MAX_TOKENS = 300


def add_structured_bench_parser(bench_subparsers) -> None:
    p = bench_subparsers.add_parser("structured", help="json_schema answers that parse and validate; decode "
                                                       "tokens/s constrained against unconstrained")
    p.add_argument("--model", default="smollm2", help="GGUF path or bundled name (default %(default)s)")
    p.add_argument("--stages", type=positive_int, default=1, help="in-process layer ranges (default %(default)s)")
    p.add_argument("--threads", type=thread_count, default=2, help="CPU threads per stage (default %(default)s)")
    p.add_argument("--requests", type=positive_int, default=100,
                   help="json_schema requests, half greedy and half sampled (default %(default)s)")
    p.add_argument("--concurrency", type=positive_int, default=4, help="requests at a time (default %(default)s)")
    p.add_argument("--rounds", type=positive_int, default=3,
                   help="pairs of constrained and unconstrained generations timed (default %(default)s)")
    p.add_argument("--out", type=results_file, default="bench-results/structured.json", help="JSON written here")
    p.set_defaults(func=run_structured_bench)


def _request(i: int, n: int) -> dict:
    who, where = _WHO[i % len(_WHO)], _WHERE[(i // len(_WHO)) % len(_WHERE)]
    body = {"messages": [{"role": "user", "content": f"Describe a {who} from {where} as JSON with name, age, "
                                                     "favourite color and a few tags."}],
            "max_tokens": MAX_TOKENS,
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                       "strict": True}}}
    greedy = i < n // 2
    return {**body, "temperature": 0} if greedy else {**body, "temperature": 1.0, "seed": i}


def _post(base: str, body: dict) -> dict:
    req = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def _check(answer: dict, validator) -> tuple[bool, str]:
    """(parses and validates, why not)."""
    choice = answer["choices"][0]
    try:
        doc = json.loads(choice["message"]["content"])
    except ValueError as e:
        return False, f"does not parse ({choice['finish_reason']}): {e}"
    errors = list(validator.iter_errors(doc))
    return (not errors), (errors[0].message if errors else "")


def _speeds(backend, rounds: int) -> dict:
    """Median decode tokens/s on one prompt, constrained (the schema) and not (64 tokens, EOS ignored)."""
    from meshnet.chat_template import chat_prompt_ids
    from meshnet.sampling_params import Grammar, SamplingParams
    from meshnet.generation import generate

    tok = backend.tokenizer
    ids = chat_prompt_ids(tok, _request(0, 2)["messages"])
    constrained, plain, n_tokens = [], [], []
    grammar = Grammar(json.dumps(PERSON))
    generate(backend.chain, tok, ids, 4, SamplingParams(grammar=grammar))  # compile and warm up
    for _ in range(rounds):
        r = generate(backend.chain, tok, ids, MAX_TOKENS, SamplingParams(grammar=grammar))
        constrained.append(r.decode_tokens_per_s)
        n_tokens.append(len(r.generated_token_ids))
        plain.append(generate(backend.chain, tok, ids, 64, SamplingParams(), stop_at_eog=False).decode_tokens_per_s)
    c, p = statistics.median(constrained), statistics.median(plain)
    return {"constrained_tokens_per_s": round(c, 2), "unconstrained_tokens_per_s": round(p, 2),
            "ratio": round(c / p, 3) if p else None, "constrained_tokens": n_tokens[0], "rounds": rounds}


def run_structured_bench(args) -> int:
    import jsonschema

    from meshnet.api.backend import local_backend
    from meshnet.api.server import start_api_in_thread, stop_api

    backend = local_backend(args.model, stages=args.stages, n_threads=args.threads, n_ctx=1024,
                            max_sessions=max(4, args.concurrency))
    validator = jsonschema.Draft202012Validator(PERSON)
    server, thread = start_api_in_thread(backend, "127.0.0.1", 0)
    base = f"http://127.0.0.1:{server.config.port}"
    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            answers = list(pool.map(lambda i: _post(base, _request(i, args.requests)), range(args.requests)))
        wall = time.perf_counter() - t0
    finally:
        stop_api(server, thread)
    checks = [_check(a, validator) for a in answers]
    half = args.requests // 2
    failures = [{"request": i, "why": why, "text": a["choices"][0]["message"]["content"][:200]}
                for i, ((ok, why), a) in enumerate(zip(checks, answers)) if not ok]
    result = {
        "model": args.model, "stages": args.stages, "requests": args.requests, "max_tokens": MAX_TOKENS,
        "valid": sum(ok for ok, _ in checks), "valid_greedy": sum(ok for ok, _ in checks[:half]),
        "valid_sampled": sum(ok for ok, _ in checks[half:]),
        "finish_stop": sum(a["choices"][0]["finish_reason"] == "stop" for a in answers),
        "completion_tokens_mean": round(statistics.mean(a["usage"]["completion_tokens"] for a in answers), 1),
        "wall_s": round(wall, 1), "failures": failures[:10], "speed": _speeds(backend, args.rounds),
    }
    backend.close()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    s = result["speed"]
    rows = [("requests", result["requests"]), ("parse and validate", result["valid"]),
            ("  greedy / sampled", f"{result['valid_greedy']} / {result['valid_sampled']}"),
            ("finish_reason stop", result["finish_stop"]),
            ("completion tokens (mean)", result["completion_tokens_mean"]), ("wall s", result["wall_s"]),
            ("decode tok/s constrained", s["constrained_tokens_per_s"]),
            ("decode tok/s unconstrained", s["unconstrained_tokens_per_s"]), ("ratio", s["ratio"])]
    for name, value in rows:
        print(f"{name:<28} {value}")
    print(f"wrote {out}")
    return 0
