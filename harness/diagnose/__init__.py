"""Stage 5, the diagnosis: what differs, whether the runs part, and why. Runs the sides; no side imports it.

Before any model loads:
- `preflight`: the differences between the sides from the spec alone; `checkpoint`: what the checkpoint's config
  files set; `fields`: every spec field the explanation can name (its TRL field, candidate values, words).
A cell, in the order it flows (docs/architecture.md draws it):
- `pairs`: one pair of runs (lockstep or free), its comparison, and the cell as a `cell.CellData`, read once;
- `runs`, `compare`, `noise`, `freerun`: any run's log as a frame; two logs -> per-metric differences and the first
  divergence (`tolerances.toml`, the noise twin's envelope, the free-run statistic);
- `attribution`: the cause of a divergence between the built-in sides, confirmed by re-runs with it aligned;
- `identify/`: each stage of your loop read from its own tensors; `tensordiff`: the step's dataflow link by link;
  `explain`: why your loop differs, with `search` re-running the built-in loop with candidates;
- `showable`, `precision`: why a toggle cannot show; a bf16 cell again as a float32 cell;
- `matrix`: the cells and the runner (`backends`: where pairs run); `verdict`: verdict.json and its words.
"""
