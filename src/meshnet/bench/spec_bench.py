"""``meshnet bench speculative``: greedy decode speed with and without n-gram speculative decoding, in
process, on a repetitive prompt (a JSON copy-edit, where drafts are mostly right) and on free prose.

Method: the chat prompt is prefilled, then ``--decode-tokens`` tokens are generated greedily (end-of-
generation ignored), plain and speculative runs alternating, ``--repeats`` of each after one warm-up
pair; the median decode tokens/s of each is reported, with the ratio speculative / plain, the drafted and
accepted tokens, and whether both produced the same token ids (they must). JSON out, a table printed.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

from meshnet.arg_types import draft_token_count, generated_tokens, positive_int, results_file, thread_count
from meshnet.contract import GREEDY
from meshnet.speculative import Speculation

USERS = ", ".join(f'{{"id": {i}, "name": "{n}", "active": true}}'
                  for i, n in enumerate(["Ann", "Bob", "Cid", "Dee", "Eve", "Fay", "Gus", "Hal", "Ivy", "Jon",
                                         "Kim", "Lou", "Max", "Ned", "Oda", "Pam"], 1))
PROMPTS = {
    "json-edit": f'Rewrite this JSON with "active" set to false for every user:\n{{"users": [{USERS}]}}',
    "prose": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def add_spec_bench_parser(bsub) -> None:
    p = bsub.add_parser("speculative", help="decode tokens/s with and without n-gram speculative decoding "
                                            "(in process; a repetitive prompt and prose)")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--threads", type=thread_count, default=2)
    p.add_argument("--stages", type=positive_int, default=1, help="in-process layer ranges")
    p.add_argument("--decode-tokens", type=generated_tokens, default=96)
    p.add_argument("--draft-tokens", type=draft_token_count, default=Speculation().draft_tokens,
                   help="draft tokens per round at most (the draft budget picks fewer where they do not pay)")
    p.add_argument("--repeats", type=positive_int, default=2, help="runs of each mode per prompt; medians reported")
    p.add_argument("--out", type=results_file, default="bench-results/speculative.json")
    p.set_defaults(func=run_spec_bench)


def run_spec_bench(args: argparse.Namespace) -> int:
    from meshnet.chat_template import chat_prompt_ids
    from meshnet.generation import generate
    from meshnet.local_mesh import load_local_chain, plan_ranges
    from meshnet.model.bundled import resolve_model
    from meshnet.tokenizer import GGUFTokenizer

    path = str(resolve_model(args.model))
    spec = Speculation(args.draft_tokens)
    if (problem := spec.validate()) is not None:
        raise ValueError(problem)
    tok = GGUFTokenizer.from_gguf(path)
    ranges = plan_ranges(path, args.stages, None)
    chain = load_local_chain(path, ranges, n_threads=args.threads, progress=False)
    result = {"model": args.model, "stages": [str(r) for r in ranges], "threads": args.threads,
              "decode_tokens": args.decode_tokens, "draft_tokens": args.draft_tokens, "repeats": args.repeats,
              "machine": platform.machine(), "prompts": {}}
    for name, text in PROMPTS.items():
        ids = chat_prompt_ids(tok, [{"role": "user", "content": text}])
        runs: dict[str, list] = {"plain": [], "speculative": []}
        for i in range(args.repeats + 1):  # the first pair warms the graphs up and is not counted
            for mode, s in (("plain", None), ("speculative", spec)):
                r = generate(chain, tok, ids, args.decode_tokens, GREEDY, stop_at_eog=False, speculation=s)
                if i:
                    runs[mode].append(r)
        plain, fast = runs["plain"], runs["speculative"]
        tps = {mode: statistics.median(r.decode_tokens_per_s for r in rs) for mode, rs in runs.items()}
        result["prompts"][name] = {
            "prompt_tokens": len(ids),
            "plain_decode_tokens_per_s": round(tps["plain"], 2),
            "speculative_decode_tokens_per_s": round(tps["speculative"], 2),
            "ratio": round(tps["speculative"] / tps["plain"], 3),
            "verify_steps": fast[-1].verify_steps, "drafted": fast[-1].drafted, "accepted": fast[-1].accepted,
            "acceptance_rate": round(fast[-1].accepted / fast[-1].drafted, 3) if fast[-1].drafted else 0.0,
            "identical_output": all(r.generated_token_ids == plain[0].generated_token_ids for r in plain + fast),
        }
        print(f"[bench] {name}: {result['prompts'][name]}", file=sys.stderr)
    print(f"{'prompt':<10} {'plain tok/s':>12} {'spec tok/s':>11} {'ratio':>6} {'accepted/drafted':>17} same")
    for name, p in result["prompts"].items():
        print(f"{name:<10} {p['plain_decode_tokens_per_s']:>12.1f} {p['speculative_decode_tokens_per_s']:>11.1f} "
              f"{p['ratio']:>6.2f} {p['accepted']:>8}/{p['drafted']:<8} {p['identical_output']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"[bench] wrote {out}", file=sys.stderr)
    return 0 if all(p["identical_output"] for p in result["prompts"].values()) else 1
