"""vLLM's own KV-cache tests, run on real vLLM and with kvspec in place of vLLM's modules.

``make vllm-tests VLLM=0.13.0`` runs ``.venv-vllm-0.13.0/bin/python scripts/vllm_tests.py
0.13.0``. It downloads vLLM's source distribution from PyPI once (build/vllm-src/, checked
against a pinned sha256), extracts its tests/ tree into build/vllm-tests-<version>/ and runs
``tests/v1/core`` there twice with pytest: once plain, on real vLLM, and once with
``-p kvspec.vllm_plugin``, which puts kvspec.impl's modules in place of vLLM's before the test
modules are imported. With ``--both-builds`` (``make vllm-tests BOTH_BUILDS=1``) kvspec runs a
third time, from its Python sources, and each build is compared with the one run on real
vLLM. Nothing from vLLM's sources is kept in this repository.

Both runs use ``--noconftest`` (vLLM's root conftest imports packages the CPU environment
lacks) and ``HF_HUB_OFFLINE=1`` (a test that needs the model hub then fails at once, on both
sides), and write JUnit XML, from which each test's outcome is read. It prints a table per
test file, then every test whose outcome differs between the two runs. A test that passes on
real vLLM and not with kvspec must be listed in docs/vllm-tests.md with its reason (it reaches
into vLLM's internals, or meets an intended difference); otherwise it is UNEXPLAINED. Tests that
do not pass on real vLLM here are not compared; the output counts them by cause.

Exit status: 0 when every test that passes on real vLLM passes with kvspec or is listed in
docs/vllm-tests.md; 1 otherwise; 2 on a set-up error (no network for the first download, no
vLLM of that version in this interpreter, a run that could not start). A JSON result goes to
build/vllm-tests-<version>.json. KVSPEC_PURE_PYTHON=1 runs kvspec from its Python sources;
by default kvspec runs its compiled build, as users do.

This script imports neither vLLM nor pytest: only its pytest subprocesses do, so the logic
below is tested from the dev environment (tests/test_vllm_tests_runner.py).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import html.parser
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build"
LEFT_OUT_DOC = ROOT / "docs" / "vllm-tests.md"
DEFAULT_TESTS = "tests/v1/core"
DEFAULT_INDEX = "https://pypi.org/simple"
# sha256 of vLLM's source distribution per release: the file is checked against this pin,
# whatever the index says. For a release not pinned here the index's own hash is used.
SDIST_SHA256 = {
    "0.13.0": "4ad43db45fef37114b550d03a4f423fb3fa3a31d8bc09ee810ef8b9cdcd4b5fe",
    "0.33.0": "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112",
}

SIDES = ("real", "kvspec")
OUTCOMES = ("passed", "failed", "error", "skipped")
ABSENT = "absent"  # the test is not in that run (its file failed to collect, or it is new)

# The table of left-out tests in docs/vllm-tests.md lies between these two lines.
TABLE_START = "<!-- vllm-tests: left-out tests, read by scripts/vllm_tests.py -->"
TABLE_END = "<!-- /vllm-tests -->"
TABLE_HEADER = ("vLLM", "test", "category", "reason")
CATEGORIES = {
    "internals": "reaches into vLLM's internals",
    "intended": "intended difference",
    "hub": "needs the model hub",
}

# What makes a test fail on real vLLM here, read from its failure text.
_HUB_SIGNS = ("Invalid repository ID or local directory", "OfflineModeIsEnabled",
              "LocalEntryNotFoundError", "HF_HUB_OFFLINE")
_DEVICE_SIGNS = ("Failed to infer device type",)
_MISSING_MODULE = re.compile(r"ModuleNotFoundError: No module named '([^']+)'")


class SetupError(Exception):
    """The comparison could not be made (exit status 2)."""


# --- test outcomes from JUnit XML ----------------------------------------------------------------


@dataclass(frozen=True)
class CaseResult:
    test_id: str  # pytest's node id, relative to the extracted root: file::[Class::]test[param]
    file: str
    outcome: str  # one of OUTCOMES
    message: str = ""  # one line: why it did not pass
    detail: str = field(default="", repr=False, compare=False)  # the whole failure text


def node_id(file: str, classname: str, name: str) -> str:
    """pytest's node id from a JUnit (xunit1) testcase's ``file``, ``classname`` and ``name``.

    A collection error is reported with an empty classname; its node id is the file's."""
    if not classname:
        return file
    module = file.removesuffix(".py").replace("/", ".")
    if classname == module:
        return f"{file}::{name}"
    if not classname.startswith(module + "."):
        raise SetupError(f"JUnit testcase {classname}.{name} does not belong to {file}")
    classes = classname[len(module) + 1:].split(".")
    return "::".join([file, *classes, name])


def _one_line(element: ET.Element) -> str:
    """The line that says why a test did not pass: the message, or for a collection error
    (whose message is only "collection failure") the last ``E`` line of the traceback."""
    message = (element.get("message") or "").strip()
    text = element.text or ""
    if message in ("", "collection failure") or message.startswith("failed on "):
        raised = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
        if raised:
            message = raised[-1] if message in ("", "collection failure") else (
                f"{message}: {raised[-1]}")
    first = message.splitlines()[0] if message else ""
    return first if len(first) <= 200 else first[:197] + "..."


def parse_junit(xml_text: str) -> dict[str, CaseResult]:
    """Each test's outcome in a pytest JUnit XML report (``-o junit_family=xunit1``, which
    records each testcase's file)."""
    try:
        root = ET.fromstring(xml_text)
    except ET.ParseError as error:
        raise SetupError(f"unreadable JUnit XML: {error}") from None
    results: dict[str, CaseResult] = {}
    for case in root.iter("testcase"):
        file = case.get("file")
        if not file:
            raise SetupError(f"JUnit testcase {case.get('name')!r} has no file attribute "
                             "(run pytest with -o junit_family=xunit1)")
        test_id = node_id(file, case.get("classname", ""), case.get("name", ""))
        # A teardown error after a failure is a second child: the error wins.
        by_tag = {child.tag: child for child in case}
        for tag, outcome in (("error", "error"), ("failure", "failed"), ("skipped", "skipped")):
            if tag in by_tag:
                element = by_tag[tag]
                detail = f"{element.get('message', '')}\n{element.text or ''}"
                results[test_id] = CaseResult(test_id, file, outcome, _one_line(element), detail)
                break
        else:
            results[test_id] = CaseResult(test_id, file, "passed")
    return results


# --- the documented list of left-out tests --------------------------------------------------------


@dataclass(frozen=True)
class LeftOut:
    test_id: str
    category: str  # a key of CATEGORIES
    reason: str


def parse_left_out(markdown: str, version: str, source: str = "docs/vllm-tests.md",
                   ) -> dict[str, LeftOut]:
    """The rows of the left-out table for vLLM ``version``: a Markdown table with the columns
    TABLE_HEADER between TABLE_START and TABLE_END, one row per test id (in backticks)."""
    lines = markdown.splitlines()
    try:
        start = lines.index(TABLE_START)
        end = lines.index(TABLE_END, start)
    except ValueError:
        raise SetupError(f"{source} has no table between {TABLE_START!r} and "
                         f"{TABLE_END!r}") from None
    rows = [line for line in lines[start + 1:end] if line.strip()]
    entries: dict[str, LeftOut] = {}
    for number, line in enumerate(rows):
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        where = f"{source}, left-out table row {number + 1}"
        if len(cells) != len(TABLE_HEADER):
            raise SetupError(f"{where}: {len(cells)} cells, expected {len(TABLE_HEADER)} "
                             f"({' | '.join(TABLE_HEADER)}; a reason may not contain '|')")
        if number == 0:
            if tuple(cells) != TABLE_HEADER:
                raise SetupError(f"{where}: header {cells}, expected {list(TABLE_HEADER)}")
            continue
        if number == 1 and set("".join(cells)) <= set("-: "):
            continue  # the header's separator row
        release, test, category, reason = cells
        test_id = test.strip("`")
        if not (test.startswith("`") and test.endswith("`") and "::" in test_id):
            raise SetupError(f"{where}: the test id {test!r} must be a pytest node id in "
                             "backticks (`file::test[param]`)")
        if category not in CATEGORIES:
            raise SetupError(f"{where}: category {category!r} is none of {sorted(CATEGORIES)}")
        if not reason:
            raise SetupError(f"{where}: {test_id} has no reason")
        if release != version:
            continue
        if test_id in entries:
            raise SetupError(f"{where}: {test_id} is listed twice for vLLM {version}")
        entries[test_id] = LeftOut(test_id, category, reason)
    return entries


# --- comparison -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Difference:
    test_id: str
    real: str  # outcome on real vLLM, or ABSENT
    kvspec: str  # outcome with kvspec, or ABSENT
    # "documented" / "unexplained": passes on real vLLM, not with kvspec; "kvspec-only":
    # passes with kvspec only; "collection": a file that fails to collect on one side only
    # (its id is the file's); "other": passes on neither side, with different outcomes.
    status: str
    message: str = ""  # why the kvspec run's outcome is what it is
    category: str = ""
    reason: str = ""


@dataclass(frozen=True)
class NotCompared:
    test_id: str
    outcome: str
    cause: str


@dataclass
class Comparison:
    counts: dict[str, dict[str, Counter[str]]]  # file -> side -> outcome -> tests
    differences: list[Difference]
    not_compared: list[NotCompared]
    stale: list[tuple[str, str]]  # (test id, why its docs entry no longer applies)

    @property
    def unexplained(self) -> list[Difference]:
        return [d for d in self.differences if d.status == "unexplained"]

    def passed(self, side: str) -> int:
        return sum(by_side[side]["passed"] for by_side in self.counts.values())


def cause_on_real(result: CaseResult) -> str:
    """Why a test does not pass on real vLLM in this environment, from its failure text."""
    if any(sign in result.detail for sign in _HUB_SIGNS):
        return "needs the model hub"
    missing = _MISSING_MODULE.search(result.detail)
    if missing:
        return f"needs {missing.group(1).split('.')[0]}, which this environment lacks"
    if any(sign in result.detail for sign in _DEVICE_SIGNS):
        return "needs an accelerator"
    if result.outcome == "skipped":
        return "skipped by vLLM's test"
    return f"{result.outcome} on real vLLM: {result.message}"


def _why_absent(file: str, kvspec: dict[str, CaseResult]) -> str:
    collection = kvspec.get(file)
    if collection is not None and collection.outcome == "error":
        return f"not run: {file} fails to collect with kvspec"
    return "not run with kvspec"


def compare(real: dict[str, CaseResult], kvspec: dict[str, CaseResult],
            left_out: dict[str, LeftOut]) -> Comparison:
    """Both runs side by side: per-file counts, the tests whose outcomes differ (each that
    passes on real vLLM only, matched with its docs entry), the tests not compared because
    they do not pass on real vLLM, and the docs entries that no longer apply."""
    counts: dict[str, dict[str, Counter[str]]] = {}
    for side, results in zip(SIDES, (real, kvspec), strict=True):
        for result in results.values():
            by_side = counts.setdefault(result.file, {s: Counter() for s in SIDES})
            by_side[side][result.outcome] += 1

    differences: list[Difference] = []
    for test_id in sorted(real.keys() | kvspec.keys()):
        ours = kvspec.get(test_id)
        theirs = real.get(test_id)
        real_outcome = theirs.outcome if theirs else ABSENT
        kvspec_outcome = ours.outcome if ours else ABSENT
        if real_outcome == kvspec_outcome:
            continue
        # A test absent from kvspec's run is in the real one (it is in at least one).
        message = ours.message if ours else _why_absent(real[test_id].file, kvspec)
        if real_outcome == "passed":
            entry = left_out.get(test_id)
            if entry is None:
                differences.append(Difference(test_id, real_outcome, kvspec_outcome,
                                              "unexplained", message))
            else:
                differences.append(Difference(test_id, real_outcome, kvspec_outcome,
                                              "documented", message, entry.category,
                                              entry.reason))
        else:
            status = ("kvspec-only" if kvspec_outcome == "passed"
                      else "collection" if "::" not in test_id else "other")
            differences.append(Difference(test_id, real_outcome, kvspec_outcome, status,
                                          message))

    not_compared = [NotCompared(r.test_id, r.outcome, cause_on_real(r))
                    for r in sorted(real.values(), key=lambda r: r.test_id)
                    if r.outcome != "passed"]

    # A docs entry is stale once its test passes with kvspec, or is no longer a test that
    # passes on real vLLM; only entries whose file was run are judged.
    stale: list[tuple[str, str]] = []
    files_run = {r.file for r in real.values()}
    for test_id in sorted(left_out):
        if test_id.split("::")[0] not in files_run:
            continue
        ours = kvspec.get(test_id)
        theirs = real.get(test_id)
        if theirs is None or theirs.outcome != "passed":
            stale.append((test_id, "not a test that passes on real vLLM"
                          + (f" (it {theirs.outcome} here)" if theirs else "")))
        elif ours is not None and ours.outcome == "passed":
            stale.append((test_id, "passes with kvspec now"))
    return Comparison(counts, differences, not_compared, stale)


# --- report ---------------------------------------------------------------------------------------


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def render(comparison: Comparison, heading: str, *, list_not_compared: bool = False) -> str:
    """The report printed to the terminal."""
    out = [heading, ""]
    width = max([len("file"), len("total"), *(len(f) for f in comparison.counts)])
    columns = ("passed", "failed", "errors", "skipped")
    out.append(f"{'':{width}}  {'real vLLM':^35}  {'kvspec':^35}")
    out.append(f"{'file':{width}}  " + "  ".join(
        " ".join(f"{c:>8}" for c in columns) for _ in SIDES))
    totals = {side: Counter[str]() for side in SIDES}
    for file in sorted(comparison.counts):
        row = []
        for side in SIDES:
            tally = comparison.counts[file][side]
            totals[side].update(tally)
            row.append(" ".join(f"{tally[o]:>8}" for o in OUTCOMES))
        out.append(f"{file:{width}}  " + "  ".join(row))
    out.append(f"{'total':{width}}  " + "  ".join(
        " ".join(f"{totals[side][o]:>8}" for o in OUTCOMES) for side in SIDES))

    collection = [d for d in comparison.differences if d.status == "collection"]
    if collection:
        out += ["", f"Fail to collect on one side only ({len(collection)}):"]
        out += [f"  {d.test_id}: real {d.real}, kvspec {d.kvspec}"
                + (f": {d.message}" if d.message else "") for d in collection]

    regressions = [d for d in comparison.differences if d.status in ("unexplained",
                                                                     "documented")]
    regressions.sort(key=lambda d: (d.status != "unexplained", d.category, d.test_id))
    out += ["", f"Pass on real vLLM, not with kvspec ({len(regressions)}):"]
    for d in regressions:
        label = "UNEXPLAINED" if d.status == "unexplained" else d.category
        out.append(f"  {label:<12} {d.test_id}")
        out.append(f"  {'':<12}   " + (d.message if d.kvspec == ABSENT
                                          else f"{d.kvspec}: {d.message}"))
        if d.status == "documented":
            out.append(f"  {'':<12}   documented, {CATEGORIES[d.category]}: {d.reason}")
    if not regressions:
        out.append("  none")

    # Tests that pass on neither side are shown only where both sides ran them (a file that
    # fails to collect, above, accounts for its tests' absence).
    for status, title in (("kvspec-only", "Pass with kvspec only"),
                          ("other", "Pass on neither side, outcomes differ")):
        group = [d for d in comparison.differences if d.status == status
                 and (status != "other" or ABSENT not in (d.real, d.kvspec))]
        if group:
            out += ["", f"{title} ({len(group)}):"]
            out += [f"  {d.test_id}: real {d.real}, kvspec {d.kvspec}"
                    + (f": {d.message}" if d.message and d.kvspec != "passed" else "")
                    for d in group]

    if comparison.not_compared:
        causes = Counter(n.cause for n in comparison.not_compared)
        count = len(comparison.not_compared)
        out += ["", f"Not compared: {_plural(count, 'test')} "
                    f"{'does' if count == 1 else 'do'} not pass on real vLLM here"]
        out += [f"  {n:>4}  {cause}" for cause, n in causes.most_common()]
        if list_not_compared:
            out += [f"        {n.test_id}: {n.cause}" for n in comparison.not_compared]

    if comparison.stale:
        out += ["", f"Stale entries in docs/vllm-tests.md ({len(comparison.stale)}; "
                    "remove them):"]
        out += [f"  {test_id}: {why}" for test_id, why in comparison.stale]
    return "\n".join(out)


def summary_line(comparison: Comparison) -> str:
    documented = Counter(d.category for d in comparison.differences
                         if d.status == "documented")
    listed = ", ".join(f"{n} {category}" for category, n in sorted(documented.items()))
    unexplained = len(comparison.unexplained)
    verdict = "FAIL" if unexplained else "ok"
    return (f"vllm-tests: {comparison.passed('real')} pass on real vLLM; with kvspec "
            f"{comparison.passed('kvspec')} pass, {sum(documented.values())} documented"
            f"{f' ({listed})' if listed else ''}, {unexplained} UNEXPLAINED: {verdict}")


def result_json(comparison: Comparison, **about: Any) -> dict[str, Any]:
    return {
        "kvspec_vllm_tests": 1,
        **about,
        "verdict": "fail" if comparison.unexplained else "ok",
        "passed": {side: comparison.passed(side) for side in SIDES},
        "files": {file: {side: {o: by_side[side][o] for o in OUTCOMES} for side in SIDES}
                  for file, by_side in sorted(comparison.counts.items())},
        "differences": [asdict(d) for d in comparison.differences],
        "not_compared": [asdict(n) for n in comparison.not_compared],
        "stale": [{"test_id": t, "why": why} for t, why in comparison.stale],
    }


# --- vLLM's source distribution ---------------------------------------------------------------


class _Links(html.parser.HTMLParser):
    """The ``href`` of every ``<a>`` in a PEP 503 simple index page."""

    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        href = dict(attrs).get("href")
        if tag == "a" and href:
            self.hrefs.append(href)


def sdist_link(page: str, content_type: str, filename: str, page_url: str) -> tuple[str, str]:
    """(URL, sha256) of ``filename`` in a simple index page, JSON (PEP 691) or HTML (PEP 503).
    The sha256 is "" where the index gives none."""
    if "json" in content_type:
        for entry in json.loads(page).get("files", []):
            if entry.get("filename") == filename:
                url = urllib.parse.urljoin(page_url, entry["url"])
                return url, entry.get("hashes", {}).get("sha256", "")
    else:
        links = _Links()
        links.feed(page)
        for href in links.hrefs:
            url, _, fragment = urllib.parse.urljoin(page_url, href).partition("#")
            if url.rsplit("/", 1)[-1] == filename:
                digest = fragment.removeprefix("sha256=") if fragment.startswith("sha256=") \
                    else ""
                return url, digest
    raise SetupError(f"{page_url} lists no {filename}")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _get(url: str, accept: str = "*/*") -> tuple[bytes, str]:
    request = urllib.request.Request(url, headers={"Accept": accept,
                                                   "User-Agent": "kvspec-vllm-tests"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.read(), response.headers.get("Content-Type", "")
    except (urllib.error.URLError, TimeoutError, OSError) as error:
        raise SetupError(f"could not download {url}: {error}") from None


def fetch_sdist(version: str, index_url: str) -> tuple[Path, str]:
    """vLLM ``version``'s source distribution under build/vllm-src/, downloaded on first use
    and checked by sha256. Returns its path and hash."""
    filename = f"vllm-{version}.tar.gz"
    cache = BUILD / "vllm-src"
    path = cache / filename
    hash_file = cache / f"{filename}.sha256"  # for a release without a pin: the index's hash
    expected = SDIST_SHA256.get(version) or (
        hash_file.read_text().strip() if hash_file.exists() else "")
    if path.exists() and expected and _sha256(path) == expected:
        return path, expected

    page_url = f"{index_url.rstrip('/')}/vllm/"
    print(f"vllm-tests: downloading {filename} (vLLM's source distribution) from {page_url}",
          flush=True)
    page, content_type = _get(page_url, "application/vnd.pypi.simple.v1+json, "
                                        "text/html;q=0.1")
    url, listed = sdist_link(page.decode(), content_type, filename, page_url)
    pinned = SDIST_SHA256.get(version)
    if pinned and listed and listed != pinned:
        raise SetupError(f"{page_url} gives sha256 {listed} for {filename}; "
                         f"scripts/vllm_tests.py pins {pinned}")
    expected = pinned or listed
    if not expected:
        raise SetupError(f"{page_url} gives no sha256 for {filename}, and none is pinned")
    data, _ = _get(url)
    if hashlib.sha256(data).hexdigest() != expected:
        raise SetupError(f"{url}: sha256 {hashlib.sha256(data).hexdigest()}, "
                         f"expected {expected}")
    cache.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".part")
    partial.write_bytes(data)
    partial.replace(path)
    if not pinned:
        hash_file.write_text(expected + "\n")
    print(f"vllm-tests: {path.relative_to(ROOT)} ({len(data) / 1e6:.1f} MB, sha256 {expected})")
    return path, expected


def extract_tests(sdist: Path, digest: str, version: str) -> Path:
    """The sdist's tests/ tree (with vLLM's pyproject.toml, which holds its pytest settings)
    in build/vllm-tests-<version>/, extracted again when the sdist changes. vLLM's tests
    import their helpers as ``tests.v1...``, so the package layout is kept; vLLM's own
    package sources are left in the archive, so ``import vllm`` finds the installed one."""
    root = BUILD / f"vllm-tests-{version}"
    stamp = root / ".sdist-sha256"
    if stamp.exists() and stamp.read_text().strip() == digest and (root / "tests").is_dir():
        return root
    if (root / "tests").exists():
        shutil.rmtree(root / "tests")
    root.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as archive:
        members = []
        for member in archive.getmembers():
            inner = member.name.partition("/")[2]  # without the top folder, vllm-<version>/
            if inner == "pyproject.toml" or inner.startswith("tests/"):
                member.name = inner
                members.append(member)
        if not any(m.name.startswith("tests/") for m in members):
            raise SetupError(f"{sdist} has no tests/ tree")
        archive.extractall(root, members=members, filter="data")
    stamp.write_text(digest + "\n")
    return root


# --- running pytest ---------------------------------------------------------------------------


PYTEST_OWN_FAILURES = {2: "interrupted", 3: "internal error", 4: "usage error",
                       5: "no tests collected"}
KVSPEC_HEADER = "kvspec in place of vLLM"  # kvspec.vllm_plugin's pytest report header


def _pytest_env(side: str, pure: bool = False) -> dict[str, str]:
    env = dict(os.environ)
    if pure:  # kvspec from its Python sources, whatever build this process has
        env["KVSPEC_PURE_PYTHON"] = "1"
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    # The plugin's switch: on for kvspec's run, so any vLLM process a test starts uses
    # kvspec too; off for the real run, whatever the caller's shell exports.
    if side == "kvspec":
        env["VLLM_USE_KVSPEC"] = "1"
    else:
        env.pop("VLLM_USE_KVSPEC", None)
    return env


def _run_pytest(side: str, root: Path, targets: list[str], name: str,
                timeout: float, pure: bool = False) -> tuple[int | None, Path, Path]:
    """One pytest run from the extracted root. Returns its exit status (None on timeout),
    its JUnit XML path (absent when pytest died before writing it) and its log."""
    xml = root / f"{name}.xml"
    log = root / f"{name}.log"
    xml.unlink(missing_ok=True)
    command = [sys.executable, "-m", "pytest", *targets, "-c", "pyproject.toml",
               "--rootdir", ".", "--noconftest", "-p", "no:cacheprovider",
               "--continue-on-collection-errors", "--tb=short", "-o", "junit_family=xunit1",
               f"--junitxml={xml.name}"]
    if side == "kvspec":
        command += ["-p", "kvspec.vllm_plugin"]
    with log.open("w") as stream:
        stream.write(" ".join(command) + "\n\n")
        stream.flush()
        try:
            status: int | None = subprocess.run(command, cwd=root, env=_pytest_env(side, pure),
                                                stdout=stream, stderr=subprocess.STDOUT,
                                                timeout=timeout, check=False).returncode
        except subprocess.TimeoutExpired:
            status = None
    return status, xml, log


def _how_it_ended(status: int | None) -> str:
    if status is None:
        return "timed out"
    if status < 0:
        try:
            return f"died of {signal.Signals(-status).name}"
        except ValueError:
            return f"died of signal {-status}"
    return f"exited with status {status}"


def _log_tail(log: Path, lines: int = 25) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def run_side(side: str, root: Path, tests: str, timeout: float,
             pure: bool = False) -> dict[str, CaseResult]:
    """Every test's outcome in one run of ``tests`` on ``side`` (``pure``: kvspec's Python
    sources). Should pytest die without a report (a crash in compiled code, a hang), each
    test file is run on its own so that the others still count and the culprit is named."""
    name = f"{side}-pure" if pure else side
    status, xml, log = _run_pytest(side, root, [tests], name, timeout, pure)
    if status in PYTEST_OWN_FAILURES:
        raise SetupError(f"pytest's {name} run ended with {PYTEST_OWN_FAILURES[status]} "
                         f"(status {status}); {log}:\n{_log_tail(log)}")
    if status in (0, 1) and xml.exists():
        results = parse_junit(xml.read_text())
    else:
        print(f"vllm-tests: the {name} run {_how_it_ended(status)} without a report ({log}); "
              "running each test file on its own", flush=True)
        results = {}
        target = root / tests
        for path in [target] if target.is_file() else sorted(target.rglob("test_*.py")):
            file = path.relative_to(root).as_posix()
            status, xml, file_log = _run_pytest(side, root, [file], f"{name}-{path.stem}",
                                                timeout, pure)
            if status == 5:  # a file without tests
                continue
            if status in (0, 1) and xml.exists():
                results.update(parse_junit(xml.read_text()))
            else:
                results[file] = CaseResult(
                    file, file, "error", f"pytest {_how_it_ended(status)} running this file, "
                    f"without a report ({file_log.name})")
    if side == "kvspec" and KVSPEC_HEADER not in log.read_text(errors="replace"):
        raise SetupError(f"the kvspec run did not report kvspec in place ({log})")
    return results


# --- main -----------------------------------------------------------------------------------------


def _kvspec_build() -> str:
    """Which build of kvspec.impl the kvspec run gets: the same choice as in this process."""
    with warnings.catch_warnings():  # a stale compiled build: said here instead
        warnings.simplefilter("ignore")
        import kvspec.impl

    if kvspec.impl.COMPILED:
        return "compiled build"
    if os.environ.get("KVSPEC_PURE_PYTHON", "") not in ("", "0"):
        return "Python sources, KVSPEC_PURE_PYTHON=1"
    return "Python sources, the compiled build being out of date or missing"


def check_interpreter(version: str) -> None:
    try:
        installed = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        raise SetupError(f"{sys.executable} has no vLLM; run this with .venv-vllm-{version}"
                         f"/bin/python (make vllm-tests VLLM={version})") from None
    if installed != version:
        raise SetupError(f"{sys.executable} has vLLM {installed}, not {version}")
    for module in ("pytest", "kvspec.vllm_plugin"):
        if importlib.util.find_spec(module) is None:
            raise SetupError(f"{sys.executable} cannot import {module}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("version", help="vLLM release, e.g. 0.13.0 (the one this interpreter "
                                        "has)")
    parser.add_argument("--tests", default=DEFAULT_TESTS,
                        help=f"test path inside vLLM's sources (default {DEFAULT_TESTS})")
    parser.add_argument("--timeout", type=float, default=900,
                        help="seconds a pytest run may take (default 900)")
    parser.add_argument("--index-url", default=DEFAULT_INDEX,
                        help=f"simple package index (default {DEFAULT_INDEX})")
    parser.add_argument("--json", type=Path, default=None,
                        help="where to write the result (default build/vllm-tests-VERSION.json;"
                             " the --both-builds pure run's goes beside it, -pure.json)")
    parser.add_argument("--both-builds", action="store_true",
                        help="also run the tests with kvspec's Python sources in place, "
                             "compared with the same run on real vLLM (CI does)")
    parser.add_argument("--list-not-compared", action="store_true",
                        help="list each test that does not pass on real vLLM here")
    args = parser.parse_args(argv)
    version: str = args.version
    json_path: Path = args.json or BUILD / f"vllm-tests-{version}.json"
    try:
        check_interpreter(version)
        left_out = parse_left_out(LEFT_OUT_DOC.read_text(), version)
        sdist, digest = fetch_sdist(version, args.index_url)
        root = extract_tests(sdist, digest, version)
        if not (root / args.tests).exists():
            raise SetupError(f"vLLM {version}'s sources have no {args.tests}")
        build = _kvspec_build()
        # kvspec's runs: this process's build, and its Python sources too where asked and
        # this build is not already them. One run on real vLLM serves every kvspec run.
        builds = [(build, False)]
        if args.both_builds and build == "compiled build":
            builds.append(("Python sources, KVSPEC_PURE_PYTHON=1", True))
        started = time.monotonic()
        for what in ("on real vLLM", *(f"with kvspec in place ({b})" for b, _ in builds)):
            print(f"vllm-tests: running vLLM's {args.tests} {what}", flush=True)
        # The runs share nothing but the extracted sources (each writes its own log and
        # report), so they run side by side where there is a core for each.
        workers = min(1 + len(builds), os.cpu_count() or 1)
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            real_run = pool.submit(run_side, "real", root, args.tests, args.timeout)
            kvspec_runs = [pool.submit(run_side, "kvspec", root, args.tests, args.timeout,
                                       pure) for _, pure in builds]
            real = real_run.result()
            kvspec_results = [run.result() for run in kvspec_runs]
        if not any(r.outcome == "passed" for r in real.values()):
            raise SetupError(f"no test passes on real vLLM; see {root / 'real.log'}")
    except SetupError as error:
        print(f"vllm-tests: set-up error: {error}", file=sys.stderr)
        return 2

    seconds = time.monotonic() - started
    status = 0
    for (build_name, pure), results in zip(builds, kvspec_results, strict=True):
        comparison = compare(real, results, left_out)
        log = "kvspec-pure.log" if pure else "kvspec.log"
        heading = (f"vLLM {version}'s {args.tests} on real vLLM, and with kvspec "
                   f"({build_name}) in place of its KV-cache modules\n({seconds:.0f} s for "
                   f"every run; logs: {root.relative_to(ROOT)}/real.log and {log})")
        print(render(comparison, heading, list_not_compared=args.list_not_compared))
        print()
        print(summary_line(comparison))
        path = json_path.with_name(f"{json_path.stem}-pure{json_path.suffix}") if pure \
            else json_path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result_json(
            comparison, vllm=version, tests=args.tests, kvspec_build=build_name,
            sdist={"file": sdist.name, "sha256": digest}), indent=1) + "\n")
        print(f"vllm-tests: result in {path}\n")
        if comparison.unexplained:
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
