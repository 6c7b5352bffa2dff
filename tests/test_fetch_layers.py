"""Model identity by manifest, and nodes that fetch only their layers (SmolLM2-135M, 30 layers).

In-process peers serve tensors through :class:`meshnet.node.tensor_source.TensorSource` (a corrupting
and an interrupting variant beside the honest one); the mesh test runs real node processes.
"""

from __future__ import annotations

import json
import os
import subprocess
from concurrent import futures

import grpc
import pytest

from gguf_rewrite import rewrite_gguf
from meshnet.contract import LayerRange
from meshnet.model.gguf_file import GGUFError, open_gguf, range_tensor_names
from meshnet.model.manifest import model_id, model_manifest
from meshnet.model.range_file import write_metadata_file
from meshnet.node.fetch import FetchError, fetch_range
from meshnet.node.tensor_source import TensorSource
from meshnet.proto import meshnet_pb2 as pb
from meshnet.proto import meshnet_pb2_grpc as pb_grpc
from meshnet.wire.envelope import PROTOCOL_MAJOR, PROTOCOL_MINOR
from mesh_util import Mesh, run_generate

MIDDLE = LayerRange(10, 20)


class _Peer(pb_grpc.NodeServicer):
    """FetchTensors from a file; ``corrupt``: flip one byte of that tensor; ``stop_after``: end the
    stream (UNAVAILABLE) after that many whole tensors."""

    def __init__(self, path, corrupt: str | None = None, stop_after: int | None = None):
        self.source = TensorSource(str(path), model_id(path))
        self.corrupt, self.stop_after = corrupt, stop_after

    def FetchTensors(self, request, context):
        sent = set()
        for c in self.source.chunks(request):
            if self.stop_after is not None and c.name not in sent and len(sent) == self.stop_after:
                context.abort(grpc.StatusCode.UNAVAILABLE, "peer went away")
            sent.add(c.name)
            if c.name == self.corrupt and c.offset == 0:
                c = pb.TensorChunk(name=c.name, offset=c.offset, total_bytes=c.total_bytes,
                                   data=bytes([c.data[0] ^ 1]) + c.data[1:])
            yield c


@pytest.fixture
def peer():
    servers = []

    def start(servicer) -> tuple[str, str]:
        server = grpc.server(futures.ThreadPoolExecutor(4))
        pb_grpc.add_NodeServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return ("peer", f"127.0.0.1:{port}")

    yield start
    for s in servers:
        s.stop(0)


def _fetch(path, dest, peers, layers=MIDDLE):
    return fetch_range(model_manifest(path), layers, dest, peers, grpc.insecure_channel, progress=False)


def _range_bytes(path, layers) -> int:
    m = model_manifest(path)
    by = m.by_name()
    return sum(by[n].n_bytes for n in range_tensor_names(m.tensors, layers, 30))


def test_one_id_for_a_single_file_a_split_set_a_range_only_file_and_a_metadata_file(
        smollm2_path, tmp_path, peer):
    rewrite_gguf(smollm2_path, tmp_path / "m.gguf", split_max_tensors=80)
    shards = sorted(tmp_path.glob("m-*-of-*.gguf"))
    assert len(shards) == 4
    got = _fetch(smollm2_path, tmp_path / "models", [peer(_Peer(smollm2_path))])
    meta = write_metadata_file(model_manifest(smollm2_path), tmp_path / "meta.gguf")
    single = model_id(smollm2_path)
    assert {model_id(shards[0]), model_id(shards[3]), model_id(got.path), model_id(meta)} == {single}
    assert got.model_id == single
    held = {t.name for t in open_gguf(got.path).tensors}
    assert len(held) == 90 and all(n.startswith(tuple(f"blk.{i}." for i in range(10, 20))) for n in held)


def test_a_third_of_the_layers_moves_a_fraction_of_the_file(smollm2_path, tmp_path, peer):
    got = _fetch(smollm2_path, tmp_path, [peer(_Peer(smollm2_path))])
    size = os.path.getsize(smollm2_path)
    assert got.bytes_moved == got.range_bytes == _range_bytes(smollm2_path, MIDDLE) == 22_164_480
    assert got.bytes_moved / size <= 0.36  # 0.225 of the file
    assert os.path.getsize(got.path) < 0.25 * size
    # Fetched again: the file is complete and verifies, nothing moves.
    assert _fetch(smollm2_path, tmp_path, [peer(_Peer(smollm2_path))]).bytes_moved == 0


def test_a_peer_whose_bytes_do_not_verify_is_refused_naming_the_tensor(smollm2_path, tmp_path, peer):
    bad = "blk.12.ffn_up.weight"
    with pytest.raises(FetchError, match=f"tensor '{bad}' whose bytes hash to .* refused"):
        _fetch(smollm2_path, tmp_path, [peer(_Peer(smollm2_path, corrupt=bad))])
    assert not list(tmp_path.glob("*.gguf"))  # only the .part: nothing a node could load
    # An honest peer after it completes the range, fetching only what was not verified.
    got = _fetch(smollm2_path, tmp_path, [peer(_Peer(smollm2_path))])
    assert model_id(got.path) == model_id(smollm2_path)


def test_a_models_dir_that_is_a_file_is_named_not_a_traceback(smollm2_path, tmp_path, peer):
    """--models-dir naming a file (or a folder under one) raised FileExistsError / NotADirectoryError."""
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for where in (a_file, a_file / "sub"):
        with pytest.raises(ValueError, match=f"cannot keep range files in {where}: "):
            _fetch(smollm2_path, where, [peer(_Peer(smollm2_path))])


def test_an_interrupted_fetch_resumes_and_moves_only_what_is_missing(smollm2_path, tmp_path, peer):
    with pytest.raises(FetchError, match="UNAVAILABLE: peer went away"):
        _fetch(smollm2_path, tmp_path, [peer(_Peer(smollm2_path, stop_after=40))])
    m = model_manifest(smollm2_path)
    by = m.by_name()
    names = range_tensor_names(m.tensors, MIDDLE, 30)
    first = sum(by[n].n_bytes for n in names[:40])
    got = _fetch(smollm2_path, tmp_path, [peer(_Peer(smollm2_path))])
    assert got.bytes_moved == got.range_bytes - first == 12_812_544


def test_a_truncated_range_only_file_fails_at_start_naming_the_tensor(smollm2_path, tmp_path, peer):
    from meshnet.engine.ggml_engine import GgmlEngine
    from meshnet.contract import ArtifactId
    from meshnet.load_spec import LoadSpec

    got = _fetch(smollm2_path, tmp_path, [peer(_Peer(smollm2_path))])
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(got.path.read_bytes()[:-300_000])
    out = GgmlEngine().load(LoadSpec(path=str(cut), artifact=ArtifactId("", MIDDLE)))
    assert not out.ok and "truncated GGUF: tensor 'blk.19." in out.message
    flipped = bytearray(got.path.read_bytes())
    flipped[-100] ^= 1
    (tmp_path / "flip.gguf").write_bytes(bytes(flipped))
    with pytest.raises(GGUFError, match=r"flip.gguf: tensor 'blk\.19\.[a-z_.]+' is corrupt"):
        model_id(tmp_path / "flip.gguf")


def test_a_node_fetching_the_middle_third_generates_what_whole_file_nodes_do(smollm2_path, tmp_path):
    mesh = Mesh()
    try:
        a, b, c = mesh.start_nodes([("a", "0:10"), ("b", "10:20"), ("c", "20:30")], str(smollm2_path),
                                   "--in-process-engine")
        args = ("--max-tokens", "8", "--ignore-eos")
        whole = run_generate(mesh.tracker, "The capital of France is", "--model", str(smollm2_path), *args)
        assert whole.returncode == 0, whole.stderr
        ids = json.loads(whole.stdout.splitlines()[-1])["generated_token_ids"]
        assert len(ids) == 8
        mid = model_id(smollm2_path)
        proc = mesh.spawn_node("10:20", "f", None, "--in-process-engine", "--fetch",
                               "smollm2 135M 8k Lc100K Mix1 Ep2", "--models-dir", str(tmp_path))
        fetched = proc.stdout.readline()
        assert fetched.startswith("MESHNET_FETCHED"), fetched
        moved = int(dict(kv.split("=", 1) for kv in fetched.split()[1:])["bytes_moved"])
        assert moved == 22_164_480 and moved / os.path.getsize(smollm2_path) <= 0.36
        assert proc.stdout.readline().startswith("MESHNET_NODE_READY")
        b.proc.terminate()  # drains and deregisters: the route's middle must be the fetched node
        b.proc.wait(timeout=30)
        mesh.wait_registered({"a", "c", "f"})
        assert mesh.registered() == {"a", "c", "f"}
        # the bundled name, as the nodes were started with, names the model's id at the tracker
        fetched_run = run_generate(mesh.tracker, "The capital of France is", "--model-id", "smollm2", *args)
        assert fetched_run.returncode == 0, fetched_run.stderr
        assert json.loads(fetched_run.stdout.splitlines()[-1])["generated_token_ids"] == ids
        # `meshnet api --model-id` without the file: the same text, under the bundled name however the
        # model was named (its id's prefix served it as its general.name, where "smollm2" served "smollm2")
        from fastapi.testclient import TestClient

        from meshnet.api.app import create_app
        from meshnet.api.server import build_backend
        from meshnet.cli import build_parser
        from meshnet.tokenizer import GGUFTokenizer

        for named in (mid[:8], "Smollm2 135M 8k Lc100K Mix1 Ep2"):
            other = build_backend(build_parser().parse_args(["api", "--tracker", mesh.tracker, "--model-id", named]))
            assert other.model_name == "smollm2"
            other.close()
        api_args = build_parser().parse_args(["api", "--tracker", mesh.tracker, "--model-id", mid])
        backend = build_backend(api_args)
        try:
            with TestClient(create_app(backend)) as http:
                assert http.get("/v1/models").json()["data"][0]["id"] == "smollm2"
                r = http.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 8,
                                                       "temperature": 0, "ignore_eos": True})
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == GGUFTokenizer.from_gguf(str(smollm2_path)).decode(ids)
        finally:
            backend.close()
        proc.kill()
        proc.wait(timeout=10)
    finally:
        mesh.close()


def test_a_bundled_name_is_its_model_id(smollm2_path):
    from meshnet.model.bundled import BUNDLED, tracker_name

    assert BUNDLED["smollm2"].model_id == model_id(smollm2_path)
    assert tracker_name("smollm2") == model_id(smollm2_path)
    assert tracker_name("Smollm2 135M 8k Lc100K Mix1 Ep2") == "Smollm2 135M 8k Lc100K Mix1 Ep2"


def test_the_tracker_keeps_a_manifest_only_under_its_own_id(smollm2_path):
    mesh = Mesh()
    try:
        t = mesh.tracker_stub()
        m = model_manifest(smollm2_path)
        with pytest.raises(grpc.RpcError) as e:
            t.GetManifest(pb.ManifestRequest(model=m.id), timeout=5)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as e:
            t.PublishManifest(pb.ModelManifest(model_id="0" * 64, manifest=m.compressed()), timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not the model id" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            t.PublishManifest(pb.ModelManifest(model_id=m.id, manifest=b"not zlib"), timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        t.PublishManifest(pb.ModelManifest(model_id=m.id, manifest=m.compressed()), timeout=5)
        by_name = t.GetManifest(pb.ManifestRequest(model=m.name.upper()), timeout=5)
        assert by_name.model_id == m.id and by_name.manifest == m.compressed()
        assert t.GetManifest(pb.ManifestRequest(), timeout=5).model_id == m.id  # the only one
        # The short id `meshnet nodes` and `meshnet ledger` print names the model too (8 hex digits at least).
        assert t.GetManifest(pb.ManifestRequest(model=m.id[:12]), timeout=5).model_id == m.id
        assert t.GetManifest(pb.ManifestRequest(model=m.id[:8].upper()), timeout=5).model_id == m.id
        with pytest.raises(grpc.RpcError) as e:
            t.GetManifest(pb.ManifestRequest(model=m.id[:7]), timeout=5)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert "an id prefix needs at least 8 hex digits" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:  # a name nobody serves: the error lists what is known
            t.GetManifest(pb.ManifestRequest(model="llama-7b"), timeout=5)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert e.value.details().endswith(f"known: {m.name} ({m.id[:12]})")
    finally:
        mesh.close()


def test_a_node_fetching_from_a_corrupting_peer_exits_naming_the_tensor_and_never_registers(
        smollm2_path, tmp_path, peer):
    mesh = Mesh(heartbeat_s=30)  # the peer registered by hand sends no heartbeats
    try:
        m = model_manifest(smollm2_path)
        t = mesh.tracker_stub()
        t.PublishManifest(pb.ModelManifest(model_id=m.id, manifest=m.compressed()), timeout=5)
        _, address = peer(_Peer(smollm2_path, corrupt="blk.15.attn_q.weight"))
        t.Register(pb.NodeInfo(node_id="liar", address=address, layers=pb.LayerRange(start=0, end=30),
                               model=pb.ModelIdentity(sha256=m.id, architecture="llama", n_layer=30),
                               protocol_major=PROTOCOL_MAJOR, protocol_minor=PROTOCOL_MINOR), timeout=5)
        proc = mesh.spawn_node("10:20", "f", None, "--fetch", m.id, "--models-dir", str(tmp_path),
                               stderr=subprocess.PIPE)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 2
        assert "tensor 'blk.15.attn_q.weight' whose bytes hash to" in err and "MESHNET_NODE_READY" not in out
        assert mesh.registered() == {"liar"}
        assert not list(tmp_path.glob("*.gguf"))
    finally:
        mesh.close()


@pytest.mark.parametrize("canonical, words", [
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"metadata": {}, "tensors": [{"name": "t", "type": "F32", "shape": [1e999], "sha256": "x"}]}', "malformed"),
    (b'{"metadata": {}, "tensors": [{"name": "t", "type": "F32", "shape": [-4], "sha256": "x"}]}', "malformed"),
])
def test_publish_manifest_refuses_a_hostile_manifest_as_invalid_argument(canonical, words):
    import hashlib
    import zlib

    from meshnet.tracker.server import serve_tracker
    from meshnet.wire.security import open_channel

    server, port = serve_tracker("127.0.0.1", 0)
    try:
        t = pb_grpc.TrackerStub(open_channel(f"127.0.0.1:{port}"))
        with pytest.raises(grpc.RpcError) as e:
            t.PublishManifest(pb.ModelManifest(model_id=hashlib.sha256(canonical).hexdigest(),
                                               manifest=zlib.compress(canonical)), timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in e.value.details()
    finally:
        server.stop(None)


def test_an_overlong_model_name_is_refused_naming_its_length_and_long_refusals_are_cut():
    """A 100 kB --model-id was quoted whole in the refusal, which gRPC sends as a header: the client saw
    'metadata size exceeds hard limit' instead of the tracker's answer."""
    from meshnet.tracker.refusals import bounded
    from meshnet.tracker.server import serve_tracker
    from meshnet.wire.security import open_channel

    server, port = serve_tracker("127.0.0.1", 0)
    try:
        t = pb_grpc.TrackerStub(open_channel(f"127.0.0.1:{port}"))
        with pytest.raises(grpc.RpcError) as e:
            t.GetManifest(pb.ManifestRequest(model="x" * 100_000), timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details() == ("GetManifest: the model asked for is 100000 characters long; an id or name "
                                     "has at most 1024")
        with pytest.raises(grpc.RpcError) as e:  # at the bound: looked up, and quoted in the answer
            t.GetManifest(pb.ManifestRequest(model="\u00e9" * 1024), timeout=5)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "\u00e9" * 1024 in e.value.details()
    finally:
        server.stop(None)
    assert bounded("a" * 4096) == "a" * 4096
    assert bounded("\u00e9" * 3000) == "\u00e9" * 2048 + "... (952 more characters)"  # 2 bytes each


@pytest.mark.parametrize("command", [["generate", "a prompt", "--tracker", "127.0.0.1:1"],
                                     ["api", "--tracker", "127.0.0.1:1"]])
def test_a_model_file_and_a_model_id_together_are_refused_before_anything_starts(command, capsys):
    from meshnet.cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([*command, "--model", "model.gguf", "--model-id", "smollm2"])
    assert e.value.code == 2
    assert "argument --model-id: not allowed with argument --model" in capsys.readouterr().err


def test_a_model_id_the_tracker_cannot_be_asked_for_is_exit_1_and_an_unknown_one_exit_2(capsys):
    """Both were usage errors (exit 2): a tracker that is down or refuses the token is the mesh's
    state, as `generate --tracker` without `--model-id` says with exit 1."""
    from meshnet.cli import main
    from meshnet.tracker.server import serve_tracker

    server, port = serve_tracker("127.0.0.1", 0, join_token="right")
    try:
        tracker = f"127.0.0.1:{port}"
        assert main(["generate", "--tracker", tracker, "--join-token", "wrong", "--model-id", "smollm2", "hi"]) == 1
        assert f"error: tracker {tracker}: " in capsys.readouterr().err
        assert main(["generate", "--tracker", tracker, "--join-token", "right", "--model-id", "0123abc", "hi"]) == 2
        assert f"error: tracker {tracker}: " in capsys.readouterr().err
    finally:
        server.stop(None)
    assert main(["generate", "--tracker", "127.0.0.1:1", "--model-id", "smollm2", "hi"]) == 1
    assert "error: tracker 127.0.0.1:1: " in capsys.readouterr().err
