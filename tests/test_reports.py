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
    assert html.index('id="verdict"') < html.index("data:image/png")
    assert "DIVERGED at step 1" in html and "as the preflight predicted: 1 of 1 cells as expected" in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "<script>alert(1)" not in html and "onerror=alert(2)>" not in html
    assert "http://" not in html and "https://" not in html  # no CDN, nothing fetched
    assert 'id="overview"' in html and html.count("data:image/png;base64,") >= 2  # overview + the cell's curves
    assert "loss_type" in html and "confirmed" in html
    # the first words say what to change, before the cell table and any picture
    head = html[html.index('id="headline"'):html.index('id="cells"')]
    assert "part at step" in head and "set loss_type = &#34;grpo&#34; in [trl] to match" in head
    assert "metrics identical on every step" in html  # lockstep: rewards and lengths collapse into one line


def test_only_metrics_that_differ_get_a_curve():
    import pandas as pd

    from reports.render import classify_metrics

    a = pd.DataFrame({"loss": [1.0, 2.0, 3.0], "reward": [0.1, 0.5, 0.2], "epoch": [1.0, 1.0, 1.0],
                      "entropy": [2.0, 2.0, 2.0], "kl": [0.0, 0.1, 0.2]}, index=[1, 2, 3])
    b = pd.DataFrame({"loss": [1.0, 2.0, 3.5], "reward": [0.1, 0.5, 0.2], "epoch": [1.0, 1.0, 1.0],
                      "entropy": [2.0, 2.0, 2.5]}, index=[1, 2, 3])
    kinds = classify_metrics(a, b, ["loss", "reward", "epoch", "entropy", "kl", "absent"])
    assert kinds == {"plot": ["loss", "entropy"], "identical": ["reward"], "constant": ["epoch"], "one_sided": ["kl"]}


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
        verdict = page.inner_text("#verdict")
        page.locator("details").first.evaluate("d => d.open = true")
        body_text = page.inner_text("body")
        shot = tmp_path / "report.png"
        page.screenshot(path=str(shot), full_page=False)
        browser.close()
    assert errors == [] and dialogs == []
    assert images and all(done and w > 0 and h > 0 for done, w, h in images)
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
