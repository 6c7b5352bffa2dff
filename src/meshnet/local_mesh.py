"""Build an in-process mesh: load each layer range of a GGUF as its own ggml engine and chain them."""

from __future__ import annotations

import sys
from typing import Callable, Sequence

from tqdm import tqdm

from meshnet.chain import LocalChain
from meshnet.contract import ArtifactId, LayerRange
from meshnet.load_spec import LoadSpec, load_failure
from meshnet.layer_split import balanced_split, layer_costs
from meshnet.engine.ggml_engine import GgmlEngine
from meshnet.model.gguf_file import open_gguf
from meshnet.model.hparams import ModelConfig


def plan_ranges(model_path: str, stages: int | None = None, layers: str | None = None) -> list[LayerRange]:
    """Layer ranges from ``--layers "0:10,10:20,20:30"``, or ``--stages N`` ranges of about equal decode
    cost (:func:`meshnet.layer_split.balanced_split`: the tail's output projection counts too).

    Raises:
        ValueError: ranges that do not tile ``[0, n_layer)`` contiguously, or a stage count outside
            ``1..n_layer``; the message names the flag and the model's layer count.
    """
    reader = open_gguf(model_path)
    n_layer = ModelConfig.from_reader(reader).n_layer
    if layers is not None:
        parts = [part.strip() for part in layers.split(",")]
        if not any(parts):
            raise ValueError(f"--layers {layers!r} names no layer range (expected e.g. \"0:10,10:{n_layer}\")")
        if not all(parts):  # "0:10,10:30," or "0:10,,10:30": a range left out by mistake, perhaps
            raise ValueError(f"--layers {layers!r} has an empty range between its commas (expected e.g. "
                             f"\"0:10,10:{n_layer}\")")
        ranges = [LayerRange.parse(part) for part in parts]
        expect = 0
        for r in ranges:
            if r.start != expect:
                raise ValueError(f"layer ranges must tile [0, {n_layer}) in order: {r} starts at "
                                 f"{r.start}, expected {expect}")
            expect = r.end
        if expect != n_layer:
            raise ValueError(f"layer ranges end at {expect} but the model has {n_layer} layers")
        return ranges
    stages = 1 if stages is None else stages
    if not 1 <= stages <= n_layer:  # each stage holds one layer at least
        raise ValueError(f"--stages {stages}: the model has {n_layer} layers, so give 1 to {n_layer} stages")
    costs, tail = layer_costs(reader, n_layer)
    return balanced_split(costs, tail, stages)


def load_local_chain(model_path: str, ranges: Sequence[LayerRange], n_threads: int = 2, n_ctx: int = 0,
                     progress: bool = True, engine_factory: Callable[[], GgmlEngine] = GgmlEngine,
                     **spec_kw) -> LocalChain:
    """Load one engine per range (``engine_factory()``, the CPU :class:`GgmlEngine` by default; progress
    on stderr) and chain them.

    Raises:
        ValueError: a stage failed to load; the message is the engine's (bad file, range, type), or
            says that memory ran out.
    """
    engines = []
    bar = tqdm(ranges, desc="loading layer ranges", unit="stage", file=sys.stderr, disable=not progress,
               leave=False)
    for r in bar:
        bar.set_postfix_str(f"layers {r}")
        eng = engine_factory()
        try:
            out = eng.load(LoadSpec(path=str(model_path), artifact=ArtifactId("", r), n_threads=n_threads,
                                    n_ctx=n_ctx, **spec_kw))
        except (MemoryError, OSError) as e:
            raise ValueError(load_failure(e, f"layers {r} of {model_path} with n_ctx={n_ctx}")) from None
        if not out.ok:
            raise ValueError(out.message)
        engines.append(eng)
    return LocalChain(engines)
