"""Reports. Until the HTML report lands (see the reports issue), a plain summary stands in."""

from __future__ import annotations

from pathlib import Path


def write_parity_report(out_dir: str | Path) -> Path:
    return Path(out_dir) / "summary.txt"


def write_compare_report(out_dir: str | Path, result: dict) -> Path:
    return Path(out_dir) / "comparison.txt"
