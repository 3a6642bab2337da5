"""Which build of impl/ a process runs: the mypyc extensions or the Python sources."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvspec.impl.block_pool as block_pool
from kvspec import impl
from tests.tree_build import building_in_tree

ROOT = Path(__file__).resolve().parent.parent


def _module_file(module: str, **env: str) -> str:
    code = f"from kvspec import impl; import {module} as m; print(impl.COMPILED, m.__file__)"
    result = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **env),
                            cwd=ROOT, capture_output=True, text=True, check=True)
    return result.stdout.strip()


def test_this_process_runs_the_build_it_reports() -> None:
    compiled = block_pool.__file__.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))
    assert compiled == impl.COMPILED


def test_pure_python_switch_imports_the_sources() -> None:
    out = _module_file("kvspec.impl.kv_cache_manager", KVSPEC_PURE_PYTHON="1")
    assert out.startswith("False ") and out.endswith("kv_cache_manager.py"), out


@pytest.mark.skipif(not impl.COMPILED, reason="impl/ is not compiled here (make compile)")
def test_compiled_build_is_used_by_default() -> None:
    out = _module_file("kvspec.impl.kv_cache_manager", KVSPEC_PURE_PYTHON="0")
    assert out.startswith("True ") and not out.endswith(".py"), out


def test_typed_errors_in_either_build() -> None:
    """Compiled functions check annotated argument types with a bare TypeError; the public
    parameters that take user input are left unchecked so the typed error comes first."""
    pool = block_pool.BlockPool(4, True, 16)
    with pytest.raises(block_pool.InvalidBlockCountError, match=r"2\.5"):
        pool.get_new_blocks(2.5)  # type: ignore[arg-type]
    with pytest.raises(block_pool.InvalidBlockHashError, match="'abc'"):
        pool.get_cached_block("abc", [0])  # type: ignore[arg-type]
    with pytest.raises(block_pool.InvalidBlockCountError, match="'4'"):
        block_pool.BlockPool("4", True, 16)  # type: ignore[arg-type]


# Runs one PEP 517 hook of setuptools' backend as pip does (a process of its own), with mypyc's
# mypycify replaced by a counter: prints how many times the build would have run mypyc.
HOOK = """
import sys
import mypyc.build
calls = []
mypyc.build.mypycify = lambda *args, **kwargs: calls.append(1) or []
from setuptools import build_meta
hook, out = sys.argv[1], sys.argv[2]
getattr(build_meta, hook)(*([] if hook.startswith("get_requires") else [out]))
print("mypycify", len(calls))
"""


@pytest.mark.parametrize(("hooks", "runs"), [
    (("get_requires_for_build_wheel", "prepare_metadata_for_build_wheel", "build_wheel"), 1),
    (("get_requires_for_build_editable", "prepare_metadata_for_build_editable",
      "build_editable"), 1),
    (("get_requires_for_build_sdist", "build_sdist"), 0),
])
def test_pip_install_runs_mypyc_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     hooks: tuple[str, ...], runs: int) -> None:
    """pip calls the backend once per phase, each in a new process; only the phase that builds
    makes the extensions (setup.py: mypyc in each phase tripled the time of `pip install`)."""
    pytest.importorskip("setuptools")
    env = {k: v for k, v in os.environ.items() if k != "KVSPEC_PURE_PYTHON"}
    spec = importlib.util.spec_from_file_location("kvspec_compile", ROOT / "scripts/compile.py")
    assert spec is not None and spec.loader is not None
    compile_script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compile_script)
    monkeypatch.delenv("KVSPEC_PURE_PYTHON", raising=False)
    reason = compile_script.why_not_compiled()
    if reason is not None:
        pytest.skip(f"this Python cannot compile kvspec: {reason}")
    counts = []
    for hook in hooks:
        out = tmp_path / hook
        out.mkdir()
        with building_in_tree():  # the hooks build in the tree: one build at a time
            result = subprocess.run([sys.executable, "-c", HOOK, hook, str(out)], cwd=ROOT,
                                    env=env, capture_output=True, text=True, timeout=300,
                                    check=False)
        assert result.returncode == 0, result.stderr[-3000:]
        counts.append(int(result.stdout.split("mypycify")[-1]))
    assert sum(counts) == runs and counts[-1] == runs, dict(zip(hooks, counts, strict=True))


def test_mypyc_type_check_reads_kvspec_and_msgspec_only(tmp_path: Path) -> None:
    """mypyc's type check (scripts/compile.py, MYPY_CONFIG) reads kvspec's modules, msgspec's
    stubs and the standard library, not the packages the building Python has installed (torch,
    numpy, and in a vLLM environment vLLM and transformers, whose bodies mypyc keeps: most of
    the 14-17 minutes `pip install` took there)."""
    build = pytest.importorskip("mypy.build")
    from mypyc.build import get_mypy_config
    from mypyc.options import CompilerOptions

    spec = importlib.util.spec_from_file_location("kvspec_compile", ROOT / "scripts/compile.py")
    assert spec is not None and spec.loader is not None
    compile_script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compile_script)
    view = compile_script._package_view.make_view(ROOT, tmp_path / "view")
    config = tmp_path / "mypy.ini"
    config.write_text(compile_script.MYPY_CONFIG)
    sources = [str(view / "kvspec" / "impl" / f"{m}.py")
               for m in compile_script.compiled_modules()]
    # mypycify's own reading of its arguments: mypyc's options (every body read is kept)
    _, found, options = get_mypy_config(["--config-file", str(config), *sources], None,
                                        CompilerOptions(), None)
    result = build.build(sources=found, options=options)
    assert not result.errors, result.errors[:20]
    third_party = {name.split(".")[0] for name in result.files} & {
        "torch", "numpy", "vllm", "transformers", "triton", "redis", "hypothesis"}
    assert not third_party, sorted(third_party)
    assert "msgspec" in result.files and "kvspec.impl.block_pool" in result.files
