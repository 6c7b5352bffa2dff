"""The WAN benchmark's plan and latency model, pure: which modes exist, how many one-way network legs a
token costs in each, what the model predicts from a compute time and a delay, and how llama.cpp's RPC
split is told to hold the same layer ranges as the mesh.

Latency model: a token costs its compute (measured with every link at RTT 0, which includes the
emulator's own per-hop cost) plus ``legs x one-way delay``. A *leg* is one message crossing one link
one way; messages that leave back to back on one connection share a leg.

- ``client-orchestrated``: the client sends the step to hop 0, takes its hidden states back, sends them
  to hop 1, ...: 2 legs per stage, ``2S``.
- ``node-to-node`` (+ ``ngram``): the client sends token ids to the head, each stage sends its output
  to the next, the tail answers the client: ``S + 1``. With speculation the legs are paid once per
  verification round, which carries ``tokens_per_round`` tokens (1 without drafts).
- ``llama.cpp-rpc``: ``2S``, derived from llama.cpp's RPC backend (ggml-rpc.cpp) and its graph scheduler
  (ggml-backend.cpp, ``ggml_backend_sched_compute_splits``): the token's graph is cut into one split per
  device; the client sends each RPC split its inputs and a GRAPH_COMPUTE without waiting (both are
  async sends, no reply), but the next split's input is a tensor on another server, and the RPC backend
  has no cross-server copy (``cpy_tensor_async`` is NULL; ``buffer_cpy_tensor`` only copies within one
  server), so the scheduler falls back to ``ggml_backend_tensor_copy``: a blocking GET_TENSOR from the
  previous server (its reply waits for that server's compute) and a SET_TENSOR to the next. The logits
  come back the same way from the last server. Per stage: client -> server, server -> client.

TTFT adds, for meshnet's client, one round trip to the tracker for the session's route (2 legs) before
the prefill step; llama-bench's prompt test is one ``llama_decode``: ``2S`` legs.
"""

from __future__ import annotations

from dataclasses import dataclass

CLIENT = "client-orchestrated"
FORWARDING = "node-to-node"
NGRAM = "node-to-node+ngram"
LLAMA_RPC = "llama.cpp-rpc"
MODES = (CLIENT, FORWARDING, NGRAM, LLAMA_RPC)
MESHNET_MODES = (CLIENT, FORWARDING, NGRAM)
ROUTE_LEGS = 2  # the client's GetRoute to the tracker, once per session


def parse_rtts(text: str) -> list[float]:
    """``"0,10,25,50"`` -> ``[0.0, 10.0, 25.0, 50.0]`` (milliseconds, in the given order).

    Raises ValueError: empty, not a number, negative, or repeated (the message names no flag: ``meshnet
    bench wan --rtt-ms`` puts it after the flag's name)."""
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated milliseconds, e.g. 0,10,25,50, got {text!r}") from None
    if any(v != v or v in (float("inf"), -float("inf")) for v in values):
        raise ValueError(f"an RTT must be a finite number of milliseconds: {text!r}")
    if not values:
        raise ValueError(f"expected at least one RTT in milliseconds, e.g. 0,10,25,50, got {text!r}")
    if any(v < 0 for v in values):
        raise ValueError(f"an RTT cannot be negative: {text!r}")
    if len(set(values)) != len(values):
        raise ValueError(f"an RTT is listed twice: {text!r}")
    return values


def parse_modes(text: str) -> list[str]:
    """``"client-orchestrated,llama.cpp-rpc"`` -> the modes, in :data:`MODES` order.

    Raises ValueError naming an unknown mode, or when none is given (naming no flag, as :func:`parse_rtts`)."""
    wanted = {part.strip() for part in text.split(",") if part.strip()}
    unknown = wanted - set(MODES)
    if unknown:
        raise ValueError(f"unknown mode(s) {sorted(unknown)}; choose from {', '.join(MODES)}")
    if not wanted:
        raise ValueError(f"expected at least one mode of {', '.join(MODES)}, got {text!r}")
    return [m for m in MODES if m in wanted]


def client_options(mode: str) -> dict:
    """The MeshClient keyword arguments that select ``mode``. (n-gram speculation is the generation
    loop's, ``Generation(speculation=)``, on top of node-to-node forwarding.) Raises ValueError."""
    if mode not in (CLIENT, FORWARDING, NGRAM):
        raise ValueError(f"{mode!r} is not a meshnet client mode")
    return {"forwarding": mode != CLIENT}


def decode_legs(mode: str, stages: int) -> int:
    """One-way legs a decode round costs in ``mode`` through ``stages`` stages (see the module doc)."""
    if stages < 1:
        raise ValueError(f"stages must be >= 1, not {stages}")
    if mode in (CLIENT, LLAMA_RPC):
        return 2 * stages
    if mode in (FORWARDING, NGRAM):
        return stages + 1
    raise ValueError(f"unknown mode {mode!r}")


def ttft_legs(mode: str, stages: int) -> int:
    """One-way legs before the first token: the prefill's legs, plus the route's for meshnet's client."""
    return decode_legs(mode, stages) + (0 if mode == LLAMA_RPC else ROUTE_LEGS)


@dataclass(frozen=True)
class Prediction:
    """The latency model's figures for one RTT: ``tokens_per_s`` (decode), ``ttft_s`` (seconds)."""

    tokens_per_s: float
    ttft_s: float


def predict(rtt_ms: float, legs: int, ttft_legs_: int, base_tokens_per_s: float, base_ttft_s: float,
            tokens_per_round: float = 1.0) -> Prediction:
    """Decode tokens/s and TTFT at ``rtt_ms`` from those measured at RTT 0 (``base_*``): per token,
    ``1/base_tokens_per_s + legs * rtt/2 / tokens_per_round``; TTFT ``base_ttft_s + ttft_legs_ * rtt/2``.

    Raises ValueError for a non-positive base rate or ``tokens_per_round``."""
    if base_tokens_per_s <= 0 or tokens_per_round <= 0:
        raise ValueError("the base rate and tokens per round must be positive")
    one_way_s = rtt_ms / 2000.0
    per_token_s = 1.0 / base_tokens_per_s + legs * one_way_s / tokens_per_round
    return Prediction(1.0 / per_token_s, base_ttft_s + ttft_legs_ * one_way_s)


def fitted_legs(points: list[tuple[float, float]]) -> float | None:
    """Legs measured: the least-squares slope of seconds against the one-way delay, from ``(rtt_ms,
    seconds)`` points (seconds per token, or TTFTs); None with fewer than two distinct RTTs."""
    xs = [rtt / 2000.0 for rtt, _ in points]
    ys = [seconds for _, seconds in points]
    if len(set(xs)) < 2:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def tensor_split(ranges: list[tuple[int, int]], n_layer: int) -> str:
    """llama.cpp's ``-ts`` value that puts layers ``[start, end)`` of each range on the matching RPC
    device, the output layer with the last (as meshnet's tail holds it).

    llama.cpp (``llama_model_base::load_tensors``) offloads ``n_layer + 1`` layers (the output one is
    layer ``n_layer``) and gives layer ``il`` to the first device whose cumulative split fraction
    exceeds ``il / (n_layer + 1)``: weights of ``end - start`` (``+ 1`` on the last) put each boundary
    exactly on a range's start. ``12/13/6`` for SmolLM2's ``0:12, 12:25, 25:30``.

    Raises ValueError unless the ranges tile ``[0, n_layer)`` in order."""
    expect = 0
    for start, end in ranges:
        if start != expect or end <= start:
            raise ValueError(f"ranges must tile [0, {n_layer}) in order: ({start}, {end}) after {expect}")
        expect = end
    if expect != n_layer:
        raise ValueError(f"ranges end at {expect}, not at the model's {n_layer} layers")
    weights = [end - start for start, end in ranges]
    weights[-1] += 1
    return "/".join(str(w) for w in weights)
