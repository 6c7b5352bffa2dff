"""The OpenAI-compatible API with speculative decoding: the request fields and the server default, greedy
answers equal to plain ones, acceptance figures in /metrics, and bad values refused with 400."""

from __future__ import annotations

import re

import httpx
import pytest

from meshnet.api.backend import local_backend
from meshnet.api.server import start_api_in_thread, stop_api
from meshnet.speculative import Speculation
from test_speculative_ggml import JSON_EDIT

MESSAGES = [{"role": "user", "content": JSON_EDIT}]


@pytest.fixture(scope="module")
def served(smollm2_path):
    backend = local_backend(str(smollm2_path), n_ctx=1024, max_sessions=4, name="smollm2")
    server, thread = start_api_in_thread(backend, "127.0.0.1", 0)
    with httpx.Client(base_url=f"http://127.0.0.1:{server.config.port}", timeout=120) as http:
        yield backend, http
    stop_api(server, thread)


def _metric(http, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", http.get("/metrics").text, re.M)
    assert m, name
    return float(m.group(1))


def _chat(http, **extra) -> str:
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 48, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_speculative_chat_equals_plain_and_reports_acceptance(served):
    backend, http = served
    plain = _chat(http)
    assert _metric(http, "meshnet_api_speculative_steps_total") == 0
    assert _chat(http, speculative="ngram", draft_tokens=5) == plain
    drafted = _metric(http, "meshnet_api_speculative_drafted_tokens_total")
    accepted = _metric(http, "meshnet_api_speculative_accepted_tokens_total")
    assert _metric(http, "meshnet_api_speculative_steps_total") > 0
    assert drafted >= accepted > 0
    assert _metric(http, "meshnet_api_speculative_acceptance_rate") == pytest.approx(accepted / drafted)
    # the server's default (meshnet api --speculative ngram) applies to requests that do not say ...
    backend.speculation = Speculation(4, adaptive=False)
    try:
        assert _chat(http) == plain
        assert _metric(http, "meshnet_api_speculative_drafted_tokens_total") > drafted
        # ... and "none" turns it off for one request
        before = _metric(http, "meshnet_api_speculative_steps_total")
        assert _chat(http, speculative="none") == plain
        assert _metric(http, "meshnet_api_speculative_steps_total") == before
    finally:
        backend.speculation = None


@pytest.mark.parametrize("field,value", [("speculative", "eagle"), ("draft_tokens", 0), ("draft_tokens", 17),
                                         ("draft_tokens", "4")])
def test_bad_speculation_fields_are_400(served, field, value):
    _, http = served
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field



def test_a_model_request_uses_the_servers_draft_model_and_without_one_is_400(served, smollm2_path):
    from meshnet.draft_model import ModelDrafter

    backend, http = served
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, "speculative": "model"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "speculative"
    assert "needs a draft model" in r.json()["error"]["message"]
    plain = _chat(http)
    drafter = ModelDrafter(str(smollm2_path), str(smollm2_path))  # the target as its own draft: all kept
    backend.speculation = Speculation(4, drafter=drafter)  # meshnet api --speculative model --draft-model
    try:
        accepted = _metric(http, "meshnet_api_speculative_accepted_tokens_total")
        assert _chat(http, speculative="model", draft_tokens=4) == plain
        assert _metric(http, "meshnet_api_speculative_accepted_tokens_total") > accepted
    finally:
        backend.speculation = None
        drafter.close()

def test_an_mtp_request_to_a_model_without_nextn_names_the_model_not_its_path(smollm2_path):
    from meshnet.api.server import build_backend
    from meshnet.cli import build_parser

    backend = build_backend(build_parser().parse_args(["api", "--model", str(smollm2_path), "--n-ctx", "256"]))
    try:
        assert backend.mtp_problem == (f"needs a model with next-token-prediction layers: {smollm2_path.stem} "
                                       "(llama) has no nextn tensors (llama.nextn_predict_layers is absent or 0)")
    finally:
        backend.close()
