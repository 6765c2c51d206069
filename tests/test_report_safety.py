"""Output safety: the HTML reports stay inert with hostile strings in every field that reaches them (prompts,
completions, cell and run names, metric names, reward-function names, errors), long texts are cut with a visible
mark, and no name the harness makes a folder from can leave the run folder."""

import json
from html.parser import HTMLParser

import pytest

from harness.cli import main

HOSTILE = ('<script>alert(1)</script>"><img src=x onerror=alert(2)></textarea><svg onload=alert(3)>'
           "\u202e\u2066javascript:alert(4)$\\frac{a}{")
OWN_TAGS = {"html", "head", "meta", "title", "style", "body", "h1", "h2", "h3", "div", "p", "ul", "li", "table", "tr",
            "th", "td", "a", "img", "span", "pre", "details", "summary", "b", "code", "br", "small", "i", "em",
            "section", "ol", "button",  # the report on your loop: its answer's parts, the trace, the copy button
            # the inline SVG figures
            "svg", "title", "text", "rect", "line", "polyline", "polygon", "circle"}


class Tags(HTMLParser):
    """The start tags with their attributes, and the texts of the figures' <text> and <title> elements."""

    def __init__(self):
        super().__init__()
        self.found, self.chart_texts, self.open = [], [], []

    def handle_starttag(self, tag, attrs):
        self.found.append((tag, dict(attrs)))
        self.open.append(tag)

    def handle_endtag(self, tag):
        if tag in self.open:
            del self.open[len(self.open) - 1 - self.open[::-1].index(tag):]

    def handle_data(self, data):
        if "svg" in self.open and self.open[-1] in ("text", "title"):
            self.chart_texts.append(data)


def assert_inert(html: str) -> None:
    """Only the harness's own tags; no event handler, no script but the report's own copy button's (a constant, no
    data in it: once at most), every image inlined, every link relative."""
    from reports.render import COPY_SCRIPT

    own = f"<script>{COPY_SCRIPT}</script>"
    assert html.count(own) <= 1
    html = html.replace(own, "")
    parser = Tags()
    parser.feed(html)
    assert "<script" not in html.lower() and "</textarea" not in html.lower()
    for tag, attrs in parser.found:
        assert tag in OWN_TAGS, tag
        assert not [a for a in attrs if a.startswith("on")], (tag, attrs)
        assert not [a for a in attrs if a.endswith("href")] or tag == "a", (tag, attrs)  # no link inside a figure
        if tag == "img":
            assert attrs["src"].startswith("data:image/png;base64,"), attrs
        if tag == "a":
            assert attrs["href"].startswith(("#", "./")), attrs


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def hostile_parity_run(out):
    """A parity folder as a run writes it, every free-text field hostile."""
    cell_dir = out / "matched"
    for side, loss in (("scratch", 0.5), ("trl", 0.7)):  # the hostile metrics differ too: they get a curve
        write_jsonl(cell_dir / side / "metrics.jsonl", [{"step": s, "loss": loss * s, "reward": 0.1 * s,
                                                         HOSTILE: loss * s, f"rewards/{HOSTILE}/mean": loss * s}
                                                        for s in (1, 2, 3)])
        (cell_dir / side / "manifest.json").write_text(json.dumps({"side": side, "spec": {"NAME": HOSTILE},
                                                                   "sampler": HOSTILE, "device": HOSTILE}))
        write_jsonl(cell_dir / side / "completions.jsonl", [
            {"step": 3, "prompt": [{"role": "user", "content": HOSTILE + "x" * 50_000}],
             "completion": HOSTILE * 3 + "y" * 80_000, "advantage": 0.5, "rewards": {HOSTILE: 1.0}}])
    (cell_dir / "trl" / "mapping.json").write_text(json.dumps([{"check": HOSTILE, "scratch": HOSTILE,
                                                                "scratch_value": HOSTILE, "trl": HOSTILE,
                                                                "trl_value": HOSTILE, "note": HOSTILE}]))
    cell = {"name": HOSTILE, "dir": str(cell_dir), "toggles": {HOSTILE: HOSTILE}, "expected": "parity",
            "expected_cause": None, "sides": ["scratch", "trl"], "verdict": "diverged", "ok": False,
            "first_divergence": {"step": 1, "metric": HOSTILE}, "attribution": [HOSTILE],
            "attribution_detail": [{"cause": HOSTILE, "status": "suspected", "evidence": HOSTILE}],
            "metrics": {HOSTILE: {"max_abs": 1.0, "max_rel": 1.0, "mean_delta": 1.0, "first_outside": 1}},
            "notes": [HOSTILE], "only_in": {"scratch": [HOSTILE], "trl": []}, "wall_s": 1.0}
    failed = {**cell, "name": HOSTILE + "2", "verdict": "failed", "error": HOSTILE, "traceback": HOSTILE,
              "first_divergence": None, "attribution": [], "attribution_detail": [], "metrics": {}}
    doc = {"spec": HOSTILE, "mode": "lockstep", "matrix": HOSTILE, "ok": False, "complete": True,
           "cells": [cell, failed], "cells_selected": [HOSTILE], "elapsed_s": 1, "versions": {"trl": HOSTILE}}
    (out / "verdict.json").write_text(json.dumps(doc))
    return out


def test_the_parity_report_and_index_stay_inert(tmp_path):
    from reports.render import write_index, write_parity_report

    for name in ("run", "javascript:alert(1)"):
        hostile_parity_run(tmp_path / name)
    html = write_parity_report(tmp_path / "run").read_text()
    assert_inert(html)
    assert "&lt;script&gt;" in html  # shown as text, not dropped
    assert html.count('<svg class="chart"') >= 3  # the hostile metrics drawn: their names escaped in the figures
    parser = Tags()
    parser.feed(html)
    # read back as the text it was: escaped, not cut at a quote or a bracket, and no element of its own
    assert any(t.startswith(HOSTILE[:40]) for t in parser.chart_texts), parser.chart_texts
    assert any(HOSTILE in attrs.get("aria-label", "") for tag, attrs in parser.found if tag == "svg")
    assert len(html) < 2_000_000 and "chars cut)" in html  # 130 kB texts per completion, cut
    assert_inert(write_index(tmp_path).read_text())


def test_chart_texts_and_attributes_are_escaped():
    """Every place reports/svg.py puts a name: the title, a text, a legend entry, a series' data attribute, a
    marker's class. Each reads back whole, as text."""
    from reports import svg

    chart = svg.Chart(300, 200, HOSTILE)
    chart.text(10, 10, HOSTILE, limit=len(HOSTILE))
    chart.legend(10, 30, [(HOSTILE, "#000", "line"), (HOSTILE, "#000", "band")])
    plot = chart.plot(40, 40, 200, 100, (0.5, 3.5), (0.0, 1.0))
    plot.axes()
    plot.line([1, 2, 3], [0.1, 0.5, 0.9], "#000", name=HOSTILE)
    plot.vline(2, "#f00", cls=HOSTILE)
    html = chart.svg()
    assert_inert(html)
    parser = Tags()
    parser.feed(html)
    assert [t for t, _ in parser.found].count("svg") == 1
    assert HOSTILE in parser.chart_texts and parser.chart_texts.count(HOSTILE) == 2  # the title and the text
    assert [a["data-series"] for t, a in parser.found if t == "polyline"] == [HOSTILE]
    assert [a["class"] for t, a in parser.found if t == "line" and "class" in a] == [HOSTILE]
    assert parser.found[0][1]["aria-label"] == HOSTILE


def test_the_compare_report_stays_inert(tmp_path, capsys):
    a = tmp_path / "a.csv"
    b = tmp_path / "b.csv"
    header = f'step,loss,"{HOSTILE.replace(chr(34), chr(34) * 2)}"\n'
    a.write_text(header + "1,0.5,1\n2,0.4,2\n")
    b.write_text(header + "1,0.5,1\n2,0.9,3\n")
    assert main(["compare", str(a), str(b), "--out", str(tmp_path / "cmp")]) == 1
    assert_inert((tmp_path / "cmp" / "report.html").read_text())


def test_clip_text():
    from reports.render import clip_text

    assert clip_text("abc", 5) == "abc"
    assert clip_text("a" * 12, 5) == "aaaaa… (7 chars cut)"


@pytest.mark.parametrize("name", ["../../x", "a/b", "/etc/passwd", "..", "a\\b", "."])
def test_a_cell_name_never_leaves_the_run_folder(tmp_path, name):
    from harness.diagnose.matrix import _dirname

    out = tmp_path / "run"
    path = (out / _dirname(name)).resolve()
    assert path.parent == out.resolve() and path.name not in ("", ".", "..")
