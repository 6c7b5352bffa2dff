"""Next-token-prediction (MTP) drafts on tiny-deepseek2-mtp (tests/make_mtp_model.py: the golden
tiny-deepseek2 plus one nextn block): greedy output with MTP drafts equals plain decoding of the golden
tiny-deepseek2 (the same trunk) token for token, in one stage, split in two in process and over a mesh of
node processes with a failover; the drafts follow llama.cpp's; a model without nextn tensors is refused."""

from __future__ import annotations

import pytest

from conftest import GOLDEN_DIR
from make_mtp_model import build
from meshnet.contract import GREEDY, LayerRange, SampledToken, StepRequest, StepResult, Status
from meshnet.generation import generate
from meshnet.local_mesh import load_local_chain
from meshnet.speculative import Speculation, mtp_problem, speculation_from
from meshnet.tokenizer import GGUFTokenizer
from meshnet.wire.envelope import frames_to_request, replies_to_result, request_to_frames, result_to_replies

# llama-server (the pinned llama.cpp, 0.3.36) on tiny-deepseek2-mtp.gguf:
#   llama-server -m tiny-deepseek2-mtp.gguf -c 512 -t 2 --spec-type draft-mtp --spec-draft-n-max 1
#   POST /completion {"prompt": PROMPT, "n_predict": 32, "temperature": 0}
# gave these tokens and timings draft_n 16, draft_n_accepted 15.
PROMPT = "The quick brown fox jumps over the lazy dog. The quick"
LLAMA_CPP_TOKENS = [22106, 38361, 17467, 47021, 47204, 26333, 37818, 44569, 27821, 41310, 13843, 3157, 20518,
                    9727, 21960, 38250, 39625, 28828, 18556, 11160, 33649, 30702, 34919, 36640, 24258, 7986,
                    36714, 4481, 6826, 1004, 15249, 40601]
LLAMA_CPP_DRAFTED, LLAMA_CPP_ACCEPTED = 16, 15


@pytest.fixture(scope="module")
def mtp_path(tmp_path_factory, deepseek2_path):
    return build(GOLDEN_DIR, tmp_path_factory.mktemp("mtp"))


@pytest.fixture(scope="module")
def tok(mtp_path):
    return GGUFTokenizer.from_gguf(str(mtp_path))


@pytest.fixture(scope="module")
def plain_ids(deepseek2_path, tok):
    """Greedy ids of the golden tiny-deepseek2 (no MTP block) on PROMPT."""
    chain = load_local_chain(str(deepseek2_path), [LayerRange(0, 4)], n_threads=2, progress=False)
    return generate(chain, tok, tok.encode(PROMPT), 32, GREEDY, stop_at_eog=False).generated_token_ids


def test_mtp_drafts_keep_greedy_output_and_follow_llama_cpp(mtp_path, tok, plain_ids):
    chain = load_local_chain(str(mtp_path), [LayerRange(0, 4)], n_threads=2, progress=False)
    ids = tok.encode(PROMPT)
    r = generate(chain, tok, ids, 32, GREEDY, stop_at_eog=False,
                 speculation=Speculation(1, adaptive=False, mtp=True))
    assert r.generated_token_ids == plain_ids == LLAMA_CPP_TOKENS
    # one draft a step, as llama-server --spec-draft-n-max 1 drafts: the same drafts kept and rejected
    assert (r.drafted, r.accepted) == (LLAMA_CPP_DRAFTED, LLAMA_CPP_ACCEPTED)


def test_mtp_on_the_tail_of_two_stages_equals_plain(mtp_path, tok, plain_ids):
    chain = load_local_chain(str(mtp_path), [LayerRange(0, 2), LayerRange(2, 4)], n_threads=2, progress=False)
    assert [e.stage.has_mtp for e in chain.stages] == [False, True]
    r = generate(chain, tok, tok.encode(PROMPT), 32, GREEDY, stop_at_eog=False,
                 speculation=Speculation(4, adaptive=False, mtp=True))
    assert r.generated_token_ids == plain_ids
    assert r.verify_steps > 0 and r.accepted > r.drafted // 2, (r.drafted, r.accepted)


def test_rejected_mtp_cells_roll_back_and_release_frees_them(mtp_path):
    """A verification step whose drafts are wrong: the next step (rollback) drafts what a fresh session
    holding only the accepted tokens drafts, and release leaves no session behind."""
    chain = load_local_chain(str(mtp_path), [LayerRange(0, 4)], n_threads=2, progress=False)
    prompt = tuple(range(1000, 1012))
    first = chain.step(StepRequest("a", 0, 0, prompt, mtp_drafts=2), decode=False)
    assert first.ok and len(first.drafts) == 2
    wrong = tuple(d + 1 for d in first.drafts)
    res = chain.step(StepRequest("a", 0, 12, (first.token.token_id, *wrong), verify=True, mtp_drafts=2),
                     decode=True)
    assert res.ok and res.tokens[0].token_id == first.drafts[0] != wrong[0] and len(res.drafts) == 2
    kept = (first.token.token_id, res.tokens[0].token_id)
    again = chain.step(StepRequest("a", 0, 13, kept[1:], rollback=True, mtp_drafts=3), decode=True)
    fresh = chain.step(StepRequest("b", 0, 0, prompt + kept, mtp_drafts=3), decode=False)
    assert again.token == fresh.token and again.drafts == fresh.drafts and len(fresh.drafts) == 3
    chain.release("a")
    chain.release("b")
    assert chain.stages[0].metrics().active_sessions == 0


def test_mtp_fields_cross_the_wire():
    req = StepRequest("s", 0, 5, (1, 2), mtp_drafts=3)
    back, _ = frames_to_request(request_to_frames(req, True))
    assert back.mtp_drafts == 3
    res = StepResult(Status.OK, token=SampledToken(7, -0.5), n_past=6, drafts=(9, 4, 2))
    assert replies_to_result(result_to_replies(req, res)).drafts == (9, 4, 2)


def test_a_model_without_nextn_refuses_mtp(deepseek2_path, mtp_path):
    problem = mtp_problem(str(deepseek2_path))
    assert "no nextn tensors" in problem and "tiny-deepseek2.gguf" in problem
    with pytest.raises(ValueError, match="speculative 'mtp' needs a model with next-token-prediction layers"):
        speculation_from("mtp", None, mtp_problem=problem)
    assert mtp_problem(str(mtp_path)) is None
    assert speculation_from("mtp", 3, mtp_problem=None) == Speculation(3, mtp=True)


@pytest.mark.long  # three node processes: about 18 s on two cores
def test_mtp_mesh_with_failover_equals_plain(mesh, mtp_path, tok, plain_ids):
    """Node processes, forwarded steps, the MTP block on the tail; the head dies midway and a spare
    rebuilds its cells by replaying the session's steps (the tail rebuilds its MTP cells the same way)."""
    from meshnet.generation import Generation

    head, spare, tail = mesh.start_nodes([("a-head", "0:2"), ("b-spare", "0:2"), ("c-tail", "2:4")],
                                         str(mtp_path))
    client = mesh.client(failover_deadline_s=30.0)
    gen = Generation(client, tok, tok.encode(PROMPT), 32, GREEDY, stop_at_eog=False,
                     speculation=Speculation(3, adaptive=False, mtp=True))
    _, route = client.route()
    victim = head if head.node_id in {h.node_id for h in route} else spare
    for i, _ in enumerate(gen):
        if i + 1 == 12:
            assert gen.result.drafted > 0
            victim.kill()
    r = gen.result
    assert r.generated_token_ids == plain_ids
    assert client.failovers == 1 and r.accepted > 0
    client.close()
