"""The engine contract suite run against the real ggml engine on a tiny 4-layer llama (split 2/1/1)."""

from __future__ import annotations

import pytest

from conftest import GOLDEN_DIR
from contract_suite import EngineContractSuite
from meshnet.contract import ArtifactId, LayerRange
from meshnet.load_spec import LoadSpec
from meshnet.engine.ggml_engine import GgmlEngine

MODEL = GOLDEN_DIR / "models" / "tiny-llama-q8_0.gguf"


@pytest.mark.skipif(not MODEL.is_file(), reason=f"{MODEL} not found")
class TestGgmlEngineContract(EngineContractSuite):
    @pytest.fixture
    def new_engine(self):
        return GgmlEngine

    @pytest.fixture
    def load_spec(self):
        def spec(layers: LayerRange, **overrides) -> LoadSpec:
            return LoadSpec(path=str(MODEL), artifact=ArtifactId("", layers), **overrides)

        return spec

    @pytest.fixture
    def n_layer(self) -> int:
        return 4

    @pytest.fixture
    def prompt_ids(self) -> list[int]:
        # "The capital of France is" in the SmolLM2 vocabulary the tiny models share.
        return [504, 3575, 282, 4649, 314]
