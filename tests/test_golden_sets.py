"""Which kernels ran and which goldens hold: ggml's CPU feature queries, llama.cpp's system_info
strings, and the choice of golden set (plain data, plus the real ../shared/golden when present)."""

from __future__ import annotations

import json
import subprocess
import sys

import ggml
import pytest

from conftest import GOLDEN_DIR
from meshnet.backends.cpu_features import describe, ggml_cpu_features, parse_system_info
from meshnet.backends.golden_sets import golden_sets, select_golden_set

AVX2_INFO = "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 |"
AVX512_INFO = ("CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | AVX512 = 1 | "
               "AVX512_VBMI = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 |")
AVX2 = frozenset({"SSE3", "SSSE3", "AVX", "AVX2", "F16C", "FMA", "BMI2"})
AVX512 = AVX2 | {"AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16"}


def test_system_info_parses_to_simd_features_without_build_options():
    assert parse_system_info(AVX2_INFO) == AVX2
    assert parse_system_info(AVX512_INFO) == AVX512
    assert parse_system_info("CPU : NEON = 1 | ARM_FMA = 1 | SVE_CNT = 16 | OPENMP = 1 | KLEIDIAI = 0 |") == \
        {"NEON", "ARM_FMA"}
    with pytest.raises(ValueError, match="not a llama.cpp system_info string"):
        parse_system_info("AMD EPYC")
    assert describe(AVX512) == "SSE3 SSSE3 AVX AVX2 F16C FMA BMI2 AVX512 AVX512_VBMI AVX512_VNNI AVX512_BF16"


def test_features_are_ggml_own_queries_of_its_build():
    feats = ggml_cpu_features()
    ggml.ggml_cpu_init()
    assert ("AVX2" in feats) == bool(ggml.ggml_cpu_has_avx2())
    assert ("AVX512" in feats) == bool(ggml.ggml_cpu_has_avx512())
    assert ("NEON" in feats) == bool(ggml.ggml_cpu_has_neon())
    assert not {"LLAMAFILE", "OPENMP", "REPACK"} & set(feats)


def _write_set(folder, info: str, names=("m1", "m2")):
    folder.mkdir(parents=True, exist_ok=True)
    for n in names:
        (folder / f"{n}.json").write_text(json.dumps({"llama_cpp": {"system_info": info}, "prompts": []}))


@pytest.fixture
def root(tmp_path):
    _write_set(tmp_path, AVX2_INFO)
    _write_set(tmp_path / "avx512", AVX512_INFO)
    (tmp_path / "models").mkdir()
    _write_set(tmp_path / "models-moe", AVX2_INFO)  # holds models, never a golden set
    return tmp_path


def test_each_feature_set_picks_its_golden_or_falls_to_rule_3(root):
    assert [(s.name, s.features) for s in golden_sets(root, AVX2)] == [("top", AVX2), ("avx512", AVX512)]
    s = select_golden_set(root, AVX2)
    assert (s.name, s.exact, s.directory) == ("top", True, root)
    assert "exact" in s.rule
    s = select_golden_set(root, AVX512)
    assert (s.name, s.exact, s.directory) == ("avx512", True, root / "avx512")
    # AVX-512 without VNNI (Skylake-X) has no exact golden: rule 3 against the closest set.
    s = select_golden_set(root, AVX512 - {"AVX512_VNNI", "AVX512_BF16", "AVX512_VBMI"})
    assert (s.name, s.exact) == ("avx512", False)
    assert "rule 3" in s.rule and "SSE3 SSSE3 AVX AVX2 F16C FMA BMI2 AVX512)" in s.rule
    # AVX2 with AVX_VNNI (Alder Lake) also sums differently: not exact.
    assert not select_golden_set(root, AVX2 | {"AVX_VNNI"}).exact
    # An ARM machine shares nothing: the top set, by rule 3.
    s = select_golden_set(root, {"NEON", "ARM_FMA", "DOTPROD"})
    assert (s.name, s.exact) == ("top", False)
    assert select_golden_set(root / "models", AVX2) is None


def test_a_file_made_on_other_features_than_its_set_is_refused(root):
    _write_set(root / "avx512", AVX2_INFO, names=("stray",))
    s = select_golden_set(root, AVX512)
    assert s.load("m1") == {"llama_cpp": {"system_info": AVX512_INFO}, "prompts": []}
    assert s.load("no-such-model") is None
    with pytest.raises(ValueError, match="stray.json was made with SSE3"):
        s.load("stray")


@pytest.mark.skipif(not (GOLDEN_DIR / "avx512").is_dir(), reason=f"no avx512 golden set under {GOLDEN_DIR}")
def test_shared_goldens_hold_an_avx2_and_an_avx512_set():
    by_name = {s.name: s for s in golden_sets(GOLDEN_DIR, ggml_cpu_features())}
    assert by_name["top"].features == AVX2 and by_name["avx512"].features == AVX512
    chosen = select_golden_set(GOLDEN_DIR, ggml_cpu_features())
    assert chosen.exact == (frozenset(ggml_cpu_features()) in (AVX2, AVX512))


def test_meshnet_backends_names_the_kernels_and_the_goldens():
    out = subprocess.run([sys.executable, "-m", "meshnet.cli", "backends", "--json"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["environment"]["ggml"]["cpu_features"] == list(ggml_cpu_features())
    if GOLDEN_DIR.is_dir():
        chosen = select_golden_set(GOLDEN_DIR, ggml_cpu_features())
        assert report["goldens"] == {"set": chosen.name, "directory": str(chosen.directory),
                                     "exact": chosen.exact, "rule": chosen.rule}
    table = subprocess.run([sys.executable, "-m", "meshnet.cli", "backends"], capture_output=True, text=True,
                           timeout=120).stdout
    assert f"CPU kernels compiled for: {' '.join(ggml_cpu_features())}" in table.splitlines()


def test_rule_3_allows_a_divergence_only_at_a_golden_near_tie():
    from golden_check import assert_greedy_matches

    golden = {"tolerance": {"margin_threshold": 1.0},
              "prompts": [{"greedy_ids": [5, 6, 7, 8], "greedy_margins": [3.0, 2.0, 0.4, 5.0],
                           "greedy_steps_before_first_near_tie": 2}]}
    assert_greedy_matches(golden, 0, [5, 6, 7, 8], exact=True)
    assert_greedy_matches(golden, 0, [5, 6, 9, 9], exact=False)  # parts at step 2, margin 0.4 < 1.0
    with pytest.raises(AssertionError, match="!= golden"):
        assert_greedy_matches(golden, 0, [5, 6, 9, 9], exact=True)
    with pytest.raises(AssertionError, match="diverged at step 1"):
        assert_greedy_matches(golden, 0, [5, 9, 7, 8], exact=False)  # before the first near-tie
    golden["prompts"][0]["greedy_steps_before_first_near_tie"] = 0
    with pytest.raises(AssertionError, match="golden margin is 2.0"):
        assert_greedy_matches(golden, 0, [5, 9, 7, 8], exact=False)  # at a clear margin
