"""Drafts from a draft model (a GGUF with the target's vocabulary, run by the client): greedy output equals
plain decoding, the draft model's KV follows the session's kept tokens, and a model with another
vocabulary is refused."""

from __future__ import annotations

import subprocess
import sys

import pytest

from meshnet.contract import GREEDY, LayerRange
from meshnet.draft_model import ModelDrafter
from meshnet.generation import generate
from meshnet.local_mesh import load_local_chain
from meshnet.speculative import Speculation


@pytest.fixture(scope="module")
def drafter(smollm2_path):
    d = ModelDrafter(str(smollm2_path), str(smollm2_path))
    yield d
    d.close()


def test_the_target_as_its_own_draft_model_has_every_draft_kept(smollm2_path, tok, solo, drafter):
    """The same weights draft exactly the greedy tokens (a verification row gives a single decode's bits):
    every draft is kept, and the output is the plain run's."""
    chain = load_local_chain(str(smollm2_path), [LayerRange(0, 15), LayerRange(15, 30)], n_threads=2, progress=False)
    r = generate(chain, tok, solo.prompt_ids(0), 32, GREEDY, stop_at_eog=False,
                 speculation=Speculation(4, adaptive=False, drafter=drafter))
    assert r.generated_token_ids == solo.greedy(0, 32)
    assert r.drafted > 16 and r.accepted == r.drafted
    assert drafter._held == {}  # the generation's end freed its draft session


def test_the_draft_session_follows_the_kept_tokens(drafter, solo):
    """After a round whose drafts were not all kept, the draft model drops what it held beyond the kept
    tokens: its next drafts equal those of a fresh session on the same tokens."""
    ids = solo.prompt_ids(1)
    first = drafter.draft("a", ids, 4)
    assert len(first) == 4
    other = (first[0] + 1) % 1000  # the target kept none of the drafts and chose another token
    again = drafter.draft("a", ids + [other], 3)
    assert again == drafter.draft("fresh", ids + [other], 3)
    assert drafter._held["a"][1] == ids + [other] + again[:-1]
    drafter.end("a")
    drafter.end("fresh")
    assert drafter._held == {}


def test_a_draft_model_with_another_vocabulary_is_refused(smollm2_path, gemma_path):
    with pytest.raises(ValueError, match="vocabulary"):
        ModelDrafter(str(gemma_path), str(smollm2_path))


def test_generate_without_a_draft_model_says_what_is_missing():
    proc = subprocess.run([sys.executable, "-m", "meshnet.cli", "generate", "--speculative", "model", "Hi"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--draft-model" in proc.stderr


def test_a_draft_model_alone_turns_drafting_by_it_on_and_with_another_kind_is_refused(smollm2_path):
    """``--draft-model`` without ``--speculative`` was loaded and never used (llama-server's
    --model-draft drafts with it); beside ngram or mtp it would not be used either."""
    import argparse

    from meshnet.speculative import speculation_from_args

    path = str(smollm2_path)
    spec = speculation_from_args(argparse.Namespace(speculative=None, draft_model=path, draft_tokens=3), path)
    try:
        assert isinstance(spec.drafter, ModelDrafter) and spec.draft_tokens == 3 and not spec.mtp
    finally:
        spec.drafter.close()
    assert speculation_from_args(argparse.Namespace(speculative=None, draft_model=None, draft_tokens=None),
                                 path) is None
    for kind in ("ngram", "none"):
        with pytest.raises(ValueError) as ei:
            speculation_from_args(argparse.Namespace(speculative=kind, draft_model=path, draft_tokens=None), path)
        assert str(ei.value) == f"--draft-model drafts only with --speculative model, not --speculative {kind}: drop one"


def test_draft_tokens_alone_turn_ngram_drafting_on_and_beside_none_are_refused(smollm2_path):
    """``--draft-tokens 5`` alone was ignored without a word: nothing drafted."""
    import argparse

    from meshnet.speculative import speculation_from_args

    path = str(smollm2_path)
    spec = speculation_from_args(argparse.Namespace(speculative=None, draft_model=None, draft_tokens=5), path)
    assert spec is not None and spec.draft_tokens == 5 and spec.drafter is None and not spec.mtp
    with pytest.raises(ValueError, match="^--draft-tokens sets how many tokens speculative decoding drafts, and "
                                         "--speculative none drafts none: drop one$"):
        speculation_from_args(argparse.Namespace(speculative="none", draft_model=None, draft_tokens=5), path)


def test_mtp_on_a_model_without_it_names_the_model_as_the_user_did(smollm2_path):
    """A model fetched from a mesh (``--model-id``) lives in a cache file: the refusal named that file."""
    import argparse

    from meshnet.speculative import speculation_from_args

    args = argparse.Namespace(speculative="mtp", draft_model=None, draft_tokens=None)
    with pytest.raises(ValueError) as ei:
        speculation_from_args(args, str(smollm2_path), "smollm2")
    assert str(ei.value) == ("speculative 'mtp' needs a model with next-token-prediction layers: smollm2 (llama) has "
                             "no nextn tensors (llama.nextn_predict_layers is absent or 0)")
