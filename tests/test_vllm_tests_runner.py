"""scripts/vllm_tests.py (``make vllm-tests``) without vLLM or the network: reading pytest's
JUnit XML, the left-out table of docs/vllm-tests.md, the comparison and its verdict, the report,
and fetching and extracting the source distribution (from a fake index and a made-up archive).
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import re
import sys
import tarfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


def _load_runner() -> ModuleType:
    spec = importlib.util.spec_from_file_location("vllm_tests_runner",
                                                  REPO_ROOT / "scripts" / "vllm_tests.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


runner = _load_runner()

CORE = "tests/v1/core"


def junit(*cases: str) -> str:
    return ('<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">'
            + "".join(cases) + "</testsuite></testsuites>")


def case(file: str, name: str, classes: str = "", outcome: str = "passed",
         message: str = "", text: str = "") -> str:
    module = file.removesuffix(".py").replace("/", ".")
    classname = f"{module}.{classes}" if classes else module
    child = {"passed": "", "failed": "failure", "error": "error", "skipped": "skipped"}[outcome]
    message = message.replace("\n", "&#10;")  # as pytest writes a newline in an attribute
    body = f'<{child} message="{message}">{text}</{child}>' if child else ""
    return f'<testcase classname="{classname}" name="{name}" file="{file}">{body}</testcase>'


def collection_error(file: str, raised: str) -> str:
    module = file.removesuffix(".py").replace("/", ".")
    return (f'<testcase classname="" name="{module}" file="{file}">'
            '<error message="collection failure">ImportError while importing test module\n'
            f"tests/x.py:22: in &lt;module&gt;\nE   {raised}</error></testcase>")


HUB = ("pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig\n"
       "  Value error, Invalid repository ID or local directory specified: 'facebook/opt-125m'")

REAL = junit(
    case(f"{CORE}/test_pool.py", "test_plain"),
    case(f"{CORE}/test_pool.py", "test_param[sha256]"),
    case(f"{CORE}/test_pool.py", "test_internal_pointer"),
    case(f"{CORE}/test_pool.py", "test_asserts"),
    case(f"{CORE}/test_pool.py", "test_new_bug"),
    case(f"{CORE}/test_pool.py", "test_needs_hub", outcome="failed", message=HUB),
    case(f"{CORE}/test_pool.py", "test_fixed_by_kvspec", outcome="failed", message="boom"),
    case(f"{CORE}/test_pool.py", "test_failed_then_teardown", outcome="failed", message="x"),
    case(f"{CORE}/test_metrics.py", "test_in_class", classes="TestOuter.TestInner"),
    case(f"{CORE}/test_utils.py", "test_utility"),
    case(f"{CORE}/test_utils.py", "test_utility_needs_hub", outcome="failed", message=HUB),
    collection_error(f"{CORE}/test_e2e.py",
                     "ModuleNotFoundError: No module named 'lmformatenforcer'"),
)

KVSPEC = junit(
    case(f"{CORE}/test_pool.py", "test_plain"),
    case(f"{CORE}/test_pool.py", "test_param[sha256]"),
    case(f"{CORE}/test_pool.py", "test_internal_pointer", outcome="failed",
         message="AttributeError: 'FreeKVCacheBlockQueue' object has no attribute "
                 "'fake_free_list_head'"),
    case(f"{CORE}/test_pool.py", "test_asserts", outcome="failed",
         message="kvspec.impl.errors.BlockNotInPoolError: block 7 is not a block of this pool"),
    case(f"{CORE}/test_pool.py", "test_new_bug", outcome="failed",
         message="assert 3 == 4\nmore lines"),
    case(f"{CORE}/test_pool.py", "test_needs_hub", outcome="failed", message=HUB),
    case(f"{CORE}/test_pool.py", "test_fixed_by_kvspec"),
    # a failure in the call, then an error at teardown: one testcase, two children
    f'<testcase classname="tests.v1.core.test_pool" name="test_failed_then_teardown" '
    f'file="{CORE}/test_pool.py"><failure message="x">x</failure>'
    '<error message="failed on teardown with &quot;boom&quot;">E   RuntimeError: late</error>'
    "</testcase>",
    case(f"{CORE}/test_metrics.py", "test_in_class", classes="TestOuter.TestInner"),
    collection_error(f"{CORE}/test_utils.py",
                     "ImportError: cannot import name 'estimate_max_model_len'"),
    collection_error(f"{CORE}/test_e2e.py",
                     "ModuleNotFoundError: No module named 'lmformatenforcer'"),
)


def left_out_doc(*rows: str) -> str:
    return "\n".join(["# vLLM's tests", "", runner.TABLE_START,
                      "| vLLM | test | category | reason |", "|---|---|---|---|", *rows,
                      runner.TABLE_END, "", "More prose."])


DOC = left_out_doc(
    f"| 0.13.0 | `{CORE}/test_pool.py::test_internal_pointer` | internals | reads the "
    "free queue's sentinel |",
    f"| 0.13.0 | `{CORE}/test_pool.py::test_asserts` | intended | a typed error where vLLM "
    "asserts |",
    f"| 0.13.0 | `{CORE}/test_pool.py::test_plain` | intended | once failed, passes now |",
    f"| 0.13.0 | `{CORE}/test_pool.py::test_needs_hub` | hub | never passes here |",
    f"| 0.13.0 | `{CORE}/test_gone.py::test_in_a_file_not_run` | internals | not judged |",
    f"| 0.99.0 | `{CORE}/test_pool.py::test_new_bug` | intended | another release's row |",
)


def compare(real: str = REAL, kvspec: str = KVSPEC, doc: str = DOC) -> Any:
    return runner.compare(runner.parse_junit(real), runner.parse_junit(kvspec),
                          runner.parse_left_out(doc, "0.13.0"))


# --- JUnit XML ------------------------------------------------------------------------------------


def test_junit_cases_become_pytest_node_ids_with_their_outcomes() -> None:
    results = runner.parse_junit(KVSPEC)
    outcomes = {test_id: r.outcome for test_id, r in results.items()}
    assert outcomes[f"{CORE}/test_pool.py::test_param[sha256]"] == "passed"
    assert outcomes[f"{CORE}/test_metrics.py::TestOuter::TestInner::test_in_class"] == "passed"
    assert outcomes[f"{CORE}/test_pool.py::test_new_bug"] == "failed"
    # a collection error is the file's own node id
    assert outcomes[f"{CORE}/test_utils.py"] == "error"
    # an error at teardown outranks the failure before it
    assert outcomes[f"{CORE}/test_pool.py::test_failed_then_teardown"] == "error"
    assert results[f"{CORE}/test_pool.py::test_failed_then_teardown"].message == (
        'failed on teardown with "boom": RuntimeError: late')


def test_a_failure_is_summed_up_in_one_line() -> None:
    results = runner.parse_junit(KVSPEC)
    assert results[f"{CORE}/test_pool.py::test_new_bug"].message == "assert 3 == 4"
    # "collection failure" says nothing: the exception raised says why
    assert results[f"{CORE}/test_utils.py"].message == (
        "ImportError: cannot import name 'estimate_max_model_len'")


def test_junit_without_file_attributes_is_refused() -> None:
    xml = junit('<testcase classname="tests.x" name="test_a"/>')
    with pytest.raises(runner.SetupError, match="junit_family=xunit1"):
        runner.parse_junit(xml)
    with pytest.raises(runner.SetupError, match="unreadable"):
        runner.parse_junit("<testsuites>")


# --- the left-out table ---------------------------------------------------------------------------


def test_left_out_table_rows_for_the_version_asked() -> None:
    entries = runner.parse_left_out(DOC, "0.13.0")
    assert f"{CORE}/test_pool.py::test_new_bug" not in entries  # 0.99.0's row
    entry = entries[f"{CORE}/test_pool.py::test_internal_pointer"]
    assert (entry.category, entry.reason) == ("internals", "reads the free queue's sentinel")
    assert set(runner.parse_left_out(DOC, "0.99.0")) == {f"{CORE}/test_pool.py::test_new_bug"}


@pytest.mark.parametrize("row, complaint", [
    (f"| 0.13.0 | `{CORE}/t.py::test_a` | bug | a reason |", "category 'bug'"),
    (f"| 0.13.0 | {CORE}/t.py::test_a | internals | a reason |", "in backticks"),
    (f"| 0.13.0 | `{CORE}/t.py` | internals | a reason |", "in backticks"),
    (f"| 0.13.0 | `{CORE}/t.py::test_a` | internals | |", "no reason"),
    (f"| 0.13.0 | `{CORE}/t.py::test_a` | internals | a | b |", "5 cells"),
])
def test_a_malformed_row_is_refused_with_its_row_number(row: str, complaint: str) -> None:
    with pytest.raises(runner.SetupError, match=complaint) as raised:
        runner.parse_left_out(left_out_doc(row), "0.13.0")
    assert "row 3" in str(raised.value)


def test_a_test_listed_twice_or_a_missing_table_is_refused() -> None:
    row = f"| 0.13.0 | `{CORE}/t.py::test_a` | internals | a reason |"
    with pytest.raises(runner.SetupError, match="listed twice"):
        runner.parse_left_out(left_out_doc(row, row), "0.13.0")
    with pytest.raises(runner.SetupError, match="no table"):
        runner.parse_left_out("# nothing here", "0.13.0")
    with pytest.raises(runner.SetupError, match="header"):
        runner.parse_left_out(left_out_doc().replace("| category |", "| kind |"), "0.13.0")


def test_the_table_in_docs_parses_with_exact_node_ids() -> None:
    doc = (REPO_ROOT / "docs" / "vllm-tests.md").read_text()
    for version in ("0.13.0",):
        for test_id, entry in runner.parse_left_out(doc, version).items():
            assert test_id.startswith("tests/") and ".py::" in test_id
            assert entry.category in runner.CATEGORIES


# --- comparison -----------------------------------------------------------------------------------


def test_each_difference_is_documented_unexplained_or_informative() -> None:
    comparison = compare()
    status = {d.test_id: d.status for d in comparison.differences}
    assert status == {
        f"{CORE}/test_pool.py::test_internal_pointer": "documented",
        f"{CORE}/test_pool.py::test_asserts": "documented",
        f"{CORE}/test_pool.py::test_new_bug": "unexplained",
        f"{CORE}/test_pool.py::test_fixed_by_kvspec": "kvspec-only",
        f"{CORE}/test_pool.py::test_failed_then_teardown": "other",
        # the file that fails to collect with kvspec, and each of its tests
        f"{CORE}/test_utils.py": "collection",
        f"{CORE}/test_utils.py::test_utility": "unexplained",
        f"{CORE}/test_utils.py::test_utility_needs_hub": "other",
    }
    by_id = {d.test_id: d for d in comparison.differences}
    absent = by_id[f"{CORE}/test_utils.py::test_utility"]
    assert (absent.real, absent.kvspec) == ("passed", runner.ABSENT)
    assert absent.message == f"not run: {CORE}/test_utils.py fails to collect with kvspec"
    documented = by_id[f"{CORE}/test_pool.py::test_asserts"]
    assert (documented.category, documented.reason) == ("intended",
                                                        "a typed error where vLLM asserts")
    assert [d.test_id for d in comparison.unexplained] == [
        f"{CORE}/test_pool.py::test_new_bug", f"{CORE}/test_utils.py::test_utility"]


def test_counts_per_file_with_a_collection_error_as_one_error() -> None:
    comparison = compare()
    pool = comparison.counts[f"{CORE}/test_pool.py"]
    assert (pool["real"]["passed"], pool["real"]["failed"]) == (5, 3)
    assert (pool["kvspec"]["passed"], pool["kvspec"]["failed"], pool["kvspec"]["error"]) == (
        3, 4, 1)
    utils = comparison.counts[f"{CORE}/test_utils.py"]
    assert (utils["real"]["passed"], utils["kvspec"]["passed"], utils["kvspec"]["error"]) == (
        1, 0, 1)
    assert (comparison.passed("real"), comparison.passed("kvspec")) == (7, 4)


def test_tests_that_do_not_pass_on_real_vllm_are_not_compared_and_say_why() -> None:
    causes = {n.test_id: n.cause for n in compare().not_compared}
    assert causes == {
        f"{CORE}/test_pool.py::test_needs_hub": "needs the model hub",
        f"{CORE}/test_utils.py::test_utility_needs_hub": "needs the model hub",
        f"{CORE}/test_pool.py::test_fixed_by_kvspec": "failed on real vLLM: boom",
        f"{CORE}/test_pool.py::test_failed_then_teardown": "failed on real vLLM: x",
        f"{CORE}/test_e2e.py": "needs lmformatenforcer, which this environment lacks",
    }


def test_docs_entries_that_no_longer_apply_are_stale() -> None:
    stale = dict(compare().stale)
    assert stale == {
        f"{CORE}/test_pool.py::test_plain": "passes with kvspec now",
        f"{CORE}/test_pool.py::test_needs_hub":
            "not a test that passes on real vLLM (it failed here)",
    }  # test_gone.py was not run, so its entry is not judged


def test_verdict_summary_report_and_json() -> None:
    comparison = compare()
    summary = runner.summary_line(comparison)
    assert summary == ("vllm-tests: 7 pass on real vLLM; with kvspec 4 pass, 2 documented "
                       "(1 intended, 1 internals), 2 UNEXPLAINED: FAIL")
    report = runner.render(comparison, "heading")
    assert f"UNEXPLAINED  {CORE}/test_pool.py::test_new_bug" in report
    assert "failed: assert 3 == 4" in report
    assert ("documented, reaches into vLLM's internals: reads the free queue's sentinel"
            in report)
    assert f"{CORE}/test_pool.py::test_fixed_by_kvspec: real failed, kvspec passed" in report
    assert "needs the model hub" in report
    # tests absent with kvspec because their file fails to collect are not listed twice
    assert "test_utility_needs_hub" not in report
    assert f"{CORE}/test_pool.py::test_plain: passes with kvspec now" in report
    data = json.loads(json.dumps(runner.result_json(comparison, vllm="0.13.0")))
    assert data["verdict"] == "fail"
    assert data["passed"] == {"real": 7, "kvspec": 4}
    assert data["files"][f"{CORE}/test_utils.py"]["kvspec"] == {
        "passed": 0, "failed": 0, "error": 1, "skipped": 0}


def test_every_regression_documented_is_ok() -> None:
    rows = "\n".join(
        f"| 0.13.0 | `{CORE}/{test}` | intended | a reason |"
        for test in ("test_pool.py::test_internal_pointer", "test_pool.py::test_asserts",
                     "test_pool.py::test_new_bug", "test_utils.py::test_utility"))
    comparison = compare(doc=left_out_doc(rows))
    assert not comparison.unexplained
    assert runner.summary_line(comparison).endswith("0 UNEXPLAINED: ok")
    same = compare(kvspec=REAL, doc=left_out_doc())
    assert same.differences == [] and same.stale == []


# --- the source distribution ----------------------------------------------------------------------


def _sdist(version: str) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, text in ((f"vllm-{version}/pyproject.toml", "[tool.pytest.ini_options]\n"),
                           (f"vllm-{version}/tests/__init__.py", ""),
                           (f"vllm-{version}/tests/v1/core/test_a.py", "def test_a(): pass\n"),
                           (f"vllm-{version}/vllm/__init__.py", "raise SystemExit\n")):
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_index_pages_in_json_and_html_give_the_url_and_hash() -> None:
    page_url = "https://pypi.org/simple/vllm/"
    page = json.dumps({"files": [
        {"filename": "vllm-0.12.0.tar.gz", "url": "../../p/vllm-0.12.0.tar.gz",
         "hashes": {"sha256": "aa"}},
        {"filename": "vllm-0.13.0.tar.gz", "url": "https://files.example/vllm-0.13.0.tar.gz",
         "hashes": {"sha256": "bb"}}]})
    assert runner.sdist_link(page, "application/vnd.pypi.simple.v1+json", "vllm-0.13.0.tar.gz",
                             page_url) == ("https://files.example/vllm-0.13.0.tar.gz", "bb")
    html = ('<html><body><a href="../../p/vllm-0.13.0-cp38-abi3-x.whl#sha256=cc">w</a>'
            '<a href="../../p/vllm-0.13.0.tar.gz#sha256=dd">s</a></body></html>')
    assert runner.sdist_link(html, "text/html", "vllm-0.13.0.tar.gz", page_url) == (
        "https://pypi.org/p/vllm-0.13.0.tar.gz", "dd")
    with pytest.raises(runner.SetupError, match=re.escape("lists no vllm-9.9.9.tar.gz")):
        runner.sdist_link(html, "text/html", "vllm-9.9.9.tar.gz", page_url)


def test_fetch_checks_the_hash_caches_and_extracts_only_the_tests(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    archive = _sdist("7.0.0")
    digest = hashlib.sha256(archive).hexdigest()
    monkeypatch.setattr(runner, "BUILD", tmp_path)
    monkeypatch.setattr(runner, "ROOT", tmp_path)
    requests: list[str] = []

    def fake_get(url: str, accept: str = "*/*") -> tuple[bytes, str]:
        requests.append(url)
        if url.endswith("/vllm/"):
            page = {"files": [{"filename": "vllm-7.0.0.tar.gz", "url": "/f/vllm-7.0.0.tar.gz",
                               "hashes": {"sha256": digest}}]}
            return json.dumps(page).encode(), "application/vnd.pypi.simple.v1+json"
        return archive, "application/octet-stream"

    monkeypatch.setattr(runner, "_get", fake_get)
    # a pin that disagrees with the index stops before anything is downloaded
    monkeypatch.setitem(runner.SDIST_SHA256, "7.0.0", "0" * 64)
    with pytest.raises(runner.SetupError, match="pins"):
        runner.fetch_sdist("7.0.0", "https://index.example/simple")
    assert not (tmp_path / "vllm-src" / "vllm-7.0.0.tar.gz").exists()

    monkeypatch.setitem(runner.SDIST_SHA256, "7.0.0", digest)
    requests.clear()
    path, got = runner.fetch_sdist("7.0.0", "https://index.example/simple")
    assert (path, got) == (tmp_path / "vllm-src" / "vllm-7.0.0.tar.gz", digest)
    assert requests == ["https://index.example/simple/vllm/",
                        "https://index.example/f/vllm-7.0.0.tar.gz"]
    assert runner.fetch_sdist("7.0.0", "https://unreachable.example") == (path, digest)
    assert len(requests) == 2  # the cached file, checked against the pin: no download

    root = runner.extract_tests(path, digest, "7.0.0")
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    assert files == [".sdist-sha256", "pyproject.toml", "tests/__init__.py",
                     "tests/v1/core/test_a.py"]  # vLLM's package sources stay in the archive


def test_a_download_that_does_not_match_its_hash_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "BUILD", tmp_path)
    page = {"files": [{"filename": "vllm-7.0.1.tar.gz", "url": "/f/vllm-7.0.1.tar.gz",
                       "hashes": {"sha256": "ab" * 32}}]}

    def fake_get(url: str, accept: str = "*/*") -> tuple[bytes, str]:
        if url.endswith("/vllm/"):
            return json.dumps(page).encode(), "application/vnd.pypi.simple.v1+json"
        return b"not the archive", "application/octet-stream"

    monkeypatch.setattr(runner, "_get", fake_get)
    with pytest.raises(runner.SetupError, match="expected " + "ab" * 32):
        runner.fetch_sdist("7.0.1", "https://index.example/simple")
    assert not list(tmp_path.rglob("vllm-7.0.1*"))


def test_without_vllm_in_the_interpreter_it_is_a_setup_error(
        capsys: pytest.CaptureFixture[str]) -> None:
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("this interpreter has vLLM")
    assert runner.main(["0.13.0"]) == 2
    assert "has no vLLM" in capsys.readouterr().err


# --- the pytest runs ------------------------------------------------------------------------------


def test_a_run_that_crashes_is_run_again_file_by_file(tmp_path: Path) -> None:
    """Real pytest subprocesses (this interpreter's) on a made-up tree: a test that aborts
    the process leaves no report, so each file runs alone and only the crashing one errs."""
    (tmp_path / "pyproject.toml").write_text("[tool.pytest.ini_options]\n")
    tests = tmp_path / "tests" / "v1"
    tests.mkdir(parents=True)
    (tmp_path / "tests" / "__init__.py").write_text("")
    (tests / "__init__.py").write_text("")
    (tests / "test_fine.py").write_text("def test_a():\n    pass\n\n"
                                        "def test_b():\n    assert 1 == 2\n")
    (tests / "test_crash.py").write_text("import os\n\ndef test_dies():\n    os.abort()\n")
    (tests / "test_helpers.py").write_text("HELPER = 1\n")  # no tests: not an error
    results = runner.run_side("real", tmp_path, "tests/v1", timeout=300)
    assert {test_id: r.outcome for test_id, r in results.items()} == {
        "tests/v1/test_fine.py::test_a": "passed",
        "tests/v1/test_fine.py::test_b": "failed",
        "tests/v1/test_crash.py": "error",
    }
    assert results["tests/v1/test_crash.py"].message.startswith(
        "pytest died of SIGABRT running this file")


def test_the_real_run_never_has_kvspec_switched_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_USE_KVSPEC", "1")
    real = runner._pytest_env("real")
    assert "VLLM_USE_KVSPEC" not in real and real["HF_HUB_OFFLINE"] == "1"
    assert runner._pytest_env("kvspec")["VLLM_USE_KVSPEC"] == "1"


def test_both_builds_share_one_run_on_real_vllm(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """--both-builds: vLLM's tests run once on real vLLM and once per kvspec build, each build
    compared with that one real run and reported (summary line, JSON) on its own."""
    monkeypatch.setattr(runner, "check_interpreter", lambda version: None)
    monkeypatch.setattr(runner, "fetch_sdist", lambda version, index: (tmp_path / "v.tgz", "d"))
    monkeypatch.setattr(runner, "ROOT", tmp_path)
    root = tmp_path / "vllm-tests"
    (root / CORE).mkdir(parents=True)
    monkeypatch.setattr(runner, "extract_tests", lambda sdist, digest, version: root)
    monkeypatch.setattr(runner, "_kvspec_build", lambda: "compiled build")
    monkeypatch.setattr(runner, "parse_left_out", lambda text, version: {})
    runs: list[tuple[str, bool]] = []
    test_a = "tests/v1/core/test_x.py::test_a"

    def fake_run_side(side: str, where: Path, tests: str, timeout: float,
                      pure: bool = False) -> dict[str, Any]:
        runs.append((side, pure))
        outcome = "failed" if pure else "passed"  # only the pure build fails the test
        return {test_a: runner.CaseResult(test_a, "tests/v1/core/test_x.py", outcome, "boom")}

    monkeypatch.setattr(runner, "run_side", fake_run_side)
    json_path = tmp_path / "result.json"
    assert runner.main(["0.13.0", "--both-builds", "--json", str(json_path)]) == 1
    assert sorted(runs) == [("kvspec", False), ("kvspec", True), ("real", False)]
    out = capsys.readouterr().out
    summaries = [line for line in out.splitlines() if re.match(r"^vllm-tests: \d+ pass", line)]
    assert len(summaries) == 2
    assert summaries[0].endswith(": ok") and summaries[1].endswith("UNEXPLAINED: FAIL")
    assert json.loads(json_path.read_text())["verdict"] == "ok"
    pure = json.loads((tmp_path / "result-pure.json").read_text())
    assert pure["verdict"] == "fail" and pure["kvspec_build"].startswith("Python sources")
