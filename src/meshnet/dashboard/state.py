"""The dashboard's state as plain data: pure functions over what the tracker knows, so that the layer map
(coverage, replicas, gaps) is computed and tested without a server or a browser.

Inputs are the tracker's own plain forms: the nodes as ``meshnet nodes --json`` prints them
(:func:`meshnet.membership.cli.nodes_dict`), the ledger as ``meshnet ledger --json`` does
(:func:`meshnet.ledger.cli.ledger_dict`) and the clients' activity
(:meth:`meshnet.tracker.activity.ActivityBoard.snapshot`).
"""

from __future__ import annotations

import statistics

# A node whose last heartbeat is older than this many intervals has missed one: the map stops counting
# it as covering its layers at once, before the tracker drops it (at three intervals).
LATE_HEARTBEATS = 2.0


def layer_coverage(n_layer: int, ranges: list[tuple[str, int, int]]) -> list[dict]:
    """Split ``[0, n_layer)`` into maximal runs of layers covered by the same nodes.

    Args:
        n_layer: layers in the model (>= 1).
        ranges: ``(node_id, start, end)`` half-open layer ranges; parts outside ``[0, n_layer)`` are ignored.

    Returns:
        ``[{"start", "end", "nodes": [node ids, sorted]}, ...]``: consecutive, together exactly
        ``[0, n_layer)``; a run no node covers (a gap) has ``"nodes": []``; ``len(nodes)`` is the run's
        replica count.

    Raises:
        ValueError: ``n_layer`` < 1.
    """
    if n_layer < 1:
        raise ValueError(f"n_layer must be >= 1, got {n_layer}")
    cuts = sorted({0, n_layer} | {min(max(x, 0), n_layer) for _, s, e in ranges for x in (s, e)})
    runs: list[dict] = []
    for a, b in zip(cuts, cuts[1:]):
        nodes = sorted({nid for nid, s, e in ranges if s <= a and e >= b})
        if runs and runs[-1]["nodes"] == nodes:
            runs[-1]["end"] = b
        else:
            runs.append({"start": a, "end": b, "nodes": nodes})
    return runs


def is_late(node: dict, heartbeat_interval_s: float) -> bool:
    """Whether ``node`` (a :func:`nodes_dict` entry) has missed a heartbeat (see :data:`LATE_HEARTBEATS`)."""
    return node["last_heartbeat_age_s"] > LATE_HEARTBEATS * heartbeat_interval_s


def layer_maps(nodes: list[dict], heartbeat_interval_s: float) -> list[dict]:
    """One layer map per model served, by model sha256.

    Args:
        nodes: :func:`~meshnet.membership.cli.nodes_dict` entries (``node_id``, ``layers``, ``n_layer``,
            ``model_sha256``, ``last_heartbeat_age_s`` are read).
        heartbeat_interval_s: the tracker's heartbeat interval, seconds; a late node covers nothing.

    Returns:
        ``[{"model_sha256", "n_layer", "runs": layer_coverage(...), "gaps": [[start, end], ...],
        "complete": bool, "min_replicas": int}]`` sorted by model.
    """
    out = []
    for model in sorted({n["model_sha256"] for n in nodes}):
        served = [n for n in nodes if n["model_sha256"] == model]
        n_layer = max(n["n_layer"] for n in served)
        runs = layer_coverage(n_layer, [(n["node_id"], *n["layers"]) for n in served
                                        if not is_late(n, heartbeat_interval_s)])
        gaps = [[r["start"], r["end"]] for r in runs if not r["nodes"]]
        out.append({"model_sha256": model, "n_layer": n_layer, "runs": runs, "gaps": gaps, "complete": not gaps,
                    "min_replicas": min(len(r["nodes"]) for r in runs)})
    return out


def dashboard_state(nodes: dict, activity: dict, ledger: dict, tracker: dict) -> dict:
    """Everything the page shows, as one JSON-ready object (what ``GET /api/state`` answers).

    Args:
        nodes: ``{"nodes": [...]}`` as :func:`~meshnet.membership.cli.nodes_dict` returns it.
        activity: :meth:`~meshnet.tracker.activity.ActivityBoard.snapshot`.
        ledger: ``{"nodes": [...], "clients": [...]}`` as :func:`~meshnet.ledger.cli.ledger_dict` returns it.
        tracker: ``{"version", "heartbeat_interval_s", "ttl_s", "time"}`` (seconds; ``time`` Unix).

    Returns:
        ``{"tracker", "nodes" (each with "late": bool), "maps": layer_maps(...), "sessions", "clients",
        "throughput": {"tokens_per_s", "series"}, "ttft": {"last_s", "median_s", "count", "series"},
        "ledger"}``; TTFT figures in seconds (None when no session has had its first token).
    """
    interval = tracker["heartbeat_interval_s"]
    listed = [{**n, "late": is_late(n, interval)} for n in nodes["nodes"]]
    ttft = [v for _, v in activity["ttft_series"]]
    return {"tracker": tracker, "nodes": listed, "maps": layer_maps(listed, interval),
            "sessions": activity["sessions"], "clients": activity["clients"],
            "throughput": {"tokens_per_s": activity["tokens_per_s"], "series": activity["tokens_series"]},
            "ttft": {"last_s": ttft[-1] if ttft else None,
                     "median_s": statistics.median(ttft) if ttft else None, "count": len(ttft),
                     "series": activity["ttft_series"]},
            "ledger": ledger}
