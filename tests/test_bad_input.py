"""Broken model files and bad requests get clear errors naming what is wrong, never a crash."""

from __future__ import annotations

import os
import shutil

import gguf
import numpy as np
import pytest

from conftest import GOLDEN_DIR
from meshnet.contract import ArtifactId, LayerRange, Status
from meshnet.load_spec import LoadSpec
from meshnet.engine.ggml_engine import GgmlEngine
from meshnet.engine.ggml_stage import GgmlStage
from meshnet.model.gguf_file import GGUFError

TINY = GOLDEN_DIR / "models" / "tiny-llama-q8_0.gguf"
pytestmark = pytest.mark.skipif(not TINY.is_file(), reason=f"{TINY} not found")


def _load(path, layers=LayerRange(0, 4)):
    eng = GgmlEngine()
    return eng, eng.load(LoadSpec(path=str(path), artifact=ArtifactId("", layers)))


def _first_tensor_past(path, size: int) -> str:
    r = gguf.GGUFReader(str(path))
    return next(t.name for t in r.tensors if t.data_offset + t.n_bytes > size)


def test_truncated_gguf_names_the_first_tensor_past_the_end(tmp_path):
    data = TINY.read_bytes()
    cut = len(data) // 2
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(data[:cut])
    _, out = _load(bad)
    assert out.status is Status.INVALID_ARGUMENT
    assert out.message.startswith(f"{bad}: truncated GGUF")  # which file: a new user saw only the tensor
    assert repr(_first_tensor_past(TINY, cut)) in out.message


def test_file_that_is_not_gguf(tmp_path):
    bad = tmp_path / "notes.gguf"
    bad.write_bytes(b"hello, this is text\n" * 10)
    _, out = _load(bad)
    assert out.status is Status.INVALID_ARGUMENT
    assert "is not a GGUF file" in out.message and "b'hell'" in out.message


def test_an_empty_file_is_said_to_be_empty(tmp_path):
    bad = tmp_path / "empty.gguf"
    bad.write_bytes(b"")
    _, out = _load(bad)
    assert (out.status, out.message) == (Status.INVALID_ARGUMENT, f"{bad} is not a GGUF file: it is empty")


def test_missing_file():
    _, out = _load("/nonexistent/model.gguf")
    assert out.status is Status.INVALID_ARGUMENT and "/nonexistent/model.gguf" in out.message


def _patched(tmp_path, old: bytes, new: bytes, name: str):
    data = TINY.read_bytes()
    assert data.count(old) >= 1 and len(old) == len(new)
    path = tmp_path / name
    path.write_bytes(data.replace(old, new, 1))
    return path


def test_unsupported_architecture_is_named_with_the_supported_list(tmp_path):
    # general.architecture's value is the first length-prefixed "llama" string in the header.
    path = _patched(tmp_path, b"\x05\x00\x00\x00\x00\x00\x00\x00llama", b"\x05\x00\x00\x00\x00\x00\x00\x00mamba",
                    "mamba.gguf")
    _, out = _load(path)
    assert out.status is Status.INVALID_ARGUMENT
    assert "unsupported architecture 'mamba'" in out.message
    for arch in ("gemma3", "llama", "phi3", "qwen2", "qwen3"):
        assert arch in out.message


def test_unsupported_tensor_type_is_named_with_the_supported_list(tmp_path):
    # Retype blk.0.attn_q.weight (64x256 Q8_0) as IQ4_NL: same block size, smaller, so the file still
    # parses; the engine must refuse the type by name.
    name = b"blk.0.attn_q.weight"
    data = bytearray(TINY.read_bytes())
    i = data.index(name) + len(name)
    n_dims = int.from_bytes(data[i:i + 4], "little")
    t = i + 4 + 8 * n_dims
    assert int.from_bytes(data[t:t + 4], "little") == gguf.GGMLQuantizationType.Q8_0
    data[t:t + 4] = int(gguf.GGMLQuantizationType.IQ4_NL).to_bytes(4, "little")
    path = tmp_path / "iq4nl.gguf"
    path.write_bytes(bytes(data))
    _, out = _load(path)
    assert out.status is Status.INVALID_ARGUMENT
    assert "'blk.0.attn_q.weight' has type IQ4_NL" in out.message and "Q4_K" in out.message


def test_layer_range_outside_the_model():
    _, out = _load(TINY, LayerRange(2, 9))
    assert out.status is Status.INVALID_ARGUMENT
    assert "[2, 9)" in out.message and "4 layers" in out.message
    with pytest.raises(GGUFError, match="outside the model"):
        GgmlStage(str(TINY), LayerRange(0, 5))


@pytest.mark.parametrize("text,message", [
    ("abc", "bad layer range 'abc': expected START:END, two integers with START < END"),
    ("0:30:5", "bad layer range '0:30:5': expected START:END, two integers with START < END"),
    ("x:3", "bad layer range 'x:3': expected START:END, two integers with START < END"),
    ("5:3", "bad layer range '5:3': layer range [5, 3) is empty or negative"),
])
def test_a_bad_layer_range_is_named_without_python_internals(text, message):
    with pytest.raises(ValueError) as e:
        LayerRange.parse(text)
    assert str(e.value).startswith(message) and "unpack" not in str(e.value)


def test_generate_refuses_empty_layers_and_a_negative_wait():
    import subprocess
    import sys

    def run(*args):
        return subprocess.run([sys.executable, "-m", "meshnet.cli", "generate", "--model", str(TINY),
                               "--max-tokens", "2", *args, "Hi"], capture_output=True, text=True, timeout=120)

    r = run("--layers", "")
    assert r.returncode == 2 and "--layers '' names no layer range" in r.stderr and "Traceback" not in r.stderr
    for wait, message in (("-1", "must be a number of seconds >= 0, got -1"),  # inf and 1e30 waited without end
                          ("inf", "must be a finite number of seconds, got inf"),
                          ("1e30", "must be at most 31536000 seconds (a year), got 1e30"),
                          ("nan", "must be a finite number of seconds, got nan")):
        r = run("--wait", wait, "--tracker", "127.0.0.1:1")
        assert r.returncode == 2 and f"argument --wait: {message}" in r.stderr, (wait, r.stderr)
    r = run("--temperature", "inf")
    assert r.returncode == 2 and "temperature must be finite" in r.stderr


def test_wrong_sha256_is_refused():
    eng = GgmlEngine()
    out = eng.load(LoadSpec(path=str(TINY), artifact=ArtifactId("0" * 64, LayerRange(0, 4))))
    assert out.status is Status.INVALID_ARGUMENT and "expected " + "0" * 64 in out.message


def test_engine_keeps_serving_after_a_bad_load(tmp_path):
    bad = tmp_path / "copy.gguf"
    shutil.copy(TINY, bad)
    bad.write_bytes(bad.read_bytes()[:1000])
    eng, out = _load(bad)
    assert out.status is Status.INVALID_ARGUMENT
    assert eng.load(LoadSpec(path=str(TINY), artifact=ArtifactId("", LayerRange(0, 4)))).ok
    assert eng.health().healthy



@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_hidden_states_holding_nan_or_infinity_are_refused_naming_the_row(bad):
    """A tail given them answered INTERNAL (its sampling raised on an empty candidate set) or token 0."""
    from meshnet.contract import NamedTensor, SamplingParams, StepRequest

    eng, out = _load(TINY, LayerRange(2, 4))
    assert out.ok
    rows = np.full((3, eng.capabilities().n_embd), 0.5, np.float32)
    rows[1, 7] = bad
    sampling = SamplingParams(temperature=0.7, top_p=0.9, seed=1)
    res = eng.prefill(StepRequest("s", 0, 0, (1, 2, 3), hidden=NamedTensor.from_numpy("hidden", rows),
                                  sampling=sampling))
    assert res.status is Status.INVALID_ARGUMENT and res.message == "hidden states hold NaN or infinity (row 1 of 3)"
    rows[1, 7] = 0.5  # the stage keeps serving, the same session id included
    res = eng.prefill(StepRequest("s", 0, 0, (1, 2, 3), hidden=NamedTensor.from_numpy("hidden", rows),
                                  sampling=sampling))
    assert res.ok and 0 <= res.token.token_id < eng.capabilities().n_vocab

@pytest.mark.parametrize("bad,shown", [(1e30, "1e+30"), (-3e38, "3e+38"), (-1.5e9, "1.5e+09")])
def test_hidden_states_beyond_any_activation_are_refused_naming_the_row(bad, shown):
    """Finite but overflowing values: the tail's RMSNorm squared them past float32 and it answered token 0
    with OK. The refused step leaves the session where it was: its next good step gives the token a fresh
    stage gives, as do values at the bound."""
    from meshnet.contract import NamedTensor, StepRequest

    ref, out = _load(TINY, LayerRange(2, 4))
    assert out.ok
    rows = np.full((3, ref.capabilities().n_embd), 0.5, np.float32)
    rows[:, ::7] = 1e9  # at the bound (step_validation.MAX_HIDDEN_MAGNITUDE): accepted
    first = StepRequest("s", 0, 0, (1, 2), hidden=NamedTensor.from_numpy("hidden", rows[:2]))
    after = StepRequest("s", 0, 2, (3,), hidden=NamedTensor.from_numpy("hidden", rows[2:]))
    want = [ref.prefill(first), ref.decode(after)]
    assert all(r.ok for r in want), [r.message for r in want]

    eng, out = _load(TINY, LayerRange(2, 4))
    assert out.ok and eng.prefill(first).ok
    huge = rows[2:].copy()
    huge[0, 9] = bad
    res = eng.decode(StepRequest("s", 0, 2, (3,), hidden=NamedTensor.from_numpy("hidden", huge)))
    assert res.status is Status.INVALID_ARGUMENT and res.message == (
        f"hidden states hold a value of magnitude {shown} (row 0 of 1), beyond the 1e+09 a stage accepts: "
        "no model's activations reach it, and the stage's arithmetic would overflow")
    assert res.token is None and eng.metrics().errors == {"INVALID_ARGUMENT": 1}
    res = eng.decode(after)
    assert res.ok and res.n_past == 3 and res.token == want[1].token


@pytest.mark.parametrize("field,value", [("kv_tokens", -5), ("max_sessions", 0), ("n_ubatch", 0), ("n_ctx", -1),
                                         ("n_threads", 0), ("n_threads", 513)])
def test_bad_load_settings_are_named(field, value):
    """Both engines refuse impossible pool and batch settings with the value and its bound."""
    from dataclasses import replace

    from meshnet.engine.fake import FakeEngine

    spec = replace(LoadSpec(path=str(TINY), artifact=ArtifactId("", LayerRange(0, 4))), **{field: value})
    out = GgmlEngine().load(spec)
    assert out.status is Status.INVALID_ARGUMENT
    assert f"{field}={value}" in out.message
    fake_out = FakeEngine().load(replace(spec, path=""))
    assert fake_out.status is Status.INVALID_ARGUMENT and f"{field}={value}" in fake_out.message


@pytest.mark.parametrize("args,message", [
    # An empty host: gRPC's core logged "host must not be empty", then the tracker blamed a taken port.
    (["tracker", "--host", "", "--port", "0"], "argument --host: expected a host name or address to listen on"),
    (["node", "--tracker", "127.0.0.1:1", "--engine", "fake", "--host", " "],
     "argument --host: expected a host name or address to listen on"),
    (["node", "--tracker", "127.0.0.1:1", "--engine", "fake", "--idle-timeout", "0"],
     "argument --idle-timeout: must be a number of seconds > 0, got 0"),  # it freed every session at once
    (["node", "--tracker", "127.0.0.1:1", "--engine", "fake", "--port", "-5"], "argument --port: must be in 0..65535"),
    (["node", "--tracker", "127.0.0.1:1", "--engine", "fake", "--data-port", "100000"],
     "argument --data-port: must be in 0..65535"),
    (["api", "--port", "70000"], "argument --port: must be in 0..65535 (0 = any free port), got 70000"),
    (["up", "--port", "-1"], "argument --port: must be in 0..65535"),
    (["up", "--api-port", "70000", "--dashboard-port", "-1"],
     "--api-port must be -1 (no API) or in 0..65535, got 70000"),
    (["up", "--threads", "0", "--dashboard-port", "-1"], "argument --threads: must be 1 to 512, got 0"),  # nodes restarted forever
    (["up", "--stages", "2", "--port", "18620", "--node-ports", "18619", "--api-port", "-1", "--dashboard-port", "-1"],
     "error: --node-ports 18619 gives node 0 port 18620, which --port takes; pass another --node-ports"),
    (["up", "--node-ports", "65531", "--api-port", "-1", "--dashboard-port", "-1"],
     "--node-ports 65531 leaves no room for 3 nodes' 6 ports (the last would be 65536, past 65535)"),
    (["up", "--kv-tokens", "-5", "--dashboard-port", "-1"], "argument --kv-tokens: must be >= 0, got -5"),
    (["up", "--threads", "513", "--dashboard-port", "-1"], "argument --threads: must be 1 to 512, got 513"),  # OpenMP fails
    # gRPC takes a scheme for part of a host name it cannot resolve, and retried it forever
    (["node", "--engine", "fake", "--tracker", "http://127.0.0.1:7700"],
     "argument --tracker: bad address 'http://127.0.0.1:7700': expected HOST:PORT without a scheme or path"),
    (["generate", "--tracker", "127.0.0.1:", "hi"], "argument --tracker: bad address '127.0.0.1:': expected HOST:PORT"),
    (["node", "--engine", "fake", "--advertise", "nope"], "argument --advertise: bad address 'nope'"),
    (["node", "--engine", "fake", "--node-id", "a" * 300],  # the key file's name was too long for the disk
     "argument --node-id: must be 1 to 128 characters, got 300"),
    (["node", "--engine", "fake", "--node-id", "a b"], "argument --node-id: may hold only ASCII letters, digits"),
    (["node", "--engine", "fake", "--worker-hang-timeout", "0"], "argument --worker-hang-timeout: must be a number of "
                                                                 "seconds > 0, got 0"),
    (["node", "--engine", "fake", "--drain-timeout", "-1"],
     "argument --drain-timeout: must be a number of seconds >= 0"),
    (["tracker", "--heartbeat", "1e300"], "argument --heartbeat: must be 0.05 to 3600 seconds"),  # killed its thread
    # nodes beat every 0.05 s at most: a tracker asking for less dropped them before their next beat
    (["tracker", "--heartbeat", "0.01"], "argument --heartbeat: must be 0.05 to 3600 seconds, got 0.01"),
    (["node", "--engine", "fake", "--worker-hang-timeout", "1e300"],  # its deadline overflowed in a thread
     "argument --worker-hang-timeout: must be at most 31536000 seconds (a year), got 1e300"),
    (["node", "--engine", "fake", "--tracker", "::1:7900"],  # gRPC read [::0.1.121.0]:443 and retried forever
     "argument --tracker: bad address '::1:7900': an IPv6 address goes in brackets, e.g. [::1]:7700"),
    (["node", "--engine", "fake", "--node-id", "a/b"],  # a/b and a_b shared one key file
     "argument --node-id: may hold only ASCII letters, digits, '.', '_' and '-', got 'a/b'"),
    (["node", "--engine", "fake", "--tls-key", "key.pem"], "error: --tls-cert and --tls-key go together"),  # plaintext
    (["node", "--engine", "fake", "--max-sessions", str(10**12)],  # overflowed a 32-bit field in a thread
     "argument --max-sessions: must be 1 to 65536, got 1000000000000"),
    (["api", "--max-body-mb", "-1"], "argument --max-body-mb: must be a number > 0, got -1"),  # every request 413
    (["up", "--timeout", "nan", "--dashboard-port", "-1"], "argument --timeout: must be a finite number of seconds"),
    (["up", "--n-ctx", str(1 << 24), "--max-sessions", "65536", "--dashboard-port", "-1", "--port", "0"],
     "refused its settings: not enough memory to load layers "),  # its nodes were restarted forever; whichever first
    (["api", "--n-ctx", str(1 << 24), "--max-sessions", "65536", "--port", "0"],
     "error: not enough memory to load layers 0:30 of "),
    # a context past 2**24 tokens: Python's int overflowed (a traceback), or ggml's sizes (an abort)
    (["generate", "--n-ctx", str(10**20), "hi"], "argument --n-ctx: must be 0 to 16777216, got 100000000000000000000"),
    (["api", "--n-ctx", str(2**55), "--port", "0"], "argument --n-ctx: must be 0 to 16777216, got 36028797018963968"),
    (["up", "--n-ctx", str(10**12), "--dashboard-port", "-1"], "argument --n-ctx: must be 0 to 16777216, got 1000000000000"),
    (["api", "--prefix-cache", str(10**9), "--port", "0"],  # its slots grew memory 1.4 GB/s without a word
     "argument --prefix-cache: must be 0 to 65536, got 1000000000"),
    (["tracker", "--dashboard-host", ""],  # listened on every interface (http://:PORT/), with no join token
     "argument --dashboard-host: expected a host name or address to listen on"),
    (["tracker", "--port", "70000"], "argument --port: must be in 0..65535"),
    (["up", "--heartbeat", "nan"], "argument --heartbeat: must be a finite number of seconds, got nan"),
    (["api", "--max-concurrency", "0"], "argument --max-concurrency: must be >= 1, got 0"),
    (["up", "--draft-tokens", "-3", "--dashboard-port", "-1"], "argument --draft-tokens: must be 1 to 16, got -3"),
    # flags that did nothing where they were given
    (["generate", "--wait", "3", "hi"], "error: --wait needs --tracker (it applies to a running mesh's client"),
    (["generate", "--tracker", "127.0.0.1:9", "--stages", "2", "hi"],
     "error: --stages splits the model in this process; with --tracker the mesh's nodes hold the layers"),
    (["api", "--tracker", "127.0.0.1:9", "--layers", "0:10,10:30", "--port", "0"],
     "error: --layers splits the model in this process; with --tracker the mesh's nodes hold the layers"),
    (["node", "--fetch", "smollm2", "--model", "x.gguf"], "argument --model: not allowed with argument --fetch"),
    (["api", "--client-orchestrated", "--port", "0"], "error: --client-orchestrated needs --tracker"),
    (["generate", "--tracker", "127.0.0.1:9", "--n-ctx", "5", "hi"],
     "error: --n-ctx applies to stages in this process; with --tracker each node of the mesh has its own"),
    (["api", "--tracker", "127.0.0.1:9", "--max-sessions", "4", "--port", "0"],
     "error: --max-sessions applies to stages in this process; with --tracker each node of the mesh has its own"),
    # a bench that ran nothing and wrote empty results (exit 0), or failed on Python's own words
    (["bench", "serve", "--url", "notaurl"],  # httpx's UnsupportedProtocol traceback
     "argument --url: expected an http:// or https:// URL with a host, e.g. http://127.0.0.1:8000, got 'notaurl'"),
    (["backends", "--certify", "--lane", "cpu", "--threads", "100000"],  # a segmentation fault, no word
     "argument --threads: must be 1 to 512, got 100000"),
    # a folder or an empty --out failed after the whole run, its figures lost
    (["bench", "engine", "--out", "/tmp"], "argument --out: /tmp is a folder; give a file path, e.g. /tmp/bench.json"),
    (["bench", "wan", "--out", ""], "argument --out: expected a file path for the results, got ''"),
    # values that started a real run (engine: "no median for empty data" after it), or a child's traceback
    (["bench", "engine", "--repeats", "0"], "argument --repeats: must be >= 1, got 0"),
    (["bench", "engine", "--decode-tokens", "-1"], "argument --decode-tokens: must be >= 1, got -1"),
    (["bench", "serve", "--timeout", "0"], "argument --timeout: must be a number of seconds > 0, got 0"),
    (["bench", "serve", "--threads", "0"], "argument --threads: must be 1 to 512, got 0"),
    (["bench", "scale", "--threads", "0"], "argument --threads: must be 1 to 512, got 0"),
    (["bench", "wan", "--bandwidth-mbit", "0"], "argument --bandwidth-mbit: must be a number > 0, got 0"),
    (["bench", "engine", "--prompt-tokens", "0"], "argument --prompt-tokens: must be >= 1, got 0"),
    (["bench", "worker", "--prompt-tokens", "0"], "argument --prompt-tokens: must be >= 1, got 0"),
    (["bench", "serve", "--targets", "llama-server,bogus"], "argument --targets: unknown target 'bogus'; choose "
                                                            "from llama-server, meshnet, mesh, llama-rpc"),
    # text Python cannot encode: a Latin-1 prompt was a TypeError traceback, a model name a 500 on /v1/models
    (["generate", "caf\udce9"], "argument prompt: is not valid UTF-8 (byte 0xe9 at character 3)"),
    (["api", "--name", "caf\udce9"], "argument --name: is not valid UTF-8 (byte 0xe9 at character 3)"),
    (["api", "--name", ""], "argument --name: must not be empty"),  # quietly the default name
    # gRPC refused it as metadata ("INTERNAL: Invalid metadata"), and a tracker started with one nobody could send
    (["nodes", "--tracker", "127.0.0.1:9", "--join-token", "p\u00e4ss"],
     "argument --join-token: may hold only printable ASCII characters (gRPC carries it as metadata), got '\u00e4' "
     "at character 1"),
    (["tracker", "--join-token", "a" * 4097], "argument --join-token: must be at most 4096 characters, got 4097"),
    # an address nobody can dial: it registered, and every client then failed on it first
    (["node", "--engine", "fake", "--advertise", "0.0.0.0:9512"],
     "argument --advertise: 0.0.0.0 is where a server listens on every interface"),
    (["node", "--engine", "fake", "--worker-restarts", "-1"], "argument --worker-restarts: must be >= 0, got -1"),
    (["node", "--engine", "fake", "--tracker", "127.0.0.1:9", "--relay", "--port", "9510"],  # ignored
     "error: --port does not apply with --relay: a relayed node opens no port"),
    (["api", "--max-body-mb", "1e20"], "argument --max-body-mb: must be at most 1024 (MiB), got 1e20"),
    (["up", "--api-port", "-1", "--speculative", "model", "--dashboard-port", "-1", "--port", "0"],
     "error: --speculative, --draft-model and --draft-tokens set the API's speculative decoding; with --api-port -1 "
     "there is no API"),
    (["bench", "speculative", "--repeats", "0"], "argument --repeats: must be >= 1, got 0"),  # "no median for empty"
    (["bench", "structured", "--requests", "0"], "argument --requests: must be >= 1, got 0"),
    # a comma-separated list with a bad item: Python's "invalid literal for int()", or a message naming no flag
    (["bench", "wan", "--rtt-ms", "abc"],
     "meshnet bench wan: error: argument --rtt-ms: expected comma-separated milliseconds, e.g. 0,10,25,50, got 'abc'"),
    (["bench", "serve", "--concurrency", "abc"], "meshnet bench serve: error: argument --concurrency: expected "
                                                 "comma-separated whole numbers >= 1, e.g. 1,2,4, got 'abc'"),
    (["bench", "worker", "--concurrency", "1,0"], "meshnet bench worker: error: argument --concurrency: expected "
                                                  "comma-separated whole numbers >= 1, e.g. 1,2,4, got '1,0'"),
    (["bench", "wan", "--modes", "carrier-pigeon"], "meshnet bench wan: error: argument --modes: unknown mode(s) "
                                                    "['carrier-pigeon']; choose from client-orchestrated, node-to-node"),
    # more stages than the model has layers: found after a first part ran, or after making namespaces
    (["bench", "wan", "--stages", "31"], "error: --stages 31: the model has 30 layers, so give 1 to 30 stages"),
    (["bench", "scale", "--model", "smollm2", "--stages", "31"],
     "error: --stages 31: the model has 30 layers, so give 1 to 30 stages"),
    (["bench", "speculative", "--stages", "0"], "meshnet bench speculative: error: argument --stages: must be >= 1"),
    # Unknown arguments are named under their subcommand's usage (argparse named them under meshnet's),
    # with the flag a misspelled one is closest to; words past a prompt are a prompt left unquoted.
    (["generate", "--temprature", "0", "Hi"],
     "meshnet generate: error: unrecognized arguments: --temprature (did you mean --temperature?) Hi\n"),
    (["bench", "serve", "--concurency", "8"],
     "meshnet bench serve: error: unrecognized arguments: --concurency (did you mean --concurrency?) 8"),
    (["generate", "Hi", "there"], "meshnet generate: error: unrecognized arguments: there; put a prompt of several "
                                  "words in quotes"),
    (["generate", "--seed", str(2**64), "hi"], "error: seed must be a 64-bit signed integer, in [-2**63, "
                                              "2**63), got 18446744073709551616"),  # it wrapped to seed 0
    (["generate", "--seed", str(2**64 - 1), "hi"], "in [-2**63, 2**63), got 18446744073709551615"),  # seed -1's
    (["generate", "--client-id", "alice", "hi"], "error: --client-id needs --tracker"),
    (["generate", "--tracker", "127.0.0.1:1", "--client-id", "x" * 257, "hi"],
     "argument --client-id: has 257 characters; at most 256"),
    # The CPU lane has one device: the index was ignored.
    (["node", "--engine", "fake", "--port", "0", "--device", "1"],
     "error: --device 1 picks one of an accelerator's devices; give --backend too"),
])
def test_ports_and_timeouts_out_of_range_are_refused_up_front(args, message):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "meshnet.cli", *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("args,message", [
    (["--model", "/tmp"], "error: model '/tmp' is a folder: name the .gguf file in it (of a split GGUF set, any one of its parts)"),
    (["--model", "/no/such.gguf"], "error: model '/no/such.gguf' is neither a file nor a bundled model (smollm2, gemma3-270m)"),
    # KV slots for 65536 sessions of 2**24 tokens take more than any address space: the load fails, in one line.
    (["--model", "smollm2", "--n-ctx", str(1 << 24), "--max-sessions", "65536"],
     "error: not enough memory to load every layer of smollm2 with n_ctx=16777216"),
    (["--model", "smollm2", "--n-ctx", str(10**20)], "argument --n-ctx: must be 0 to 16777216, got 100000000000000000000"),
])
def test_a_node_that_cannot_load_says_why_in_one_line(args, message):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "meshnet.cli", "node", "--port", "0", *args], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and message in r.stderr
    assert "Traceback" not in r.stderr and "EOFError" not in r.stderr


def test_tls_files_that_are_not_pem_are_named_at_start(tmp_path):
    """gRPC took a garbage certificate and failed to bind ("cannot listen"), and retried a garbage CA forever."""
    import subprocess
    import sys

    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    cli = [sys.executable, "-m", "meshnet.cli"]
    r = subprocess.run([*cli, "node", "--engine", "fake", "--port", "0", "--tls-cert", str(junk),
                        "--tls-key", str(junk)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"error: TLS certificate '{junk}' and key '{junk}' do not load as a PEM certificate and its private key" \
        in r.stderr
    r = subprocess.run([*cli, "generate", "--tracker", "127.0.0.1:9", "--tls-ca", str(junk), "hi"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and f"cannot read TLS CA certificate '{junk}'" in r.stderr and "Traceback" not in r.stderr
    # A FIFO (or a device) in place of a PEM file blocked the node's start for good.
    fifo = tmp_path / "cert.fifo"
    os.mkfifo(fifo)
    r = subprocess.run([*cli, "node", "--engine", "fake", "--port", "0", "--tls-cert", str(fifo), "--tls-key",
                        str(fifo)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and f"error: cannot read TLS certificate '{fifo}': not a regular file" in r.stderr


@pytest.mark.parametrize("flag,what", [("--port", "127.0.0.1:{port}: Address already in use"),
                                       ("--data-port", "127.0.0.1:{port} (the data plane): Address already in use")])
def test_a_node_on_a_taken_port_says_so_in_one_line(flag, what):
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "meshnet.cli", "node", "--engine", "fake", flag, str(port)],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and f"error: cannot listen on {what.format(port=port)}" in r.stderr
    assert "Traceback" not in r.stderr and "add_port.cc" not in r.stderr  # gRPC's own C-level log line


def test_a_tracker_on_a_taken_port_says_so_before_it_touches_its_ledger(tmp_path):
    """A second tracker on a taken port waited 5 s for the first one's ledger lock, then named the lock."""
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "meshnet.cli", "tracker", "--port", str(port), "--dashboard-port",
                            "-1", "--ledger", f"sqlite:///{tmp_path}/l.db"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == (f"error: the tracker cannot listen on 127.0.0.1:{port}: Address "
                                                      f"already in use; pass another --port (0 = any free port) or --host")
    assert not (tmp_path / "l.db").exists()


def test_a_tracker_and_its_dashboard_on_one_port_are_refused_naming_both_flags(tmp_path):
    """The tracker took the port and served on without a dashboard (a notice), where a dashboard port another
    process holds is refused, and `meshnet up` refuses the two equal."""
    import subprocess
    import sys

    port = 17731  # nothing listens on it: the two are refused before either is bound
    r = subprocess.run([sys.executable, "-m", "meshnet.cli", "tracker", "--port", str(port), "--dashboard-port",
                        str(port), "--ledger", f"sqlite:///{tmp_path}/l.db"], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 2 and r.stderr == (f"error: --port and --dashboard-port are both {port}: the tracker and "
                                              "the dashboard each need a port of their own\n")
    assert not (tmp_path / "l.db").exists()


def test_a_join_token_from_the_environment_that_grpc_cannot_send_is_refused_naming_it():
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "meshnet.cli", "tracker", "--port", "0", "--dashboard-port", "-1"],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "MESHNET_JOIN_TOKEN": "p\u00e4ss"})
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "argument --join-token: may hold only printable ASCII characters (gRPC carries" in r.stderr
    assert "(from $MESHNET_JOIN_TOKEN)" in r.stderr


def test_output_that_cannot_be_written_and_ctrl_c_while_loading_end_without_a_traceback():
    """``> /dev/full`` was an OSError traceback; Ctrl-C in the first second (modules loading) a
    KeyboardInterrupt traceback. Now one line and exit 1, and exit 130 (or the signal's own status before
    Python has its handler) with nothing on stderr."""
    import signal
    import subprocess
    import sys
    import time

    cli = [sys.executable, "-m", "meshnet.cli", "generate", "--max-tokens", "4", "--temperature", "0", "hi"]
    with open("/dev/full", "w") as full:
        r = subprocess.run(cli, stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert r.returncode == 1 and "error: No space left on device" in r.stderr and "Traceback" not in r.stderr
    # Long enough to be running still at 1 s: the CLI loads in well under a second now. Not sooner than
    # 0.3 s: before meshnet's first line runs (the interpreter starting, runpy, the console script's own
    # `import re`) a Ctrl-C is Python's KeyboardInterrupt, and on a loaded machine (two test processes
    # and two busy loops) that took over 0.1 s.
    long = [*cli[:-1], "--max-tokens", "256", "--ignore-eos", "hi"]
    for delay in (0.3, 0.6, 1.0):
        proc = subprocess.Popen(long, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode in (130, -signal.SIGINT) and "Traceback" not in err, (delay, proc.returncode, err)


def test_ctrl_c_during_a_long_prefill_exits_130_not_a_segmentation_fault():
    """Interrupted while a stage's scheduler thread was inside a prefill's ggml graph, the interpreter's
    finalization freed the memory the graph computed in: 7 of 20 runs ended in SIGSEGV (rc -11)."""
    import random
    import signal
    import subprocess
    import sys
    import time

    prompt = " ".join(["the quick brown fox jumps over the lazy dog"] * 150)  # 1350 tokens: seconds of prefill
    cli = [sys.executable, "-m", "meshnet.cli", "generate", "--max-tokens", "1000", "--ignore-eos", prompt]
    rng = random.Random(0)
    for _ in range(4):
        proc = subprocess.Popen(cli, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        line = proc.stderr.readline()  # "[meshnet] smollm2: 1 stage(s) 0:30, 1350 prompt tokens": loaded
        assert line.endswith("1350 prompt tokens\n"), line
        time.sleep(0.2 + 0.6 * rng.random())  # in the prefill (a second or more here)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130 and "Traceback" not in err, (proc.returncode, err)


def test_a_closed_stdout_or_stderr_is_written_to_nowhere_without_a_traceback(tmp_path):
    """`meshnet generate ... >&-` was an AttributeError traceback (sys.stdout is None), and with stderr closed
    it exited 1 having written nothing, its text included."""
    import os
    import subprocess
    import sys

    cli = [sys.executable, "-m", "meshnet.cli", "generate", "--max-tokens", "4", "--temperature", "0", "hi"]
    r = subprocess.run(cli, stderr=subprocess.PIPE, text=True, timeout=120, preexec_fn=lambda: os.close(1))
    assert r.returncode == 0 and "Traceback" not in r.stderr and "4 tokens, finish_reason=length" in r.stderr
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        r = subprocess.run(cli, stdout=f, timeout=120, preexec_fn=lambda: os.close(2))
    assert r.returncode == 0 and len(out.read_text()) > 0


def test_ctrl_c_that_a_library_turned_into_an_error_of_its_own_still_exits_130(monkeypatch):
    """pydantic-core reports a KeyboardInterrupt raised while it builds a validator as a ``SchemaError``
    (CI caught it at 0.6 s into ``generate``): that was a traceback and exit 1. Any error after a SIGINT is
    the interrupt; one without a SIGINT still propagates."""
    import signal
    import time

    from meshnet import cli

    def wrapped_interrupt(argv):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler runs before the sleep ends
        except KeyboardInterrupt as e:
            raise RuntimeError("Error building validator: KeyboardInterrupt") from e
        raise AssertionError("the SIGINT never arrived")

    monkeypatch.setattr(cli, "_main", wrapped_interrupt)
    assert cli.main([]) == 130
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is put back

    def plain_error(argv):
        raise RuntimeError("not an interrupt")

    monkeypatch.setattr(cli, "_main", plain_error)
    with pytest.raises(RuntimeError, match="not an interrupt"):
        cli.main([])


def test_an_advertised_name_that_does_not_resolve_here_is_warned_about():
    """Registered without a word, and every client then failed on it first; refusing it would refuse
    names only the peers resolve (split DNS, a pod's name published once it is ready), so it is a warning."""
    line = _first_warning_of_node("--engine", "fake", "--port", "0", "--advertise", "nonexistent.invalid:9512")
    assert line.startswith("warning: --advertise nonexistent.invalid:9512: the name does not resolve on this "
                           "machine ("), line


def test_a_node_on_loopback_under_a_tracker_reached_over_the_network_is_warned_about_or_refused():
    """On the tracker's own machine such a node was taken (the tracker refuses it only from other machines),
    and every client elsewhere was refused its connection to it: `generate` failed with "no node serves
    layers [12, 25)" and nothing said why. A tracker named by a host name may be on this machine: a
    warning. One at an IP address of another machine refuses the node: it is refused before its model loads,
    or its layers are fetched (a user's --fetch moved 28 MB, then the tracker refused the node)."""
    import subprocess
    import sys

    # tracker.invalid resolves nowhere: the node is killed while it still tries to reach it
    line = _first_warning_of_node("--engine", "fake", "--port", "0", "--tracker", "tracker.invalid:7700")
    assert line == ("warning: --host 127.0.0.1: this node listens on loopback only, while its tracker "
                    "(tracker.invalid:7700) is reached over the network: clients and nodes on other machines cannot "
                    "reach it; pass --host 0.0.0.0 (or this machine's address), with --advertise HOST:PORT where "
                    "others reach it by another address\n"), line
    # 198.51.100.1 (TEST-NET-2) is no address of this machine's (this VM sits in TEST-NET-1)
    done = subprocess.run([sys.executable, "-m", "meshnet.cli", "node", "--tracker", "198.51.100.1:7700", "--layers",
                           "0:10", "--fetch", "smollm2"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "MESHNET_FETCHED" not in done.stdout
    assert done.stderr == ("error: --host 127.0.0.1: this node would listen on loopback only, and its tracker "
                           "(198.51.100.1:7700) is on another machine, which refuses a node only this machine can dial; "
                           "pass --host 0.0.0.0 (or this machine's address), with --advertise HOST:PORT where others "
                           "reach it by another address, or --relay\n"), done.stderr


def test_a_node_on_every_interface_that_can_only_register_loopback_is_warned_about(monkeypatch):
    """With its tracker on the same machine (dialled as 127.0.0.1) and no default route, a node bound to
    0.0.0.0 registered 127.0.0.1 without a word, and clients on other machines were refused at it."""
    from meshnet.node import cli as node_cli
    from meshnet.node.config import NodeConfig

    cfg = NodeConfig(model="smollm2", layers=None, tracker="127.0.0.1:7700", host="0.0.0.0")
    monkeypatch.setattr(node_cli, "dialable_host", lambda host, tracker: "127.0.0.1")  # no default route
    assert node_cli.unreachable_wildcard(cfg) == (
        "--host 0.0.0.0: this node registers 127.0.0.1, which only this machine can dial (its tracker is dialled "
        "by loopback and this machine has no default route to tell its address by): clients and nodes on other "
        "machines cannot reach it; pass --advertise HOST:PORT with its address on their network")
    for fine in (dict(advertise="10.0.0.5:7701"), dict(relay=True), dict(host="127.0.0.1")):
        assert node_cli.unreachable_wildcard(NodeConfig(**{**cfg.__dict__, **fine})) is None
    monkeypatch.setattr(node_cli, "dialable_host", lambda host, tracker: "10.0.0.5")  # a default route
    assert node_cli.unreachable_wildcard(cfg) is None


def test_a_node_on_loopback_advertising_another_address_is_warned_about():
    """The hints for a loopback node name `--advertise HOST:PORT`; a node started with it but still on the
    default --host 127.0.0.1 registered 10.x:PORT, where nothing listened, with no warning from node or
    tracker, and every client was refused there ("no node serves layers [15, 30)")."""
    from meshnet.node import cli as node_cli
    from meshnet.node.config import NodeConfig

    cfg = NodeConfig(model="smollm2", layers=None, tracker="10.0.0.1:7700", host="127.0.0.1",
                     advertise="10.0.0.5:7701")
    assert node_cli.loopback_behind_advertise(cfg) == (
        "--advertise 10.0.0.5:7701 with --host 127.0.0.1: this node listens on loopback only, so nothing answers "
        "at 10.0.0.5 unless a proxy or tunnel there forwards to it; pass --host 0.0.0.0 (or this machine's "
        "address) as well")
    for fine in (dict(host="0.0.0.0"), dict(host="10.0.0.5"), dict(advertise=None), dict(advertise="127.0.0.1:7701"),
                 dict(advertise=None, relay=True)):
        assert node_cli.loopback_behind_advertise(NodeConfig(**{**cfg.__dict__, **fine})) is None


def test_bench_serve_at_a_url_where_nothing_answers_says_so_in_one_line(tmp_path):
    """A URL where nothing listened was httpx's ConnectError traceback."""
    import subprocess
    import sys

    from mesh_util import free_port

    url = f"http://127.0.0.1:{free_port()}"
    r = subprocess.run([sys.executable, "-m", "meshnet.cli", "bench", "serve", "--url", url, "--out",
                        str(tmp_path / "serve.json")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith(f"error: {url} answered no OpenAI model list at /v1/models (ConnectError: ")
    assert len(r.stderr.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []  # neither the results nor a folder for server logs


@pytest.mark.parametrize("sampling, field", [
    ({"temperature": float("nan")}, "temperature"), ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"top_k": -5}, "top_k")])
def test_a_head_refuses_sampling_only_the_tail_uses_before_opening_the_session(sampling, field):
    """The head opened a session (cells reserved for the whole answer) for a temperature of NaN, and only the
    tail refused the step."""
    from meshnet.contract import StepRequest
    from meshnet.engine.fake import FakeEngine, FakeModel
    from meshnet.sampling_params import SamplingParams

    model = FakeModel()
    head = FakeEngine(model)
    assert head.load(LoadSpec(path="", artifact=ArtifactId(model.sha256, LayerRange(0, 10)), max_sessions=4)).ok
    res = head.prefill(StepRequest("s", 1, 0, (1, 2, 3), sampling=SamplingParams(**sampling)))
    assert res.status is Status.INVALID_ARGUMENT and res.message.startswith(f"{field} must be "), res.message
    assert head.session_ids() == [] and head.health().active_sessions == 0
    assert head.prefill(StepRequest("s", 1, 0, (1, 2, 3))).ok  # the same session, well asked: served


def test_a_step_with_an_empty_session_id_is_refused_on_the_wire():
    """Every node keyed its cache by it, and the tail its await: the head took it, the tail did not."""
    from meshnet.contract import StepRequest
    from meshnet.wire.envelope import WireError, frames_to_request, request_to_frames

    frames = request_to_frames(StepRequest("", 1, 0, (1, 2, 3)), decode=False)
    with pytest.raises(WireError, match="^session_id is empty$") as refused:
        frames_to_request(frames)
    assert refused.value.status is Status.INVALID_ARGUMENT


def test_chat_with_a_model_without_a_chat_template_is_a_400_that_says_what_to_do_instead():
    """A base model's GGUF (Gemma 3 270M's, bundled) holds no chat template: every chat request was
    refused with "this GGUF has no tokenizer.chat_template; pass template=...", a Python argument no
    HTTP client has. The completions endpoint serves it."""
    from fastapi.testclient import TestClient

    from meshnet.api.app import create_app
    from meshnet.api.backend import local_backend

    backend = local_backend(str(TINY), n_ctx=64, max_sessions=2, name="tiny")
    try:
        with TestClient(create_app(backend)) as http:
            r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                        "max_tokens": 2})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert (err["code"], err["param"]) == ("model_has_no_chat_template", "messages")
            assert err["message"] == ("the served model has no chat template (its GGUF holds no "
                                      "tokenizer.chat_template), so it cannot take messages: send the text as a "
                                      "prompt to /v1/completions")
            r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "temperature": 0,
                                                   "ignore_eos": True})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        backend.close()


def test_an_api_serving_a_model_without_a_chat_template_says_so_as_it_starts(tmp_path):
    """A new user's `meshnet api --model gemma3-270m` (a base model) said nothing of it until the first chat
    request's 400."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "meshnet.cli", "api", "--model", str(TINY), "--port", "0",
                             "--n-ctx", "64"], stderr=subprocess.PIPE, text=True, env={**os.environ, "HOME": str(tmp_path)})
    try:
        lines = [proc.stderr.readline() for _ in range(2)]
    finally:
        proc.terminate()
        proc.wait(60)
    assert lines[0].startswith("[meshnet api] serving 'tiny-llama-q8_0' on http://127.0.0.1:"), lines
    assert lines[1] == ("[meshnet api] 'tiny-llama-q8_0' has no chat template (a base model): /v1/chat/completions and "
                        "/v1/responses refuse messages; send text to /v1/completions\n"), lines


def test_generate_chat_with_a_model_without_a_chat_template_says_what_to_do_instead():
    """`meshnet generate --model gemma3-270m --chat` (a base model, bundled) said "this GGUF has no
    tokenizer.chat_template; pass template=...", a Python argument the command has no flag for."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "meshnet.cli", "generate", "--model", str(TINY), "--chat", "hi"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "template=" not in r.stderr
    assert "no chat template" in r.stderr and "without --chat" in r.stderr, r.stderr


def test_up_suggests_a_generate_command_for_the_model_it_serves():
    """`meshnet up --model gemma3-270m` printed "try: meshnet generate --tracker T "Hello"", which asks for a
    route of the default model (smollm2) and fails with "no registered node serves this model"."""
    from meshnet.up import try_command

    assert try_command("127.0.0.1:7700", "smollm2", False) == 'meshnet generate --tracker 127.0.0.1:7700 "Hello"'
    assert try_command("127.0.0.1:7700", "gemma3-270m", True) == (
        'meshnet generate --tracker 127.0.0.1:7700 --model gemma3-270m --join-token YOUR_TOKEN "Hello"')
    assert try_command("h:1", "/tmp/my model.gguf", False) == "meshnet generate --tracker h:1 --model '/tmp/my model.gguf' \"Hello\""


@pytest.mark.parametrize("escape", ["\\ud800", "\\ud800x", "\\ude00"])
def test_an_unpaired_surrogate_escape_is_named_as_one(escape):
    """\\ud800 alone is JSON's grammar but no character; the parser's "unexpected end of hex escape" read
    as a typo in the escape."""
    from meshnet.api.errors import ApiError
    from meshnet.api.schemas import ChatCompletionRequest
    from meshnet.api.validation import parse_body

    body = '{"messages": [{"role": "user", "content": "' + escape + '"}]}'
    with pytest.raises(ApiError) as e:
        parse_body(ChatCompletionRequest, body.encode())
    assert e.value.status == 400 and e.value.code == "invalid_json"
    assert "a string holds an unpaired UTF-16 surrogate escape such as \\ud800" in str(e.value), str(e.value)


def test_a_node_with_a_join_token_under_a_tracker_without_one_is_warned_about(mesh, caplog):
    """The tracker took clients without a token and routed them to the node, which refused them: nothing
    said so at start, on either side. The tracker's answer to the registration says whether it takes
    callers without a token; the node used to ask it without one, and a tracker with the mesh's token
    logged that as a refused caller at every node's start, on a correct setup."""
    import logging
    import subprocess
    import sys
    import threading

    from mesh_util import Mesh

    warning = (f"WARNING meshnet.node --join-token: the tracker at {mesh.tracker} takes callers without a join "
               "token, so the clients it routes to this node come without one, and this node refuses them; give "
               "the tracker the same --join-token (or this node none)")
    proc = subprocess.Popen([sys.executable, "-m", "meshnet.cli", "node", "--engine", "fake", "--tracker", mesh.tracker,
                             "--join-token", "node-only secret"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    lines: list[str] = []
    warned = threading.Event()

    def read() -> None:
        for line in proc.stderr:
            lines.append(line)
            if warning in line:
                warned.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert warned.wait(30), lines
    finally:
        proc.kill()
        proc.wait(30)
        reader.join(10)
    closed = Mesh(join_token="the mesh's secret")
    try:
        with caplog.at_level(logging.INFO, logger="meshnet.security"):
            [node] = closed.start_nodes([("n1", "0:30")], "smollm2", "--engine", "fake")
        assert not [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert "takes callers without a join token" not in node.log_tail()
    finally:
        closed.close()


def _first_warning_of_node(*args: str) -> str:
    """The first line ``meshnet node ARGS`` writes on stderr; the node is killed after it."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "meshnet.cli", "node", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        return proc.stderr.readline()
    finally:
        proc.kill()
        proc.communicate(timeout=30)
