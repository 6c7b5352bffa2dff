"""``meshnet bench engine``: prefill and decode speed of the ggml engine for 1 and N in-process stages,
resident memory per stage, and llama.cpp's figures on the same file in the same run.

Method (mirrors the golden README's reference speed): a ``--prompt-tokens`` prompt as one batch, then
``--decode-tokens`` single-token greedy decode steps; the median of ``--repeats`` runs after one
warm-up. The reference is llama.cpp's C++ ``llama-bench`` on the same file and threads
(:mod:`meshnet.bench.llama_bench`: prompt test, then generation at the prompt's depth), in its own
process because its ggml and ggml-python's must never share one. With ``--rounds`` N > 1 the single stage
and llama-bench are measured N times in turn and each ratio is the median of the rounds' ratios: on a
machine whose speed drifts (a shared VM), two figures taken minutes apart compare the machine with itself.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from meshnet.arg_types import positive_int, results_file, thread_count
from meshnet.bench.llama_bench import llama_bench_reference
from meshnet.contract import GREEDY, StepRequest
from meshnet.model.bundled import DEFAULT_MODEL, resolve_model
from meshnet.model.gguf_file import sha256_file

# Public-domain-style filler text; repeated until the prompt has enough tokens.
FILLER = ("On a quiet morning in early spring, the old lighthouse keeper climbed the spiral stairs one last "
          "time. For forty years he had polished the great lens, trimmed the wicks, and written the weather "
          "into a leather notebook that smelled of salt and lamp oil. ")


def bench_prompt_ids(model_path: str, n_tokens: int) -> list[int]:
    """``n_tokens`` token ids of English text for ``model_path``'s vocabulary."""
    from meshnet.tokenizer import GGUFTokenizer

    tok = GGUFTokenizer.from_gguf(model_path)
    text = FILLER
    while len(ids := tok.encode(text)) < n_tokens:
        text += FILLER
    return ids[:n_tokens]


@dataclass
class RunTiming:
    """One greedy run: ``ttft_s`` (prefill of the prompt, seconds), ``decode_s`` (the decode loop,
    seconds), ``step_s`` (each decode step, seconds), the generated token ids and ``decode_cpu_s``
    (CPU seconds this process, all its threads, spent during the decode loop)."""

    ttft_s: float
    decode_s: float
    step_s: list[float]
    tokens: list[int]
    decode_cpu_s: float = 0.0

    def decode_tokens_per_s(self) -> float:
        return len(self.step_s) / self.decode_s


def greedy_run(client, prompt_ids: list[int], n_decode: int) -> RunTiming:
    """Prefill ``prompt_ids`` then ``n_decode`` single-token greedy steps on ``client`` (a LocalChain or
    MeshClient), releasing the session at the end."""
    sid = f"bench-{uuid.uuid4().hex}"
    try:
        t0 = time.perf_counter()
        res = client.step(StepRequest(sid, 0, 0, tuple(prompt_ids), sampling=GREEDY), decode=False)
        ttft = time.perf_counter() - t0
        if not res.ok:
            raise RuntimeError(f"prefill failed: {res.status.value} {res.message}")
        pos, tok = len(prompt_ids), res.token.token_id
        tokens, steps = [tok], []
        c1 = time.process_time()
        t1 = time.perf_counter()
        for _ in range(n_decode):
            s0 = time.perf_counter()
            res = client.step(StepRequest(sid, 0, pos, (tok,), sampling=GREEDY), decode=True)
            steps.append(time.perf_counter() - s0)
            if not res.ok:
                raise RuntimeError(f"decode failed at position {pos}: {res.status.value} {res.message}")
            pos, tok = pos + 1, res.token.token_id
            tokens.append(tok)
        decode_s = time.perf_counter() - t1
        decode_cpu_s = time.process_time() - c1
    finally:
        client.release(sid)
    return RunTiming(ttft, decode_s, steps, tokens, decode_cpu_s)


def _close(chain) -> None:
    """Free a measured chain's stages: a stage left open still counts as a user of the shared CPU
    backend, and while several do, graphs run on the shared compute thread (ggml_backend.compute): the
    next configuration would be measured slower than it runs alone."""
    for engine in chain.stages:
        if getattr(engine, "stage", None) is not None:
            engine.stage.close()


def time_chain(chain, prompt_ids: list[int], n_decode: int, repeats: int) -> dict:
    """Median prefill and decode tokens/s of greedy runs on a LocalChain (after one warm-up run)."""
    greedy_run(chain, prompt_ids, n_decode)  # warms caches and builds graphs
    runs = [greedy_run(chain, prompt_ids, n_decode) for _ in range(repeats)]
    prefill = [len(prompt_ids) / r.ttft_s for r in runs]
    decode = [r.decode_tokens_per_s() for r in runs]
    return {"prefill_tokens_per_s": round(statistics.median(prefill), 2),
            "decode_tokens_per_s": round(statistics.median(decode), 2),
            "prefill_runs": [round(x, 2) for x in prefill], "decode_runs": [round(x, 2) for x in decode]}


def _rss_child(model: str, layers: str, threads: int, n_tokens: int) -> None:
    """Child process: load one range, run a 128-token prefill through it (so every weight page it
    reads is resident, plus a KV cache and compute buffers), print RSS before and after as JSON."""
    import numpy as np

    from meshnet.contract import LayerRange
    from meshnet.engine.ggml_stage import GgmlStage

    def rss() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    before = rss()
    st = GgmlStage(model, LayerRange.parse(layers), n_threads=threads, n_ctx=512)
    kv = st.new_session()
    loaded = rss()
    ids = list(range(100, 100 + n_tokens))  # the ids do not matter for memory; no tokenizer in this process
    if st.is_head:
        st.forward(kv, 0, token_ids=np.asarray(ids, dtype=np.int32))
    else:
        st.forward(kv, 0, hidden=np.zeros((len(ids), st.cfg.n_embd), dtype=np.float32))
    print(json.dumps({"layers": layers, "rss_before_load_bytes": before, "rss_after_load_bytes": loaded,
                      "rss_bytes": rss(),
                      "weight_bytes": st.weights.nbytes, "kv_bytes": st.pool.resident_bytes()}))


def measure_stages(model: str, n_stages: int, threads: int, n_ctx: int, prompt_ids: list[int], n_decode: int,
                   repeats: int) -> dict:
    """:func:`time_chain`'s figures for the model split into ``n_stages`` in-process stages, with the ranges;
    the stages are freed after."""
    from meshnet.local_mesh import load_local_chain, plan_ranges

    ranges = plan_ranges(model, n_stages)
    # No prefix reuse: every run prefills its whole prompt, as llama-bench's prompt test does (a kept
    # session would serve the repeated prompt from its cells).
    chain = load_local_chain(model, ranges, n_threads=threads, n_ctx=n_ctx, progress=False, prefix_cache=0)
    try:
        return {"layers": [str(r) for r in ranges], **time_chain(chain, prompt_ids, n_decode, repeats)}
    finally:
        _close(chain)


def _speed_child(model: str, threads: int, n_ctx: int, prompt_tokens: int, n_decode: int, repeats: int) -> None:
    """Child process: the single stage's :func:`measure_stages` figures as JSON on stdout."""
    print(json.dumps(measure_stages(model, 1, threads, n_ctx, bench_prompt_ids(model, prompt_tokens), n_decode,
                                    repeats)))


def measure_speed_fresh(model: str, threads: int, n_ctx: int, prompt_tokens: int, n_decode: int,
                        repeats: int) -> dict:
    """:func:`time_chain`'s figures for the whole model as one stage, in a fresh process: a stage loaded
    again in a process that already ran one decodes 10-20% slower (measured on Qwen3-MoE shapes)."""
    out = subprocess.run([sys.executable, "-c", "import sys; from meshnet.bench.engine_bench import _speed_child; "
                          "_speed_child(sys.argv[1], *map(int, sys.argv[2:]))",
                          model, str(threads), str(n_ctx), str(prompt_tokens), str(n_decode), str(repeats)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_rss(model: str, layers: str, threads: int, n_tokens: int = 128) -> dict:
    """Resident memory of a fresh process holding only ``layers`` after an ``n_tokens`` prefill
    (bytes, from /proc on Linux). ``rss_for_range_bytes`` excludes the interpreter and imports."""
    out = subprocess.run([sys.executable, "-c", "import sys; from meshnet.bench.engine_bench import _rss_child; "
                          "_rss_child(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))",
                          model, layers, str(threads), str(n_tokens)],
                         capture_output=True, text=True, check=True)
    d = json.loads(out.stdout.strip().splitlines()[-1])
    d["rss_for_range_bytes"] = d["rss_bytes"] - d["rss_before_load_bytes"]
    return d


def _llama_ratios(one: dict, result: dict) -> dict:
    """A single stage's figures over llama-bench's (repacked, and ``--repack 0``) from one round."""
    out = {}
    for key, suffix in (("llama_cpp", ""), ("llama_cpp_no_repack", "_no_repack")):
        ref = result[key]
        if "decode_tokens_per_s" in ref:
            for what in ("decode", "prefill"):
                out[f"1_stage_vs_llama_cpp{suffix}_{what}"] = round(
                    one[f"{what}_tokens_per_s"] / ref[f"{what}_tokens_per_s"], 3)
    return out


def format_table(result: dict) -> str:
    """The figures of a ``run_engine_bench`` result as a plain-text table: tokens/s of each meshnet
    configuration and of llama-bench, and each one's ratio to llama-bench."""
    ref = result.get("llama_cpp", {})
    rows = [(f"meshnet {k.replace('_', ' ')} ({','.join(v['layers'])})", v) for k, v in result["meshnet"].items()]
    if "accelerator" in result:
        rows.append((f"meshnet {result['accelerator']['backend']}", result["accelerator"]))
    if "decode_tokens_per_s" in ref:
        rows.append(("llama-bench", ref))
    plain = result.get("llama_cpp_no_repack", {})
    if "decode_tokens_per_s" in plain:
        rows.append(("llama-bench --repack 0", plain))
    lines = [f"{'':44} {'prefill t/s':>12} {'decode t/s':>11} {'prefill x':>10} {'decode x':>9}"]
    for name, r in rows:
        ratios = ["", ""]
        if "decode_tokens_per_s" in ref:
            ratios = [f"{r[k] / ref[k]:.3f}" for k in ("prefill_tokens_per_s", "decode_tokens_per_s")]
        lines.append(f"{name:44} {r['prefill_tokens_per_s']:12.2f} {r['decode_tokens_per_s']:11.2f} "
                     f"{ratios[0]:>10} {ratios[1]:>9}")
    if "skipped" in ref:
        lines.append(f"llama-bench skipped: {ref['skipped']}")
    if "rounds" in result:
        r = result["ratios"]
        lines.append(f"(figures of the last of {len(result['rounds'])} rounds; median of the rounds' ratios: "
                     f"prefill {r.get('1_stage_vs_llama_cpp_prefill')}x, decode {r.get('1_stage_vs_llama_cpp_decode')}x)")
    return "\n".join(lines)


def run_engine_bench(args: argparse.Namespace) -> int:
    from meshnet.local_mesh import load_local_chain, plan_ranges

    backend = getattr(args, "backend", "cpu")
    if backend != "cpu":
        from meshnet.backends.lanes import require_certified

        require_certified(backend)  # BackendUnavailable names why, before anything is measured
    model = str(resolve_model(args.model))
    # Before any part runs: a count the model cannot split into failed only after the 1-stage figures.
    stage_ranges = plan_ranges(model, args.stages)
    prompt_ids = bench_prompt_ids(model, args.prompt_tokens)
    n_ctx = 512 if args.prompt_tokens + args.decode_tokens <= 512 else 0
    result: dict = {
        "benchmark": "engine", "model": args.model, "path": model, "sha256": sha256_file(model),
        "threads": args.threads, "prompt_tokens": len(prompt_ids), "decode_tokens": args.decode_tokens,
        "repeats": args.repeats, "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "meshnet": {},
    }

    for n_stages in sorted({1, args.stages}):
        key = f"{n_stages}_stage" + ("s" if n_stages > 1 else "")
        result["meshnet"][key] = measure_stages(model, n_stages, args.threads, n_ctx, prompt_ids,
                                                args.decode_tokens, args.repeats)
        print(f"[bench] {key}: {result['meshnet'][key]}", file=sys.stderr)
    if backend != "cpu":
        from meshnet.backends.placement import AcceleratorEngine

        ranges = plan_ranges(model, 1)
        chain = load_local_chain(model, ranges, n_threads=args.threads, n_ctx=n_ctx, progress=False,
                                 engine_factory=lambda: AcceleratorEngine(backend), prefix_cache=0)
        result["accelerator"] = {"backend": backend, "device": chain.stages[0].device,
                                 "layers": [str(r) for r in ranges],
                                 **time_chain(chain, prompt_ids, args.decode_tokens, args.repeats)}
        one_cpu = result["meshnet"]["1_stage"]
        result["accelerator"]["vs_cpu_1_stage"] = {
            k: round(result["accelerator"][k] / one_cpu[k], 3)
            for k in ("prefill_tokens_per_s", "decode_tokens_per_s") if one_cpu[k] > 0}
        del chain
    whole = plan_ranges(model, 1)[0]
    n = len(prompt_ids)
    result["rss"] = {"whole_model": measure_rss(model, str(whole), args.threads, n),
                     "stages": [measure_rss(model, str(r), args.threads, n) for r in stage_ranges]}
    whole = result["rss"]["whole_model"]
    for s in result["rss"]["stages"]:
        s["fraction_of_whole_model_rss"] = round(s["rss_bytes"] / whole["rss_bytes"], 3)
        s["fraction_of_whole_model_rss_for_range"] = round(s["rss_for_range_bytes"] / whole["rss_for_range_bytes"], 3)
    one = result["meshnet"]["1_stage"]
    multi = result["meshnet"][f"{args.stages}_stages"] if args.stages > 1 else one
    result["ratios"] = {f"{args.stages}_stages_vs_1_decode": round(multi["decode_tokens_per_s"] /
                                                                   one["decode_tokens_per_s"], 3),
                        f"{args.stages}_stages_vs_1_prefill": round(multi["prefill_tokens_per_s"] /
                                                                    one["prefill_tokens_per_s"], 3)}
    if args.no_llama_cpp:
        result["llama_cpp"] = result["llama_cpp_no_repack"] = {"skipped": "--no-llama-cpp"}
    else:
        rounds = []
        for r in range(max(1, getattr(args, "rounds", 1))):
            if r:
                one = result["meshnet"]["1_stage"] = measure_speed_fresh(
                    model, args.threads, n_ctx, args.prompt_tokens, args.decode_tokens, args.repeats)
                print(f"[bench] round {r + 1}: 1_stage: {one}", file=sys.stderr)
            # As users run it (weights repacked), and on the kernels meshnet uses (see llama_bench).
            for key, repack in (("llama_cpp", True), ("llama_cpp_no_repack", False)):
                result[key] = llama_bench_reference(model, len(prompt_ids), args.decode_tokens, args.threads,
                                                    args.repeats, repack=repack)
            rounds.append(_llama_ratios(one, result))
        result["ratios"].update({k: round(statistics.median(r[k] for r in rounds), 3) for k in rounds[0]})
        if len(rounds) > 1:
            result["rounds"] = rounds
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["ratios"]), file=sys.stderr)
    print(format_table(result))
    print(f"[bench] wrote {out}", file=sys.stderr)
    return 0


def add_engine_bench_parser(bsub: argparse._SubParsersAction) -> None:
    be = bsub.add_parser("engine", help="prefill/decode tokens/s for 1 and 3 stages, RSS per stage, llama.cpp")
    be.add_argument("--model", default=DEFAULT_MODEL)
    be.add_argument("--threads", type=thread_count, default=2)
    be.add_argument("--stages", type=positive_int, default=3,
                    help="the multi-stage configuration to compare (at most the model's layer count)")
    be.add_argument("--prompt-tokens", type=positive_int, default=128)
    be.add_argument("--decode-tokens", type=positive_int, default=64)
    be.add_argument("--repeats", type=positive_int, default=3, help="runs per figure; the median is reported")
    be.add_argument("--rounds", type=positive_int, default=1,
                    help="measure the single stage and llama-bench this many times in turn; ratios are the "
                         "median of the rounds' (for machines whose speed drifts)")
    be.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp reference")
    be.add_argument("--backend", default="cpu", choices=["cpu", "cuda", "rocm", "vulkan", "metal"],
                    help="also measure this accelerator lane beside the CPU (it must be certified here)")
    be.add_argument("--out", type=results_file, default="bench-results/engine.json")
    be.set_defaults(func=run_engine_bench)
