"""Routed experts (mixture of experts) on ggml's own ops, as llama.cpp builds them.

Mirrors ``llm_graph_context::build_moe_ffn`` (src/llama-graph.cpp) for softmax gating (qwen3moe),
sigmoid gating with a selection bias and expert groups (DeepSeek-V3's layout of deepseek2), and
DeepSeek-V4's sqrt-softplus gating, hash routing (experts given per token) and clamped SwiGLU: the same ops
in the same order, so the router picks the experts llama.cpp picks and the weighted sum adds them up in
its order. Every token's routing runs inside the graph (``ggml_argsort``,
``ggml_get_rows``, ``ggml_mul_mat_id``); nothing loops over experts or tokens in Python.

Shapes are in ggml order: ``[n_embd, n_tokens]`` is n_tokens rows of n_embd floats.
"""

from __future__ import annotations

import ggml

from meshnet.model.hparams import GATING_SIGMOID, GATING_SOFTMAX, GATING_SQRT_SOFTPLUS

# build_moe_ffn clamps the sum of the routing weights from below at the smallest normal F16, so that a
# token whose k weights underflow divides by that instead of by zero.
WEIGHTS_SUM_MIN = 6.103515625e-5


def build_moe_ffn(ctx, gf, cur, gate_inp, up_exps, gate_exps, down_exps, n_expert_used: int,
                  norm_w: bool, w_scale: float, gating: int = GATING_SOFTMAX, exp_probs_b=None,
                  n_groups: int = 0, n_group_used: int = 0, selected=None, swiglu_limit: float = 0.0):
    """The routed-expert FFN of one layer with SiLU-gated experts.

    Args:
        ctx, gf: the graph's ggml context and graph (the routing weights are expanded into ``gf``
            early, and the per-expert views before their sum, as llama.cpp does).
        cur: F32 ``[n_embd, n_tokens]``, the FFN input after ``ffn_norm``.
        gate_inp: the router ``ffn_gate_inp``, ``[n_embd, n_expert]`` (F32 in Qwen3-MoE files).
        up_exps, gate_exps: ``ffn_{up,gate}_exps``, ``[n_embd, n_ff_exp, n_expert]`` in their stored
            type (Q8_0, Q4_0, ...: ``ggml_mul_mat_id`` runs the quantized kernels).
        down_exps: ``ffn_down_exps``, ``[n_ff_exp, n_embd, n_expert]``.
        n_expert_used: k, the experts each token uses.
        norm_w: renormalise the k weights to sum to 1 (Qwen3-MoE's ``norm_topk_prob``).
        w_scale: factor on the weights; 0 or 1 means none (llama.cpp skips the op then).
        gating: GATING_SOFTMAX, GATING_SIGMOID or GATING_SQRT_SOFTPLUS: router logits to scores
            (``probs``).
        exp_probs_b: F32 ``[n_expert]`` added to the scores for the selection only (DeepSeek-V3's
            ``exp_probs_b``); the weights stay the unbiased scores. None: no bias.
        n_groups, n_group_used: with ``n_groups > 1`` the experts form that many equal groups; each
            group is scored by the sum of its two best (biased) scores and only the experts of the best
            ``n_group_used`` groups can be selected.
        selected: I32 ``[k, n_tokens]`` experts chosen outside the router (DeepSeek-V4's hash-routed
            blocks: ``ffn_gate_tid2eid`` rows of the tokens); the weights are still the router's scores
            of those experts. None: top-k of the scores.
        swiglu_limit: > 1e-6 clamps the experts' SwiGLU as llama.cpp's ``ggml_swiglu_clamp`` (gate at most
            the limit, up within ±limit); 0: plain SwiGLU.
    Returns:
        F32 ``[n_embd, n_tokens]``: Σ_k w_k · down_k(SiLU(gate_k(x)) · up_k(x)), summed in the
        order of the experts' selection scores, highest first.
    """
    n_embd, n_tokens = int(cur.contents.ne[0]), int(cur.contents.ne[1])
    n_expert = int(gate_inp.contents.ne[1])
    k = n_expert_used

    logits = ggml.ggml_mul_mat(ctx, gate_inp, cur)                          # [n_expert, n_tokens]
    if gating == GATING_SIGMOID:
        probs = ggml.ggml_sigmoid(ctx, logits)                              # [n_expert, n_tokens]
    elif gating == GATING_SQRT_SOFTPLUS:
        probs = ggml.ggml_sqrt(ctx, ggml.ggml_softplus(ctx, logits))        # [n_expert, n_tokens]
    else:
        probs = ggml.ggml_soft_max(ctx, logits)                             # [n_expert, n_tokens]
    selection = probs if exp_probs_b is None else ggml.ggml_add(ctx, probs, exp_probs_b)
    if n_groups > 1 and n_tokens > 0:
        selection = _mask_groups(ctx, selection, n_expert, n_tokens, n_groups, n_group_used)
    # argsort descending, first k columns: llama.cpp's ggml_argsort_top_k (not ggml_top_k, a separate
    # op whose order of the k ids is not the probabilities' order, which the final sum depends on).
    if selected is None:
        selected = ggml.ggml_argsort_top_k(ctx, selection, k)               # I32 [k, n_tokens]
    weights = ggml.ggml_get_rows(ctx, ggml.ggml_reshape_3d(ctx, probs, 1, n_expert, n_tokens),
                                 selected)                                  # [1, k, n_tokens]
    if norm_w:
        weights = ggml.ggml_reshape_2d(ctx, weights, k, n_tokens)
        total = ggml.ggml_sum_rows(ctx, weights)                            # [1, n_tokens]
        total = ggml.ggml_clamp(ctx, total, WEIGHTS_SUM_MIN, float("inf"))
        weights = ggml.ggml_div(ctx, weights, total)                        # [k, n_tokens]
        weights = ggml.ggml_reshape_3d(ctx, weights, 1, k, n_tokens)
    if w_scale not in (0.0, 1.0):
        weights = ggml.ggml_scale(ctx, weights, w_scale)
    ggml.ggml_build_forward_expand(gf, weights)

    x = ggml.ggml_reshape_3d(ctx, cur, n_embd, 1, n_tokens)                 # one row shared by the k experts
    up = ggml.ggml_mul_mat_id(ctx, up_exps, x, selected)                    # [n_ff_exp, k, n_tokens]
    gate = ggml.ggml_mul_mat_id(ctx, gate_exps, x, selected)                # [n_ff_exp, k, n_tokens]
    act = swiglu(ctx, gate, up, swiglu_limit)
    experts = ggml.ggml_mul_mat_id(ctx, down_exps, act, selected)           # [n_embd, k, n_tokens]
    experts = ggml.ggml_mul(ctx, experts, weights)
    ggml.ggml_build_forward_expand(gf, experts)

    # One [n_embd, n_tokens] view per expert slot, all in the graph before the adds, then summed in
    # slot order.
    nb1, nb2 = experts.contents.nb[1], experts.contents.nb[2]
    views = [ggml.ggml_view_2d(ctx, experts, n_embd, n_tokens, nb2, i * nb1) for i in range(k)]
    for v in views:
        ggml.ggml_build_forward_expand(gf, v)
    out = views[0]
    for v in views[1:]:
        out = ggml.ggml_add(ctx, out, v)
        ggml.ggml_build_forward_expand(gf, out)
    if k == 1:
        out = ggml.ggml_cont(ctx, out)  # a view is not contiguous; the residual add wants a tensor
    return out


def swiglu(ctx, gate, up, limit: float = 0.0):
    """SiLU(gate) · up, F32, same shapes. With ``limit`` > 1e-6 the inputs are clamped first as in
    ggml's ``swiglu_clamp`` kernel (ops.cpp: ``gate = min(gate, limit)``, ``up = clamp(up, -limit,
    limit)``), which ggml-python 0.0.45 lacks; the SiLU then runs in ggml's vectorised swiglu rather than
    the kernel's scalar ``expf``, which may differ in the last bit."""
    if limit > 1e-6:
        gate = ggml.ggml_clamp(ctx, gate, float("-inf"), limit)
        up = ggml.ggml_clamp(ctx, up, -limit, limit)
    return ggml.ggml_swiglu_split(ctx, gate, up)


def _mask_groups(ctx, selection, n_expert: int, n_tokens: int, n_groups: int, n_group_used: int):
    """Expert-group selection of build_moe_ffn (DeepSeek-V3's ``n_group`` / ``topk_group``): F32
    ``[n_expert, n_tokens]`` scores -> the same with every expert outside the ``n_group_used`` best
    groups set to -inf. A group's score is the sum of its two best scores."""
    per = n_expert // n_groups
    groups = ggml.ggml_reshape_3d(ctx, selection, per, n_groups, n_tokens)   # [per, n_groups, n]
    top2 = ggml.ggml_argsort_top_k(ctx, groups, 2)                          # I32 [2, n_groups, n]
    top2 = ggml.ggml_get_rows(ctx, ggml.ggml_reshape_4d(ctx, groups, 1, per, n_groups, n_tokens),
                              top2)                                         # [1, 2, n_groups, n]
    scores = ggml.ggml_sum_rows(ctx, ggml.ggml_reshape_3d(ctx, top2, 2, n_groups, n_tokens))  # [1, n_groups, n]
    scores = ggml.ggml_reshape_2d(ctx, scores, n_groups, n_tokens)
    keep = ggml.ggml_argsort_top_k(ctx, scores, n_group_used)               # I32 [n_group_used, n]
    kept = ggml.ggml_get_rows(ctx, groups, keep)                            # [per, n_group_used, n]
    masked = ggml.ggml_set_rows(ctx, ggml.ggml_fill(ctx, groups, float("-inf")), kept, keep)
    return ggml.ggml_reshape_2d(ctx, masked, n_expert, n_tokens)


def moe_graph_nodes(n_expert_used: int) -> int:
    """Graph nodes (tensors) one MoE FFN adds, with room to spare: the routing (expert groups and a
    shared expert included) and the three expert mat-muls take about 40, and each used expert a view
    and an add."""
    return 48 + 2 * n_expert_used
