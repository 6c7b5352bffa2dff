"""Greedy ids and top log-probabilities from meshnet's ggml stages and from llama.cpp, and their comparison.

llama.cpp's side runs ``llama-server`` (found or built by :mod:`meshnet.bench.llama_server`; its own
process, since its ggml must never share one with ggml-python's) and asks ``/completion`` for the prompt
ids, ``n_predict`` tokens at temperature 0 (greedy: the argmax of the raw logits) with ``n_probs``: the
server's ``top_logprobs`` are the log-softmax of the raw logits (``get_token_probabilities``), so beside
the ids they say how far every runner-up is from the winner, to float32 precision. Settings mirror the
goldens': one slot, ``-c n_ctx``, the prompt as one batch, flash attention on, F16 KV cache.

Weight repacking (``repack``): llama.cpp's CPU backend repacks Q4_0, Q4_K, IQ4_NL and MXFP4 weights on x86
(AVX2) into interleaved layouts that sum in another order than ggml's plain kernels, which meshnet runs.
The reference runs with ``--no-repack`` by default so that any stored type compares kernel for kernel;
on files of types it never repacks (Q4_1, Q8_0, Q6_K, ...) the flag changes nothing.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Sequence

import numpy as np

N_TOP = 5  # log-probabilities compared per step


def stages_greedy(stages: Sequence, prompt_ids: Sequence[int], n_tokens: int, n_top: int = N_TOP,
                  never: Sequence[int] = ()) -> dict:
    """Greedy generation through in-process :class:`~meshnet.engine.ggml_stage.GgmlStage` objects
    chained in order (head first, tail last), on fresh sessions freed at the end.

    A stage past the head that picks experts by token id (DeepSeek-V4's hash-routed blocks,
    ``needs_tokens``) gets the step's token ids beside the hidden states. ``never``: ids that are not
    picked (the tokenizer's end-of-generation ids, to match :func:`llama_cpp_greedy`, whose
    ``ignore_eos`` sets their logits to -inf before sampling); the log-probabilities and margins still
    come from the raw logits, as llama-server reports them.

    Returns:
        ``{"tokens": [n_tokens ids], "top_logprobs": [[[id, logprob] x n_top] per step], "margins":
        [top-1 minus top-2 raw logit per step, ``never`` ids left out]}``; log-probabilities from the
        float32 logits in float64.
    """
    kvs = [st.new_session() for st in stages]
    try:
        tokens, tops, margins = [], [], []
        pos, step = 0, np.asarray(prompt_ids, dtype=np.int32)
        for _ in range(n_tokens):
            x = stages[0].forward(kvs[0], pos, token_ids=step)  # [n, n_embd] or, one stage, [1, n_vocab]
            for st, kv in zip(stages[1:], kvs[1:]):
                x = st.forward(kv, pos, token_ids=step if st.needs_tokens else None, hidden=x)
            logits = x[-1].astype(np.float64)  # [n_vocab]
            order = np.argsort(-logits, kind="stable")[:n_top]
            shifted = logits - logits[order[0]]
            logprobs = shifted - np.log(np.exp(shifted).sum())
            allowed = logits.copy()
            allowed[list(never)] = -np.inf
            first, second = np.argsort(-allowed, kind="stable")[:2]
            tokens.append(int(first))
            tops.append([[int(i), float(logprobs[i])] for i in order])
            margins.append(float(allowed[first] - allowed[second]))
            pos += len(step)
            step = np.asarray([first], dtype=np.int32)
    finally:
        for kv in kvs:
            kv.free()
    return {"tokens": tokens, "top_logprobs": tops, "margins": margins}


def llama_cpp_greedy(model: str, prompt_ids: Sequence[int], n_tokens: int, threads: int, n_ctx: int = 512,
                     repack: bool = False, n_top: int = N_TOP, timeout_s: float = 600.0) -> dict:
    """llama.cpp's greedy ids and top log-probabilities on ``model`` (see the module doc).

    Returns:
        ``{"tokens", "top_logprobs", "server_argv"}`` as :func:`stages_greedy` (without margins), or
        ``{"skipped": reason}`` when llama-server is missing or does not start (the reason names its log).
    """
    import httpx

    from meshnet.bench.llama_server import find_tool
    from meshnet.bench.served import Server

    binary = find_tool("llama-server")
    if binary is None:
        return {"skipped": "llama-server is not built: `python -m meshnet.bench.llama_server` builds it"}
    log_dir = Path(tempfile.mkdtemp(prefix="meshnet-greedy-"))
    srv = Server("llama-server-greedy", lambda port: [
        str(binary), "-m", model, "-t", str(threads), "-tb", str(threads), "-fa", "on", "-np", "1",
        "-c", str(n_ctx), "--host", "127.0.0.1", "--port", str(port)] + ([] if repack else ["--no-repack"]),
        log_dir, competitor=True)
    try:
        try:
            srv.start(timeout_s)
        except RuntimeError as e:
            return {"skipped": str(e)}
        r = httpx.post(srv.url + "/completion", timeout=timeout_s, json={
            "prompt": list(map(int, prompt_ids)), "n_predict": n_tokens, "temperature": 0.0, "n_probs": n_top,
            "top_k": 1, "cache_prompt": False, "return_tokens": True, "ignore_eos": True})
        r.raise_for_status()
        out = r.json()
    finally:
        srv.stop()
    tokens = [int(t) for t in out["tokens"]]
    return {"tokens": tokens, "top_logprobs": aligned_top_logprobs(tokens, out["completion_probabilities"]),
            "server_argv": srv.argv}


def aligned_top_logprobs(tokens: list[int], probs: list[dict]) -> list[list[list]]:
    """llama-server's ``completion_probabilities`` as one ``[[id, logprob], ...]`` list per generated token.

    Each entry names the token it is for (``id``); the server sometimes lists one entry fewer than it
    generated, so entries are placed by that id (at the first offset where every entry's id is its
    token's), not by position. A token without an entry gets ``[]`` (nothing to compare).
    """
    tops = [[[int(t["id"]), float(t["logprob"])] for t in p["top_logprobs"]] for p in probs]
    for offset in range(len(tokens) - len(probs) + 1):
        if all(int(p["id"]) == tokens[k + offset] for k, p in enumerate(probs)):
            return [[]] * offset + tops + [[]] * (len(tokens) - len(probs) - offset)
    return (tops + [[]] * len(tokens))[:len(tokens)]  # ids do not line up: by position, as listed


def compare_greedy(ours: dict, ref: dict) -> dict:
    """How far ``ours`` (:func:`stages_greedy`) is from ``ref`` (:func:`llama_cpp_greedy` or another
    :func:`stages_greedy`): ``equal_ids`` (leading ids equal), ``of`` (ids compared), ``first_divergence``
    (step index or None) and ``max_abs_logprob_diff`` (over the top ids both list at each step before the
    first divergence; None when there is none to compare)."""
    n = min(len(ours["tokens"]), len(ref["tokens"]))
    first = next((k for k in range(n) if ours["tokens"][k] != ref["tokens"][k]), None)
    equal = n if first is None else first
    diffs = []
    for a, b in zip(ours["top_logprobs"][:equal], ref["top_logprobs"][:equal]):
        theirs = dict((i, lp) for i, lp in b)
        diffs += [abs(lp - theirs[i]) for i, lp in a if i in theirs]
    return {"equal_ids": equal, "of": n, "first_divergence": first,
            "max_abs_logprob_diff": max(diffs) if diffs else None}
