"""Checking a chain of ggml stages against a llama.cpp golden (../shared/golden/README.md, "What a
consumer should assert"); shared by the CPU engine's and the accelerator lanes' tests."""

from __future__ import annotations

from typing import Callable

import numpy as np

from meshnet.contract import LayerRange, split_layers
from meshnet.engine.ggml_stage import GgmlStage
from meshnet.tokenizer import GGUFTokenizer

N_GEN = 64


def cpu_stage(path, layers: LayerRange) -> GgmlStage:
    """A CPU stage as the golden checks use it: 2 threads, 512 cells of context."""
    return GgmlStage(str(path), layers, n_threads=2, n_ctx=512)


def forward(stages, sessions, position, ids, all_logits=False) -> np.ndarray:
    """Run token ``ids`` at ``position`` through the chain; the tail's logits ``[n, n_vocab]`` (last
    row only unless ``all_logits``)."""
    x = None
    tokens = np.asarray(ids, dtype=np.int32)
    for st, kv in zip(stages, sessions):
        if st.is_head:
            x = st.forward(kv, position, token_ids=tokens, all_logits=all_logits)
        else:  # a stage that picks experts by token id (DeepSeek-V4's hash-routed blocks) gets them too
            x = st.forward(kv, position, token_ids=tokens if st.needs_tokens else None, hidden=x,
                           all_logits=all_logits)
    return x


def check_greedy(prompt: dict, tolerance: dict, ids: list[int], what: str = "greedy ids") -> int:
    """Rule 3 of the golden README on free-running greedy ``ids`` (a prefix of at most 64): equal to the
    golden's ``greedy_ids`` up to its first near-tie at least, and a divergence only at a step whose
    golden margin is below ``tolerance["margin_threshold"]``. Returns how many leading ids are equal.

    Where the golden set was made with this ggml's features, callers demand more (all ids equal)."""
    n = len(ids)
    k = next((i for i, (a, b) in enumerate(zip(ids, prompt["greedy_ids"])) if a != b), n)
    assert k >= min(n, prompt["greedy_steps_before_first_near_tie"]), f"{what}: diverged at step {k}"
    if k < n:
        assert prompt["greedy_margins"][k] < tolerance["margin_threshold"], (
            f"{what}: diverged at step {k} where the golden margin is {prompt['greedy_margins'][k]}")
    return k


def assert_greedy_matches(golden: dict, prompt_index: int, ids: list[int], exact: bool) -> None:
    """``ids`` (a greedy prefix) against golden prompt ``prompt_index``: equal id for id when the golden
    set holds exactly for this ggml (``exact``), else by rule 3 (:func:`check_greedy`)."""
    p = golden["prompts"][prompt_index]
    if exact:
        assert ids == p["greedy_ids"][:len(ids)], f"prompt {prompt_index}: {ids} != golden"
    else:
        check_greedy(p, golden["tolerance"], ids, f"prompt {prompt_index}")


def check_against_golden(path, golden: dict, n_stages: int = 1,
                         make_stage: Callable[[object, LayerRange], GgmlStage] = cpu_stage,
                         n_gen: int = N_GEN) -> dict:
    """Assert the golden's checks on ``n_stages`` equal stages made by ``make_stage(path, layers)``:
    tokenizer ids, logits at the recorded positions within tolerance, top-1 where the margin is clear,
    and the first ``n_gen`` (default all 64) free-running greedy ids (equal up to the first near-tie at
    least).

    Returns:
        ``{"greedy_equal": [steps equal per prompt], "max_dev": max |logit - golden|, "record_devs":
        [max |logit - golden| per recorded top-10 position, prompt by prompt]}``.
    """
    tol = golden["tolerance"]
    stages = [make_stage(path, r) for r in split_layers(golden["gguf"]["n_layer"], n_stages)]
    tok = GGUFTokenizer.from_gguf(str(path))
    report = {"greedy_equal": [], "max_dev": 0.0, "record_devs": []}
    devs = []
    for pi, p in enumerate(golden["prompts"]):
        assert tok.encode(p["prompt"]) == p["prompt_ids"], f"prompt {pi}: token ids differ"
        ids, n = p["prompt_ids"], len(p["prompt_ids"])

        # Teacher-forced along llama.cpp's own path: prompt batch, then one decode per golden token.
        sessions = [st.new_session() for st in stages]
        rows = dict(enumerate(forward(stages, sessions, 0, ids, all_logits=True)))
        for k in range(8):
            rows[n + k] = forward(stages, sessions, n + k, [p["greedy_ids"][k]])[-1]
        for s in sessions:
            s.free()
        for rec in p["top10"]:
            got = rows[rec["position"]]
            report["record_devs"].append(max(abs(float(got[tid]) - logit) for tid, logit in rec["top10"]))
            for tid, logit in rec["top10"]:
                d = abs(float(got[tid]) - logit)
                devs.append(d)
                assert d <= tol["logit_atol"], (
                    f"prompt {pi} pos {rec['position']} id {tid}: {got[tid]} vs golden {logit}")
            margin = rec["top10"][0][1] - rec["top10"][1][1]
            if margin >= tol["margin_threshold"]:
                assert int(np.argmax(got)) == rec["top10"][0][0]
        for pos in range(n):
            if p["prompt_top1_margins"][pos] >= tol["margin_threshold"]:
                assert int(np.argmax(rows[pos])) == p["prompt_top1_ids"][pos], f"prompt {pi} pos {pos}"

        # Free-running greedy: equal until the first golden near-tie at least; a divergence may only
        # start at a step whose golden margin is below the threshold.
        sessions = [st.new_session() for st in stages]
        logits = forward(stages, sessions, 0, ids)[-1]
        out = []
        for k in range(n_gen):
            t = int(np.argmax(logits))
            out.append(t)
            if k + 1 < n_gen:
                logits = forward(stages, sessions, n + k, [t])[-1]
        for s in sessions:
            s.free()
        report["greedy_equal"].append(check_greedy(p, tol, out, f"prompt {pi}"))
    assert np.mean(devs) <= tol["logit_mean_atol"]
    report["max_dev"] = max(devs)
    for st in stages:
        st.close()
    return report


