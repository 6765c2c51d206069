"""The report on your loop as a browser shows it (issue 49), for the tests that already run a loop: its first screen
at 1280x900 holds the answer (the sentence, the [trl] table with its copy button, what TRL cannot set, what the run
could not tell), nothing is wider than the page (every <details> opened), and no paragraph of more than 12 words
appears twice. Chromium is Debian's (.ci/run installs it); without it `CHROMIUM` is None and the callers skip.

    python tests/first_screen.py RUN_DIR [PNG]   # render RUN_DIR/report.html, print what is wrong, save the screen

The tests that run the five public loops (tests/test_public_loops.py) and examples/my_grpo.py with its switches
(tests/test_explain.py, tests/test_your_loop.py) call `check_report` on the run they made: no run is made for it.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
WIDTH, HEIGHT = 1280, 900
ANSWER = ("#answer-sentence", "#trl-table", "#cannot-set", "#untold")
# every block of text a reader takes as a paragraph (the innermost: a cell holding a <pre> is the <pre>); the
# completions (class "data": a group's prompt is on each of its rows) are the model's text, not the report's
BLOCKS = "p, li, td, th, pre, summary, #answer-sentence, .parting"

# more than 4 numbers in a row, which the page says as '12 rates, 3.1e-07 to 3.5e-08' or draws
RAW_LIST = re.compile(r"-?\d[\d.e+-]*(?:, -?\d[\d.e+-]*){4,}")

_WIDE = """() => Array.from(document.querySelectorAll('body *')).filter(e => {
  const r = e.getBoundingClientRect(); return r.width > 0 && (r.right > innerWidth + 0.5 || r.left < -0.5);
}).map(e => e.tagName + (e.id ? '#' + e.id : '') + ' ' + Math.round(e.getBoundingClientRect().right))"""


def first_screen(report: Path, shot: Path | None = None) -> dict:
    """What the browser shows of `report`: `boxes` (the answer's parts: top and bottom in px, None where absent),
    `copy_button` (its box), `wide` (elements past the page's edges, every <details> open), `page_width`, and
    `texts` (each text block, every <details> open). `shot`: the first screen saved as a PNG."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"])
        page = browser.new_page(viewport={"width": WIDTH, "height": HEIGHT})
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(Path(report).resolve().as_uri())
        page.wait_for_load_state("load")
        boxes = {}
        for sel in ANSWER:
            box = page.locator(sel).first.bounding_box() if page.locator(sel).count() else None
            boxes[sel] = None if box is None else (box["y"], box["y"] + box["height"])
        button = page.locator("button.copy").first.bounding_box() if page.locator("button.copy").count() else None
        if shot is not None:
            page.screenshot(path=str(shot))
        page.evaluate("document.querySelectorAll('details').forEach(d => d.open = true)")
        wide = page.evaluate(_WIDE)
        page_width = page.evaluate("document.documentElement.scrollWidth")
        texts = page.evaluate(f"Array.from(document.querySelectorAll({BLOCKS!r})).filter(e => !e.querySelector("
                              f"{BLOCKS!r}) && !e.closest('.data')).map(e => e.innerText)")
        browser.close()
    return {"boxes": boxes, "copy_button": button, "wide": wide, "page_width": page_width, "texts": texts,
            "errors": errors}


def repeated(texts: list[str], words: int = 12) -> list[str]:
    """The paragraphs (lines of a block) of more than `words` words that appear in more than one place."""
    seen: dict[str, int] = {}
    for text in texts:
        for para in {re.sub(r"\s+", " ", p).strip() for p in text.split("\n")}:
            if len(para.split()) > words:
                seen[para] = seen.get(para, 0) + 1
    return [p for p, n in seen.items() if n > 1]


def problems(report: Path, shot: Path | None = None) -> list[str]:
    """What is wrong with `report`'s first screen and width, in words; [] when nothing is."""
    seen = first_screen(report, shot)
    out = [f"script error: {e}" for e in seen["errors"]]
    for sel, box in seen["boxes"].items():
        if box is None:
            out.append(f"{sel} is missing")
        elif box[1] > HEIGHT:
            out.append(f"{sel} ends at {box[1]:.0f} px, below the first screen ({HEIGHT} px)")
    button = seen["copy_button"]
    if button is None or button["y"] + button["height"] > HEIGHT:
        out.append(f"the copy button is not on the first screen ({button})")
    if seen["page_width"] > WIDTH or seen["wide"]:
        out.append(f"wider than the page ({seen['page_width']} px): {seen['wide'][:5]}")
    out += [f"said twice: {p[:90]}" for p in repeated(seen["texts"])]
    out += [f"a raw list of numbers: {m.group(0)[:90]}" for t in seen["texts"] for m in [RAW_LIST.search(t)] if m]
    return out


def check_report(run_dir: Path, name: str) -> None:
    """For a test that ran a loop: its report written, inert, and its first screen as `problems` wants it. Without
    Chromium the browser half is not run, said by a warning; with SHOTS set, the first screen is saved there as
    NAME.png."""
    import os
    import warnings

    from reports.render import write_parity_report
    from test_report_safety import assert_inert

    report = write_parity_report(run_dir)
    assert_inert(report.read_text())
    if CHROMIUM is None:
        warnings.warn("no chromium here: the report's first screen was not checked (.ci/run installs it)")
        return
    shots = os.environ.get("SHOTS")
    found = problems(report, Path(shots) / f"{name}.png" if shots else None)
    assert found == [], found


if __name__ == "__main__":
    run = Path(sys.argv[1])
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from reports.render import write_parity_report

    found = problems(write_parity_report(run), Path(sys.argv[2]) if len(sys.argv) > 2 else None)
    print("\n".join(found) or "ok")
    sys.exit(1 if found else 0)
