"""Accelerator lanes: what is built, what is proved, and that nothing unproved is advertised.

On a CPU-only machine: the cpu lane passes a real logit comparison with llama.cpp's golden and is
certified; cuda, rocm, vulkan and metal are skipped with exact reasons (computed here from PATH and the
platform, so the expectations stay true on other machines); a node refuses ``--backend cuda`` before
loading anything; a node registers ``cpu`` with a real tracker; the build script refuses a missing
toolchain and prints exactly one switch per lane.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import GOLDEN_DIR, golden_exact, load_golden
from meshnet.backends import ACCELERATOR_LANES, LANE_NAMES, installed, lanes, toolchain
from meshnet.backends.certify import certify
from meshnet.backends.errors import BackendUnavailable
from meshnet.backends.lane_table import LANES

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "scripts" / "build_ggml_lane.sh"
CI = ROOT / "scripts" / "ci_matrix.sh"
TINY = GOLDEN_DIR / "models" / "tiny-llama-q8_0.gguf"
SWITCH = {"cuda": "-DGGML_CUDA=on", "rocm": "-DGGML_HIP=on", "vulkan": "-DGGML_VULKAN=on",
          "metal": "-DGGML_METAL=on"}
LIB = {"cuda": "ggml-cuda", "rocm": "ggml-hip", "vulkan": "ggml-vulkan", "metal": "ggml-metal"}

needs_golden = pytest.mark.skipif(not TINY.is_file(), reason=f"golden tiny model {TINY} not found")


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """Certifications go to a fresh directory per test, never the user's ~/.cache."""
    d = tmp_path / "cache"
    monkeypatch.setenv("MESHNET_CACHE_DIR", str(d))
    return d


def _env(cache_dir: Path, **extra) -> dict:
    env = dict(os.environ, MESHNET_CACHE_DIR=str(cache_dir), PYTHON=sys.executable, **extra)
    env["PYTHONPATH"] = str(ROOT / "src") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _lib_installed(lane: str) -> bool:
    d = installed.ggml_lib_dir()
    return d is not None and any((d / f"{p}{LIB[lane]}{s}").is_file()
                                 for p, s in (("lib", ".so"), ("lib", ".dylib"), ("", ".dll")))


def _cuda_headers_present() -> bool:
    return any((Path(d) / "cublas_v2.h").is_file() for d in toolchain._cuda_include_dirs())


def expected_skip_reason(lane: str) -> str | None:
    """The reason a lane must be skipped with on this machine, from PATH and the platform alone;
    None when this machine has enough of the lane that the reason is not predictable from them."""
    if lane == "metal":
        if sys.platform != "darwin":
            return f"platform {sys.platform} is not darwin"
        return None if shutil.which("xcrun") else "xcrun is not on PATH"
    tools = {"cuda": ["nvcc"], "rocm": ["hipcc", "hipconfig"], "vulkan": ["glslc"]}[lane]
    for t in tools:
        if shutil.which(t) is None:
            return f"{t} is not on PATH"
    if lane == "cuda":
        if not _cuda_headers_present():
            return None  # the cuBLAS reason lists directories; checked separately below
        if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
            return "no C++ compiler (c++, g++ or clang++) is on PATH"
        return None if shutil.which("nvidia-smi") else "nvidia-smi is not on PATH"
    if lane == "rocm":
        if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
            return "no C++ compiler (c++, g++ or clang++) is on PATH"
        return None if shutil.which("rocminfo") else "rocminfo is not on PATH"
    return None  # vulkan with glslc: headers, loader and device decide


# ---- the lane table and the probe -------------------------------------------------------------------

def test_each_lane_adds_exactly_one_switch_to_the_cpu_default():
    assert tuple(LANES) == LANE_NAMES == ("cpu", "cuda", "rocm", "vulkan", "metal")
    assert LANES["cpu"].cmake_switch is None
    for lane in ACCELERATOR_LANES:
        assert LANES[lane].cmake_switch == SWITCH[lane]


@pytest.mark.parametrize("lane", ACCELERATOR_LANES)
def test_accelerator_lane_is_skipped_with_the_exact_reason(lane):
    if _lib_installed(lane):
        pytest.skip(f"this ggml-python is built with {lane}")
    rep = lanes.probe_lane(lane)
    assert rep.state in ("skipped", "available")
    assert rep.certification is None and rep.state != "certified"
    expected = expected_skip_reason(lane)
    if lane == "cuda" and shutil.which("nvcc") and not _cuda_headers_present():
        expected = f"cublas_v2.h (cuBLAS) is not under {', '.join(toolchain._cuda_include_dirs())}"
    if expected is None:
        pytest.skip(f"this machine has enough of the {lane} toolchain that PATH alone cannot predict the reason")
    assert rep.state == "skipped"
    assert rep.reason == expected
    assert rep.problems[0] == expected
    assert rep.cmake_switch == SWITCH[lane]
    assert rep.ggml_python_version == "0.0.45"
    # Versions of every tool the lane uses are recorded, None for the absent ones.
    for tool in (*LANES[lane].build_tools, LANES[lane].device_tool):
        if tool:
            assert (rep.versions[tool] is None) == (shutil.which(tool) is None)


def _fake_vulkan_headers(root: Path, minor: int, patch: int, layer_settings: bool) -> Path:
    inc = root / "include" / "vulkan"
    inc.mkdir(parents=True)
    (inc / "vulkan.h").write_text('#include "vulkan_core.h"\n')
    (inc / "vulkan_core.h").write_text(
        f"#define VK_HEADER_VERSION {patch}\n"
        f"#define VK_HEADER_VERSION_COMPLETE VK_MAKE_API_VERSION(0, 1, {minor}, VK_HEADER_VERSION)\n"
        + ("#define VK_EXT_layer_settings 1\n" if layer_settings else ""))
    return root


def test_vulkan_headers_too_old_for_ggml_are_named_with_their_version(tmp_path, monkeypatch):
    old = _fake_vulkan_headers(tmp_path / "old", 3, 239, layer_settings=False)
    monkeypatch.setenv("VULKAN_SDK", str(old))
    expected = (f"the Vulkan headers under {old / 'include'} (1.3.239) lack VK_EXT_layer_settings, which "
                "ggml-vulkan needs: set VULKAN_SDK to a Vulkan SDK with headers 1.3.272 or newer")
    assert expected in toolchain.toolchain_problems("vulkan")
    assert lanes.probe_lane("vulkan").versions["vulkan-headers"] == "1.3.239"

    new = _fake_vulkan_headers(tmp_path / "new", 4, 309, layer_settings=True)
    monkeypatch.setenv("VULKAN_SDK", str(new))
    assert not any("Vulkan headers" in p for p in toolchain.toolchain_problems("vulkan"))
    assert toolchain.vulkan_headers_version(new / "include") == "1.4.309"


def test_nvcc_version_is_recorded_when_present():
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH")
    assert re.fullmatch(r"\d+\.\d+ \(V[\d.]+\)", lanes.probe_lane("cuda").versions["nvcc"])


@needs_golden
def test_cpu_lane_certified_by_a_real_logit_comparison_with_llama_cpp(cache_dir):
    before = lanes.probe_lane("cpu")
    assert before.state == "built" and "not certified" in before.reason and before.reason.startswith("usable: ")

    res = certify("cpu", str(TINY))
    golden = load_golden("tiny-llama-q8_0")  # the set for this ggml's CPU features, as certify picks it
    assert res.passed and res.state == "certified", res.reason
    assert res.reference == "llama.cpp golden tiny-llama-q8_0"
    assert res.logit_atol == golden["tolerance"]["logit_atol"]
    assert res.n_values == 360 and res.n_positions == 36  # 4 prompts x 9 positions x top-10
    assert 0 <= res.max_dev < res.logit_atol and res.mean_dev <= res.logit_mean_atol
    if golden_exact():  # ggml's own kernels on llama.cpp's features: its logits to their printed precision
        assert res.max_dev < 1e-3
    assert res.top1_checked > 0 and res.top1_mismatches == 0

    rec = json.loads((cache_dir / "certifications.json").read_text())["entries"][res.key]
    assert rec["max_dev"] == res.max_dev and rec["passed"] is True
    assert rec["lib_sha256"] == installed.lib_sha256()

    after = lanes.probe_lane("cpu")
    assert after.state == "certified"
    assert after.certification["max_dev"] == res.max_dev
    assert after.build_options["installed_libraries"] and "cpu_features" in after.build_options


@needs_golden
def test_a_certification_holds_only_for_the_libraries_it_tested(monkeypatch):
    assert certify("cpu", str(TINY)).passed
    monkeypatch.setattr(installed, "lib_sha256", lambda: "0" * 64)  # as if ggml-python were rebuilt
    rep = lanes.probe_lane("cpu")
    assert rep.state == "built" and "not certified" in rep.reason


@needs_golden
def test_wrong_logits_fail_the_self_test_and_stay_dark(monkeypatch):
    from meshnet.backends import certify as certify_mod

    real = certify_mod._run_rows

    def off_by_one(stage, seqs):
        rows = real(stage, seqs)
        rows[0][0] = rows[0][0] + 1.0  # one position wrong by a whole logit
        return rows

    monkeypatch.setattr(certify_mod, "_run_rows", off_by_one)
    res = certify("cpu", str(TINY))
    assert not res.passed and res.state == "failed"
    assert res.max_dev > res.logit_atol
    rep = lanes.probe_lane("cpu")
    assert rep.state == "built" and rep.reason.startswith("self-test failed: ")


@pytest.mark.parametrize("lane", ACCELERATOR_LANES)
def test_uncertified_accelerators_are_refused_and_cannot_certify(lane):
    rep = lanes.probe_lane(lane)
    if rep.state == "certified":
        pytest.skip(f"{lane} is certified on this machine")
    with pytest.raises(BackendUnavailable) as e:
        lanes.require_certified(lane)
    assert e.value.reason == rep.reason
    assert str(e.value) == f"backend {lane} is not usable here: {rep.reason}"
    if not _lib_installed(lane):
        res = certify(lane)
        assert res.state == "skipped" and not res.passed and res.reason == rep.reason
        assert res.max_dev is None  # nothing ran, so nothing is claimed


@pytest.mark.parametrize("lane", ACCELERATOR_LANES)
def test_device_placement_refuses_a_missing_backend(lane):
    from meshnet.engine.ggml_backend import accelerator_backend, registry_backends

    names = LANES[lane].registry_names
    if any(n in registry_backends() for n in names):
        pytest.skip(f"this ggml-python has the {lane} backend")
    with pytest.raises(BackendUnavailable) as e:
        accelerator_backend(lane)
    assert e.value.reason == (f"the installed ggml-python has no {names[0]} backend "
                              f"(registered: {', '.join(registry_backends())})")


@needs_golden
def test_accelerator_engine_never_falls_back_to_cpu():
    from meshnet.backends.placement import AcceleratorEngine
    from meshnet.contract import ArtifactId, LayerRange
    from meshnet.load_spec import LoadSpec
    from meshnet.engine.ggml_backend import registry_backends

    if "CUDA" in registry_backends():
        pytest.skip("this ggml-python has the CUDA backend")
    eng = AcceleratorEngine("cuda")
    out = eng.load(LoadSpec(path=str(TINY), artifact=ArtifactId("", LayerRange(0, 4))))
    assert not out.ok and "backend cuda is not usable here" in out.message
    assert eng.stage is None and not eng.loaded


# ---- meshnet backends --json --------------------------------------------------------------------------

@needs_golden
def test_backends_json_reports_every_lane(cache_dir):
    proc = subprocess.run([sys.executable, "-m", "meshnet.backends.cli", "--json", "--certify"],
                          capture_output=True, text=True, timeout=120, env=_env(cache_dir), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    assert [r["lane"] for r in rep["lanes"]] == list(LANE_NAMES)
    for r in rep["lanes"]:
        assert r["state"] in lanes.STATES and r["reason"]
        assert set(r) >= {"lane", "state", "reason", "cmake_switch", "buildable", "versions", "ggml_version",
                          "ggml_python_version", "build_options", "devices", "certification", "problems"}
        assert r["build_options"]["cmake_switch"] == r["cmake_switch"]
    by = {r["lane"]: r for r in rep["lanes"]}
    assert by["cpu"]["state"] == "certified"
    assert by["cpu"]["certification"]["max_dev"] < by["cpu"]["certification"]["logit_atol"]
    assert by["cpu"]["ggml_version"] == rep["environment"]["ggml"]["ggml"]
    for lane in ACCELERATOR_LANES:
        if not _lib_installed(lane):
            assert by[lane]["state"] in ("skipped", "available")
            test = next(t for t in rep["self_tests"] if t["lane"] == lane)
            assert test["state"] == "skipped" and test["reason"] == by[lane]["reason"]
    assert rep["advertisable"] == ["cpu"] + [n for n in rep["certified"] if n != "cpu"]
    env = rep["environment"]
    assert env["ggml"]["ggml_python"] == "0.0.45" and env["ggml"]["lib_sha256"]
    assert env["platform"]["system"] == sys.platform
    assert {"gcc", "cmake", "nvcc", "hipcc", "glslc", "xcrun"} <= set(env["toolchain"])
    assert (env["toolchain"]["nvcc"] is None) == (shutil.which("nvcc") is None)


def test_backends_table_without_certify_claims_nothing(cache_dir):
    from meshnet.backends.cli import backends_report, format_table

    rep = backends_report()
    assert rep["self_tests"] == [] and "cpu" not in rep["certified"]
    table = format_table(rep)
    for r in rep["lanes"]:
        assert f"{r['lane']}" in table and r["reason"] in table


# ---- the node -----------------------------------------------------------------------------------------

def test_node_backend_cuda_exits_2_before_loading_anything(cache_dir):
    rep = lanes.probe_lane("cuda")
    if rep.state == "certified":
        pytest.skip("cuda is certified on this machine")
    # A model path that does not exist: a node that loaded before checking would complain about it.
    proc = subprocess.run([sys.executable, "-m", "meshnet.cli", "node", "--backend", "cuda",
                           "--model", "/no/such/model.gguf", "--tracker", "127.0.0.1:9"],
                          capture_output=True, text=True, timeout=60, env=_env(cache_dir))
    assert proc.returncode == 2
    assert proc.stderr == f"error: backend cuda is not usable here: {rep.reason}\n"
    assert "MESHNET_NODE_READY" not in proc.stdout


def test_backends_refuses_a_negative_device_index(cache_dir):
    proc = subprocess.run([sys.executable, "-m", "meshnet.cli", "backends", "--device", "-1"],
                          capture_output=True, text=True, timeout=60, env=_env(cache_dir))
    assert proc.returncode == 2
    assert proc.stderr == "error: --device must be 0 or more, got -1\n"


def test_node_refuses_a_negative_device_index(cache_dir):
    proc = subprocess.run([sys.executable, "-m", "meshnet.cli", "node", "--backend", "vulkan", "--device", "-1",
                           "--model", "/no/such/model.gguf"], capture_output=True, text=True, timeout=60,
                          env=_env(cache_dir))
    assert proc.returncode == 2
    assert proc.stderr == "error: --device must be 0 or more, got -1\n"


@needs_golden
def test_build_engine_refuses_an_uncertified_accelerator():
    from meshnet.node.config import NodeConfig
    from meshnet.node.engine_loader import build_engine

    if lanes.probe_lane("vulkan").state == "certified":
        pytest.skip("vulkan is certified on this machine")
    with pytest.raises(BackendUnavailable):
        build_engine(NodeConfig(model=str(TINY), layers=None, backend="vulkan"))


@needs_golden
@pytest.mark.slow
def test_node_registers_cpu_and_no_accelerator_with_the_tracker(cache_dir):
    from mesh_util import Mesh

    from meshnet.proto import meshnet_pb2 as pb

    mesh = Mesh()
    try:
        mesh.start_nodes([("lane-node", "0:4")], str(TINY), "--backend", "cpu")
        infos = mesh.tracker_stub().ListNodes(pb.Empty(), timeout=5).nodes
        assert [n.info.backend for n in infos] == ["cpu"]
        assert infos[0].info.decode_tokens_per_s > 0 and infos[0].info.free_memory_bytes > 0
    finally:
        mesh.close()


# ---- scripts/build_ggml_lane.sh ----------------------------------------------------------------------

def _build(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(BUILD), *args], capture_output=True, text=True, timeout=60, env=env,
                          cwd=ROOT)


def test_build_script_refuses_cuda_without_nvcc(cache_dir, tmp_path):
    # PATH without any directory that holds nvcc, so the expectation holds on CUDA machines too.
    path = os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep)
                           if d and not (Path(d) / "nvcc").exists())
    proc = _build("--venv", str(tmp_path / "venv"), "cuda", env=_env(cache_dir, PATH=path))
    assert proc.returncode == 3
    assert proc.stderr.strip() == "error: cannot build the cuda lane here: nvcc is not on PATH"
    assert proc.stdout == ""


@pytest.mark.parametrize("lane", ACCELERATOR_LANES)
def test_build_script_gives_the_probe_reason(lane, cache_dir, tmp_path):
    problem = toolchain.build_problem(lane)
    if problem is None:
        pytest.skip(f"the {lane} lane can be built here; not building it in a test")
    proc = _build("--venv", str(tmp_path / "venv"), lane, env=_env(cache_dir))
    assert proc.returncode == 3
    assert proc.stderr.strip() == f"error: cannot build the {lane} lane here: {problem}"


def test_build_script_dry_run_cpu_is_the_default_build(cache_dir):
    proc = _build("--dry-run", "cpu", env=_env(cache_dir))
    assert proc.returncode == 0, proc.stderr
    cmd = proc.stdout.strip()
    assert "\n" not in cmd
    assert cmd == (".venv/bin/python -m pip install --force-reinstall --no-deps --no-cache-dir "
                   "--no-binary ggml-python ggml-python==0.0.45")
    assert "CMAKE_ARGS" not in cmd and "-D" not in cmd


@pytest.mark.parametrize("lane", ACCELERATOR_LANES)
def test_build_script_dry_run_adds_exactly_one_switch(lane, cache_dir):
    # --dry-run skips the toolchain check, so this runs on machines without the SDK.
    env = _env(cache_dir)
    for var in ("HIPCXX", "HIP_PATH"):
        env.pop(var, None)
    proc = _build("--dry-run", "--venv", "/opt/lane-venv", lane, env=env)
    assert proc.returncode == 0, proc.stderr
    cmd = proc.stdout.strip()
    assert re.findall(r"-D\w+=\w+", cmd) == [SWITCH[lane]]
    assert cmd.count(SWITCH[lane]) == 1
    # rocm also names ROCm's compiler through the environment (HIPCXX), which is not a CMake switch.
    env = 'HIPCXX="$(hipconfig -l)/clang" HIP_PATH="$(hipconfig -R)" ' if lane == "rocm" else ""
    assert cmd == (f"{env}CMAKE_ARGS={SWITCH[lane]} /opt/lane-venv/bin/python -m pip install --force-reinstall "
                   "--no-deps --no-cache-dir --no-binary ggml-python ggml-python==0.0.45")
    problem = toolchain.build_problem(lane)
    if problem:
        assert f"here it would refuse: {problem}" in proc.stderr


def test_build_script_pins_the_project_ggml_python():
    pin = re.search(r'"ggml-python==([\d.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert f'GGML_PYTHON_VERSION="{pin}"' in BUILD.read_text()


@pytest.mark.parametrize("args, status, message", [
    ([], 2, "which lane?"),
    (["opencl"], 2, "unknown lane 'opencl'"),
    (["--venv", "/no/such/venv", "cpu"], 2, "no virtual environment at /no/such/venv"),
])
def test_build_script_usage_errors(args, status, message, cache_dir):
    if args[-1:] == ["cpu"] and toolchain.build_problem("cpu"):
        pytest.skip("no C++ compiler here")
    proc = _build(*args, env=_env(cache_dir))
    assert proc.returncode == status and message in proc.stderr


def test_build_record_checks_the_backend_is_really_there(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    assert lanes.main(["record", "cpu", "--cmake-args", "", "--command", "pip install ..."]) == 0
    rec = installed.build_record()
    assert rec["lane"] == "cpu" and rec["stale"] is False and rec["lib_sha256"] == installed.lib_sha256()
    assert lanes.probe_lane("cpu").build_options["recorded_build"]["command"] == "pip install ..."
    if not _lib_installed("cuda"):
        assert lanes.main(["record", "cuda", "--cmake-args=-DGGML_CUDA=on"]) == 4
        assert "not CUDA" in capsys.readouterr().err


# ---- scripts/ci_matrix.sh ----------------------------------------------------------------------------

@needs_golden
def test_ci_matrix_certifies_cpu_and_skips_the_rest(cache_dir, tmp_path):
    out = tmp_path / "backends.json"
    proc = subprocess.run(["bash", str(CI), "--out", str(out)], capture_output=True, text=True, timeout=180,
                          env=_env(cache_dir), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rep = json.loads(out.read_text())
    assert rep["ci"] == {"verdict": "pass", "problems": []}
    by = {r["lane"]: r for r in rep["lanes"]}
    assert by["cpu"]["state"] == "certified"
    assert math.isfinite(by["cpu"]["certification"]["max_dev"])
    for lane in ACCELERATOR_LANES:
        line = next(ln for ln in proc.stdout.splitlines() if ln.startswith(f"{lane} ") and "pip" not in ln)
        assert by[lane]["state"] in line and by[lane]["reason"] in line
        if not _lib_installed(lane):
            assert by[lane]["state"] in ("skipped", "available")
    assert rep["advertisable"] == ["cpu"] + [n for n in rep["certified"] if n != "cpu"]


# ---- a foreign ggml in the process -----------------------------------------------------------------

def test_foreign_ggml_libraries_are_those_outside_the_bindings_folder():
    from meshnet.engine.ggml_backend import _mapped_files, foreign_ggml_libraries

    maps = ("7f00-7f10 r-xp 00000000 08:01 11 /venv/ggml/lib/libggml.so\n"
            "7f10-7f20 r-xp 00000000 08:01 12 /opt/llama.cpp/build/bin/libggml-cpu.so\n"
            "7f20-7f30 r--p 00000000 08:01 12 /opt/llama.cpp/build/bin/libggml-cpu.so\n"
            "7f30-7f40 r-xp 00000000 08:01 13 /opt/llama.cpp/build/bin/libggml-base.so.0\n"
            "7f40-7f50 r-xp 00000000 08:01 14 /usr/lib/libz.so.1\n"
            "7f50-7f60 rw-p 00000000 00:00 0 \n"
            "7ffd-7ffe rw-p 00000000 00:00 0                          [stack]\n")
    mapped = _mapped_files(maps)
    assert mapped[0] == "/venv/ggml/lib/libggml.so" and len(mapped) == 5
    own = ["/venv/ggml/lib/libggml.so", "/venv/ggml/lib/libggml-cpu.so", "/venv/ggml/lib/libggml-base.so"]
    assert foreign_ggml_libraries(mapped, own) == ["/opt/llama.cpp/build/bin/libggml-base.so.0",
                                                  "/opt/llama.cpp/build/bin/libggml-cpu.so"]
    assert foreign_ggml_libraries(mapped[:1] + mapped[4:], own) == []


def test_a_foreign_libggml_cpu_on_ld_library_path_stops_generate_with_its_path(tmp_path, smollm2_path):
    """Any other shared object named libggml-cpu.so on LD_LIBRARY_PATH gets mapped next to the bindings'."""
    import _ctypes

    fake = tmp_path / "llama.cpp-build"
    fake.mkdir()
    shutil.copy(_ctypes.__file__, fake / "libggml-cpu.so")
    env = dict(os.environ, LD_LIBRARY_PATH=str(fake))
    p = subprocess.run([sys.executable, "-c", "import sys; from meshnet.cli import main; sys.exit(main())",
                        "generate", "--max-tokens", "1", "Hi"], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert f"{fake / 'libggml-cpu.so'}" in p.stderr and "outside ggml-python's" in p.stderr
    assert "backend cpu is not usable here" in p.stderr and f"LD_LIBRARY_PATH='{fake}'" in p.stderr
