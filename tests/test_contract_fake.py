"""The engine contract suite run against the fake engine (30 layers, split 10/10/10)."""

from __future__ import annotations

import pytest

from contract_suite import EngineContractSuite
from meshnet.contract import ArtifactId, LayerRange
from meshnet.load_spec import LoadSpec
from meshnet.engine.fake import FakeEngine, FakeModel

MODEL = FakeModel()


class TestFakeEngineContract(EngineContractSuite):
    @pytest.fixture
    def new_engine(self):
        return lambda: FakeEngine(MODEL)

    @pytest.fixture
    def load_spec(self):
        def spec(layers: LayerRange, **overrides) -> LoadSpec:
            return LoadSpec(path="", artifact=ArtifactId(MODEL.sha256, layers), **overrides)

        return spec

    @pytest.fixture
    def n_layer(self) -> int:
        return MODEL.n_layer

    @pytest.fixture
    def prompt_ids(self) -> list[int]:
        return [504, 357, 282, 464, 314, 7, 999, 0, 42]
