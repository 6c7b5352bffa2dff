"""Range-only GGUF files whose carried tensor list (``meshnet.manifest.tensors``) lies or is garbage:
opening one fails with GGUFError naming the file or the tensor, never another exception."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from gguf_rewrite import rewrite_gguf
from meshnet.model.gguf_file import GGUFError, open_gguf
from meshnet.model.manifest import MANIFEST_TENSORS_KEY, listed_tensors, model_manifest
from meshnet.model.range_file import layout


@pytest.fixture(scope="module")
def range_file(qwen3moe_path, tmp_path_factory):
    """A range-only file of the tiny qwen3moe holding layer 0's tensors, and the model's manifest."""
    manifest = model_manifest(qwen3moe_path)
    held = {t.name: t for t in open_gguf(qwen3moe_path).tensors}
    lay = layout(manifest, [n for n in held if n.startswith("blk.0.")])
    path = tmp_path_factory.mktemp("range") / "L0-1.gguf"
    with open(path, "wb") as f:
        f.write(lay.header)
        f.truncate(lay.size)
        for name, offset in lay.offsets.items():
            f.seek(offset)
            f.write(held[name].data.reshape(-1).view("u1").tobytes())
    assert model_manifest(path).id == manifest.id
    return path, manifest


def _opened_with(range_file, tmp_path, listed: str) -> str:
    path, _ = range_file
    bad = rewrite_gguf(path, tmp_path / "bad.gguf", fields={MANIFEST_TENSORS_KEY: listed})
    with pytest.raises(GGUFError) as e:
        model_manifest(bad)
    return str(e.value)


def _entries(manifest, name: str | None = None, **change) -> list[dict]:
    return [dict(t.encode(), **change) if t.name == name else t.encode() for t in manifest.tensors]


def test_a_held_tensor_missing_from_the_list_is_named(range_file, tmp_path):
    listed = [e for e in _entries(range_file[1]) if e["name"] != "blk.0.attn_q.weight"]
    assert _opened_with(range_file, tmp_path, json.dumps(listed)) == (
        "bad.gguf: tensor 'blk.0.attn_q.weight' is not in the model manifest it carries")


def test_a_listed_shape_other_than_the_held_one_is_named_with_both(range_file, tmp_path):
    listed = _entries(range_file[1], "blk.0.attn_norm.weight", shape=[65])
    assert _opened_with(range_file, tmp_path, json.dumps(listed)) == (
        "bad.gguf: tensor 'blk.0.attn_norm.weight' is F32 [64], the manifest says F32 [65]")


class _Carrying:
    """A reader whose only metadata is ``meshnet.manifest.tensors`` holding ``listed`` (the key's parts as
    gguf-py's reader gives them), so the list's own checks run without rewriting a file for each."""

    def __init__(self, listed: str):
        self.field = SimpleNamespace(parts=[listed.encode()], data=[0])

    def get_field(self, key):
        return self.field if key == MANIFEST_TENSORS_KEY else None


def test_a_tensor_listed_twice_is_named(range_file):
    listed = _entries(range_file[1]) + _entries(range_file[1])[:1]
    with pytest.raises(GGUFError) as e:
        listed_tensors(_Carrying(json.dumps(listed)))
    assert str(e.value) == f"GGUF key {MANIFEST_TENSORS_KEY!r} lists tensor {listed[0]['name']!r} twice"


@pytest.mark.parametrize("garbage", ["{not json", '{"a": 1}', "[" * 100_000 + "]" * 100_000])
def test_a_list_that_is_not_a_json_tensor_list_is_named(garbage):
    with pytest.raises(GGUFError) as e:
        listed_tensors(_Carrying(garbage))
    assert str(e.value).startswith(f"GGUF key {MANIFEST_TENSORS_KEY!r} does not hold a JSON tensor list")


def test_writing_a_header_logs_nothing_a_user_would_see(range_file, tmp_path, caplog):
    """gguf-py's writer printed "This GGUF file is for Little Endian only" and the scratch header's file
    list into `meshnet api --model-id` and `meshnet node --fetch` output, which log at INFO."""
    from meshnet.model.range_file import write_metadata_file

    _, manifest = range_file
    with caplog.at_level("INFO"):
        written = write_metadata_file(manifest, tmp_path / "meta.gguf")
        layout(manifest, [t.name for t in manifest.tensors][:2])
    assert model_manifest(written).id == manifest.id
    assert [r.getMessage() for r in caplog.records if r.name.startswith("gguf")] == []
