"""Split a model's layers into contiguous ranges of about equal decode cost.

Decoding one token multiplies every weight of a stage once (matrix-vector products), so a stage's cost
is roughly the number of weight elements it multiplies: its layers' tensors, plus, on the tail, the
output projection (``output.weight``, or ``token_embd`` for tied models), which for small models is
worth several layers (SmolLM2: 28M elements against 3.5M per layer). The head only gathers embedding
rows, which costs next to nothing. Balancing this cost keeps a pipeline's stages equally busy.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence

import gguf

from meshnet.contract import LayerRange
from meshnet.model.gguf_file import model_tensors, tensor_name


def layer_costs(reader: gguf.GGUFReader, n_layer: int) -> tuple[list[int], int]:
    """Weight elements per layer ``[n_layer]`` and the tail's extra (output norm and projection)."""
    costs = [0] * n_layer
    tensors = model_tensors(reader)  # the whole model's, also for a range-only file
    by_name = {t.name: t for t in tensors}
    for t in tensors:
        if t.name.startswith("blk."):
            il = int(t.name.split(".")[1])
            if 0 <= il < n_layer:
                costs[il] += int(t.n_elements)
    out = by_name.get(tensor_name(gguf.MODEL_TENSOR.OUTPUT)) or by_name.get(
        tensor_name(gguf.MODEL_TENSOR.TOKEN_EMBD))
    norm = by_name.get(tensor_name(gguf.MODEL_TENSOR.OUTPUT_NORM))
    tail = (int(out.n_elements) if out is not None else 0) + (int(norm.n_elements) if norm is not None else 0)
    return costs, tail


def pipeline_depth(costs: Sequence[int], tail_extra: int, layers: LayerRange) -> int:
    """About how many stages a pipeline has whose ranges are as costly as ``layers`` (balanced as
    :func:`balanced_split` balances them): the model's whole cost over the range's, rounded, at least 1.
    A stage that cannot see the route uses it to size its decode groups."""
    total = sum(costs) + tail_extra
    mine = sum(costs[layers.start:layers.end]) + (tail_extra if layers.end == len(costs) else 0)
    return max(1, round(total / mine)) if mine > 0 else 1


def balanced_split(costs: Sequence[int], tail_extra: int, n_stages: int) -> list[LayerRange]:
    """Contiguous half-open ranges covering ``[0, len(costs))`` that minimise the largest stage cost
    (the tail's cost includes ``tail_extra``); among equal maxima, the most even costs win.

    Raises:
        ValueError: ``n_stages`` not in ``[1, len(costs)]``.
    """
    n = len(costs)
    if not 1 <= n_stages <= n:
        raise ValueError(f"cannot split {n} layers into {n_stages} stages (need 1..{n})")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(a: int, b: int) -> int:
        return prefix[b] - prefix[a] + (tail_extra if b == n else 0)

    @lru_cache(maxsize=None)
    def best(start: int, stages: int) -> tuple[tuple[int, int], tuple[int, ...]]:
        """Best split of layers [start, n) into ``stages`` ranges: ((max, sum of squares), ends)."""
        if stages == 1:
            c = cost(start, n)
            return (c, c * c), (n,)
        found = None
        for end in range(start + 1, n - stages + 2):
            c = cost(start, end)
            (rest_max, rest_sq), ends = best(end, stages - 1)
            key = (max(c, rest_max), c * c + rest_sq)
            if found is None or key < found[0]:
                found = (key, (end,) + ends)
        assert found is not None
        return found

    ranges, start = [], 0
    for end in best(0, n_stages)[1]:
        ranges.append(LayerRange(start, end))
        start = end
    return ranges
