"""The README and docs/: links that resolve, a README a newcomer reads, no outside documents.

- Every relative link in README.md and docs/*.md (``[text](path)``), and every ``docs/*.md``
  a page names in its text, is a file of the repository.
- README.md stays a newcomer's page: under 220 lines.
- The set-up and test commands the README gives are those CI runs (.ci/run).
- The README's Python example imports names that exist.
- Nothing in README.md, docs/ or the code points to documents outside the repository (the
  reference folder of the workspace the project was written in): cite vLLM's own files,
  issues and pull requests instead.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
CODE_FOLDERS = ("spec", "impl", "models", "conformance", "kvspec", "tests", "benchmarks",
                "scripts")
CODE_SUFFIXES = {".py", ".sh", ".toml", ".cfg", ".in", ".txt"}

MARKDOWN_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
DOCS_MENTION = re.compile(r"(?<![\w/.-])(docs/[\w.-]+\.md)\b")
# Built from parts, so that this file does not match itself.
OUTSIDE = re.compile("|".join([r"\.\./" + "shared", "shared" + r"/reference"]))


def relative_links(page: Path) -> list[str]:
    links = []
    for target in MARKDOWN_LINK.findall(page.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL (https:, mailto:) or an anchor on the same page
        links.append(target.split("#", 1)[0])
    return links


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = [link for link in relative_links(page) if not (page.parent / link).exists()]
    assert broken == [], f"{page.relative_to(ROOT)} links to missing files: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_docs_page_named_exists(page: Path) -> None:
    named = set(DOCS_MENTION.findall(page.read_text()))
    missing = sorted(name for name in named if not (ROOT / name).exists())
    assert missing == [], f"{page.relative_to(ROOT)} names missing pages: {missing}"


def test_readme_is_a_newcomers_page() -> None:
    lines = README.read_text().count("\n")
    assert lines < 220, f"README.md has {lines} lines: move the detail to docs/"
    for page in ("docs/architecture.md", "docs/audit.md", "docs/benchmarks.md"):
        assert f"]({page})" in README.read_text(), f"the README does not link {page}"


def test_the_readme_commands_are_those_ci_runs() -> None:
    text = README.read_text()
    section = text.split("## The two commands", 1)[1].split("\n## ", 1)[0]
    block = section.split("```sh", 1)[1].split("```", 1)[0]
    commands = [line.split("#", 1)[0].strip() for line in block.strip().splitlines()]
    # A command of .ci/run: a line of its own, or the command of a timed step
    # (`step "make test" make test`, `step "make audit" make audit || status=1`).
    ci = [re.sub(r'^step "[^"]*" ', "", line.split("#", 1)[0].strip()).split("||", 1)[0].strip()
          for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert commands == ["make test", "make audit"]
    for command in commands:
        assert command in ci, f"the README's {command!r} is not run by .ci/run"


def test_the_readme_example_imports_exist() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    imports = [m for block in blocks
               for m in re.findall(r"^from ([\w.]+) import ([\w, ]+)$", block, re.M)]
    assert imports, "the README's example imports nothing from kvspec"
    for module_name, names in imports:
        module = importlib.import_module(module_name)
        for name in names.split(","):
            assert hasattr(module, name.strip()), f"{module_name} has no {name.strip()}"


def test_nothing_points_outside_the_repository() -> None:
    files = list(PAGES)
    for folder in CODE_FOLDERS:
        files += [p for p in (ROOT / folder).rglob("*")
                  if p.is_file() and p.suffix in CODE_SUFFIXES and "__pycache__" not in p.parts]
    files += [ROOT / "Makefile", ROOT / "pyproject.toml", ROOT / ".ci" / "run"]
    hits = [f"{path.relative_to(ROOT)}:{number}"
            for path in files if path.exists()
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
            if OUTSIDE.search(line)]
    assert hits == [], f"references to documents outside the repository: {hits}"
