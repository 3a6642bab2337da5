"""The merged report of an audit campaign: a terminal table and one static HTML page.

`kvspec campaign` runs the audits as jobs ("shards") on many workers; when it ends it merges
what they recorded into one plain-JSON dict, `CampaignData` (the TypedDicts below are the
contract), and renders it here: `render_table` for the terminal, `write_html` for a single
self-contained page (inline CSS and SVG made here, no script, nothing fetched) that a CI job can
keep as an artifact and anyone can open offline. docs/campaign-report.md says what each part of
the page shows.

Standard library only: the page is generated as text, so the report works in any environment
the audit runs in (no plotting library to install next to vLLM's pins).

``python -m kvspec.campaign.report CAMPAIGN.json [OUT.html]`` renders a saved
campaign again: the table on stdout and, with OUT.html, the page.
"""

from __future__ import annotations

import html
import itertools
import json
import math
import re
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

__all__ = [
    "CampaignData",
    "CampaignEvent",
    "CoverageRow",
    "FailureRecord",
    "NotReachedRow",
    "ShardRecord",
    "TimelinePoint",
    "render_html",
    "render_table",
    "write_html",
]


class ShardRecord(TypedDict):
    """One job: one layer x target x profile x policy x seed range, on one worker."""

    job: str
    layer: str
    target: str
    profile: str
    policy: str | None
    seed: int
    worker: str  # "hostname:pid"
    status: str  # finished, failed, retried, queued, started, abandoned
    attempts: int
    started: float | None
    finished: float | None
    examples: int
    steps: int
    replayed: int  # saved examples replayed first from the database
    failures: int


class CoverageRow(TypedDict):
    """A rule, situation, invariant or event reached, merged over the shards."""

    layer: str
    profile: str
    kind: str  # rule, situation, invariant, event
    name: str
    count: int  # steps (rules, situations, invariants) or examples (events)
    shards: int  # how many shards reached it


class NotReachedRow(TypedDict):
    layer: str
    profile: str
    kind: str
    name: str


class FailureRecord(TypedDict):
    """A distinct failure, with its minimal program."""

    id: str
    layer: str
    target: str
    profile: str
    policy: str | None
    kind: str
    check: str
    situation: str
    error: str
    message: str
    program: list[str]  # the calls of the minimal program, one per line
    found_at: float  # unix time
    worker: str
    replayed: bool  # found by replaying the database first: known from an earlier run
    runs: int  # how many shards reported it


class TimelinePoint(TypedDict):
    t: float  # seconds since the campaign started
    examples: int  # cumulative, all shards
    steps: int
    failures: int  # cumulative distinct failures
    reached: int  # cumulative distinct (layer, kind, name) reached


class CampaignEvent(TypedDict):
    t: float  # seconds since the campaign started
    kind: str  # "worker started", "worker lost", "redis unreachable", "shard retried"...
    text: str


class CampaignData(TypedDict):
    campaign: str
    started: float  # unix times
    finished: float
    budget: float  # seconds asked for
    workers: int  # local worker processes started; remote ones show in the shards' "worker"
    database: str
    target: str
    shards: list[ShardRecord]
    coverage: list[CoverageRow]
    not_reached: list[NotReachedRow]
    failures: list[FailureRecord]
    timeline: list[TimelinePoint]
    events: list[CampaignEvent]


# The kinds of coverage row, in the order the tables show them.
KINDS = ("rule", "situation", "invariant", "event")
# Shard statuses, in the order the legends list them, each with its colour on the page.
STATUS_COLORS = {
    "finished": "#2e7d32", "failed": "#c62828", "retried": "#ef6c00",
    "started": "#1565c0", "queued": "#9e9e9e", "abandoned": "#6d4c41",
}
# Past this many points a plotted series is thinned: the page stays small whatever the
# campaign's length, and a plot 900 px wide cannot show more.
MAX_PLOT_POINTS = 600


# -- what both views compute ------------------------------------------------------------------

@dataclass
class GroupSummary:
    """One layer x profile of the campaign: the table row and its coverage."""

    layer: str
    profile: str
    shards: int = 0
    examples: int = 0
    steps: int = 0
    failures: int = 0
    reached: Counter[str] = field(default_factory=Counter)  # kind -> names reached
    missing: Counter[str] = field(default_factory=Counter)  # kind -> names not reached

    def ratio(self, kind: str) -> str:
        """`reached/total` for a kind, or "-" when the layer has none of that kind."""
        total = self.reached[kind] + self.missing[kind]
        return f"{self.reached[kind]}/{total}" if total else "-"


def group_summaries(data: CampaignData) -> list[GroupSummary]:
    """The layer x profile groups, in the order of first appearance (shards, then coverage)."""
    groups: dict[tuple[str, str], GroupSummary] = {}

    def group(layer: str, profile: str) -> GroupSummary:
        return groups.setdefault((layer, profile), GroupSummary(layer, profile))

    for shard in data["shards"]:
        summary = group(shard["layer"], shard["profile"])
        summary.shards += 1
        summary.examples += shard["examples"]
        summary.steps += shard["steps"]
    for row in data["coverage"]:
        # A row with count 0 is listed but was not reached: count it with the missing ones.
        counter = group(row["layer"], row["profile"])
        (counter.reached if row["count"] > 0 else counter.missing)[row["kind"]] += 1
    for missing in data["not_reached"]:
        group(missing["layer"], missing["profile"]).missing[missing["kind"]] += 1
    for failure in data["failures"]:
        group(failure["layer"], failure["profile"]).failures += 1
    return list(groups.values())


def verdict(data: CampaignData) -> str:
    failures = data["failures"]
    if not failures:
        return "no failures"
    replayed = sum(1 for f in failures if f["replayed"])
    noun = "failure" if len(failures) == 1 else "failures"
    return (f"{len(failures)} {noun} ({len(failures) - replayed} new, {replayed} replayed "
            f"from the database)")


def status_counts(shards: Iterable[ShardRecord]) -> str:
    """"57 finished, 2 retried, 1 abandoned": the statuses present, in the legend's order."""
    counts = Counter(shard["status"] for shard in shards)
    order = [*STATUS_COLORS, *sorted(set(counts) - set(STATUS_COLORS))]
    return ", ".join(f"{counts[status]} {status}" for status in order if counts[status])


def duration(seconds: float) -> str:
    """A length of time as a person reads it: 4.2 s, 12 min 03 s, 2 h 05 min."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    whole = round(seconds)
    if whole < 3600:
        return f"{whole // 60} min {whole % 60:02d} s"
    return f"{whole // 3600} h {whole % 3600 // 60:02d} min"


def offset(seconds: float) -> str:
    """A time since the campaign started, as +m:ss (or +h:mm:ss)."""
    whole = max(0, round(seconds))
    hours, rest = divmod(whole, 3600)
    if hours:
        return f"+{hours}:{rest // 60:02d}:{rest % 60:02d}"
    return f"+{rest // 60}:{rest % 60:02d}"


def plural(count: int, noun: str, nouns: str = "") -> str:
    """"1 shard", "3 shards"; `nouns` where the plural is not noun + s."""
    return f"{count:,} {noun if count == 1 else nouns or noun + 's'}"


def first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(0, width - 1)] + "…"


def headline_lines(data: CampaignData) -> list[str]:
    """The facts the headline of both views gives, after the verdict."""
    shards = data["shards"]
    examples = sum(s["examples"] for s in shards)
    steps = sum(s["steps"] for s in shards)
    replayed = sum(s["replayed"] for s in shards)
    remote = {s["worker"] for s in shards if s["worker"]}
    statuses = status_counts(shards)
    return [
        f"{plural(examples, 'example')}, {plural(steps, 'step')} "
        f"({plural(replayed, 'example')} replayed from the database)",
        plural(len(shards), "shard") + (f": {statuses}" if statuses else ""),
        f"ran {duration(data['finished'] - data['started'])} of a "
        f"{duration(data['budget'])} budget; {plural(data['workers'], 'local worker')} "
        f"started, {plural(len(remote), 'worker process', 'worker processes')} ran shards",
        f"database {data['database']}",
    ]


def natural_key(name: str) -> list[tuple[int, int | str]]:
    """Sorts rule_2 before rule_10."""
    return [(0, int(part)) if part.isdigit() else (1, part)
            for part in re.split(r"(\d+)", name) if part]


def condensed(label: str, names: Sequence[str], width: int) -> str:
    """`label` and as many names as fit in `width`, then how many more there are."""
    line = label
    for index, name in enumerate(names):
        more = f", +{len(names) - index} more" if index else f"+{len(names)} more"
        rest = len(names) - index - 1
        piece = (", " if index else "") + name
        # Keep room for the "+N more" that would follow if later names do not fit.
        tail = len(f", +{rest} more") if rest else 0
        if len(line) + len(piece) + tail > width:
            return line + more
        line += piece
    return line


# -- the terminal table -----------------------------------------------------------------------

ANSI = {"bold": "\033[1m", "red": "\033[31m", "green": "\033[32m", "dim": "\033[2m",
        "reset": "\033[0m"}


def render_table(data: CampaignData, *, width: int = 100, color: bool = False) -> str:
    """The campaign as text for a terminal: headline, a table per layer x profile, the
    failures with their programs, what was not reached, and the notable events.

    Lines are clipped to `width`, except the programs' calls: they are what reproduces a
    failure, so they are printed whole. `color` adds ANSI colour (for a tty only).
    """

    def paint(text: str, *styles: str) -> str:
        if not color:
            return text
        return "".join(ANSI[s] for s in styles) + text + ANSI["reset"]

    out: list[str] = []
    title = f"kvspec campaign {data['campaign']}: target {data['target']}"
    out.append(paint(clip(title, width), "bold"))
    out.append(paint(clip(f"verdict: {verdict(data)}", width),
                     "bold", "red" if data["failures"] else "green"))
    out.extend(clip(line, width) for line in headline_lines(data))

    out.append("")
    out.append(paint("== coverage by layer and profile", "bold"))
    header = ("layer", "profile", "shards", "examples", "steps", "rules", "situations",
              "invariants", "events", "failures")
    rows = [(g.layer, g.profile, str(g.shards), f"{g.examples:,}", f"{g.steps:,}",
             g.ratio("rule"), g.ratio("situation"), g.ratio("invariant"), g.ratio("event"),
             str(g.failures)) for g in group_summaries(data)]
    if rows:
        widths = [max(len(cell) for cell in column) for column in zip(header, *rows,
                                                                       strict=True)]
        for index, cells in enumerate([header, *rows]):
            # Names left-aligned, numbers right-aligned, as a reader scans them.
            line = "  ".join(cell.ljust(w) if i < 2 else cell.rjust(w)
                             for i, (cell, w) in enumerate(zip(cells, widths, strict=True)))
            out.append(clip("   " + line, width))
            if index == 0:
                out.append(clip("   " + "  ".join("-" * w for w in widths), width))
        out.append(clip("   (rules, situations, invariants, events: reached/total)", width))
    else:
        out.append("   no shard ran")

    out.append("")
    failures = sorted(data["failures"], key=lambda f: f["found_at"])
    out.append(paint(f"== failures ({len(failures)})", "bold"))
    if not failures:
        out.append("   none")
    for failure in failures:
        origin = "replayed from the database" if failure["replayed"] else "new"
        policy = f", policy {failure['policy']}" if failure["policy"] else ""
        head = (f"[{failure['id']}] {failure['layer']}: {failure['kind']} {failure['check']}, "
                f"{failure['error']} ({origin})")
        out.append(paint(clip("   " + head, width), "red"))
        if failure["situation"]:
            out.append(clip(f"      situation: {failure['situation']}", width))
        out.append(clip(f"      {first_line(failure['message'])}", width))
        out.append(clip(
            f"      profile {failure['profile']}{policy}; found by {failure['worker']} at "
            f"{offset(failure['found_at'] - data['started'])}, reported by "
            f"{plural(failure['runs'], 'shard')}", width))
        out.extend(paint(f"         {call}", "dim") for call in failure["program"])

    out.append("")
    missing = group_not_reached(data)
    total_missing = sum(len(names) for names in missing.values())
    out.append(paint(f"== not reached ({total_missing})", "bold"))
    if not missing:
        out.append("   everything listed was reached")
    for (layer, profile, kind), names in missing.items():
        out.append(condensed(f"   {layer}/{profile} {kind}s ({len(names)}): ", names, width))

    out.append("")
    out.append(paint(f"== events ({len(data['events'])})", "bold"))
    if not data["events"]:
        out.append("   none")
    for event in sorted(data["events"], key=lambda e: e["t"]):
        out.append(clip(f"   {offset(event['t']):>9}  {event['kind']}: {event['text']}", width))
    return "\n".join(out) + "\n"


def group_not_reached(data: CampaignData) -> dict[tuple[str, str, str], list[str]]:
    """(layer, profile, kind) -> the names not reached, rows of count 0 included."""
    missing: dict[tuple[str, str, str], list[str]] = defaultdict(list)
    for row in data["not_reached"]:
        missing[row["layer"], row["profile"], row["kind"]].append(row["name"])
    for coverage in data["coverage"]:
        if coverage["count"] <= 0:
            missing[coverage["layer"], coverage["profile"], coverage["kind"]].append(
                coverage["name"])
    return {key: sorted(set(names), key=natural_key) for key, names in sorted(missing.items())}


# -- SVG plots --------------------------------------------------------------------------------

def esc(text: object) -> str:
    """Text for an HTML or SVG element or attribute value."""
    return html.escape(str(text), quote=True)


def nice_ticks(high: float, count: int = 5, *, whole: bool = False) -> list[float]:
    """Round tick values from 0 to at least `high` (steps of 1, 2 or 5 x 10^k); `whole`: no
    step under 1 (an axis of counts has no 0.2)."""
    high = max(high, 1e-9)
    raw = max(high / count, 1.0) if whole else high / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    ticks = [0.0]
    while ticks[-1] < high - 1e-9:
        ticks.append(ticks[-1] + step)
    return ticks


def count_label(value: float) -> str:
    """A tick label for a count: 1.2k, 35M."""
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= limit:
            return f"{value / limit:g}{suffix}"
    return f"{value:g}"


def time_ticks(high: float) -> tuple[list[float], str]:
    """Ticks for a time axis in seconds, and the unit their labels are in."""
    for unit, size in (("h", 3600.0), ("min", 60.0)):
        if high >= 3 * size:
            return [t * size for t in nice_ticks(high / size)], unit
    return nice_ticks(high), "s"


def thin(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """At most MAX_PLOT_POINTS of the points, evenly spaced, the first and last kept."""
    if len(points) <= MAX_PLOT_POINTS:
        return list(points)
    stride = len(points) / (MAX_PLOT_POINTS - 1)
    kept = [points[int(i * stride)] for i in range(MAX_PLOT_POINTS - 1)]
    return [*kept, points[-1]]


@dataclass
class Series:
    label: str
    color: str
    points: list[tuple[float, float]]
    step: bool = False  # drawn as a step line (a count that jumps), not a slope


@dataclass
class Marker:
    x: float
    y: float
    label: str
    color: str
    title: str
    link: str  # the fragment it links to, e.g. "#failure-F1"


class Plot:
    """One SVG chart: time on x (0 to `x_max` seconds), a count on y from 0."""

    WIDTH, HEIGHT = 560, 240
    LEFT, RIGHT, TOP, BOTTOM = 56, 16, 28, 36

    def __init__(self, title: str, x_max: float, y_max: float) -> None:
        self.title = title
        self.x_ticks, self.x_unit = time_ticks(max(x_max, 1.0))
        self.y_ticks = nice_ticks(max(y_max, 1.0), whole=True)
        self.x_max = self.x_ticks[-1]
        self.y_max = self.y_ticks[-1]

    def x(self, value: float) -> float:
        span = self.WIDTH - self.LEFT - self.RIGHT
        return round(self.LEFT + span * min(max(value, 0.0), self.x_max) / self.x_max, 1)

    def y(self, value: float) -> float:
        span = self.HEIGHT - self.TOP - self.BOTTOM
        return round(self.HEIGHT - self.BOTTOM - span * max(value, 0.0) / self.y_max, 1)

    def render(self, series: Sequence[Series], markers: Sequence[Marker] = ()) -> str:
        parts = [f'<svg class="plot" viewBox="0 0 {self.WIDTH} {self.HEIGHT}" '
                 f'role="img" aria-label="{esc(self.title)}" '
                 f'xmlns="http://www.w3.org/2000/svg">',
                 f"<title>{esc(self.title)}</title>",
                 f'<text class="ptitle" x="{self.LEFT}" y="16">{esc(self.title)}</text>']
        bottom, top = self.HEIGHT - self.BOTTOM, self.TOP
        for tick in self.y_ticks:
            y = self.y(tick)
            parts.append(f'<line class="grid" x1="{self.LEFT}" x2="{self.WIDTH - self.RIGHT}" '
                         f'y1="{y}" y2="{y}"/>')
            parts.append(f'<text class="tick" x="{self.LEFT - 6}" y="{y + 4}" '
                         f'text-anchor="end">{esc(count_label(tick))}</text>')
        scale = {"h": 3600.0, "min": 60.0, "s": 1.0}[self.x_unit]
        for tick in self.x_ticks:
            x = self.x(tick)
            parts.append(f'<line class="grid" x1="{x}" x2="{x}" y1="{top}" y2="{bottom}"/>')
            parts.append(f'<text class="tick" x="{x}" y="{bottom + 16}" '
                         f'text-anchor="middle">{tick / scale:g}</text>')
        parts.append(f'<text class="tick" x="{self.WIDTH - self.RIGHT}" y="{self.HEIGHT - 2}" '
                     f'text-anchor="end">time ({self.x_unit})</text>')
        legend_x = self.WIDTH - self.RIGHT
        for item in reversed(series):
            parts.append(f'<text class="legend" x="{legend_x}" y="16" text-anchor="end" '
                         f'fill="{item.color}">{esc(item.label)}</text>')
            legend_x -= 9 * len(item.label) + 16
        for item in series:
            points = thin(item.points)
            if item.step:
                # A count that jumps: hold each value until the next point.
                stepped: list[tuple[float, float]] = []
                for (x0, y0), (x1, _) in itertools.pairwise(points):
                    stepped += [(x0, y0), (x1, y0)]
                points = [*stepped, points[-1]] if points else []
            coords = " ".join(f"{self.x(px)},{self.y(py)}" for px, py in points)
            if len(points) == 1:
                # One point is no line: show it as a dot.
                parts.append(f'<circle cx="{self.x(points[0][0])}" cy="{self.y(points[0][1])}" '
                             f'r="3" fill="{item.color}"/>')
            elif points:
                parts.append(f'<polyline fill="none" stroke="{item.color}" stroke-width="2" '
                             f'points="{coords}"/>')
        # Each marker a level higher than the last: labels beside them stay apart while the
        # levels are at least a line apart; past that only the tooltips name them.
        levels = (self.HEIGHT - self.TOP - self.BOTTOM) / self.y_max
        for marker in markers:
            x, y = self.x(marker.x), self.y(marker.y)
            label = (f'<text class="mlabel" x="{x + 8}" y="{y + 4}">{esc(marker.label)}</text>'
                     if levels >= 12 else "")
            parts.append(f'<a href="{esc(marker.link)}"><title>{esc(marker.title)}</title>'
                         f'<circle cx="{x}" cy="{y}" r="5" fill="{marker.color}" '
                         f'stroke="#fff" stroke-width="1.5"/>{label}</a>')
        parts.append(f'<line class="axis" x1="{self.LEFT}" x2="{self.WIDTH - self.RIGHT}" '
                     f'y1="{bottom}" y2="{bottom}"/>')
        parts.append(f'<line class="axis" x1="{self.LEFT}" x2="{self.LEFT}" y1="{top}" '
                     f'y2="{bottom}"/>')
        parts.append("</svg>")
        return "".join(parts)


def campaign_length(data: CampaignData) -> float:
    """The x range of the plots: the campaign's length, or its last point if that is later."""
    ends = [data["finished"] - data["started"]]
    ends += [p["t"] for p in data["timeline"]] + [e["t"] for e in data["events"]]
    ends += [f["found_at"] - data["started"] for f in data["failures"]]
    ends += [s["finished"] - data["started"] for s in data["shards"] if s["finished"]]
    return max(ends)


def failure_marker(failure: FailureRecord, t: float, y: float) -> Marker:
    origin = "replayed from the database" if failure["replayed"] else "new"
    return Marker(
        x=t, y=y, label=failure["id"], color="#9e9e9e" if failure["replayed"] else "#c62828",
        title=f"{failure['id']} at {offset(t)} ({origin}): {failure['layer']} "
              f"{failure['check']}, {failure['error']}, by {failure['worker']}",
        link=f"#failure-{failure['id']}")


def progress_plots(data: CampaignData) -> str:
    """Examples, steps and what was reached against time, then the failures found."""
    timeline = sorted(data["timeline"], key=lambda p: p["t"])
    length = campaign_length(data)
    parts: list[str] = []
    if timeline:
        plotted = (("examples (cumulative)", "examples", "#1565c0",
                    [float(p["examples"]) for p in timeline]),
                   ("steps (cumulative)", "steps", "#6a1b9a",
                    [float(p["steps"]) for p in timeline]),
                   ("rules, situations, invariants, events reached", "reached", "#2e7d32",
                    [float(p["reached"]) for p in timeline]))
        for title, label, color, values in plotted:
            points = [(p["t"], value) for p, value in zip(timeline, values, strict=True)]
            if points[0][0] > 0:
                points.insert(0, (0.0, 0.0))  # cumulative since the start: nothing at t=0
            plot = Plot(title, length, max(values))
            parts.append(plot.render([Series(label, color, points)]))
    else:
        parts.append('<p class="empty">No timeline was recorded: no progress plots.</p>')

    # The failure line is drawn from the failures' own times, so that each marker sits on it.
    found = sorted(data["failures"], key=lambda f: f["found_at"])
    times = [f["found_at"] - data["started"] for f in found]
    steps = [(0.0, 0.0)] + [(t, float(i + 1)) for i, t in enumerate(times)]
    steps.append((length, float(len(found))))
    plot = Plot("distinct failures found", length, max(len(found), 1))
    markers = [failure_marker(f, t, i + 1) for i, (f, t) in enumerate(zip(found, times,
                                                                          strict=True))]
    parts.append(plot.render([Series("failures", "#c62828", steps, step=True)], markers))
    return "".join(parts)


MARKER_NOTE = ('<p class="note">Failure markers: red where new, grey where replayed from the '
               "database; each links to its failure below and names it in its tooltip.</p>")


def shard_gantt(data: CampaignData) -> str:
    """Each worker a row, each shard a bar from its start to its end, coloured by status;
    a diamond where a failure was found."""
    length = campaign_length(data)
    ran = [s for s in data["shards"] if s["started"] is not None]
    failures = sorted(data["failures"], key=lambda f: f["found_at"])
    workers = sorted({s["worker"] for s in ran} | {f["worker"] for f in failures})
    not_started = len(data["shards"]) - len(ran)
    note = (f'<p class="note">{plural(not_started, "shard")} never started (not shown).</p>'
            if not_started else "")
    if not workers:
        return '<p class="empty">No shard started.</p>' + note
    label_width = min(220, 10 + 7 * max(len(w) for w in workers))
    width, row, top, bottom = 1100, 22, 28, 30
    height = top + row * len(workers) + bottom
    ticks, unit = time_ticks(max(length, 1.0))
    x_max = ticks[-1]
    span = width - label_width - 16

    def x(t: float) -> float:
        return round(label_width + span * min(max(t, 0.0), x_max) / x_max, 1)

    parts = [f'<svg class="gantt" viewBox="0 0 {width} {height}" role="img" '
             f'aria-label="shards by worker" xmlns="http://www.w3.org/2000/svg">',
             "<title>shards by worker</title>"]
    legend_x = label_width
    for status, colour in STATUS_COLORS.items():
        parts.append(f'<rect x="{legend_x}" y="6" width="12" height="12" fill="{colour}"/>'
                     f'<text class="legend" x="{legend_x + 16}" y="16">{status}</text>')
        legend_x += 16 + 8 * len(status) + 14
    parts.append(f'<path d="M{legend_x + 6} 6 l6 6 l-6 6 l-6 -6 z" fill="#c62828" '
                 f'stroke="#fff"/><text class="legend" x="{legend_x + 16}" y="16">'
                 f"failure found</text>")
    scale = {"h": 3600.0, "min": 60.0, "s": 1.0}[unit]
    for tick in ticks:
        px = x(tick)
        parts.append(f'<line class="grid" x1="{px}" x2="{px}" y1="{top}" '
                     f'y2="{height - bottom}"/><text class="tick" x="{px}" '
                     f'y="{height - bottom + 16}" text-anchor="middle">{tick / scale:g}</text>')
    parts.append(f'<text class="tick" x="{width - 16}" y="{height - 2}" text-anchor="end">'
                 f"time ({unit})</text>")
    rows = {worker: top + row * index for index, worker in enumerate(workers)}
    for worker, y in rows.items():
        if (y - top) // row % 2:
            parts.append(f'<rect class="band" x="0" y="{y}" width="{width}" height="{row}"/>')
        parts.append(f'<text class="wlabel" x="{label_width - 6}" y="{y + 15}" '
                     f'text-anchor="end">{esc(clip(worker, 30))}</text>')
    # A worker runs one shard at a time: a shard without an end (still running, or abandoned
    # when its worker was lost) is drawn up to the worker's next shard, or the campaign's end.
    starts: dict[str, list[float]] = defaultdict(list)
    for shard in ran:
        starts[shard["worker"]].append((shard["started"] or data["started"]) - data["started"])
    for shard in ran:
        start = (shard["started"] or data["started"]) - data["started"]
        later = [t for t in starts[shard["worker"]] if t > start]
        end = ((shard["finished"] - data["started"]) if shard["finished"]
               else min(later, default=length))
        x0, x1 = x(start), x(end)
        colour = STATUS_COLORS.get(shard["status"], "#000")
        policy = f" {shard['policy']}" if shard["policy"] else ""
        tip = (f"{shard['job']}: {shard['layer']} {shard['target']} {shard['profile']}{policy} "
               f"seed {shard['seed']}, {shard['status']} (attempt {shard['attempts']}), "
               f"{offset(start)} to {offset(end)}, {shard['examples']:,} examples, "
               f"{shard['steps']:,} steps, {shard['failures']} failures")
        parts.append(f'<g><title>{esc(tip)}</title><rect x="{x0}" y="{rows[shard["worker"]] + 3}" '
                     f'width="{max(x1 - x0, 2.0)}" height="{row - 6}" rx="2" fill="{colour}" '
                     f'stroke="#fff" stroke-width="0.5"/>')
        label = f"{shard['layer']} {shard['seed']}"
        if x1 - x0 > 7 * len(label) + 8:
            parts.append(f'<text class="blabel" x="{x0 + 4}" y="{rows[shard["worker"]] + 15}">'
                         f"{esc(label)}</text>")
        parts.append("</g>")
    for failure in failures:
        t = failure["found_at"] - data["started"]
        px, py = x(t), rows[failure["worker"]] + row / 2
        marker = failure_marker(failure, t, 0)
        parts.append(f'<a href="{esc(marker.link)}"><title>{esc(marker.title)}</title>'
                     f'<path d="M{px} {py - 7} l7 7 l-7 7 l-7 -7 z" fill="{marker.color}" '
                     f'stroke="#fff" stroke-width="1.5"/></a>')
    parts.append("</svg>")
    return "".join(parts) + note


# -- the HTML page ----------------------------------------------------------------------------

CSS = """
:root { color-scheme: light; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 0;
       color: #1a1a1a; background: #fafafa; }
main { max-width: 1180px; margin: 0 auto; padding: 16px 24px 48px; }
h1 { font-size: 22px; margin: 8px 0 4px; }
h2 { font-size: 18px; margin: 28px 0 8px; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
h3 { font-size: 15px; margin: 18px 0 6px; }
.verdict { font-size: 20px; font-weight: 600; margin: 4px 0 8px; }
.verdict.fail { color: #c62828; } .verdict.pass { color: #2e7d32; }
.facts { margin: 0; padding-left: 18px; color: #333; }
.plots { display: grid; grid-template-columns: repeat(auto-fit, minmax(480px, 1fr));
         gap: 12px; }
svg { background: #fff; border: 1px solid #e0e0e0; border-radius: 4px; width: 100%;
      height: auto; font-family: inherit; }
svg .grid { stroke: #eee; } svg .axis { stroke: #888; }
svg .tick { font-size: 11px; fill: #666; } svg .legend { font-size: 12px; }
svg .ptitle { font-size: 13px; font-weight: 600; fill: #333; }
svg .mlabel { font-size: 11px; font-weight: 600; fill: #333; paint-order: stroke;
              stroke: #fff; stroke-width: 3px; }
svg .wlabel { font-size: 11px; fill: #333; font-family: ui-monospace, monospace; }
svg .blabel { font-size: 10px; fill: #fff; pointer-events: none; }
svg .band { fill: #f6f6f6; }
table { border-collapse: collapse; background: #fff; margin: 4px 0 8px; }
th, td { border: 1px solid #e0e0e0; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f0f0f0; font-weight: 600; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
table.coverage { width: 100%; }
table.coverage td.bar { width: 45%; }
.bar div { background: #64b5f6; height: 10px; border-radius: 2px; min-width: 2px; }
tr.missing td { background: #fff3e0; } tr.missing td.name { color: #bf360c; font-weight: 600; }
.tag { display: inline-block; padding: 0 6px; border-radius: 8px; font-size: 12px; }
.tag.new { background: #ffcdd2; color: #b71c1c; } .tag.replayed { background: #e0e0e0; }
.failure { background: #fff; border: 1px solid #e0e0e0; border-left: 4px solid #c62828;
           padding: 8px 12px; margin: 10px 0; border-radius: 4px; }
.failure.replayed { border-left-color: #9e9e9e; }
.failure h3 { margin: 0 0 4px; }
.failure .message { white-space: pre-wrap; margin: 4px 0; }
.failure p { margin: 4px 0; color: #333; }
pre { background: #f5f5f5; padding: 8px; overflow-x: auto; margin: 6px 0 0; font-size: 12px; }
.empty, .note { color: #666; font-style: italic; }
details summary { cursor: pointer; font-weight: 600; margin: 10px 0 4px; }
"""


def coverage_section(data: CampaignData) -> str:
    """A table per layer x profile: every rule, situation, invariant and event with a bar for
    its count (log scale), the ones not reached highlighted."""
    rows: dict[tuple[str, str], list[tuple[str, str, int, int]]] = defaultdict(list)
    for coverage in data["coverage"]:
        rows[coverage["layer"], coverage["profile"]].append(
            (coverage["kind"], coverage["name"], coverage["count"], coverage["shards"]))
    for (layer, profile, kind), names in group_not_reached(data).items():
        listed = {(k, n) for k, n, count, _ in rows[layer, profile] if count <= 0}
        rows[layer, profile].extend((kind, name, 0, 0) for name in names
                                    if (kind, name) not in listed)
    if not rows:
        return '<p class="empty">No coverage was recorded.</p>'
    kind_order = {kind: index for index, kind in enumerate(KINDS)}
    parts: list[str] = []
    for (layer, profile), entries in sorted(rows.items()):
        entries.sort(key=lambda e: (kind_order.get(e[0], len(KINDS)), e[0], -e[2], e[1]))
        highest = max([count for _, _, count, _ in entries] + [1])
        missing = sum(1 for _, _, count, _ in entries if count <= 0)
        summary = (f"{esc(layer)} / {esc(profile)}: {len(entries) - missing} of {len(entries)} "
                   f"reached" + (f", {missing} not reached" if missing else ""))
        parts.append(f'<details open><summary>{summary}</summary><table class="coverage">'
                     "<tr><th>kind</th><th>name</th><th>count</th><th>shards</th>"
                     "<th>count (log scale)</th></tr>")
        for kind, name, count, shards in entries:
            if count <= 0:
                parts.append(f'<tr class="missing"><td>{esc(kind)}</td><td class="name">'
                             f'{esc(name)}</td><td class="num">0</td><td class="num">0</td>'
                             f"<td>not reached</td></tr>")
                continue
            # Log scale: counts span from a handful to millions of steps.
            share = 100 * math.log10(count + 1) / math.log10(highest + 1)
            parts.append(f"<tr><td>{esc(kind)}</td><td>{esc(name)}</td>"
                         f'<td class="num">{count:,}</td><td class="num">{shards}</td>'
                         f'<td class="bar"><div style="width:{share:.1f}%"></div></td></tr>')
        parts.append("</table></details>")
    return "".join(parts)


def summary_table(data: CampaignData) -> str:
    groups = group_summaries(data)
    if not groups:
        return '<p class="empty">No shard ran.</p>'
    parts = ["<table><tr><th>layer</th><th>profile</th><th>shards</th><th>examples</th>"
             "<th>steps</th><th>rules</th><th>situations</th><th>invariants</th><th>events</th>"
             "<th>failures</th></tr>"]
    for g in groups:
        numbers = (g.shards, f"{g.examples:,}", f"{g.steps:,}", g.ratio("rule"),
                   g.ratio("situation"), g.ratio("invariant"), g.ratio("event"), g.failures)
        parts.append(f"<tr><td>{esc(g.layer)}</td><td>{esc(g.profile)}</td>"
                     + "".join(f'<td class="num">{esc(n)}</td>' for n in numbers) + "</tr>")
    parts.append("</table><p class=\"note\">rules, situations, invariants, events: "
                 "reached/total.</p>")
    return "".join(parts)


def failures_section(data: CampaignData) -> str:
    failures = sorted(data["failures"], key=lambda f: f["found_at"])
    if not failures:
        return '<p class="empty">No failures.</p>'
    parts: list[str] = []
    for failure in failures:
        origin = "replayed" if failure["replayed"] else "new"
        tag = ("replayed from the database" if failure["replayed"] else "new")
        policy = f", policy {failure['policy']}" if failure["policy"] else ""
        situation = (f"situation <i>{esc(failure['situation'])}</i>; "
                     if failure["situation"] else "")
        parts.append(
            f'<article class="failure {origin}" id="failure-{esc(failure["id"])}">'
            f"<h3>{esc(failure['id'])}: {esc(failure['layer'])} {esc(failure['kind'])} "
            f"{esc(failure['check'])} <span class=\"tag {origin}\">{tag}</span></h3>"
            f'<div class="message"><strong>{esc(failure["error"])}</strong>: '
            f"{esc(failure['message'])}</div>"
            f"<p>{situation}target {esc(failure['target'])}, profile {esc(failure['profile'])}"
            f"{esc(policy)}; found by {esc(failure['worker'])} at "
            f"{offset(failure['found_at'] - data['started'])}, reported by "
            f"{plural(failure['runs'], 'shard')}</p>"
            f"<pre>{esc(chr(10).join(failure['program']))}</pre></article>")
    return "".join(parts)


def events_section(data: CampaignData) -> str:
    if not data["events"]:
        return '<p class="empty">No notable events.</p>'
    rows = "".join(f'<tr><td class="num">{offset(e["t"])}</td><td>{esc(e["kind"])}</td>'
                   f"<td>{esc(e['text'])}</td></tr>"
                   for e in sorted(data["events"], key=lambda e: e["t"]))
    return f"<table><tr><th>time</th><th>event</th><th>detail</th></tr>{rows}</table>"


def render_html(data: CampaignData) -> str:
    """The page as one string: see write_html."""
    failed = bool(data["failures"])
    facts = "".join(f"<li>{esc(line)}</li>" for line in headline_lines(data))
    body = [
        f"<h1>kvspec campaign {esc(data['campaign'])}: target {esc(data['target'])}</h1>",
        f'<p class="verdict {"fail" if failed else "pass"}">{esc(verdict(data))}</p>',
        f'<ul class="facts">{facts}</ul>',
        "<h2>Progress</h2>", f'<div class="plots">{progress_plots(data)}</div>', MARKER_NOTE,
        "<h2>Shards by worker</h2>", shard_gantt(data),
        "<h2>Coverage by layer and profile</h2>", summary_table(data),
        coverage_section(data),
        f"<h2>Failures ({len(data['failures'])})</h2>", failures_section(data),
        f"<h2>Events ({len(data['events'])})</h2>", events_section(data),
    ]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>kvspec campaign {esc(data['campaign'])}</title>"
            f"<style>{CSS}</style></head><body><main>" + "\n".join(body)
            + "</main></body></html>\n")


def write_html(data: CampaignData, path: Path) -> Path:
    """Write the campaign's page to `path`: one self-contained static HTML file (inline CSS
    and SVG, no script, nothing fetched). Returns the path."""
    path.write_text(render_html(data), encoding="utf-8")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not 1 <= len(args) <= 2:
        print("usage: python -m kvspec.campaign.report CAMPAIGN.json [OUT.html]",
              file=sys.stderr)
        return 2
    data: CampaignData = json.loads(Path(args[0]).read_text())
    print(render_table(data, color=sys.stdout.isatty()), end="")
    if len(args) == 2:
        print(f"page: {write_html(data, Path(args[1]))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
