"""What `pip install` of the project puts on a user's path: the one `kvspec` import package,
its data, the `kvspec` command and the vLLM plugin entry point, and nothing else (no top-level
`spec`, `impl` or `models` next to vLLM's own modules)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.tree_build import building_in_tree

ROOT = Path(__file__).resolve().parent.parent

setuptools = pytest.importorskip("setuptools", reason="building a wheel needs setuptools")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    # --no-build-isolation: this venv's setuptools, so that nothing is downloaded; a pure
    # wheel (KVSPEC_PURE_PYTHON=1), as mypyc would take minutes (test_compiled_wheel does it).
    with building_in_tree():  # pip builds in the tree: one build at a time
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                        "--no-build-isolation", "--quiet", "--wheel-dir", str(out), str(ROOT)],
                       env=dict(os.environ, KVSPEC_PURE_PYTHON="1"),
                       check=True, capture_output=True, text=True, timeout=300)
    (path,) = out.glob("kvspec-*.whl")
    return zipfile.ZipFile(path)


def test_one_top_level_import_package(wheel: zipfile.ZipFile) -> None:
    top_level = {name.split("/")[0] for name in wheel.namelist()}
    assert {t for t in top_level if not t.endswith(".dist-info")} == {"kvspec"}


def test_package_holds_spec_impl_models_and_their_data(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    for module in ("kvspec/cli.py", "kvspec/vllm_plugin.py", "kvspec/spec/pool.py",
                   "kvspec/conformance/audit.py", "kvspec/impl/block_pool.py",
                   "kvspec/models/plan.py", "kvspec/models/data/llama-3.1-8b.json"):
        assert module in names, module


def test_entry_points(wheel: zipfile.ZipFile) -> None:
    (entry_points,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    text = wheel.read(entry_points).decode()
    assert "[console_scripts]\nkvspec = kvspec.cli:main" in text
    assert "[vllm.general_plugins]\nkvspec = kvspec.vllm_plugin:register" in text


def test_no_module_imports_a_bare_top_level_folder() -> None:
    """Everything imports through kvspec.*: an installed kvspec has no top-level spec, impl or
    models (a bare `import models` works from a checkout, where the repo root is on the path,
    and nowhere else)."""
    import re

    layers = ("spec", "impl", "models", "conformance")
    bare = re.compile(rf"^\s*(?:import|from)\s+(?:{'|'.join(layers)})(?:\.|\s|$)", re.MULTILINE)
    offenders = [str(path.relative_to(ROOT)) for folder in (*layers, "kvspec")
                 for path in (ROOT / folder).glob("**/*.py")
                 if bare.search(path.read_text(encoding="utf-8"))]
    assert offenders == []


def test_no_extra_names_vllm(wheel: zipfile.ZipFile) -> None:
    """An extra naming vLLM makes pip re-resolve vLLM's own pins (a CUDA torch in place of the
    CPU one; vLLM 0.33 downgraded to 0.13): kvspec has none, and requires neither vLLM nor a
    version of torch or numpy that a vLLM environment lacks."""
    (metadata,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    requires = [line.split(":", 1)[1].strip() for line in wheel.read(metadata).decode().splitlines()
                if line.startswith("Requires-Dist:")]
    extras = [line.split(":", 1)[1].strip() for line in wheel.read(metadata).decode().splitlines()
              if line.startswith("Provides-Extra:")]
    assert "vllm" not in extras and not [r for r in requires if r.lower().startswith("vllm")]


VLLM_ENVS = sorted(ROOT.glob(".venv-vllm-*/bin/python"))


@pytest.mark.slow
@pytest.mark.skipif(not VLLM_ENVS, reason="no .venv-vllm-* (make vllm-env VLLM=...)")
def test_install_into_vllm_environments_changes_nothing(wheel: zipfile.ZipFile) -> None:
    """scripts/check_install.py: pip's own dry run of installing the clone and the wheel into
    each vLLM environment upgrades, downgrades or reinstalls none of its packages."""
    with building_in_tree():  # pip prepares the clone's metadata in the tree
        result = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_install.py"),
                                 "--wheel", str(wheel.filename)],
                                capture_output=True, text=True, timeout=900, check=False)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert len(lines) == 2 * len(VLLM_ENVS) and all("changes nothing" in x for x in lines), lines
