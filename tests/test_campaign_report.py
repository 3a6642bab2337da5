"""The campaign report (campaign/report.py) on synthetic campaigns.

- The terminal table: the verdict, the totals, a row per layer x profile, the failures with
  their programs, the not-reached names, the events; plain text unless colour is asked for.
- The HTML page: one self-contained file (no script, nothing fetched), well-formed enough for
  html.parser, all user text escaped, small even for a big campaign, and edge cases (one
  shard, no timeline, nothing started) render.
- In a real browser, where Chromium is installed: the page is screenshot headless at the asked
  size and is not blank, and the DOM Chromium builds shows the plots and the failure ids.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import struct
import subprocess
from collections.abc import Callable
from html.parser import HTMLParser
from pathlib import Path
from typing import ClassVar

import pytest

from kvspec.campaign.report import (
    CampaignData,
    CampaignEvent,
    CoverageRow,
    FailureRecord,
    NotReachedRow,
    ShardRecord,
    TimelinePoint,
    main,
    render_table,
    write_html,
)

T0 = 1_795_000_000.0  # the campaigns' start, a unix time
HOSTILE = '<script>alert("x")</script> & <b>'
STATUSES = ("finished", "failed", "retried", "queued", "started", "abandoned")
LAYERS = ("pool", "manager", "block_table", "offload")
RULES = [f"rule_{n}" for n in range(30)]
INVARIANTS = [f"invariant_{n}" for n in range(15)]
SITUATIONS = [f"situation_{n}" for n in range(25)]
EVENTS = [f"event: {n}" for n in range(30)]


def shard(index: int, *, layer: str = "pool", status: str = "finished", worker: str = "w:1",
          start: float | None = 0.0, end: float | None = 10.0, failures: int = 0,
          policy: str | None = None) -> ShardRecord:
    return {
        "job": f"job-{index}", "layer": layer, "target": "impl", "profile": "ci",
        "policy": policy, "seed": 1000 * index, "worker": worker, "status": status,
        "attempts": 2 if status == "retried" else 1,
        "started": None if start is None else T0 + start,
        "finished": None if end is None else T0 + end,
        "examples": 100 + index, "steps": 2000 + 10 * index, "replayed": index % 3,
        "failures": failures,
    }


def failure(ident: str, *, at: float, replayed: bool = False, worker: str = "w:1",
            layer: str = "pool", message: str = "free count 3 != 4\nsecond line") -> FailureRecord:
    return {
        "id": ident, "layer": layer, "target": "impl", "profile": "ci", "policy": "lru",
        "kind": "invariant", "check": "free_count_matches", "situation": "after eviction",
        "error": "AssertionError", "message": message,
        "program": ["state = PoolMachine()", "state.allocate(n=3)", "state.free(blocks=[0, 1])"],
        "found_at": T0 + at, "worker": worker, "replayed": replayed, "runs": 2,
    }


def tiny_campaign() -> CampaignData:
    """One shard, nothing failed, one timeline point."""
    return {
        "campaign": "2026-11-26T13-05-00-ab12", "started": T0, "finished": T0 + 12.0,
        "budget": 10.0, "workers": 1, "database": "/tmp/hypothesis-db", "target": "impl",
        "shards": [shard(0, end=11.5)],
        "coverage": [
            {"layer": "pool", "profile": "ci", "kind": "rule", "name": "allocate",
             "count": 120, "shards": 1},
            {"layer": "pool", "profile": "ci", "kind": "invariant", "name": "free_count",
             "count": 300, "shards": 1},
        ],
        "not_reached": [{"layer": "pool", "profile": "ci", "kind": "rule", "name": "evict"}],
        "failures": [],
        "timeline": [{"t": 11.0, "examples": 100, "steps": 2000, "failures": 0, "reached": 2}],
        "events": [],
    }


def big_campaign() -> CampaignData:
    """60 shards on 12 workers over 20 minutes (5 each, one after another), 5 failures, 500
    timeline points, 400 coverage rows, shards of every status."""
    shards: list[ShardRecord] = []
    for index in range(60):
        worker = f"host-{index % 3}.example:{4000 + index % 12}"
        start = 240.0 * (index // 12) + index % 12
        status = STATUSES[index % len(STATUSES)] if index % 5 == 0 else "finished"
        end: float | None = start + 200.0 + 7 * (index % 5)
        if status in ("started", "abandoned"):
            end = None
        shards.append(shard(index, layer=LAYERS[index % 4], status=status, worker=worker,
                            start=None if status == "queued" else start,
                            end=None if status == "queued" else end,
                            policy="lru" if index % 2 else None))
    coverage: list[CoverageRow] = []
    for layer in LAYERS:
        for kind, names in (("rule", RULES[:25]), ("invariant", INVARIANTS[:12]),
                            ("situation", SITUATIONS[:20]), ("event", EVENTS[:25])):
            for rank, name in enumerate(names):
                coverage.append({"layer": layer, "profile": "ci", "kind": kind, "name": name,
                                 "count": 10 ** (rank % 6) + rank, "shards": 1 + rank % 15})
    coverage += [{"layer": "offload", "profile": "ci", "kind": "rule", "name": f"zero_{n}",
                  "count": 0, "shards": 0} for n in range(400 - len(coverage))]
    not_reached: list[NotReachedRow] = [
        {"layer": layer, "profile": "ci", "kind": "rule", "name": name}
        for layer in LAYERS for name in RULES[25:]]
    failures = [failure("F1", at=35.0, replayed=True, worker="host-0.example:4000"),
                failure("F2", at=37.0, worker="host-1.example:4001", layer="manager"),
                failure("F3", at=400.0, worker="host-2.example:4002", message=HOSTILE),
                failure("F4", at=650.0, replayed=True, worker="host-0.example:4003"),
                failure("F5", at=1100.0, worker="host-1.example:4004", layer="offload")]
    timeline: list[TimelinePoint] = [
        {"t": 2.4 * n, "examples": 12 * n, "steps": 240 * n, "failures": sum(
            1 for f in failures if f["found_at"] - T0 <= 2.4 * n), "reached": min(n, 300)}
        for n in range(500)]
    events: list[CampaignEvent] = [
        {"t": 0.5, "kind": "worker started", "text": "host-0.example:4000"},
        {"t": 300.0, "kind": "worker lost", "text": "host-2.example:4010: no heartbeat"},
        {"t": 301.0, "kind": "shard retried", "text": "job-10 (attempt 2)"},
        {"t": 900.0, "kind": "redis unreachable", "text": HOSTILE},
    ]
    return {
        "campaign": "2026-11-26T13-05-00-ab12", "started": T0, "finished": T0 + 1200.0,
        "budget": 1200.0, "workers": 12,
        "database": "redis://127.0.0.1:6399/0 (started by kvspec)", "target": "impl",
        "shards": shards, "coverage": coverage, "not_reached": not_reached,
        "failures": failures, "timeline": timeline, "events": events,
    }


def empty_campaign() -> CampaignData:
    """Nothing started: every shard queued, nothing recorded."""
    data = tiny_campaign()
    data["shards"] = [shard(0, status="queued", worker="", start=None, end=None)]
    data["coverage"], data["not_reached"] = [], []
    data["timeline"], data["events"], data["finished"] = [], [], T0
    return data


# -- the terminal table -----------------------------------------------------------------------

def test_table_of_a_tiny_campaign() -> None:
    text = render_table(tiny_campaign())
    assert "verdict: no failures" in text
    assert "100 examples, 2,000 steps" in text and "1 shard: 1 finished" in text
    assert "database /tmp/hypothesis-db" in text
    row = next(line for line in text.splitlines() if line.strip().startswith("pool"))
    # rules 1 reached of 2 (allocate; evict not reached), invariants 1/1, no situations.
    assert row.split() == ["pool", "ci", "1", "100", "2,000", "1/2", "-", "1/1", "-", "0"]
    assert "pool/ci rules (1): evict" in text
    assert "\033[" not in text


def test_table_of_a_big_campaign() -> None:
    data = big_campaign()
    text = render_table(data, width=100)
    assert "verdict: 5 failures (3 new, 2 replayed from the database)" in text
    assert ("60 shards: 50 finished, 2 failed, 2 retried, 2 started, 2 queued, 2 abandoned"
            in text)
    assert all(len(line) <= 100 for line in text.splitlines()
               if not line.startswith("         ")), "a line other than a call is too wide"
    for layer in LAYERS:
        assert any(line.split()[:2] == [layer, "ci"] for line in text.splitlines()
                   if line.strip())
    for ident in ("F1", "F2", "F3", "F4", "F5"):
        assert f"[{ident}]" in text
    # The failures in the order found, each with its program indented and its origin.
    assert text.index("[F1]") < text.index("[F3]") < text.index("[F5]")
    assert "         state.free(blocks=[0, 1])" in text
    assert "(replayed from the database)" in text and "(new)" in text
    assert "second line" not in text  # only the message's first line
    assert "pool/ci rules (5): rule_25, rule_26" in text
    # 77 names do not fit a line: as many as fit in natural order, then how many more.
    offload = next(line for line in text.splitlines() if "offload/ci rules (77)" in line)
    assert "zero_0, zero_1" in offload and offload.endswith("+70 more")
    assert "worker lost: host-2.example:4010" in text


def test_table_colour_only_when_asked() -> None:
    plain = render_table(big_campaign())
    coloured = render_table(big_campaign(), color=True)
    assert "\033[" not in plain and "\033[31m" in coloured


def test_table_of_an_empty_campaign() -> None:
    text = render_table(empty_campaign())
    assert "verdict: no failures" in text and "1 queued" in text
    assert "everything listed was reached" in text and "== events (0)" in text


# -- the HTML page ----------------------------------------------------------------------------

class PageParser(HTMLParser):
    """Checks that every element closes in order (void elements aside) and collects what the
    tests look at: tags, ids, scripts, outside references and the text."""

    VOID: ClassVar[frozenset[str]] = frozenset(
        {"meta", "br", "img", "input", "link", "hr", "wbr", "col", "source"})
    # SVG shapes written as self-closing tags.
    SHAPES: ClassVar[frozenset[str]] = frozenset({"line", "rect", "circle", "path", "polyline"})

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.tags: list[str] = []
        self.ids: set[str] = set()
        self.outside: list[str] = []
        self.text: list[str] = []
        self.errors: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        for name, value in attrs:
            if name == "id" and value:
                self.ids.add(value)
            if name in ("src", "href") and value and not value.startswith("#"):
                self.outside.append(value)
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        if tag not in self.SHAPES | self.VOID:
            self.errors.append(f"self-closing <{tag}/>")

    def handle_endtag(self, tag: str) -> None:
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:]}")
            return
        self.stack.pop()

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def parse(path: Path) -> PageParser:
    parser = PageParser()
    parser.feed(path.read_text(encoding="utf-8"))
    parser.close()
    assert parser.errors == [] and parser.stack == [], (parser.errors, parser.stack)
    return parser


def test_page_of_a_big_campaign(tmp_path: Path) -> None:
    page = write_html(big_campaign(), tmp_path / "campaign.html")
    assert page == tmp_path / "campaign.html"
    size = page.stat().st_size
    assert size < 2_000_000, f"the page is {size} bytes"
    parsed = parse(page)
    assert "script" not in parsed.tags and parsed.outside == []
    # Four plots (examples, steps, reached, failures) and the Gantt chart.
    assert parsed.tags.count("svg") == 5
    assert {f"failure-F{n}" for n in range(1, 6)} <= parsed.ids
    text = "".join(parsed.text)
    assert "5 failures (3 new, 2 replayed from the database)" in text
    assert "state.free(blocks=[0, 1])" in text
    assert "rule_27" in text and "not reached" in text
    assert "redis unreachable" in text


def test_page_escapes_user_text(tmp_path: Path) -> None:
    data = big_campaign()
    data["campaign"] = HOSTILE
    data["shards"][0]["worker"] = HOSTILE
    data["coverage"][0]["name"] = HOSTILE
    data["failures"][0]["program"].append(HOSTILE)
    data["failures"][1]["situation"] = HOSTILE
    data["failures"][2]["policy"] = HOSTILE
    data["database"] = HOSTILE
    data["shards"][1]["policy"] = HOSTILE
    data["not_reached"][0]["name"] = HOSTILE
    source = write_html(data, tmp_path / "hostile.html").read_text()
    assert "<script>" not in source and "<b>" not in source
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in source
    parsed = parse(tmp_path / "hostile.html")
    assert "script" not in parsed.tags and HOSTILE in "".join(parsed.text)


@pytest.mark.parametrize("build", [tiny_campaign, empty_campaign], ids=["tiny", "empty"])
def test_page_of_a_small_campaign(tmp_path: Path, build: Callable[[], CampaignData]) -> None:
    data = build()
    parsed = parse(write_html(data, tmp_path / "small.html"))
    text = "".join(parsed.text)
    assert "no failures" in text and "No failures." in text
    if data["timeline"]:
        # One point: a line from the origin (the counts are cumulative since the start).
        assert parsed.tags.count("svg") == 5 and "polyline" in parsed.tags
    else:
        assert "No timeline was recorded" in text and "No shard started." in text


def test_long_timelines_are_thinned(tmp_path: Path) -> None:
    data = big_campaign()
    data["timeline"] = [{"t": n / 10, "examples": n, "steps": 20 * n, "failures": 0,
                         "reached": n // 100} for n in range(50_000)]
    assert write_html(data, tmp_path / "long.html").stat().st_size < 600_000


def test_a_failure_without_a_known_worker_still_shows(tmp_path: Path) -> None:
    data = copy.deepcopy(tiny_campaign())
    data["failures"] = [failure("F9", at=5.0, worker="gone:1")]
    parsed = parse(write_html(data, tmp_path / "lost.html"))
    assert "failure-F9" in parsed.ids and "gone:1" in "".join(parsed.text)


def test_a_saved_campaign_renders_again(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    # The contract is plain JSON: a campaign saved as JSON renders the same.
    data = big_campaign()
    saved = tmp_path / "campaign.json"
    saved.write_text(json.dumps(data))
    assert main([str(saved), str(tmp_path / "again.html")]) == 0
    assert capsys.readouterr().out.startswith(render_table(data))
    assert (tmp_path / "again.html").read_text() == (
        write_html(data, tmp_path / "first.html").read_text())
    assert main([]) == 2


# -- in a real browser ------------------------------------------------------------------------

def chromium() -> str | None:
    if os.access("/usr/bin/chromium", os.X_OK):
        return "/usr/bin/chromium"
    return shutil.which("chromium") or shutil.which("chromium-browser")


def headless(browser: str, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # A fresh profile and no background traffic: the page must render offline, on its own.
    return subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", f"--user-data-dir={profile}", "--window-size=1280,2000", *args],
        capture_output=True, text=True, timeout=60, check=False)


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", "not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


@pytest.mark.skipif(chromium() is None, reason="no Chromium (/usr/bin/chromium, chromium or "
                    "chromium-browser on PATH) to render the page in")
def test_page_in_chromium(tmp_path: Path) -> None:
    browser = chromium()
    assert browser is not None
    page = write_html(big_campaign(), tmp_path / "campaign.html")
    blank = tmp_path / "blank.html"
    blank.write_text("<!DOCTYPE html><html><body></body></html>")
    shots = {}
    for name, source in (("page", page), ("blank", blank)):
        shots[name] = tmp_path / f"{name}.png"
        run = headless(browser, tmp_path / f"profile-{name}", f"--screenshot={shots[name]}",
                       source.as_uri())
        assert shots[name].exists(), f"no screenshot of {name}: {run.stderr[-2000:]}"
        assert png_size(shots[name]) == (1280, 2000)
    # A page of plots and tables compresses far worse than a white one.
    assert shots["page"].stat().st_size > 5 * shots["blank"].stat().st_size
    dom = headless(browser, tmp_path / "profile-dom", "--dump-dom", page.as_uri()).stdout
    assert dom.count("<svg") == 5 and "<polyline" in dom
    for ident in ("F1", "F2", "F3", "F4", "F5"):
        assert f'id="failure-{ident}"' in dom
