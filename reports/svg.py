"""Small charts as inline SVG, written as plain strings: the report's figures without a plotting library.

A `Chart` is one <svg> element of a fixed size in pixels (the page lets it shrink on a narrow screen). Inside it,
a `Plot` is a rectangle that maps data to pixels: `plot.x(step)`, `plot.y(value)`; a value beyond the plot's
limits sits on its edge. Every text is escaped here: titles and legend entries are metric, cell and run names
that come from user files.
"""

from __future__ import annotations

import math
from html import escape

FONT = "system-ui, -apple-system, 'Segoe UI', sans-serif"
SUPERSCRIPT = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")
CHAR_W = 5.8  # the width of one character at 10 px, roughly: enough to lay out a legend
BIG, TINY = 1e300, 1e-200  # the values and the narrowest range an axis is made for (no overflow, no underflow)
TEXT_MAX = 60  # characters of a title or legend entry; the whole text is in the chart's tooltip


def finite(v) -> float | None:
    """`v` as a float, or None when it is missing, NaN or infinite."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _short(text: str, limit: int = TEXT_MAX) -> str:
    text = str(text)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _sci(v: float, digits: int = 2) -> str:
    """1.5e-08 as '1.5e-8'."""
    return f"{v:.{digits}g}".replace("e-0", "e-").replace("e+0", "e").replace("e+", "e")


# ---------------------------------------------------------------------------------------------
# limits and ticks
# ---------------------------------------------------------------------------------------------
def limits(values, log: bool = False) -> tuple[float, float]:
    """The range a plot shows for `values` (None, NaN, inf and beyond ±1e300 left out, they sit on the edge; on a
    log axis, values below 1e-300 too), with a margin of 5% on each side. A range narrower than 1e-200 is shown
    as one value."""
    vs = [f for f in map(finite, values) if f is not None and abs(f) <= BIG and (f >= 1 / BIG or not log)]
    if not vs:
        return (0.1, 10.0) if log else (0.0, 1.0)
    lo, hi = min(vs), max(vs)
    if log:
        lo, hi = math.log10(lo), math.log10(hi)
        pad = (hi - lo) * 0.05 if hi > lo else 0.3
        return 10 ** (lo - pad), 10 ** (hi + pad)
    if hi - lo > TINY:
        pad = (hi - lo) * 0.05
    else:
        pad = abs(lo) * 0.1 if abs(lo) > TINY else 1.0
    return lo - pad, hi + pad


def ticks(lo: float, hi: float, count: int = 5, integer: bool = False) -> list[float]:
    """Round values from lo to hi, as many as fit in count + 1, spaced 1, 2, 2.5 or 5 times a power of ten (whole
    numbers for `integer`); never a lone tick where a finer spacing gives two or more."""
    if not hi > lo:
        return [lo]
    power = math.floor(math.log10((hi - lo) / count))
    finer = None
    for step in (m * 10.0 ** p for p in (power - 1, power, power + 1) for m in (1, 2, 2.5, 5)):
        if integer and step != round(step):
            continue
        first, last = math.ceil(lo / step - 1e-9), math.floor(hi / step + 1e-9)
        values = [k * step for k in range(first, last + 1)]
        if last - first <= count:
            return finer if len(values) < 2 and finer else values
        finer = values
    return [lo, hi]


def tick_labels(values: list[float]) -> list[str]:
    """The labels of one axis's ticks, all in one style: as many decimals as the spacing needs, or 2e-8 style for
    very small or very large values."""
    if len(values) < 2:
        return [_sci(v, 3) for v in values]
    step = abs(values[1] - values[0])
    biggest = max(abs(v) for v in values)
    if biggest >= 1e5 or biggest < 1e-3:  # as many significant digits as it takes to tell the ticks apart
        digits = next((d for d in range(3, 17) if len({_sci(v, d) for v in values}) == len(values)), 17)
        return ["0" if abs(v) < step * 1e-6 else _sci(v, digits) for v in values]
    decimals = next((d for d in range(16) if abs(round(step, d) - step) < step * 1e-6), 16)  # 0.25: 2
    return ["0" if abs(v) < step * 1e-6 else f"{v:.{decimals}f}" for v in values]


def log_ticks(lo: float, hi: float) -> tuple[list[float], list[str]]:
    """Powers of ten from lo to hi (at most 6, every second or third one on a wide axis), labelled 10⁻⁵; the two
    ends when the axis spans less than a decade."""
    first, last = math.ceil(math.log10(lo) - 1e-9), math.floor(math.log10(hi) + 1e-9)
    if first > last:
        return [lo, hi], [_sci(lo), _sci(hi)]
    stride = math.ceil((last - first + 1) / 6)
    powers = range(last, first - 1, -stride)  # counted down from the top decade: the largest values stay labelled
    return [10.0 ** k for k in powers], ["10" + str(k).translate(SUPERSCRIPT) for k in powers]


# ---------------------------------------------------------------------------------------------
# a chart and its plots
# ---------------------------------------------------------------------------------------------
class Chart:
    """One <svg>: texts, a legend, and the plots made with `plot`, drawn in the order they are added."""

    def __init__(self, width: int, height: int, label: str):
        self.width, self.height, self.label = width, height, str(label)
        self.parts: list[str] = []

    def plot(self, left, top, width, height, xlim, ylim, log: bool = False) -> Plot:
        return Plot(self, left, top, width, height, xlim, ylim, log)

    def text(self, x, y, text, size: int = 10, color: str = "#333", anchor: str = "start", weight: int = 400,
             limit: int = TEXT_MAX) -> None:
        self.parts.append(f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" fill="{color}" text-anchor="{anchor}" '
                          f'font-weight="{weight}">{escape(_short(text, limit))}</text>')

    def legend(self, x, y, entries) -> None:
        """One row of (label, color, style): style "line", "dash" or "band". Labels are cut (24 characters at
        most) so that the row fits in the chart; the whole names are in the chart's tooltip."""
        entries = list(entries)
        room = self.width - x - 4
        limit = next((n for n in range(24, 5, -1)
                      if sum(30 + CHAR_W * len(_short(label, n)) for label, *_ in entries) <= room), 6)
        for label, color, style in entries:
            label = _short(label, limit)
            if style == "band":
                self.parts.append(f'<rect x="{x:.1f}" y="{y - 7:.1f}" width="14" height="8" fill="{color}" '
                                  'fill-opacity="0.3"/>')
            else:
                dash = ' stroke-dasharray="4 2"' if style == "dash" else ""
                self.parts.append(f'<line x1="{x:.1f}" y1="{y - 3:.1f}" x2="{x + 14:.1f}" y2="{y - 3:.1f}" '
                                  f'stroke="{color}" stroke-width="2"{dash}/>')
            self.text(x + 18, y, label, color="#333")
            x += 18 + CHAR_W * len(label) + 12

    def svg(self) -> str:
        label = escape(self.label)
        return (f'<svg class="chart" width="{self.width}" height="{self.height}" '
                f'viewBox="0 0 {self.width} {self.height}" role="img" aria-label="{label}" font-family="{FONT}">'
                f'<title>{label}</title>{"".join(self.parts)}</svg>')


class Plot:
    """A rectangle of its chart (left, top, width, height in pixels) showing x in xlim, y in ylim (log: on a
    log axis). Draw the axes first, then bands, then lines: later parts cover earlier ones."""

    def __init__(self, chart: Chart, left, top, width, height, xlim, ylim, log: bool = False):
        self.chart, self.left, self.top, self.width, self.height = chart, left, top, width, height
        self.xlim, self.ylim, self.log = xlim, ylim, log

    def x(self, v: float) -> float:
        lo, hi = self.xlim
        return self.left + (v - lo) / (hi - lo) * self.width

    def y(self, v: float) -> float:
        lo, hi = self.ylim
        if self.log:
            v, lo, hi = (math.log10(max(t, 1e-300)) for t in (v, lo, hi))
        share = min(max((v - lo) / (hi - lo), 0.0), 1.0)  # beyond the limits: on the edge
        return self.top + (1 - share) * self.height

    def axes(self, y_ticks: int = 4) -> None:
        """The frame, grid lines at the ticks, tick labels: steps along the bottom, values on the left (about
        `y_ticks` of them)."""
        add, right, bottom = self.chart.parts.append, self.left + self.width, self.top + self.height
        add(f'<rect x="{self.left}" y="{self.top}" width="{self.width}" height="{self.height}" fill="#fff" '
            'stroke="#999" stroke-width="0.8"/>')
        for v in ticks(*self.xlim, count=6, integer=True):
            x = self.x(v)
            add(f'<line x1="{x:.1f}" y1="{self.top}" x2="{x:.1f}" y2="{bottom}" stroke="#e4e4e4" stroke-width="0.6"/>')
            self.chart.text(x, bottom + 12, f"{v:g}", color="#555", anchor="middle")
        self.chart.text(self.left - 4, bottom + 12, "step", color="#777", anchor="end")
        if self.log:
            values, labels = log_ticks(*self.ylim)
        else:
            values = ticks(*self.ylim, count=y_ticks)
            labels = tick_labels(values)
        for v, label in zip(values, labels):
            y = self.y(v)
            add(f'<line x1="{self.left}" y1="{y:.1f}" x2="{right}" y2="{y:.1f}" stroke="#e4e4e4" stroke-width="0.6"/>')
            self.chart.text(self.left - 4, y + 3.5, label, color="#555", anchor="end")

    def line(self, xs, ys, color: str, width: float = 1.5, dash: bool = False, name: str = "",
             markers: bool = False) -> None:
        """A polyline through the finite points, broken where a value is missing; `name` goes in data-series."""
        runs, run = [], []
        for x, y in zip(xs, ys):
            x, y = finite(x), finite(y)
            if x is None or y is None or (self.log and y <= 0):
                runs, run = runs + [run] if run else runs, []
            else:
                run.append(f"{self.x(x):.1f},{self.y(y):.1f}")
        runs += [run] if run else []
        style = f'fill="none" stroke="{color}" stroke-width="{width}" stroke-linejoin="round"'
        style += ' stroke-dasharray="5 3"' if dash else ""
        for run in runs:
            self.chart.parts.append(f'<polyline data-series="{escape(str(name))}" {style} points="{" ".join(run)}"/>')
            if markers:
                for point in run:
                    cx, cy = point.split(",")
                    self.chart.parts.append(f'<circle cx="{cx}" cy="{cy}" r="2.5" fill="{color}"/>')

    def band(self, xs, lo, hi, color: str, opacity: float) -> None:
        """The area between lo and hi (arrays over xs), over the steps where both are finite."""
        pts = [(x, a, b) for x, a, b in zip(map(finite, xs), map(finite, lo), map(finite, hi))
               if None not in (x, a, b)]
        if not pts:
            return
        outline = [(self.x(x), self.y(b)) for x, _, b in pts] + [(self.x(x), self.y(a)) for x, a, _ in reversed(pts)]
        if len(pts) == 1:  # one step: a thin bar, so that it shows
            (x, a, b), = pts
            outline = [(self.x(x) - 2, self.y(b)), (self.x(x) + 2, self.y(b)), (self.x(x) + 2, self.y(a)),
                       (self.x(x) - 2, self.y(a))]
        points = " ".join(f"{px:.1f},{py:.1f}" for px, py in outline)
        self.chart.parts.append(f'<polygon fill="{color}" fill-opacity="{opacity}" stroke="none" points="{points}"/>')

    def hline(self, v: float, color: str, dash: bool = False, width: float = 0.8) -> None:
        y = self.y(v)
        dashes = ' stroke-dasharray="5 3"' if dash else ""
        self.chart.parts.append(f'<line x1="{self.left}" y1="{y:.1f}" x2="{self.left + self.width}" y2="{y:.1f}" '
                                f'stroke="{color}" stroke-width="{width}"{dashes}/>')

    def vline(self, v: float, color: str, cls: str = "") -> None:
        x = self.x(v)
        self.chart.parts.append(f'<line class="{escape(cls)}" x1="{x:.1f}" y1="{self.top}" x2="{x:.1f}" '
                                f'y2="{self.top + self.height}" stroke="{color}" stroke-width="1.3"/>')
