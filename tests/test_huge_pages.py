"""Weights copied into memory backed by transparent huge pages: which tensors move, that the pages are
huge, and that every result keeps its bits (the bytes and kernels are the same)."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from meshnet.contract import LayerRange
from meshnet.engine import huge_pages
from meshnet.engine.ggml_stage import GgmlStage

needs_thp = pytest.mark.skipif(not huge_pages.huge_pages_available(),
                               reason=f"the kernel offers no transparent huge pages here "
                                      f"(THP setting: {huge_pages.thp_mode() or 'none'})")


@pytest.mark.parametrize("text, mode", [("always [madvise] never\n", "madvise"), ("[always] madvise never", "always"),
                                        ("always madvise [never]", "never"), ("garbage", "")])
def test_the_thp_setting_is_the_bracketed_word(tmp_path, text, mode):
    f = tmp_path / "enabled"
    f.write_text(text)
    assert huge_pages.thp_mode(f) == mode
    assert huge_pages.thp_mode(tmp_path / "absent") == ""


@needs_thp
def test_only_whole_huge_pages_are_advised():
    area = mmap.mmap(-1, 8 * huge_pages.HUGE_PAGE_BYTES)
    try:
        base = np.frombuffer(area, np.uint8).ctypes.data
        assert huge_pages.advise_huge_pages(base + 4096, 4 * huge_pages.HUGE_PAGE_BYTES)
        # 1 MiB from an unaligned start holds no whole 2 MiB page: nothing to advise
        start = -(-base // huge_pages.HUGE_PAGE_BYTES) * huge_pages.HUGE_PAGE_BYTES + 4096
        assert not huge_pages.advise_huge_pages(start, 1 << 20)
    finally:
        area.close()


def _anon_huge_kib(address: int) -> int:
    """AnonHugePages (KiB) of the mapping of this process that holds ``address``."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    return 0


@needs_thp
def test_a_stage_serves_its_weights_from_huge_pages(smollm2_path):
    """SmolLM2 ties its output to the token embedding: the tail copies it with the rest, the head keeps
    it mapped (it only looks rows up in it); the copies sit on huge pages."""
    import ggml

    head = GgmlStage(smollm2_path, LayerRange(0, 2), n_threads=1, n_ctx=64, n_slots=1)
    tail = GgmlStage(smollm2_path, LayerRange(28, 30), n_threads=1, n_ctx=64, n_slots=1)
    try:
        assert "token_embd.weight" not in head.huge_paged
        assert head.weights.mapped_names() == ["token_embd.weight"]
        assert len(head.huge_paged) == 2 * 9  # 7 matrices and 2 norms a block
        assert "token_embd.weight" in tail.huge_paged and "output_norm.weight" in tail.huge_paged
        assert tail.weights.mapped_names() == []
        w = tail.weights.get("token_embd.weight")
        huge_kib = _anon_huge_kib(int(ggml.ggml_get_data(w) or 0))
        defrag = huge_pages.thp_mode(huge_pages.THP_ENABLED.with_name("defrag"))
        if huge_kib == 0 and defrag not in ("always", "defer+madvise", "madvise"):
            pytest.skip(f"the kernel had no free huge page and may not compact for one (THP defrag: {defrag})")
        assert huge_kib >= huge_pages.HUGE_PAGE_BYTES // 1024
    finally:
        head.close()
        tail.close()


def test_huge_pages_change_no_bit(smollm2_path):
    """The same prompt through the whole model, weights mapped and copied: the logits are equal bit for
    bit (on a machine without THP both stay mapped, and the test still holds)."""
    prompt = np.asarray([1, 504, 3458, 28, 253, 1345, 282, 2], np.int32)
    out = []
    for copy in (False, True):
        stage = GgmlStage(smollm2_path, LayerRange(0, 30), n_threads=2, n_ctx=64, n_slots=1, huge_pages=copy)
        try:
            assert bool(stage.huge_paged) == (copy and huge_pages.huge_pages_available())
            kv = stage.new_session(reserve_tokens=32)
            out.append(stage.forward(kv, 0, token_ids=prompt)[-1].tobytes())
        finally:
            stage.close()
    assert out[0] == out[1]


def test_weights_that_would_take_most_of_the_memory_stay_mapped(smollm2_path, monkeypatch):
    """Mapped, a stage's pages are the file's and can be evicted; copied they could not: a stage whose
    weights exceed half the memory available keeps them mapped."""
    monkeypatch.setattr(huge_pages, "huge_pages_available", lambda: True)
    stage = GgmlStage(smollm2_path, LayerRange(0, 30), n_threads=1, n_ctx=64, n_slots=1)
    try:
        weight_bytes = stage.weights.nbytes
    finally:
        stage.close()
    assert weight_bytes == 96_576_768  # SmolLM2-135M Q4_1, every tensor
    for available, copied in ((2 * weight_bytes, True), (2 * weight_bytes - 1, False)):
        monkeypatch.setattr(huge_pages, "available_memory_bytes", lambda a=available: a)
        stage = GgmlStage(smollm2_path, LayerRange(0, 30), n_threads=1, n_ctx=64, n_slots=1)
        try:
            assert bool(stage.huge_paged) == copied
            assert stage.weights.mapped_names() == ([] if copied else list(stage.weights.tensors))
        finally:
            stage.close()


@pytest.mark.parametrize("command", [["api"], ["generate", "hi"], ["up"], ["node", "--tracker", "h:1"]])
def test_every_command_that_loads_stages_takes_no_huge_pages(command):
    from meshnet.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(command).huge_pages is True
    assert parser.parse_args(command + ["--no-huge-pages"]).huge_pages is False


def test_the_api_in_process_leaves_weights_mapped_when_asked(smollm2_path):
    from meshnet.api.backend import local_backend

    backend = local_backend(str(smollm2_path), n_ctx=64, max_sessions=1, huge_pages=False)
    stage = backend.chain.stages[0].stage
    assert stage.huge_paged == [] and stage.repacked == []  # SmolLM2's Q4_1 has no repacked kernel
    assert stage.weights.mapped_names() == list(stage.weights.tensors)


def test_stages_on_one_machine_take_turns_to_copy(smollm2_path, tmp_path, monkeypatch):
    """While another holder (here this test, on a file description of its own, as another process's would
    be) has the machine's turn, a stage does not even judge the memory available: it waits, then judges
    what the copies before it left."""
    import threading

    lock = tmp_path / "turn.lock"
    judged = threading.Event()
    real = huge_pages.worth_copying

    def worth(reader, names):
        judged.set()
        return real(reader, names)

    from meshnet.engine import ggml_stage

    monkeypatch.setattr(ggml_stage, "worth_copying", worth)
    monkeypatch.setattr(ggml_stage, "copy_turn", lambda: huge_pages.copy_turn(lock))
    loaded = []
    with huge_pages.copy_turn(lock):
        t = threading.Thread(target=lambda: loaded.append(
            GgmlStage(smollm2_path, LayerRange(0, 2), n_threads=1, n_ctx=64, n_slots=1)))
        t.start()
        assert not judged.wait(1.0)  # still waiting for the turn held here
    t.join(60)
    assert judged.is_set() and len(loaded) == 1
    loaded[0].close()
