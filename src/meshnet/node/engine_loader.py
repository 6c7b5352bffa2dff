"""Load a node's engine: the model's layer range on the ggml engine (or the fake fixture), its decode
speed probe, and the fake engine's injected faults. Runs in the engine worker process, or in the node
process itself with ``--in-process-engine``."""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass

from meshnet.load_spec import load_failure as spec_load_failure
from meshnet.contract import ArtifactId, Capabilities, LayerRange, StepRequest, split_layers
from meshnet.load_spec import LoadSpec
from meshnet.engine.base import ShardEngine
from meshnet.node.config import NodeConfig
from meshnet.proto import meshnet_pb2 as pb


def pin_to_cpu(cpu: int) -> None:
    """Run this process on CPU ``cpu`` only; threads started later (ggml's workers, gRPC's) inherit it.

    Raises:
        ValueError: ``cpu`` is not one this process may run on (the message lists those), or the
            platform cannot pin processes.
    """
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError(f"--cpu {cpu}: pinning to a CPU is not supported on this platform")
    allowed = sorted(os.sched_getaffinity(0))
    if cpu not in allowed:
        raise ValueError(f"--cpu {cpu}: no such CPU available to this process (available: "
                         f"{', '.join(map(str, allowed))})")
    os.sched_setaffinity(0, {cpu})


def build_engine(cfg: NodeConfig) -> tuple[ShardEngine, pb.ModelIdentity, bytes]:
    """Load the engine for ``cfg``: the engine, the model identity it registers, and the model's
    compressed manifest (:meth:`meshnet.model.manifest.ModelManifest.compressed`; empty for the fake).
    Raises ValueError with the engine's message on a bad model/range."""
    if cfg.engine == "fake":
        from meshnet.engine.fake import FakeEngine, FakeModel

        model = FakeModel()
        layers = cfg.layers or LayerRange(0, model.n_layer)
        eng = FakeEngine(model)
        out = eng.load(LoadSpec(path="", artifact=ArtifactId(model.sha256, layers), max_sessions=cfg.max_sessions))
        if not out.ok:
            raise ValueError(out.message)
        return eng, pb.ModelIdentity(sha256=model.sha256, architecture="fake", n_layer=model.n_layer), b""
    from meshnet.engine.ggml_engine import GgmlEngine
    from meshnet.model.bundled import resolve_model
    from meshnet.model.gguf_file import open_gguf
    from meshnet.model.manifest import model_manifest
    from meshnet.model.hparams import ModelConfig

    path = str(resolve_model(cfg.model))
    mcfg = ModelConfig.from_reader(open_gguf(path))
    layers = cfg.layers or split_layers(mcfg.n_layer, max(1, cfg.stages_hint))[cfg.stage_index]
    manifest = model_manifest(path)  # hashes every tensor once; the engine's load finds it cached
    sha = manifest.id
    if cfg.backend != "cpu":
        from meshnet.backends.lanes import require_certified
        from meshnet.backends.placement import AcceleratorEngine

        # BackendUnavailable (a ValueError) with the probe's exact reason
        require_certified(cfg.backend, cfg.device_index)
        eng = AcceleratorEngine(cfg.backend, cfg.device_index)
    else:
        eng = GgmlEngine()
    out = eng.load(LoadSpec(path=path, artifact=ArtifactId(sha, layers), n_threads=cfg.threads, n_ctx=cfg.n_ctx,
                            max_sessions=cfg.max_sessions, kv_tokens=cfg.kv_tokens,
                            prefix_cache=cfg.prefix_cache, decode_groups=cfg.decode_groups,
                            repack=cfg.repack, huge_pages=cfg.huge_pages))
    if not out.ok:
        raise ValueError(out.message)
    return eng, pb.ModelIdentity(sha256=sha, architecture=mcfg.architecture, n_layer=mcfg.n_layer), \
        manifest.compressed()


def measure_decode_speed(engine: ShardEngine, steps: int = 8) -> float:
    """Tokens/s of single-token decode steps on a scratch session (what routing compares nodes by).

    The first step (a one-token prefill) is not timed: it builds graphs and, on an accelerator, loads
    kernels, which a serving node pays once."""
    import numpy as np

    from meshnet.contract import NamedTensor

    caps = engine.capabilities()
    sid = f"speed-probe-{uuid.uuid4().hex}"
    hidden = None if caps.is_head else NamedTensor.from_numpy("hidden", np.zeros((1, *caps.hidden_row_shape), np.float32))
    # Its own cells only (reserve_tokens 0 would ask for n_ctx: refused by a pool below that, --kv-tokens).
    first = StepRequest(sid, 0, 0, (1,), hidden=hidden, reserve_tokens=steps + 1)
    try:
        if not engine.prefill(first).ok:
            return 0.0
        t0 = time.perf_counter()
        n = 0
        for i in range(1, steps + 1):
            if not engine.decode(StepRequest(sid, 0, i, (1,), hidden=hidden)).ok:
                break
            n += 1
        dt = time.perf_counter() - t0
    finally:
        engine.release(sid, keep_prefix=False)  # its cells would take a place of the prefix cache
    return n / dt if dt > 0 and n else 0.0


@dataclass(frozen=True)
class LoadedEngine:
    """What a node learns from loading its engine, wherever it runs.

    Attributes:
        caps: the engine's capabilities (range, n_embd, n_ctx, ...).
        model: the model identity the node registers.
        decode_tokens_per_s: the speed probe's result (tokens/s; 0 when it failed).
        device: the engine's device description (``ShardEngine.device``-style dict), None without one.
        device_index: which of the lane's devices.
        manifest: the model's compressed manifest, published to the tracker (empty: none, the fake).
    """

    caps: Capabilities
    model: pb.ModelIdentity
    decode_tokens_per_s: float
    device: dict | None = None
    device_index: int = 0
    manifest: bytes = b""


def load_engine(cfg: NodeConfig, generation: int = 0) -> tuple[ShardEngine, LoadedEngine]:
    """Load ``cfg``'s engine, probe its speed, then arm ``cfg.fault`` (the fake engine's faults, for
    the first ``workers`` generations of engine worker; ``generation`` counts from 0).

    Raises:
        ValueError: a bad model, range or fault spec, or faults asked of an engine other than the fake.
    """
    faults = None
    if cfg.fault:
        if cfg.engine != "fake":
            raise ValueError(f"--fault needs --engine fake (got --engine {cfg.engine})")
        from meshnet.engine.fake_faults import parse_fault_spec

        faults, workers = parse_fault_spec(cfg.fault)
        if workers and generation >= workers:
            faults = None
    engine, model, manifest = build_engine(cfg)
    speed = measure_decode_speed(engine)
    if faults is not None:
        engine.set_faults(faults)  # after the probe: its steps are not the ones a fault counts
    info = LoadedEngine(engine.capabilities(), model, speed, getattr(engine, "device", None) or None,
                        getattr(engine, "device_index", 0), manifest)
    return engine, info


def load_subject(cfg: NodeConfig) -> str:
    """What ``cfg`` loads, for messages: ``"layers 0:12 of smollm2"``, ``"every layer of smollm2"``."""
    return f"{f'layers {cfg.layers}' if cfg.layers else 'every layer'} of {cfg.model}"


def load_failure(e: Exception, cfg: NodeConfig) -> str:
    """One line saying why loading ``cfg``'s engine failed with ``e`` (see :func:`meshnet.load_spec.load_failure`)."""
    return spec_load_failure(e, f"{load_subject(cfg)} with n_ctx={cfg.n_ctx}, kv_tokens={cfg.kv_tokens}, "
                                    f"max_sessions={cfg.max_sessions}")
