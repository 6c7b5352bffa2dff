"""``meshnet bench wan``'s figures, pure: the latency model beside each measurement, the legs fitted from
the measurements, the ratios the goals speak of, greedy identity across modes, and the printed table.

The measured result is plain data::

    {"stages": 3, "rtt_ms": [0, 25], "prompts": {"repetitive": {"tokens": 93}, ...},
     "modes": {"client-orchestrated": {"rtts": {"25": {"repetitive": {"decode_tokens_per_s": 31.2,
                "ttft_s": 0.21, "ids": [...]}, ...}}},
               "node-to-node": {"skipped": "why"}, ...}}

RTT keys are :func:`rtt_key` strings ("0", "12.5"); figures are tokens/s and seconds.
"""

from __future__ import annotations

from meshnet.bench.wan_model import CLIENT, FORWARDING, LLAMA_RPC, MESHNET_MODES, NGRAM, decode_legs, \
    fitted_legs, predict, ttft_legs

# The issue's goals (same run, ratios): node-to-node over client-orchestrated decode at an RTT (ms);
# n-gram speculation over node-to-node on the repetitive prompt.
GOAL_FORWARDING_VS_CLIENT = {25.0: 1.3, 50.0: 1.4}
GOAL_NGRAM_VS_FORWARDING = 2.0


def rtt_key(rtt_ms: float) -> str:
    return f"{rtt_ms:g}"


def analyze(result: dict) -> dict:
    """Add to ``result`` (in place, and return it): for each measured figure its ``model`` (from the
    same mode and prompt at RTT 0: None when RTT 0 was not measured), ``legs`` and ``ttft_legs``; per mode
    and prompt ``fitted_legs`` and ``fitted_ttft_legs`` (the slopes of seconds per token and of TTFT
    against the one-way delay); ``ids_match`` for meshnet
    modes (greedy ids equal to client-orchestrated's at the first RTT); and ``ratios``."""
    stages = result["stages"]
    base_key = rtt_key(0.0)
    ref = result["modes"].get(CLIENT, {}).get("rtts", {}).get(rtt_key(result["rtt_ms"][0]), {})
    for mode, entry in result["modes"].items():
        if "rtts" not in entry:
            continue
        legs, t_legs = decode_legs(mode, stages), ttft_legs(mode, stages)
        entry["legs"], entry["ttft_legs"] = legs, t_legs
        entry["fitted_legs"], entry["fitted_ttft_legs"] = {}, {}
        for prompt in result["prompts"]:
            points, ttft_points = [], []
            for key, by_prompt in entry["rtts"].items():
                fig = by_prompt.get(prompt)
                if fig is None:
                    continue
                points.append((float(key), 1.0 / fig["decode_tokens_per_s"]))
                ttft_points.append((float(key), fig["ttft_s"]))
                base = entry["rtts"].get(base_key, {}).get(prompt)
                fig["model"] = None
                if base is not None:
                    # A speculative client may report the tokens its rounds carried (1 without drafts).
                    p = predict(float(key), legs, t_legs, base["decode_tokens_per_s"], base["ttft_s"],
                                fig.get("tokens_per_round", 1.0))
                    fig["model"] = {"decode_tokens_per_s": round(p.tokens_per_s, 2), "ttft_s": round(p.ttft_s, 4)}
                if mode in MESHNET_MODES and "ids" in fig and prompt in ref:
                    fig["ids_match"] = fig["ids"] == ref[prompt]["ids"]
            for name, pts in (("fitted_legs", points), ("fitted_ttft_legs", ttft_points)):
                fitted = fitted_legs(pts)
                entry[name][prompt] = None if fitted is None else round(fitted, 2)
    result["ratios"] = ratios(result)
    return result


def _decode(result: dict, mode: str, key: str, prompt: str) -> float | None:
    fig = result["modes"].get(mode, {}).get("rtts", {}).get(key, {}).get(prompt)
    return None if fig is None else fig["decode_tokens_per_s"]


def ratios(result: dict) -> dict:
    """Per RTT key and prompt: decode ratios ``node-to-node/client-orchestrated``,
    ``ngram/node-to-node`` and ``meshnet-best/llama.cpp-rpc`` (None where a side was not measured)."""
    out: dict[str, dict] = {}
    for rtt in result["rtt_ms"]:
        key = rtt_key(rtt)
        out[key] = {}
        for prompt in result["prompts"]:
            fig = {m: _decode(result, m, key, prompt) for m in (CLIENT, FORWARDING, NGRAM, LLAMA_RPC)}
            best = max((fig[m] for m in MESHNET_MODES if fig[m]), default=None)
            out[key][prompt] = {
                "node-to-node/client-orchestrated": _ratio(fig[FORWARDING], fig[CLIENT]),
                "ngram/node-to-node": _ratio(fig[NGRAM], fig[FORWARDING]),
                "meshnet-best/llama.cpp-rpc": _ratio(best, fig[LLAMA_RPC]),
            }
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_table(result: dict) -> str:
    """The printed table: one row per RTT, mode and prompt, the latency model's figure in parentheses
    beside each measured one; skipped modes and the goal ratios after it."""
    head = (f"{'RTT ms':>6}  {'mode':<20} {'prompt':<10} {'decode tok/s':>12} {'(model)':>9} "
            f"{'TTFT ms':>8} {'(model)':>9} {'legs':>5} {'same ids':>8}")
    lines = [head, "-" * len(head)]
    for rtt in result["rtt_ms"]:
        key = rtt_key(rtt)
        for mode, entry in result["modes"].items():
            for prompt in result["prompts"]:
                fig = entry.get("rtts", {}).get(key, {}).get(prompt)
                if fig is None:
                    continue
                model = fig.get("model") or {}
                ttft_model = model.get("ttft_s")
                same = {True: "yes", False: "NO"}.get(fig.get("ids_match"), "-")
                lines.append(
                    f"{key:>6}  {mode:<20} {prompt:<10} {fig['decode_tokens_per_s']:>12.1f} "
                    f"{'(' + _cell(model.get('decode_tokens_per_s'), '.1f') + ')':>9} "
                    f"{fig['ttft_s'] * 1000:>8.0f} "
                    f"{'(' + _cell(None if ttft_model is None else ttft_model * 1000, '.0f') + ')':>9} "
                    f"{str(entry['legs']) + '/' + str(entry['ttft_legs']):>5} {same:>8}")
    for mode, entry in result["modes"].items():
        if "skipped" in entry:
            lines.append(f"{mode}: skipped: {entry['skipped']}")
        elif entry.get("fitted_legs"):
            fitted = ", ".join(f"{p} {_cell(v, '.1f')} / {_cell(entry['fitted_ttft_legs'][p], '.1f')}"
                               for p, v in entry["fitted_legs"].items())
            lines.append(f"{mode}: legs fitted from the RTTs, per token / before the first: {fitted} "
                         f"(model: {entry['legs']} / {entry['ttft_legs']})")
    for key, by_prompt in result.get("ratios", {}).items():
        for prompt, r in by_prompt.items():
            parts = [f"{name} {v:.2f}" for name, v in r.items() if v is not None]
            goal = GOAL_FORWARDING_VS_CLIENT.get(float(key))
            if goal is not None and r["node-to-node/client-orchestrated"] is not None:
                parts.append(f"(goal node-to-node >= {goal}x)")
            if prompt == "repetitive" and r["ngram/node-to-node"] is not None:
                parts.append(f"(goal ngram >= {GOAL_NGRAM_VS_FORWARDING}x)")
            if parts:
                lines.append(f"RTT {key} ms, {prompt}: " + ", ".join(parts))
    lines.append("legs: one-way link crossings per decode token / before the first token; "
                 "model: compute at RTT 0 + legs x RTT/2")
    return "\n".join(lines)
