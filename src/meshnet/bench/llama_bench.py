"""llama.cpp's own ``llama-bench`` on one machine, the reference ``meshnet bench engine`` reports beside
the engine: the C++ tool with no Python in its loop, on the same file and thread count.

Two runs, so that the decode figure is measured where meshnet's is (after the prompt, in the cache): a
prompt test of ``n_prompt`` tokens (one ``llama_decode`` of the whole prompt), then a generation test
of ``n_gen`` single-token decodes at depth ``n_prompt`` (``-d``; a depth applies to every test of a run,
hence two runs). ``-fa on`` as meshnet's kernels (flash attention, F16 KV), ``-r`` repeats after
llama-bench's own warm-up run. It runs as a subprocess: its ggml must never share a process with
ggml-python's, and without ``LD_LIBRARY_PATH`` (the binaries are static).

llama-bench repacks weights for the CPU by default (Q4_0, Q4_K, ... into interleaved layouts); meshnet
does not, because a repacked mat-mul's rows depend on how many rows share it (batched output would
differ from solo). ``repack=False`` (``--repack 0``) measures llama.cpp on the kernels meshnet uses.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from meshnet.bench.llama_server import cache_dir, find_tool
from meshnet.openmp import competitor_env


def llama_bench_argvs(bench: Path, model: str, n_prompt: int, n_gen: int, threads: int,
                      repeats: int, repack: bool = True) -> list[list[str]]:
    """The two llama-bench command lines (see the module doc), JSON on stdout."""
    common = [str(bench), "-m", model, "-t", str(threads), "-fa", "on", "-r", str(repeats), "-o", "json"]
    if not repack:
        common += ["--repack", "0"]
    return [[*common, "-p", str(n_prompt), "-n", "0"],
            [*common, "-p", "0", "-n", str(n_gen), "-d", str(n_prompt)]]


def summarize(tests: list[dict], n_prompt: int, n_gen: int) -> dict:
    """``prefill_tokens_per_s``, ``decode_tokens_per_s`` (llama-bench's mean ``avg_ts``) and the runs'
    ``samples_ts`` from llama-bench's JSON tests. Raises ValueError when a test is missing."""
    prompt = next((t for t in tests if t["n_prompt"] == n_prompt and t["n_gen"] == 0), None)
    gen = next((t for t in tests if t["n_gen"] == n_gen and t["n_prompt"] == 0), None)
    if prompt is None or gen is None:
        raise ValueError(f"llama-bench reported no {'prompt' if prompt is None else 'generation'} test")
    return {"tool": "llama-bench", "build_commit": gen.get("build_commit", ""), "flash_attn": True,
            "prefill_tokens_per_s": round(prompt["avg_ts"], 2), "decode_tokens_per_s": round(gen["avg_ts"], 2),
            "prefill_runs": [round(x, 2) for x in prompt.get("samples_ts", [])],
            "decode_runs": [round(x, 2) for x in gen.get("samples_ts", [])], "decode_depth": gen.get("n_depth", 0)}


def llama_bench_reference(model: str, n_prompt: int, n_gen: int, threads: int, repeats: int,
                          timeout_s: float = 1800.0, repack: bool = True) -> dict:
    """llama-bench's prefill and decode tokens/s on ``model`` (:func:`summarize`), or ``{"skipped":
    reason}`` when the tool is missing, fails or outlives ``timeout_s`` (the reason holds its stderr's
    tail)."""
    bench = find_tool("llama-bench")
    if bench is None:
        return {"skipped": f"llama-bench is neither on PATH nor in {cache_dir() / 'bin'}: build it with "
                           "`python -m meshnet.bench.llama_server`"}
    env = {k: v for k, v in competitor_env().items() if k not in ("LD_LIBRARY_PATH", "LD_PRELOAD")}
    tests: list[dict] = []
    argvs = llama_bench_argvs(bench, model, n_prompt, n_gen, threads, repeats, repack)
    for argv in argvs:
        try:
            out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"skipped": f"llama-bench ran over {timeout_s:.0f} s: {' '.join(argv)}"}
        if out.returncode != 0:
            return {"skipped": f"llama-bench exited with {out.returncode}: {out.stderr.strip()[-500:]}"}
        tests += json.loads(out.stdout)
    return {"command": [" ".join(a) for a in argvs], "repack": repack, **summarize(tests, n_prompt, n_gen)}
