"""The reference a mesh is compared with: the same engine, on this machine, in one process, one stage.

Splitting a model, failing over, relaying or running sessions side by side must not change one bit on
any CPU, so mesh tests compare their tokens with this run rather than with llama.cpp's goldens, whose
exact ids hold only for the CPU features that made them (``test_engine_golden`` checks this run
against the goldens for the running features). The prompts are the golden prompts, kept here so that
mesh tests run without ``../shared`` too.
"""

from __future__ import annotations

from pathlib import Path

from meshnet.contract import GREEDY
from meshnet.generation import generate
from meshnet.local_mesh import load_local_chain, plan_ranges
from meshnet.tokenizer import GGUFTokenizer

PROMPTS = (
    "The capital of France is",
    "On a quiet morning in early spring, the old lighthouse keeper climbed the spiral stairs one last time. "
    "For forty years he had polished the great lens, trimmed the wicks, and written the weather into a "
    "leather notebook that smelled of salt and lamp oil. Ships no longer needed him; satellites and radio "
    "beacons now guided them safely past the rocks. Still, he liked to imagine that some sailor, far out on "
    "the grey water, would glance toward the shore and feel comforted by the steady beam. When he reached "
    "the top, he opened the small window, listened to the gulls, and watched the tide roll slowly over the "
    "sand. Then he wrote a final entry: calm sea, light wind from the west, visibility excellent, and "
    "everything exactly where it should be.",
    "Crème brûlée in Zürich, a naïve façade in São Paulo, and then 北京欢迎你 🙂",
    "1, 2, 3, 4,",
)
N_GREEDY = 64


class SoloReference:
    """Greedy ids of the golden prompts from one in-process stage over all layers (2 threads), the
    generation loop's own path (the prompt as one prefill step, then one decode step per token, no
    stop at end-of-generation). Each prompt runs once, on first use; the engine is loaded then."""

    def __init__(self, model_path: Path, tokenizer: GGUFTokenizer) -> None:
        self.model_path, self.tokenizer = model_path, tokenizer
        self._chain = None
        self._greedy: dict[int, list[int]] = {}

    def prompt_ids(self, i: int) -> list[int]:
        """Token ids ``[n_prompt]`` of golden prompt ``i`` (0-3)."""
        return self.tokenizer.encode(PROMPTS[i])

    def greedy(self, i: int, n: int = N_GREEDY) -> list[int]:
        """The first ``n`` (<= 64) greedy ids after golden prompt ``i``."""
        if n > N_GREEDY:
            raise ValueError(f"the reference holds {N_GREEDY} greedy ids, not {n}")
        if i not in self._greedy:
            if self._chain is None:  # one range over every layer
                self._chain = load_local_chain(str(self.model_path), plan_ranges(str(self.model_path)),
                                               n_threads=2, progress=False)
            res = generate(self._chain, self.tokenizer, self.prompt_ids(i), N_GREEDY, GREEDY, stop_at_eog=False)
            self._greedy[i] = res.generated_token_ids
        return self._greedy[i][:n]
