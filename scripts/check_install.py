"""Check that installing kvspec into an existing vLLM environment changes none of its packages.

For each environment's Python (by default every ``.venv-vllm-*`` of the repository) this asks
that environment's own pip what ``pip install`` of kvspec would do, without doing it::

    <env>/bin/python -m pip install --dry-run --report <json> <kvspec>

once for the clone (pip builds the metadata with the environment's own setuptools,
``--no-build-isolation``, pure Python) and once for a wheel (built here once, pure Python, in a
temporary folder). pip's report lists every distribution it would install; any that the
environment already has, at any version, would be changed (upgraded, downgraded or
reinstalled). kvspec itself is allowed; new packages kvspec needs (Hypothesis where vLLM does
not bring it) are listed but allowed. Nothing is installed and nothing is built in the
environments; pip may read its indexes to resolve a requirement the environment lacks.

    python scripts/check_install.py                      # every .venv-vllm-* here
    python scripts/check_install.py --python /path/to/venv/bin/python ...
    python scripts/check_install.py --wheel dist/kvspec-0.1.0-...whl

Exit status 1 when an environment would change (the lines say which packages, from which
version to which), 2 when pip could not answer, 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WATCHED = ("vllm", "torch", "numpy")  # named in every summary line
_PURE = {"KVSPEC_PURE_PYTHON": "1"}  # metadata only: mypyc has no part in what pip resolves


def normalize(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def installed(python: str) -> dict[str, str]:
    """Every distribution the environment has: normalized name -> version."""
    code = ("import importlib.metadata as m, json; print(json.dumps("
            "{d.metadata['Name']: d.version for d in m.distributions() if d.metadata['Name']}))")
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True,
                         timeout=120).stdout
    return {normalize(name): version for name, version in json.loads(out).items()}


def would_install(python: str, target: str, timeout: float = 600) -> list[tuple[str, str]]:
    """(normalized name, version) of each distribution ``pip install target`` would install."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        command = [python, "-m", "pip", "install", "--dry-run", "--quiet",
                   "--disable-pip-version-check", "--no-input", "--no-build-isolation",
                   "--report", str(report), target]
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                                env=dict(os.environ, **_PURE), check=False)
        if result.returncode != 0 or not report.exists():
            raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
        data: dict[str, Any] = json.loads(report.read_text())
    return [(normalize(item["metadata"]["name"]), item["metadata"]["version"])
            for item in data.get("install", [])]


def changes(before: dict[str, str], planned: list[tuple[str, str]]) -> list[str]:
    """Each planned install of a distribution the environment already has, kvspec aside."""
    return [f"{name} {before[name]} -> {version}" for name, version in planned
            if name in before and name != "kvspec"]


def build_wheel(out: Path) -> Path:
    """A pure-Python wheel of the clone (this Python's setuptools; no download, no mypyc)."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--quiet", "--wheel-dir", str(out), str(ROOT)],
                   env=dict(os.environ, **_PURE), check=True, capture_output=True, text=True,
                   timeout=600)
    (wheel,) = out.glob("kvspec-*.whl")
    return wheel


def check(python: str, targets: dict[str, str]) -> tuple[bool, list[str]]:
    """Whether installing each target leaves the environment's packages as they are; the
    report lines."""
    before = installed(python)
    watched = ", ".join(f"{name} {before.get(name, '-')}" for name in WATCHED)
    ok, lines = True, []
    for label, target in targets.items():
        planned = would_install(python, target)
        changed = changes(before, planned)
        new = sorted(f"{n} {v}" for n, v in planned if n not in before and n != "kvspec")
        ok = ok and not changed
        lines.append(f"{python} ({watched}), {label}: "
                     + (f"CHANGES {'; '.join(changed)}" if changed else "changes nothing")
                     + f"; adds kvspec{' and ' + ', '.join(new) if new else ''}")
    return ok, lines


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--python", action="append", default=[],
                        help="an environment's Python (repeatable); default: .venv-vllm-*")
    parser.add_argument("--wheel", help="a built kvspec wheel to check instead of building one")
    args = parser.parse_args(argv)
    pythons = args.python or [str(p) for p in sorted(ROOT.glob(".venv-vllm-*/bin/python"))]
    if not pythons:
        print("check_install: no vLLM environment (make vllm-env VLLM=...); nothing checked")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        wheel = args.wheel or str(build_wheel(Path(tmp)))
        targets = {"from the clone": str(ROOT), f"from {Path(wheel).name}": wheel}
        all_ok = True
        for python in pythons:
            try:
                ok, lines = check(python, targets)
            except (RuntimeError, subprocess.SubprocessError) as error:
                print(f"check_install: {python}: {error}", file=sys.stderr)
                return 2
            all_ok = all_ok and ok
            print("\n".join(lines))
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
