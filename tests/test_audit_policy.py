"""``kvspec audit --policy``: impl's plug-ins conform; a broken policy class is caught.

Every audit here is bounded by examples (``--examples``) from a fixed seed, never by what a
budget of seconds allows: a loaded machine runs the same programs, more slowly. The budget
is a hard cap only, far above what the examples take."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvspec.conformance.audit import run_audit
from kvspec.spec.pool import Profile

ROOT = Path(__file__).resolve().parent.parent
CONFORMING = 30  # examples of a policy that conforms


@pytest.mark.parametrize("policy", ["lru-lifo-unhashed", "priority", "pinned"])
def test_impl_conforms_under_each_policy(policy: str) -> None:
    audit = run_audit("impl", Profile.V0_13, 600.0, layer="pool", seed_base=1, policy=policy,
                      examples=CONFORMING)
    assert audit.passes, audit.failures
    assert audit.layers[0].examples >= CONFORMING


def test_broken_policy_class_is_caught(tmp_path: Path) -> None:
    """Run until the bug is found: seed 3 finds it at its 9th example (seconds, even on a
    loaded machine), and the audit stops there. The cap on examples is far beyond that; the
    budget caps the time, most of it spent shrinking the failure, which takes what is left
    of it on a loaded machine (the shrunk program's length is not what this test checks)."""
    result = subprocess.run(
        [sys.executable, "-m", "kvspec.cli", "audit", "--target",
         "tests.broken_policy:ForgetfulPriorityPolicy", "--policy", "priority",
         "--layer", "pool", "--examples", "1000", "--budget", "40", "--seed", "3",
         "--no-progress", "--counterexamples", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "no_expired_priority" in result.stdout, result.stdout
    written = list(tmp_path.glob("*.py"))
    assert written, "no counterexample written"
    # The counterexample is plain API calls on impl's pool with the broken plug-in: it fails.
    rerun = subprocess.run([sys.executable, "-m", "pytest", "-q", str(written[0])], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 1, rerun.stdout


def test_example_third_party_policy_conforms(tmp_path: Path) -> None:
    """tests/example_policy.py, written against the public policy API only, passes the audit."""
    result = subprocess.run(
        [sys.executable, "-m", "kvspec.cli", "audit", "--target",
         "tests.example_policy:ReuseUnkeyedFirst", "--policy", "lru-lifo-unhashed",
         "--layer", "pool", "--examples", str(CONFORMING), "--budget", "600", "--seed", "1",
         "--no-progress",
         "--counterexamples", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_example_policy_uses_no_private_name_of_impl() -> None:
    """The example reads impl only through public names: no ``x._name`` but its own, and no
    ``from kvspec.impl... import _name``."""
    import ast

    tree = ast.parse((ROOT / "tests" / "example_policy.py").read_text(encoding="utf-8"))
    own = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
    private = [
        f"line {node.lineno}: {ast.unparse(node)}" for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr.startswith("_")
        and not node.attr.startswith("__") and node.attr not in own
    ] + [
        f"line {node.lineno}: import {alias.name}" for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) for alias in node.names
        if alias.name.startswith("_")
    ]
    assert private == []
