"""`kvspec audit` with a target it cannot audit: a usage error (exit 2, one line on stderr),
never a conformance failure (exit 1), and never a traceback.

Each case runs the command as a user does, in a fresh interpreter, with a tiny budget; a
target that cannot be loaded is refused before any machine runs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

BROKEN_MODULE = '''
class Broken:
    """A class whose constructor always raises."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("Broken cannot be built")


NOT_A_CLASS = 42
'''


def kvspec(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "kvspec_cli_broken.py").write_text(BROKEN_MODULE)
    (tmp_path / "kvspec_cli_raises_on_import.py").write_text(
        "raise RuntimeError('this module cannot be imported')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]))
    return subprocess.run(
        [sys.executable, "-m", "kvspec.cli", *argv], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.parametrize(("target", "message"), [
    ("kvspec_no_such_module:BlockPool", "cannot import module 'kvspec_no_such_module'"),
    ("kvspec_cli_raises_on_import:Pool", "RuntimeError: this module cannot be imported"),
    ("os:NoSuchPool", "module 'os' has no class 'NoSuchPool'"),
    ("os:path", "target 'os:path' names module 'path', not a class"),
    ("kvspec_cli_broken:NOT_A_CLASS", "names int 'NOT_A_CLASS', not a class"),
    ("kvspec_cli_broken:Broken", "RuntimeError: Broken cannot be built"),
    ("no_colon_here", "unknown target 'no_colon_here'"),
])
def test_a_target_that_cannot_be_audited_is_a_usage_error(
        tmp_path: Path, target: str, message: str) -> None:
    result = kvspec(tmp_path, "audit", "--target", target, "--layer", "pool", "--budget", "1",
                    "--seed", "1", "--no-progress", "--counterexamples", str(tmp_path / "cx"))
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("kvspec audit: error: ")
    assert message in lines[0]
    assert result.stdout == ""  # no report: nothing was audited
    assert not (tmp_path / "cx").exists()


def test_bad_arguments_exit_2(tmp_path: Path) -> None:
    result = kvspec(tmp_path, "audit", "--no-such-option")
    assert result.returncode == 2
    assert "unrecognized arguments: --no-such-option" in result.stderr


def test_help_documents_the_exit_statuses(tmp_path: Path) -> None:
    result = kvspec(tmp_path, "audit", "--help")
    assert result.returncode == 0
    text = result.stdout
    assert "exit status:" in text
    for status, meaning in (("0", "conforms"), ("1", "does not conform"), ("2", "usage error")):
        assert re.search(rf"^\s+{status}\s+.*{meaning}", text, re.MULTILINE), text
    assert "--seed" in text


def test_make_audit_runs_with_a_fixed_seed() -> None:
    makefile = (REPO / "Makefile").read_text()
    recipe = re.search(r"^audit: .*\n\t(.*)$", makefile, re.MULTILINE)
    assert recipe is not None
    assert re.search(r"--seed \d+", recipe.group(1)), recipe.group(1)
