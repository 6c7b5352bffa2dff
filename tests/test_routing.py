"""Route planning over plain NodeRecords: chains, replicas, load, exclusion and the NoRoute messages."""

from __future__ import annotations

import itertools

import pytest

from meshnet.contract import LayerRange
from meshnet.tracker.routing import (
    DEFAULT_LAYERS_PER_S,
    HOP_OVERHEAD_S,
    RELAY_OVERHEAD_S,
    NodeRecord,
    NoRoute,
    hop_cost,
    missing_layers,
    plan_route,
)

SHA = "a" * 64
OTHER = "b" * 64


def node(node_id: str, start: int, end: int, n_layer: int = 30, sha: str = SHA, **kw) -> NodeRecord:
    return NodeRecord(node_id=node_id, address=f"10.0.0.1:{7000 + len(node_id)}", model_sha256=sha,
                      architecture="llama", n_layer=n_layer, layers=LayerRange(start, end), **kw)


def ids(route) -> list[str]:
    return [n.node_id for n in route]


def test_single_node_covering_all_layers():
    n = node("solo", 0, 30)
    assert plan_route([n], SHA) == (n,)


def test_three_stage_chain_in_layer_order():
    nodes = [node("c", 20, 30), node("a", 0, 10), node("b", 10, 20)]
    route = plan_route(nodes, SHA)
    assert ids(route) == ["a", "b", "c"]
    assert [(h.layers.start, h.layers.end) for h in route] == [(0, 10), (10, 20), (20, 30)]


def test_replica_chosen_by_speed():
    nodes = [node("a", 0, 10), node("slow", 10, 20, decode_tokens_per_s=20.0),
             node("fast", 10, 20, decode_tokens_per_s=80.0), node("c", 20, 30)]
    assert ids(plan_route(nodes, SHA)) == ["a", "fast", "c"]


def test_replica_chosen_by_load():
    nodes = [node("a", 0, 10), node("busy", 10, 20, active_sessions=12, max_sessions=16),
             node("idle", 10, 20, active_sessions=1, max_sessions=16), node("c", 20, 30)]
    assert ids(plan_route(nodes, SHA)) == ["a", "idle", "c"]


def test_excluded_node_forces_the_replica():
    nodes = [node("a", 0, 10), node("b1", 10, 20, decode_tokens_per_s=90.0),
             node("b2", 10, 20, decode_tokens_per_s=10.0), node("c", 20, 30)]
    assert ids(plan_route(nodes, SHA)) == ["a", "b1", "c"]
    assert ids(plan_route(nodes, SHA, exclude={"b1"})) == ["a", "b2", "c"]


def test_node_at_its_session_limit_is_avoided_while_an_alternative_exists():
    # "full" is ten times faster, but at its limit it would refuse the session.
    full = node("full", 0, 30, decode_tokens_per_s=100.0, active_sessions=4, max_sessions=4)
    chain = [node("a", 0, 15, decode_tokens_per_s=10.0), node("b", 15, 30, decode_tokens_per_s=10.0)]
    assert ids(plan_route([full, *chain], SHA)) == ["a", "b"]
    # With no alternative the saturated node is still used (it may free a slot before the call lands).
    assert ids(plan_route([full], SHA)) == ["full"]
    assert ids(plan_route([full, *chain], SHA, exclude={"b"})) == ["full"]


def test_fewer_hops_win_when_speeds_are_unknown():
    # Same compute either way, so the per-hop overhead decides.
    one = node("one", 0, 30)
    two = [node("x", 0, 15), node("y", 15, 30)]
    assert ids(plan_route([*two, one], SHA)) == ["one"]


def test_missing_layers_are_named_exactly():
    nodes = [node("a", 0, 10), node("c", 20, 30)]
    with pytest.raises(NoRoute) as ei:
        plan_route(nodes, SHA)
    assert ei.value.missing == (LayerRange(10, 20),)
    assert "no node serves layers [10, 20)" in ei.value.message
    assert ei.value.message.startswith("no complete route for model aaaaaaaaaaaa…")
    assert missing_layers(nodes, SHA, 30) == (LayerRange(10, 20),)


def test_several_missing_spans_and_exclusion_named():
    nodes = [node("a", 0, 5), node("b", 5, 10), node("d", 12, 28)]
    with pytest.raises(NoRoute) as ei:
        plan_route(nodes, SHA, exclude={"b"})
    assert ei.value.missing == (LayerRange(5, 12), LayerRange(28, 30))
    assert "no node serves layers [5, 12), [28, 30) (excluded: b)" in ei.value.message
    assert missing_layers(nodes, SHA, 30, exclude={"b"}) == (LayerRange(5, 12), LayerRange(28, 30))
    assert missing_layers(nodes, SHA, 30) == (LayerRange(10, 12), LayerRange(28, 30))


def test_all_layers_covered_but_ranges_do_not_chain():
    nodes = [node("a", 0, 15), node("b", 10, 30)]
    assert missing_layers(nodes, SHA, 30) == ()
    with pytest.raises(NoRoute) as ei:
        plan_route(nodes, SHA)
    assert ei.value.missing == ()
    msg = ei.value.message
    assert "every layer of [0, 30) is served but the node ranges do not chain" in msg
    assert "stop at layer(s) 15" in msg
    assert "[0, 15) a" in msg and "[10, 30) b" in msg


def test_other_models_nodes_are_ignored():
    nodes = [node("mine-a", 0, 10), node("theirs", 10, 30, sha=OTHER), node("mine-b", 10, 30)]
    assert ids(plan_route(nodes, SHA)) == ["mine-a", "mine-b"]
    with pytest.raises(NoRoute) as ei:
        plan_route([node("theirs", 0, 30, sha=OTHER)], SHA)
    assert "no registered node serves this model" in ei.value.message
    assert missing_layers([node("theirs", 0, 30, sha=OTHER)], SHA, 30) == (LayerRange(0, 30),)


def test_tie_break_by_node_id_is_independent_of_input_order():
    nodes = [node("a", 0, 10), node("r2", 10, 20), node("r1", 10, 20), node("r3", 10, 20), node("c", 20, 30)]
    for perm in itertools.permutations(nodes):
        assert ids(plan_route(list(perm), SHA)) == ["a", "r1", "c"]


def test_hop_cost_model_values():
    # Known speed: 1 / tokens-per-second for the node's whole range, plus the per-hop overhead.
    assert hop_cost(node("k", 0, 10, decode_tokens_per_s=50.0)) == pytest.approx(HOP_OVERHEAD_S + 0.02)
    # Unknown speed: the neutral per-layer default.
    assert hop_cost(node("u", 0, 30)) == pytest.approx(HOP_OVERHEAD_S + 30 / DEFAULT_LAYERS_PER_S)
    # Half the session slots taken: compute estimate x1.5.
    assert hop_cost(node("h", 0, 10, decode_tokens_per_s=50.0, active_sessions=8, max_sessions=16)) == \
        pytest.approx(HOP_OVERHEAD_S + 0.03)
    assert hop_cost(node("r", 0, 10, decode_tokens_per_s=50.0, relayed=True)) == \
        pytest.approx(HOP_OVERHEAD_S + RELAY_OVERHEAD_S + 0.02)


def test_relayed_hop_loses_to_an_equal_direct_replica():
    nodes = [node("a-relayed", 0, 30, relayed=True), node("z-direct", 0, 30)]
    assert ids(plan_route(nodes, SHA)) == ["z-direct"]


def test_a_spare_holding_a_smaller_context_is_routed_only_when_no_larger_chain_is_left():
    """An idle spare of 128 tokens beside a busy node of 512: sessions keep the 512-token chain (the idle
    spare took them, and the API's context shrank to 128), and the spare serves once the other is gone."""
    head, busy, spare = node("head", 0, 10, n_ctx=512), node("busy", 10, 30, n_ctx=512, active_sessions=15), \
        node("spare", 10, 30, n_ctx=128)
    assert ids(plan_route([head, busy, spare], SHA)) == ["head", "busy"]
    assert ids(plan_route([head, busy, spare], SHA, exclude={"busy"})) == ["head", "spare"]
    # A node that did not say its context fits any, and ties fall back to the cost model.
    legacy = node("legacy", 10, 30)
    assert ids(plan_route([head, busy, legacy], SHA)) == ["head", "legacy"]
    # The widest chain may need a longer path: two 512-token nodes beat one 128-token node's shortcut.
    a, b, wide_tail = node("a", 0, 10, n_ctx=512), node("b", 10, 20, n_ctx=512), node("wt", 20, 30, n_ctx=512)
    short = node("short", 10, 30, n_ctx=128, decode_tokens_per_s=1000.0)
    assert ids(plan_route([a, b, wide_tail, short], SHA)) == ["a", "b", "wt"]


def test_a_session_needing_more_context_than_a_node_holds_is_never_routed_through_it():
    head, spare = node("head", 0, 10, n_ctx=512), node("spare", 10, 30, n_ctx=128)
    assert ids(plan_route([head, spare], SHA, min_n_ctx=128)) == ["head", "spare"]
    with pytest.raises(NoRoute) as e:
        plan_route([head, spare], SHA, min_n_ctx=300)
    assert e.value.missing == (LayerRange(10, 30),)
    assert e.value.message.endswith("no node serves layers [10, 30) (holding fewer than 300 tokens a session: "
                                    "spare (128))")


AVX2, AVX512 = "ggml cpu [AVX2] threads=2 repacked", "ggml cpu [AVX512] threads=2 repacked"


def test_a_failover_prefers_the_spare_that_computes_as_the_failed_node_over_a_faster_one():
    """The route a failover replaces ran [10, 20) on AVX2 kernels: the slow AVX2 spare rebuilds its KV
    cache bit for bit and is taken ahead of the fast AVX-512 one, which is taken without the preference."""
    nodes = [node("a", 0, 10, numerics=AVX2), node("fast512", 10, 20, numerics=AVX512, decode_tokens_per_s=90.0),
             node("slow2", 10, 20, numerics=AVX2, decode_tokens_per_s=10.0), node("c", 20, 30, numerics=AVX2)]
    like = [(LayerRange(0, 10), AVX2), (LayerRange(10, 20), AVX2), (LayerRange(20, 30), AVX2)]
    assert ids(plan_route(nodes, SHA, exclude={"dead"})) == ["a", "fast512", "c"]
    assert ids(plan_route(nodes, SHA, exclude={"dead"}, like=like)) == ["a", "slow2", "c"]
    # Where no spare computes alike, the cheapest serves (the output then continues within tolerance).
    assert ids(plan_route([n for n in nodes if n.node_id != "slow2"], SHA, like=like)) == ["a", "fast512", "c"]


def test_numerics_yield_to_saturation_and_unknown_keys_ask_for_nothing():
    full = node("full2", 10, 20, numerics=AVX2, active_sessions=16, max_sessions=16)
    other = node("free512", 10, 20, numerics=AVX512)
    ends = [node("a", 0, 10, numerics=AVX2), node("c", 20, 30, numerics=AVX2)]
    like = [(LayerRange(10, 20), AVX2)]
    # A saturated node would refuse the replay: a spare computing otherwise is better than none.
    assert ids(plan_route([*ends, full, other], SHA, like=like)) == ["a", "free512", "c"]
    # A replaced hop whose key was not said prefers nothing; a node that says none is unlike a known key.
    fast, slow = node("fast", 10, 20, numerics=AVX512, decode_tokens_per_s=90.0), node("slow", 10, 20, numerics=AVX2)
    assert ids(plan_route([*ends, fast, slow], SHA, like=[(LayerRange(10, 20), "")])) == ["a", "fast", "c"]
    silent = node("silent", 10, 20, decode_tokens_per_s=90.0)
    assert ids(plan_route([*ends, silent, slow], SHA, like=like)) == ["a", "slow", "c"]


def test_numerics_are_matched_over_the_layers_a_replacement_shares_with_the_replaced_hop():
    """A replacement range spanning two replaced hops must compute as both; the split that does wins."""
    like = [(LayerRange(0, 15), AVX2), (LayerRange(15, 30), AVX512)]
    whole = node("whole512", 0, 30, numerics=AVX512, decode_tokens_per_s=500.0)
    split = [node("h2", 0, 15, numerics=AVX2), node("t512", 15, 30, numerics=AVX512)]
    assert ids(plan_route([whole, *split], SHA)) == ["whole512"]
    assert ids(plan_route([whole, *split], SHA, like=like)) == ["h2", "t512"]


def test_a_node_clients_excluded_lately_is_taken_only_where_no_chain_avoids_it():
    """A node the tracker reaches but clients do not (NAT without --relay) measured fastest and was handed to
    every new client, each of which waited for it before routing around it. Nodes in ``avoid`` (excluded by
    clients' route requests lately) now come after saturation and numerics, before speed."""
    ends = [node("a", 0, 10), node("c", 20, 30)]
    nat = node("nat", 10, 20, decode_tokens_per_s=166.8)
    lan = node("lan", 10, 20, decode_tokens_per_s=146.1)
    assert ids(plan_route([*ends, nat, lan], SHA)) == ["a", "nat", "c"]
    assert ids(plan_route([*ends, nat, lan], SHA, avoid={"nat"})) == ["a", "lan", "c"]
    assert ids(plan_route([*ends, nat], SHA, avoid={"nat"})) == ["a", "nat", "c"]  # the only way: taken
    full = node("lan", 10, 20, active_sessions=16, max_sessions=16)
    assert ids(plan_route([*ends, nat, full], SHA, avoid={"nat"})) == ["a", "nat", "c"]  # saturation first
    like = [(LayerRange(10, 20), AVX2)]
    same, other = node("nat", 10, 20, numerics=AVX2), node("lan", 10, 20, numerics=AVX512)
    assert ids(plan_route([*ends, same, other], SHA, like=like, avoid={"nat"})) == ["a", "nat", "c"]  # numerics too
