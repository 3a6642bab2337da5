"""``kvspec audit --policy``: impl's plug-ins conform; a broken policy class is caught."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvspec.conformance.audit import run_audit
from kvspec.spec.pool import Profile

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("policy", ["lru-lifo-unhashed", "priority", "pinned"])
def test_impl_conforms_under_each_policy(policy: str) -> None:
    audit = run_audit("impl", Profile.V0_13, 12.0, layer="pool", seed_base=1, policy=policy)
    assert audit.passes, audit.failures


def test_broken_policy_class_is_caught(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvspec.cli", "audit", "--target",
         "tests.broken_policy:ForgetfulPriorityPolicy", "--policy", "priority",
         "--layer", "pool", "--budget", "20", "--seed", "1", "--no-progress",
         "--counterexamples", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "no_expired_priority" in result.stdout, result.stdout
    written = list(tmp_path.glob("*.py"))
    assert written, "no counterexample written"
    # The counterexample is plain API calls on impl's pool with the broken plug-in: it fails.
    rerun = subprocess.run([sys.executable, "-m", "pytest", "-q", str(written[0])], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert rerun.returncode == 1, rerun.stdout


def test_example_third_party_policy_conforms(tmp_path: Path) -> None:
    """tests/example_policy.py, written against the public policy API only, passes the audit."""
    result = subprocess.run(
        [sys.executable, "-m", "kvspec.cli", "audit", "--target",
         "tests.example_policy:ReuseUnkeyedFirst", "--policy", "lru-lifo-unhashed",
         "--layer", "pool", "--budget", "20", "--seed", "1", "--no-progress",
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
