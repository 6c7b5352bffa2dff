"""An accelerator lane end to end: its self-test, weights and KV cache in device memory, golden outputs
with layer ranges on the device, and a node that registers it with the tracker.

Runs on whichever accelerator the installed ggml-python was built with and finds a device for
(``scripts/build_ggml_lane.sh LANE``): a GPU, or, on a machine without one, Mesa's llvmpipe through the
Vulkan lane (``apt install mesa-vulkan-drivers``, ``GGML_VK_VISIBLE_DEVICES=0``), which runs ggml's
Vulkan kernels on the CPU. In the default CPU environment every test here is skipped, saying why.
"""

from __future__ import annotations

import json
import subprocess
import sys

import ggml
import pytest

from conftest import GOLDEN_DIR, TINY_MODELS, load_golden
from golden_check import check_against_golden, cpu_stage
from meshnet.backends import ACCELERATOR_LANES
from meshnet.contract import GREEDY, LayerRange
from meshnet.engine.ggml_backend import accelerator_devices, registry_backends


def _lane_with_device() -> str | None:
    return next((lane for lane in ACCELERATOR_LANES if accelerator_devices(lane)), None)


LANE = _lane_with_device()
pytestmark = pytest.mark.skipif(
    LANE is None, reason="the installed ggml-python has no accelerator backend with a device "
                         f"(registered: {', '.join(registry_backends())}); build one with "
                         "scripts/build_ggml_lane.sh")
TINY = GOLDEN_DIR / "models" / "tiny-llama-q8_0.gguf"
N_DECODE_MESH = 16
# Greedy ids checked per golden prompt on the device: llvmpipe takes about 70 ms a step even for the
# tiny models, so not all 64.
N_GEN_DEVICE = 16


def _certify_here() -> None:
    """Certify LANE into this run's MESHNET_CACHE_DIR (node subprocesses read the same one)."""
    from meshnet.backends.certify import certify

    res = certify(LANE, str(TINY))
    assert res.passed, res.reason


def _device_stage(path, layers: LayerRange):
    from meshnet.backends.placement import AcceleratorStage

    return AcceleratorStage(str(path), layers, LANE, n_ctx=512)


def _buffer_name(buf) -> str:
    return ggml.ggml_backend_buffer_name(buf).decode()


def test_lane_is_dark_until_its_self_test_passes_then_advertisable(tmp_path, monkeypatch, golden_dir):
    from meshnet.backends import lanes
    from meshnet.backends.certify import certify
    from meshnet.backends.errors import BackendUnavailable

    monkeypatch.setenv("MESHNET_CACHE_DIR", str(tmp_path / "fresh"))
    before = lanes.probe_lane(LANE)
    assert before.state == "built"
    assert before.reason == "not certified on this machine: run `meshnet backends --certify`"
    with pytest.raises(BackendUnavailable):
        lanes.require_certified(LANE)

    res = certify(LANE, str(TINY))
    assert res.passed and res.state == "certified", res.reason
    assert res.reference == "the CPU backend"
    assert res.max_dev is not None and res.max_dev <= res.logit_atol
    assert res.mean_dev <= res.logit_mean_atol
    assert res.top1_checked > 0 and res.top1_mismatches == 0
    assert res.n_values == res.n_positions * 10 > 0
    assert res.device["description"] == accelerator_devices(LANE)[0]["description"]

    after = lanes.require_certified(LANE)
    assert after.state == "certified" and after.certification["passed"] is True
    # A device that is not there is neither certified nor usable.
    missing = len(accelerator_devices(LANE))
    with pytest.raises(BackendUnavailable) as e:
        lanes.require_certified(LANE, device_index=missing)
    assert e.value.reason.endswith(f"lists {missing} device(s), no device {missing}")
    res = certify(LANE, str(TINY), device_index=missing)
    assert res.state == "skipped" and not res.passed and res.max_dev is None


def test_weights_and_kv_cache_live_in_device_memory(smollm2_path):
    stage = _device_stage(smollm2_path, LayerRange(12, 25))
    try:
        device_name = accelerator_devices(LANE)[0]["name"]
        assert _buffer_name(stage.weights.buffer) == device_name
        assert not ggml.ggml_backend_buffer_is_host(stage.weights.buffer)
        # Weights keep their stored types: Q4_1 blocks, not a dequantized copy.
        assert stage.weights.nbytes < 30_000_000
        assert ggml.ggml_backend_buffer_get_size(stage.weights.buffer) >= stage.weights.nbytes
        pool = stage.pool
        assert _buffer_name(pool.buffer) == device_name
        assert not ggml.ggml_backend_buffer_is_host(pool.buffer)
        assert ggml.ggml_backend_buffer_get_size(pool.buffer) >= pool.n_slots * 13 * 2 * stage.cfg.n_embd_k_gqa * 512 * 2
    finally:
        stage.close()


@pytest.mark.timeout(1800)  # llvmpipe compiles each kernel on first use: minutes with a cold shader cache
@pytest.mark.parametrize("name", TINY_MODELS)
def test_tiny_models_on_the_device_match_llama_cpp(golden_dir, name):
    """Every architecture's graph and every weight type runs on the device (both stages there): logits
    within the golden tolerance, and the first N_GEN_DEVICE greedy ids equal up to any near-tie."""
    golden = load_golden(name)
    report = check_against_golden(golden_dir / "models" / f"{name}.gguf", golden, n_stages=2,
                                  make_stage=_device_stage, n_gen=N_GEN_DEVICE)
    assert report["max_dev"] <= golden["tolerance"]["logit_atol"]
    for k, p in zip(report["greedy_equal"], golden["prompts"]):
        assert k == N_GEN_DEVICE or p["greedy_margins"][k] < golden["tolerance"]["margin_threshold"]


@pytest.mark.timeout(1800)  # llvmpipe: about 0.2 s a decode step for the ten middle layers
def test_smollm2_with_its_middle_on_the_device_matches_llama_cpp(smollm2_path, golden_dir):
    """A CPU head, the middle range on the device and a CPU tail: hidden states cross between backends."""
    middle = LayerRange(10, 20)

    def make(path, layers):
        return _device_stage(path, layers) if layers == middle else cpu_stage(path, layers)

    golden = load_golden("SmolLM2-135M-Instruct.Q4_1")
    report = check_against_golden(smollm2_path, golden, n_stages=3, make_stage=make, n_gen=N_GEN_DEVICE)
    assert report["max_dev"] <= golden["tolerance"]["logit_atol"]
    for k, p in zip(report["greedy_equal"], golden["prompts"]):
        assert k == N_GEN_DEVICE or p["greedy_margins"][k] < golden["tolerance"]["margin_threshold"]


@pytest.mark.timeout(1800)
def test_node_on_the_lane_registers_its_device_and_serves_golden_tokens(mesh, tok, golden_dir):
    from meshnet.generation import Generation
    from meshnet.proto import meshnet_pb2 as pb

    _certify_here()
    golden = load_golden("SmolLM2-135M-Instruct.Q4_1")
    mesh.start_nodes([("cpu-head", "0:12")])
    mesh.start_nodes([("dev-mid", "12:25")], "smollm2", "--backend", LANE)
    mesh.start_nodes([("cpu-tail", "25:30")])
    listed = {s.info.node_id: s.info for s in mesh.tracker_stub().ListNodes(pb.Empty(), timeout=5).nodes}
    dev = accelerator_devices(LANE)[0]
    mid = listed["dev-mid"]
    assert mid.backend == LANE and listed["cpu-head"].backend == "cpu"
    assert (mid.device.name, mid.device.description, mid.device.index) == (dev["name"], dev["description"], 0)
    assert mid.device.memory_total_bytes == dev["memory_total_bytes"] > 0
    assert mid.decode_tokens_per_s > 0
    p = golden["prompts"][0]
    client = mesh.client()
    try:
        gen = Generation(client, tok, p["prompt_ids"], N_DECODE_MESH, GREEDY,
                         stop_at_eog=False)
        for _ in gen:
            pass
        got = gen.result.generated_token_ids
        assert len(got) == N_DECODE_MESH and client.failovers == 0
        # Equal to llama.cpp's greedy ids up to the first near-tie at least (prompt 0 has one at step 14,
        # margin 0.06, where the device's rounding may pick the other token).
        k = next((i for i, (a, b) in enumerate(zip(got, p["greedy_ids"])) if a != b), N_DECODE_MESH)
        assert k == N_DECODE_MESH or p["greedy_margins"][k] < golden["tolerance"]["margin_threshold"]
        assert k >= 14
    finally:
        client.close()


@pytest.mark.timeout(1800)
def test_bench_engine_reports_the_lane_beside_the_cpu(tmp_path, golden_dir):
    _certify_here()
    out = tmp_path / "engine.json"
    proc = subprocess.run([sys.executable, "-m", "meshnet.cli", "bench", "engine", "--backend", LANE,
                           "--prompt-tokens", "32", "--decode-tokens", "8", "--repeats", "1", "--stages", "2",
                           "--no-llama-cpp", "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["accelerator"]["backend"] == LANE
    assert data["accelerator"]["decode_tokens_per_s"] > 0 and data["meshnet"]["1_stage"]["decode_tokens_per_s"] > 0
    assert data["prompt_tokens"] == 32 and data["accelerator"]["layers"] == ["0:30"]
    assert data["accelerator"]["device"]["description"] == accelerator_devices(LANE)[0]["description"]
    assert data["accelerator"]["vs_cpu_1_stage"]["decode_tokens_per_s"] == pytest.approx(
        data["accelerator"]["decode_tokens_per_s"] / data["meshnet"]["1_stage"]["decode_tokens_per_s"], abs=1e-3)
