"""Cost-balanced layer splits, as plain data and on the bundled model."""

from __future__ import annotations

import pytest

from meshnet.contract import LayerRange
from meshnet.layer_split import balanced_split, layer_costs, pipeline_depth
from meshnet.model.gguf_file import open_gguf


def spans(ranges):
    return [(r.start, r.end) for r in ranges]


def test_equal_layers_without_tail_cost_split_evenly():
    assert spans(balanced_split([1] * 30, 0, 3)) == [(0, 10), (10, 20), (20, 30)]


def test_tail_cost_moves_layers_to_the_head():
    # The output projection is worth 8 layers: 38 units over 2 stages -> 19 / 11 + 8.
    assert spans(balanced_split([1] * 30, 8, 2)) == [(0, 19), (19, 30)]


def test_minimises_the_largest_stage():
    costs = [5, 1, 1, 1, 1, 5]
    ranges = balanced_split(costs, 0, 3)
    worst = max(sum(costs[r.start:r.end]) for r in ranges)
    assert worst == 5 and spans(ranges)[0] == (0, 1) and spans(ranges)[-1] == (5, 6)


def test_one_stage_and_bad_counts():
    assert balanced_split([3, 4], 9, 1) == [LayerRange(0, 2)]
    with pytest.raises(ValueError, match="cannot split 2 layers into 3 stages"):
        balanced_split([3, 4], 0, 3)


def test_smollm2_costs_and_split(smollm2_path):
    costs, tail = layer_costs(open_gguf(smollm2_path), 30)
    # Per layer: q 576x576, k/v 576x192, o 576x576, gate/up/down 576x1536, two norms of 576.
    assert costs == [576 * 576 * 2 + 576 * 192 * 2 + 576 * 1536 * 3 + 576 * 2] * 30
    assert tail == 49152 * 576 + 576  # tied: token_embd projects, plus output_norm
    assert spans(balanced_split(costs, tail, 3)) == [(0, 12), (12, 25), (25, 30)]


@pytest.mark.parametrize("n_stages", [1, 2, 3, 4])
def test_each_balanced_range_estimates_the_pipeline_depth(n_stages):
    # 24 layers of cost 10 and a tail worth 4 layers: the tail's range is short but as costly as the others
    costs, tail = [10] * 24, 40
    ranges = balanced_split(costs, tail, n_stages)
    assert [pipeline_depth(costs, tail, r) for r in ranges] == [n_stages] * n_stages


def test_the_bundled_models_three_stages_each_estimate_three(smollm2_path):
    from meshnet.model.gguf_file import open_gguf

    costs, tail = layer_costs(open_gguf(str(smollm2_path)), 30)
    ranges = balanced_split(costs, tail, 3)
    assert [str(r) for r in ranges] == ["0:12", "12:25", "25:30"]
    assert [pipeline_depth(costs, tail, r) for r in ranges] == [3, 3, 3]
