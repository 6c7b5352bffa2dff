"""The self-test a lane must pass on this machine before a node may advertise it.

``certify(lane)`` runs a short forward pass on a golden model and compares logits:

* **cpu**: the CPU backend against llama.cpp's golden logits (``../shared/golden/<model>.json``, from the
  set made with this ggml's CPU features when there is one: :mod:`meshnet.backends.golden_sets`; the
  tolerance is the golden's own ``logit_atol`` / ``logit_mean_atol``; top-1 must agree wherever the
  golden margin is at least ``margin_threshold``). Without a golden for the model, against a second
  CPU run, which must be bit-identical (determinism is all that can be proved without a reference).
* **cuda / rocm / vulkan / metal**: the accelerator against the CPU backend on the same tokens, at the
  CPU's top-10 ids of every checked position, within the golden's tolerance (or
  :data:`DEFAULT_TOLERANCE` without a golden), top-1 agreeing wherever the CPU's margin is clear.
  A lane that is not built with a device here is *skipped* with the probe's exact reason.

The token sequence is llama.cpp's own path: each golden prompt as one batch, then 8 single-token decode
steps with the golden's greedy ids, so prefill and decode kernels both run. The result is recorded in
``certifications.json`` (see :mod:`meshnet.backends.certifications`) keyed by lane, the sha256 of ggml's
libraries, the host and the device, so a rebuild or another device needs a new self-test.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from meshnet.backends import ACCELERATOR_LANES, LANE_NAMES
from meshnet.backends import certifications, installed
from meshnet.backends import lanes as lanes_mod
from meshnet.backends.errors import BackendUnavailable
from meshnet.backends.golden_sets import golden_root, running_golden_set

TINY_GOLDEN_MODEL = "tiny-llama-q8_0"
N_DECODE = 8
# Used only for a model with no golden JSON: about the golden tolerances of the tiny models (0.35-0.66
# on logits of sigma ~8) and of SmolLM2 (1.3 on sigma ~3.2), on the safe side of both.
DEFAULT_TOLERANCE = {"logit_atol": 0.5, "logit_mean_atol": 0.15, "margin_threshold": 0.5}


@dataclass(frozen=True)
class CertResult:
    """One self-test.

    Attributes:
        lane: the lane tested.
        passed: True only when every comparison was within tolerance.
        state: ``certified`` (passed), ``failed`` (ran, outside tolerance or crashed) or ``skipped``
            (could not run here; ``reason`` is exact).
        reason: one line: the measured deviation against the tolerance, or why it failed or skipped.
        model: GGUF path used; model_sha256: its sha256.
        reference: what the lane's logits were compared with.
        max_dev, mean_dev: max and mean |logit - reference| over the compared values (logit units).
        logit_atol, logit_mean_atol: the tolerances they were held to.
        margin_threshold: top-1 is required to agree where the reference margin is at least this.
        n_values: logits compared; n_positions: sequence positions compared.
        top1_checked, top1_mismatches: positions with a clear reference margin, and disagreements there.
        seconds: wall time of the test.
        lib_sha256: the ggml libraries tested (sha256 over ggml's lib dir).
        ggml_version: ggml's version; device: the device tested (name, description, memory in bytes).
        key: the certifications.json key the result is stored under (None when skipped).
        certified_at: UTC time of the test.
    """

    lane: str
    passed: bool
    state: str
    reason: str
    model: str | None = None
    model_sha256: str | None = None
    reference: str | None = None
    max_dev: float | None = None
    mean_dev: float | None = None
    logit_atol: float | None = None
    logit_mean_atol: float | None = None
    margin_threshold: float | None = None
    n_values: int = 0
    n_positions: int = 0
    top1_checked: int = 0
    top1_mismatches: int = 0
    seconds: float = 0.0
    lib_sha256: str | None = None
    ggml_version: str | None = None
    device: dict | None = None
    key: str | None = None
    certified_at: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


# ---- model and golden --------------------------------------------------------------------------------

def default_model() -> str:
    """The golden tiny llama (7 MB, 4 layers: a self-test in well under a second) when the goldens are
    here, else the bundled SmolLM2.

    Raises:
        meshnet.model.bundled.ModelNotFound: neither is available.
    """
    gd = golden_root()
    if gd is not None:
        tiny = gd / "models" / f"{TINY_GOLDEN_MODEL}.gguf"
        if tiny.is_file():
            return str(tiny)
    from meshnet.model.bundled import resolve_model

    return str(resolve_model("smollm2"))


def golden_for(model_path: str, model_sha256: str) -> dict | None:
    """The llama.cpp golden JSON recorded for exactly this file (matched by sha256), from the golden
    set made with this ggml's CPU features when there is one, else from the closest set (its tolerance
    covers other kernels' rounding), or None."""
    gs = running_golden_set()
    if gs is None:
        return None
    for cand in (gs.path(Path(model_path).stem), *sorted(gs.directory.glob("*.json"))):
        try:
            data = json.loads(cand.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("sha256") == model_sha256 and "prompts" in data:
            return data
    return None


def _sequences(golden: dict | None, n_vocab: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, decode ids) pairs: the golden's prompts and first greedy ids, or a fixed sequence."""
    if golden is not None:
        return [(p["prompt_ids"], p["greedy_ids"][:N_DECODE]) for p in golden["prompts"]]
    ids = [int(i) % n_vocab for i in range(1, 17)]
    return [(ids[:8], ids[8:8 + N_DECODE])]


def _logit_rows(stage, prompt: list[int], decode: list[int]) -> np.ndarray:
    """float32 ``[1 + len(decode), n_vocab]``: the prompt's last position, then each decode step."""
    kv = stage.new_session()
    try:
        rows = [stage.forward(kv, 0, token_ids=np.asarray(prompt, dtype=np.int32))[-1]]
        for k, t in enumerate(decode):
            rows.append(stage.forward(kv, len(prompt) + k, token_ids=np.asarray([t], dtype=np.int32))[-1])
    finally:
        kv.free()
    return np.stack(rows)


def _run_rows(stage, seqs) -> list[np.ndarray]:
    return [_logit_rows(stage, p, d) for p, d in seqs]


# ---- comparisons -------------------------------------------------------------------------------------

def _compare_golden(rows: list[np.ndarray], golden: dict, seqs) -> dict:
    """Deviations at every recorded golden top-10 (id, logit), and top-1 where the margin is clear."""
    thr = golden["tolerance"]["margin_threshold"]
    devs, checked, mismatches, positions = [], 0, 0, 0
    for (prompt, _), r, p in zip(seqs, rows, golden["prompts"]):
        for rec in p["top10"]:
            i = rec["position"] - (len(prompt) - 1)  # row 0 is the prompt's last position
            if not 0 <= i < len(r):
                continue
            positions += 1
            devs += [abs(float(r[i][tid]) - logit) for tid, logit in rec["top10"]]
            if rec["top10"][0][1] - rec["top10"][1][1] >= thr:
                checked += 1
                mismatches += int(np.argmax(r[i])) != rec["top10"][0][0]
    return {"devs": devs, "positions": positions, "top1_checked": checked, "top1_mismatches": mismatches}


def _compare_rows(rows: list[np.ndarray], ref: list[np.ndarray], margin_threshold: float) -> dict:
    """Deviations at the reference's top-10 ids of every row, and top-1 where its margin is clear."""
    devs, checked, mismatches, positions = [], 0, 0, 0
    for r, f in zip(rows, ref):
        for got, want in zip(r, f):
            positions += 1
            top = np.argsort(-want, kind="stable")[:10]
            devs += [abs(float(got[t]) - float(want[t])) for t in top]
            if float(want[top[0]] - want[top[1]]) >= margin_threshold:
                checked += 1
                mismatches += int(np.argmax(got)) != int(top[0])
    return {"devs": devs, "positions": positions, "top1_checked": checked, "top1_mismatches": mismatches}


def _verdict(cmp: dict, tol: dict, reference: str) -> tuple[bool, str, float, float]:
    devs = cmp["devs"]
    if not devs:
        return False, "no logits were compared", float("nan"), float("nan")
    max_dev, mean_dev = float(max(devs)), float(np.mean(devs))
    if not (np.isfinite(max_dev) and np.isfinite(mean_dev)):
        return False, f"non-finite logits against {reference}", max_dev, mean_dev
    ok = (max_dev <= tol["logit_atol"] and mean_dev <= tol["logit_mean_atol"]
          and cmp["top1_mismatches"] == 0)
    summary = (f"max |logit - {reference}| {max_dev:.4g} {'<=' if max_dev <= tol['logit_atol'] else '>'} "
               f"{tol['logit_atol']:.4g}, mean {mean_dev:.4g} "
               f"{'<=' if mean_dev <= tol['logit_mean_atol'] else '>'} {tol['logit_mean_atol']:.4g}, "
               f"top-1 {cmp['top1_checked'] - cmp['top1_mismatches']}/{cmp['top1_checked']} "
               f"({len(devs)} logits at {cmp['positions']} positions)")
    return ok, summary, max_dev, mean_dev


# ---- the self-test -----------------------------------------------------------------------------------

def certify(lane: str, model_path: str | None = None, n_threads: int = 2, device_index: int = 0,
            record: bool = True) -> CertResult:
    """Run lane ``lane``'s self-test here and (with ``record``) store the result for :func:`probe_lane`.

    Args:
        lane: cpu, cuda, rocm, vulkan or metal.
        model_path: GGUF path or bundled name (``smollm2``); default :func:`default_model`.
        n_threads: CPU threads for the CPU runs.
        device_index: which of the lane's devices (accelerators only).
        record: write the result to certifications.json (a skipped result is never written).
    Returns:
        The result; ``state`` is certified, failed or skipped. Never raises for a missing backend or
        device: that is a ``skipped`` result whose reason is the lane probe's.
    Raises:
        ValueError: unknown lane.
        meshnet.model.bundled.ModelNotFound / FileNotFoundError / GGUFError: bad model.
    """
    if lane not in LANE_NAMES:
        raise ValueError(f"unknown lane {lane!r}; expected one of {', '.join(LANE_NAMES)}")
    t0 = time.perf_counter()
    if lane in ACCELERATOR_LANES:
        probe = lanes_mod.probe_lane(lane)
        if probe.state not in ("built", "certified") or not probe.devices:
            return CertResult(lane, False, "skipped", probe.reason)
    runtime, load_error = installed.ggml_runtime()
    if runtime is None:
        return CertResult(lane, False, "skipped", f"ggml-python cannot be loaded: {load_error}")

    from meshnet.contract import LayerRange
    from meshnet.engine.ggml_stage import GgmlStage
    from meshnet.model.gguf_file import open_gguf, sha256_file
    from meshnet.model.hparams import ModelConfig

    from meshnet.model.bundled import resolve_model

    path = str(resolve_model(model_path)) if model_path else default_model()
    sha = sha256_file(path)
    golden = golden_for(path, sha)
    cfg = ModelConfig.from_reader(open_gguf(path))
    seqs = _sequences(golden, cfg.n_vocab)
    n_ctx = min(cfg.n_ctx_train, max(512, max(len(p) + len(d) for p, d in seqs)))
    whole = LayerRange(0, cfg.n_layer)
    tol = dict(golden["tolerance"]) if golden else dict(DEFAULT_TOLERANCE)

    cpu_stage = GgmlStage(path, whole, n_threads=n_threads, n_ctx=n_ctx)
    try:
        cpu_rows = _run_rows(cpu_stage, seqs)
        if lane == "cpu":
            cpu_dev = next(d for d in runtime["devices"] if d["backend"] == "CPU")
            if golden is not None:
                reference = f"llama.cpp golden {golden.get('model', Path(path).stem)}"
                cmp = _compare_golden(cpu_rows, golden, seqs)
            else:
                # No reference but ourselves: a second run must repeat the first bit for bit.
                reference = "a second CPU run"
                tol = {"logit_atol": 0.0, "logit_mean_atol": 0.0,
                       "margin_threshold": DEFAULT_TOLERANCE["margin_threshold"]}
                cmp = _compare_rows(_run_rows(cpu_stage, seqs), cpu_rows, tol["margin_threshold"])
            device = cpu_dev
            ok, summary, max_dev, mean_dev = _verdict(cmp, tol, reference)
        else:
            from meshnet.backends.placement import AcceleratorStage

            reference = "the CPU backend"
            try:
                acc = AcceleratorStage(path, whole, lane, device_index, n_ctx=n_ctx)
            except BackendUnavailable as e:
                return CertResult(lane, False, "skipped", e.reason)
            device = acc.device
            try:
                cmp = _compare_rows(_run_rows(acc, seqs), cpu_rows, tol["margin_threshold"])
                ok, summary, max_dev, mean_dev = _verdict(cmp, tol, reference)
            except Exception as e:  # noqa: BLE001 - a crashing backend is a failed self-test, recorded
                cmp = {"devs": [], "positions": 0, "top1_checked": 0, "top1_mismatches": 0}
                ok, summary, max_dev, mean_dev = False, f"{type(e).__name__}: {e}", None, None
            finally:
                acc.close()
    finally:
        cpu_stage.close()

    desc = device["description"] or device["name"]
    key = certifications.certification_key(lane, desc)
    result = CertResult(
        lane=lane, passed=ok, state="certified" if ok else "failed", reason=summary, model=path,
        model_sha256=sha, reference=reference, max_dev=max_dev, mean_dev=mean_dev,
        logit_atol=tol["logit_atol"], logit_mean_atol=tol["logit_mean_atol"],
        margin_threshold=tol["margin_threshold"], n_values=len(cmp["devs"]), n_positions=cmp["positions"],
        top1_checked=cmp["top1_checked"], top1_mismatches=cmp["top1_mismatches"],
        seconds=round(time.perf_counter() - t0, 3), lib_sha256=installed.lib_sha256(),
        ggml_version=runtime["version"], device=device, key=key,
        certified_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    if record:
        certifications.save_certification(key, result.to_dict())
    return result
