"""The HTML report: self-contained, escaped, and checked in a real browser (Debian's chromium via Playwright)."""

import json
import shutil

import pytest

from conftest import small_spec
from harness.diagnose.matrix import run_matrix
from reports.render import write_compare_report, write_index, write_parity_report

EVIL = "<script>alert(1)</script><img src=x onerror=alert(2)>"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def parity_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    run_matrix(small_spec("STEPS=4", 'trl.loss_type="dapo"'), out, "none", log=lambda *_: None)
    # a model that writes markup: its completion must show as text
    comp = out / "as-given" / "scratch" / "completions.jsonl"
    rows = [json.loads(line) for line in comp.read_text().splitlines()]
    rows[0]["completion"] = EVIL
    comp.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    write_parity_report(out)
    return out


def test_report_is_self_contained_and_escaped(parity_dir):
    html = (parity_dir / "report.html").read_text()
    # the verdict comes first, before any picture
    assert html.index('id="verdict"') < html.index("<svg")
    assert "DIVERGED at step 1" in html and "as the preflight predicted: 1 of 1 cells as expected" in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "<script>alert(1)" not in html and "onerror=alert(2)>" not in html
    assert "http://" not in html and "https://" not in html  # no CDN, nothing fetched
    assert 'id="overview"' in html and html.count("<svg") >= 2  # overview + the cell's curves, inline SVG
    assert "<img" not in html and "data:image" not in html
    assert "loss_type" in html and "confirmed" in html
    # the first words say what to change, before the cell table and any picture
    head = html[html.index('id="headline"'):html.index('id="cells"')]
    assert "part at step" in head and "set loss_type = &#34;grpo&#34; in [trl] to match" in head
    assert "metrics identical on every step" in html  # lockstep: rewards and lengths collapse into one line


def test_the_headline_names_the_first_training_metric_that_parts_not_a_statistic():
    """Against your loop compare's first divergence may be a statistic (kl from step 2) that the verdict calls
    defined differently while training parts at step 4: the headline names grad_norm there (it said 'first on kl'),
    the loss before grad_norm at one step, and where only statistics part says so. The built-in sides' first
    divergence (prompts_in_step) is named as it is."""
    from harness.diagnose.verdict import headline

    def sentence(sides, first, **parted):
        cell = {"verdict": "diverged", "sides": sides, "first_divergence": first, "attribution_detail": [],
                "metrics": {m: {"first_outside": s} for m, s in parted.items()}}
        return headline({"mode": "lockstep", "cells": [cell]})["sentence"]

    kl = {"step": 2, "metric": "kl"}
    assert sentence(["yours", "trl"], kl, kl=2, loss=None, grad_norm=4, param_rel_l2=6) == \
        "The two loops part at step 4, first on grad_norm."
    assert sentence(["yours", "trl"], kl, kl=2, reward_std=1, grad_norm=3, loss=3).startswith(
        "The two loops part at step 3, first on loss.")
    assert sentence(["yours", "trl"], kl, kl=2, loss=None, param_rel_l2=8).startswith(
        "The two loops part at step 8, first on param_rel_l2 (the final weights).")
    assert sentence(["yours", "trl"], kl, kl=2, loss=None, learning_rate=None).startswith(
        "Only statistics part, first kl at step 2: what training computes (loss, learning_rate) agrees")
    batch = {"step": 1, "metric": "prompts_in_step"}
    assert sentence(["scratch", "trl"], batch, prompts_in_step=1, loss=1).startswith(
        "The two loops part at step 1, first on prompts_in_step.")


def test_the_cell_tables_first_divergence_is_the_headlines_training_metric():
    """The summary's cell table names where the loops part as the headline does (issue 47 item 6, 49 item 5): against
    your loop grad_norm at step 4, not compare's kl at step 2; 'statistics only' where only statistics part; the
    built-in sides' first divergence as it is."""
    from harness.diagnose.verdict import format_verdict

    def row(sides, first, **parted):
        cell = {"name": "c", "expected": "parity", "verdict": "diverged", "ok": False, "sides": sides,
                "first_divergence": first, "attribution_detail": [],
                "metrics": {m: {"first_outside": s} for m, s in parted.items()}}
        text = format_verdict({"ok": False, "mode": "lockstep", "matrix": "none", "elapsed_s": 1, "cells": [cell]})
        return next(line for line in text.splitlines() if line.startswith("c ")).split()[3:6]

    kl = {"step": 2, "metric": "kl"}
    assert row(["yours", "trl"], kl, kl=2, loss=None, grad_norm=4) == ["step", "4", "grad_norm"]
    assert row(["yours", "trl"], kl, kl=2, loss=None) == ["statistics", "only", "-"]
    assert row(["scratch", "trl"], {"step": 1, "metric": "prompts_in_step"}, prompts_in_step=1) == \
        ["step", "1", "prompts_in_step"]


def _explained_doc(status="confirmed", **entry) -> dict:
    """A verdict of your loop, explained: two TRL fields, a schedule TRL cannot set, and what the run could not
    tell (a stage's, a look-alike's, a clip threshold's)."""
    rates = [0.0, 2.5e-07, 5e-07, 4.997e-07, 4.988e-07, 4.974e-07, 4.954e-07, 4.928e-07, 4.897e-07, 4.86e-07,
             4.818e-07, 4.77e-07]
    notes = ["at step 1 these are outside tolerance: grad_norm, loss",
             "optimizer, read from your tensors: your loop steps Adam",
             "optimizer: this run could not tell: the learning rate per step (0, 1.002e-06, 9.116e-07, 8.218e-07, "
             "7.307e-07, 6.379e-07) follows neither a constant nor a linear-to-0 schedule",
             "this run could not tell: with beta = 0.001 (or 0.01) instead of 0.0, the built-in loop reproduces your "
             "loop over all 12 steps as well (the effect stays under the tolerance here)",
             "max_grad_norm: 1 and 2 each reproduce your loop over all 12 steps, so the run cannot tell which it has"]
    lead = {"cause": "x", "status": status, "differences": [], "notes": notes,
            "fix": {"trl": {"loss_type": "dapo", "learning_rate": 5e-07}, "scratch": {"LR_STEPS": rates}}, **entry}
    cell = {"name": "yours-vs-trl", "expected": "parity", "verdict": "diverged", "ok": False, "sides": ["yours", "trl"],
            "first_divergence": {"step": 1, "metric": "reward"}, "attribution_detail": [lead],
            "metrics": {"reward": {"first_outside": 1}, "loss": {"first_outside": 1}}}
    return {"ok": False, "mode": "lockstep", "matrix": "none", "elapsed_s": 1, "base_spec": {"STEPS": 12},
            "cells": [cell]}


def test_the_answer_on_your_loop_comes_first_in_a_sentence_a_table_and_two_lists():
    """Issue 49: the sentence counts the table's fields and what TRL cannot set and says how sure; the switch's
    12 rates are said by their count and ends, as is a run of 6 numbers in a sentence (4 stay as they are); what
    the run could not tell is one line each, a look-alike as its setting; the summary prints all of it first."""
    from harness.diagnose.answer import answer_lines, short_numbers, your_loop_answer
    from harness.diagnose.verdict import format_verdict

    answer = your_loop_answer(_explained_doc())
    assert answer["sentence"] == ("Your loop is TRL with 2 settings changed, plus 1 thing TRL cannot set; confirmed "
                                  "over 12 steps.")
    assert answer["table"] == '[trl]\nloss_type = "dapo"\nlearning_rate = 5e-07\n'
    assert answer["cannot_set"] == [{"words": "follows a learning-rate schedule of its own, 12 rates from 0 to "
                                              "4.77e-07 (TRL's are named schedules over the run's steps)",
                                     "field": "LR_STEPS", "value": "12 rates, 0 to 4.77e-07"}]
    assert answer["untold"] == [
        "Optimizer: the learning rate per step (6 values, 0 to 6.379e-07) follows neither a constant nor a linear-to-0 "
        "schedule", "beta = 0.001 (or 0.01) instead of 0.0 does as well",
        "max_grad_norm: 1 and 2 each reproduce your loop over all 12 steps, so the run cannot tell which it has"]
    assert short_numbers("beta2: 0.999, 0.99, 0.98, 0.9999 fit") == "beta2: 0.999, 0.99, 0.98, 0.9999 fit"
    suspected = your_loop_answer(_explained_doc("suspected"))["sentence"]
    assert suspected.startswith("Your loop is TRL with 2 settings changed, plus 1 thing TRL cannot set; suspected, "
                                "not confirmed over 12 steps: no setting found reproduces every step")
    parts = your_loop_answer(_explained_doc("suspected", parts={"step": 2, "metrics": ["grad_norm", "loss"]}))
    assert parts["sentence"].endswith("suspected, not confirmed over 12 steps: the closest found still parts at step 2 "
                                      "on grad_norm, loss.")
    lines = answer_lines(answer)
    assert len(lines) <= 15 and lines[0] == answer["sentence"] and lines[1:4] == answer["table"].splitlines()
    text = format_verdict(_explained_doc()).splitlines()
    assert text[2:2 + len(lines)] == lines and text[3 + len(lines)].startswith("cell ")  # the answer, then the table
    assert "step 1 loss" in text[4 + len(lines)]  # the training metric, not the reward


def test_a_loss_logged_otherwise_is_not_where_training_parts():
    """Issue 47 item 6: where the confirmed explanation found your logged loss defined otherwise in value (oat's last
    micro-batch's loss), the cell table and the headline name the first training metric after it (grad_norm at step
    2 here, though the loss parts at step 1); without that finding the loss stays first."""
    from harness.diagnose.answer import training_divergence

    doc = _explained_doc()
    cell = doc["cells"][0]
    cell["metrics"] = {"loss": {"first_outside": 1}, "grad_norm": {"first_outside": 2}, "reward": {"first_outside": 1}}
    assert training_divergence(cell) == {"step": 1, "metric": "loss"}
    cell["attribution_detail"][0]["loss_logged_otherwise"] = {"from_step": 1, "agrees": ["grad_norm", "param_rel_l2"]}
    assert training_divergence(cell) == {"step": 2, "metric": "grad_norm"}
    cell["attribution_detail"][0]["loss_logged_otherwise"]["from_step"] = 3  # logged otherwise from step 3 only:
    assert training_divergence(cell) == {"step": 1, "metric": "loss"}  # its parting at step 1 is training's


def test_only_metrics_that_differ_get_a_curve():
    import pandas as pd

    from reports.render import classify_metrics

    a = pd.DataFrame({"loss": [1.0, 2.0, 3.0], "reward": [0.1, 0.5, 0.2], "epoch": [1.0, 1.0, 1.0],
                      "entropy": [2.0, 2.0, 2.0], "kl": [0.0, 0.1, 0.2]}, index=[1, 2, 3])
    b = pd.DataFrame({"loss": [1.0, 2.0, 3.5], "reward": [0.1, 0.5, 0.2], "epoch": [1.0, 1.0, 1.0],
                      "entropy": [2.0, 2.0, 2.5]}, index=[1, 2, 3])
    kinds = classify_metrics(a, b, ["loss", "reward", "epoch", "entropy", "kl", "absent"])
    assert kinds == {"plot": ["loss", "entropy"], "identical": ["reward"], "constant": ["epoch"], "one_sided": ["kl"]}


def test_curves_follow_the_logged_values():
    """Known answer for the coordinate mapping, on a hand-made frame: each side's polyline passes through its logged
    values in step order (x linear in the step, y linear in the value, larger values higher up), the difference
    below on its own scale, and the red divergence line at its step's x in both plots."""
    import re

    import pandas as pd

    from reports.render import curves_figure

    steps = [1, 2, 3, 4]
    a = pd.DataFrame({"loss": [1.0, 2.0, 4.0, 3.0]}, index=steps)
    b = pd.DataFrame({"loss": [1.0, 2.0, 5.0, 1.0]}, index=steps)
    html = str(curves_figure(a, b, ["loss"], first_div={"step": 3, "metric": "loss"}))
    assert html.count("<svg") == 1 and "parts at step 3" in html
    lines = {name: [tuple(map(float, p.split(","))) for p in points.split()]
             for name, points in re.findall(r'<polyline data-series="([^"]*)"[^>]* points="([^"]*)"', html)}
    assert sorted(lines) == ["difference", "scratch", "trl"]

    def linear(pairs):  # the map through the (value, pixel) pairs of the smallest and largest value
        (v0, p0), (v1, p1) = min(pairs), max(pairs)
        return lambda v: p0 + (v - v0) * (p1 - p0) / (v1 - v0)

    x = linear([(s, px) for s, (px, _) in zip(steps, lines["scratch"])])
    y = linear([(v, py) for v, (_, py) in zip(a["loss"], lines["scratch"])])
    assert y(2.0) < y(1.0)  # up the page
    for side, frame in (("scratch", a), ("trl", b)):
        assert [px for px, _ in lines[side]] == pytest.approx([x(s) for s in steps], abs=0.15)
        assert [py for _, py in lines[side]] == pytest.approx([y(v) for v in frame["loss"]], abs=0.15)
    diff = [py for _, py in lines["difference"]]  # 0, 0, -1, 2 on the difference's own scale
    zero = diff[0]
    assert diff[1] == zero and diff[2] > zero > diff[3] and diff[3] - zero == pytest.approx(-2 * (diff[2] - zero), abs=0.2)
    marks = [float(v) for v in re.findall(r'<line class="divergence" x1="([^"]*)"', html)]
    assert marks == pytest.approx([x(3), x(3)], abs=0.15)


def test_the_weights_chart_and_its_tolerance():
    """The distance between the weights on a log axis (decades labelled 10⁻ⁿ), its tolerance drawn and said in
    words; a user's loop that logs only its final weights gets one marked point."""
    import math

    from reports.render import curves_figure

    html = str(curves_figure(None, None, ["param_rel_l2"], tolerance={"param_rel_l2": {"max": 1e-5}},
                             rel_l2=[1e-7, 1e-6, 1e-4, 1e-3]))
    assert html.count("<svg") == 1 and "10⁻⁵" in html and "10⁻³" in html
    assert "tolerance: 1e-05 (a fixed bound)" in html and 'stroke-dasharray="5 3"' in html
    one = str(curves_figure(None, None, ["param_rel_l2"], rel_l2=[math.nan, math.nan, 2e-3]))
    assert one.count("<circle") == 1


@pytest.mark.parametrize("lo, hi", [(0, 1e-14), (-1e-13, 1e-13), (1e-6 - 1e-10, 1e-6 + 1e-10), (0.5, 30.5),
                                    (-3e6, 4e6), (5, 5), (1.0000001, 1.0000002)])
def test_tick_labels_for_any_range(lo, hi):
    """A float32 difference of 1e-14 or a learning rate that moves in its fifth digit: ticks inside the axis, each
    labelled, no two labels alike."""
    from reports import svg

    axis = svg.limits([lo, hi])
    values = svg.ticks(*axis, count=4)
    labels = svg.tick_labels(values)
    assert len(values) >= 2 and all(axis[0] <= v <= axis[1] for v in values)
    assert len(set(labels)) == len(labels) and all(labels), labels


def test_curves_of_extreme_values():
    """Values near the float limits, inf, NaN and subnormals: drawn (beyond ±1e300 on the edge), no coordinate
    that is not a number."""
    import math
    import re

    import pandas as pd

    from reports.render import curves_figure

    a = pd.DataFrame({"loss": [1e308, -1e308, math.inf, 1.0], "kl": [1e-320, 0.0, 5e-324, 1e-321]}, index=[1, 2, 3, 4])
    b = pd.DataFrame({"loss": [-1e308, 1e308, 0.0, math.nan], "kl": [0.0] * 4}, index=[1, 2, 3, 4])
    html = str(curves_figure(a, b, ["loss", "kl", "param_rel_l2"], tolerance={"loss": {"atol": 1e-5}},
                             rel_l2=[math.inf, math.nan, 1e-320, 1e308]))
    assert html.count("<svg") == 3
    numbers = re.findall(r'(?:points|x|y|x1|y1|x2|y2|cx|cy)="([^"]*)"', html)
    assert numbers and not [n for n in numbers if re.search(r"nan|inf", n)]


def test_index_for_several_runs(parity_dir, tmp_path):
    for name in ("run-a", "run-b"):
        shutil.copytree(parity_dir, tmp_path / name)
    index = write_index(tmp_path)
    assert index is not None and "run-a/report.html" in index.read_text()


def test_compare_report(parity_dir, tmp_path):
    from harness.diagnose.compare import compare_runs

    result = compare_runs(parity_dir / "as-given" / "scratch", parity_dir / "as-given" / "trl")
    path = write_compare_report(tmp_path, result)
    html = path.read_text()
    assert "diverged" in html and "data:image/png;base64," in html


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium here; .ci/run installs Debian's chromium package")
def test_report_in_a_real_browser(parity_dir, tmp_path):
    from playwright.sync_api import sync_playwright

    errors, dialogs, requests = [], [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--no-first-run", "--disable-sync"])
        page = browser.new_page(viewport={"width": 1280, "height": 1400})
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
        page.on("request", lambda r: requests.append(r.url))
        page.goto((parity_dir / "report.html").as_uri())
        page.wait_for_load_state("load")
        images = page.evaluate("Array.from(document.images).map(i => [i.complete, i.naturalWidth, i.naturalHeight])")
        charts = page.evaluate("Array.from(document.querySelectorAll('svg.chart')).map(s => [s.getBoundingClientRect()"
                               ".width, s.getBoundingClientRect().height, s.querySelectorAll('polyline').length])")
        verdict = page.inner_text("#verdict")
        page.locator("details").first.evaluate("d => d.open = true")
        body_text = page.inner_text("body")
        shot = tmp_path / "report.png"
        page.screenshot(path=str(shot), full_page=False)
        browser.close()
    assert errors == [] and dialogs == []
    assert all(done and w > 0 and h > 0 for done, w, h in images)
    assert charts and all(w > 100 and h > 100 and lines > 0 for w, h, lines in charts), charts  # drawn, not empty
    assert "cells as expected" in verdict
    assert EVIL in body_text  # shown as text
    assert [u for u in requests if not u.startswith(("file:", "data:"))] == []
    assert shot.stat().st_size > 10_000


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium here; .ci/run installs Debian's chromium package")
@pytest.mark.parametrize("width, height", [(390, 844), (1280, 800)])  # a phone, a laptop
def test_first_screens_at_phone_and_desktop_width(parity_dir, tmp_path, width, height):
    """Verdict, what to change, the cell table and the first picture within two screens; nothing cut off sideways."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu",
                                                                     "--disable-background-networking"])
        page = browser.new_page(viewport={"width": width, "height": height})
        page.goto((parity_dir / "report.html").as_uri())
        page.wait_for_load_state("load")
        boxes = {sel: page.locator(sel).bounding_box() for sel in ("#verdict", "#headline", "#cells", "#overview")}
        page_width = page.evaluate("document.documentElement.scrollWidth")
        verdict_overflow = page.evaluate("(e => e.scrollWidth - e.clientWidth)(document.querySelector('#verdict'))")
        shot = tmp_path / f"report-{width}.png"
        page.screenshot(path=str(shot))
        browser.close()
    assert page_width <= width, f"the page scrolls sideways at {width} px ({page_width} px wide)"
    assert verdict_overflow <= 0
    for sel, box in boxes.items():
        assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= width + 0.5, (sel, box)
    assert boxes["#verdict"]["y"] < boxes["#headline"]["y"] < boxes["#cells"]["y"] < boxes["#overview"]["y"]
    if width >= 1280:  # the laptop shows all four within its first two screens
        assert boxes["#overview"]["y"] < 2 * height, boxes
    else:  # the phone shows the verdict and the first words on its first screen
        assert boxes["#headline"]["y"] < height
    assert shot.stat().st_size > 10_000


def test_settings_that_differ_come_from_the_preflight(parity_dir, tmp_path):
    """An aligned spec lists no differing settings (the mapping table's texts differ for equal settings); the
    dapo cell lists exactly the preflight's one."""
    html = (parity_dir / "report.html").read_text()
    assert "settings that differ (1, from the preflight)" in html
    run_matrix(small_spec("STEPS=2"), tmp_path, "none", log=lambda *_: None)
    assert "settings that differ" not in write_parity_report(tmp_path).read_text()


def test_your_loops_parting_says_it_is_the_logged_metrics_before_the_answers_settings():
    """A newcomer read "first on loss" beside a dataflow chain whose loss link was "same" as a contradiction: the
    report on your loop says the parting is the logged metrics', before the settings it gives."""
    from reports.render import _parting_before

    assert (_parting_before("The two loops part at step 1, first on loss. Re-running the built-in loop found it.")
            == "Before these settings, the logged metrics part at step 1, first on loss.")
    assert _parting_before("Parity OK.") == "Parity OK."
