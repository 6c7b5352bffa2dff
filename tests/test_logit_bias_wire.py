"""A logit_bias map on the wire is bounded before the node converts it.
check, not after converting and sorting every entry."""

from __future__ import annotations

import time

import numpy as np

from meshnet.contract import ArtifactId, LayerRange, NamedTensor, StepRequest

from meshnet.load_spec import LoadSpec
from meshnet.engine.fake import FakeEngine, FakeModel
from meshnet.node.service import NodeService
from meshnet.proto import meshnet_pb2 as pb
from meshnet.sampling_params import MAX_LOGIT_BIAS
from meshnet.wire.envelope import request_to_frames

N_ENTRIES = 600_000  # about 6.6 MB of frame: under the data plane's 8 MiB frame limit


def _tail() -> tuple[NodeService, FakeModel]:
    model = FakeModel()
    eng = FakeEngine(model)
    assert eng.load(LoadSpec(path="", artifact=ArtifactId(model.sha256, LayerRange(10, model.n_layer)),
                             max_sessions=4)).ok
    return NodeService(eng, "tail", pb.ModelIdentity(sha256=model.sha256)), model


def _frames(model: FakeModel, session: str, n_entries: int) -> list[pb.Envelope]:
    x = np.zeros((1, model.n_embd), np.float32)
    frames = request_to_frames(StepRequest(session, 0, 0, (1,), hidden=NamedTensor.from_numpy("hidden", x)), False)
    for i in range(n_entries):
        frames[0].sampling.logit_bias[i] = -1.0
    return [pb.Envelope.FromString(f.SerializeToString()) for f in frames]  # as received


def test_an_over_long_logit_bias_map_is_refused_before_it_is_sorted():
    """A step whose header carries a logit_bias map of 600,000 entries (6.6 MB, one frame under the 8 MiB
    limit) is refused INVALID_ARGUMENT ('logit_bias may hold at most 1024 tokens, got 600000') only after
    envelope.sampling_from_pb has turned the map into sorted tuples twice (``tuple(sorted(m.logit_bias.items()))``
    then SamplingParams.__post_init__ sorting again): 0.53 s of the node's CPU per frame measured here
    (cProfile: all of it in sampling_from_pb / sorted), 1.2 s on the loaded tail of a `meshnet up` mesh.

    Symptom on a live 3-node mesh (SmolLM2, API port): a 40-token greedy completion took 0.61-0.74 s alone and
    5.3-7.3 s while two connections sent such frames to the tail's data plane (40 frames in all), against
    1.1-1.6 s while the same connections sent 345 frames of the same size refused for a wrong hidden shape.
    The head and middle stages (which never validate sampling) pay the same conversion on every step."""
    svc, model = _tail()
    small = _frames(model, "small", MAX_LOGIT_BIAS + 1)
    big = _frames(model, "big", N_ENTRIES)
    t0 = time.perf_counter()
    out_small = svc.run_step(small)
    t_small = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = svc.run_step(big)
    t_big = time.perf_counter() - t0
    assert out_small.code == out.code == "INVALID_ARGUMENT" and "at most 1024 tokens" in out.message
    assert t_big < max(0.1, 20 * t_small), f"refusing {N_ENTRIES} entries took {t_big:.3f} s ({t_small:.4f} s for 1025)"
