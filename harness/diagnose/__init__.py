"""Stage 5, the diagnosis: what differs, whether the runs part, and why. Runs the sides; no side imports it.

- `preflight`: the differences between the sides from the spec alone, before any model loads;
- `compare`: two metric logs -> per-metric differences and the first divergence (`tolerances.toml`);
- `freerun`: the free-run statistic (several seeds per side against their own noise);
- `pairs`: one pair of runs (lockstep or free) and its comparison;
- `attribution`: the cause of a divergence, confirmed by re-runs with one difference aligned;
- `matrix`: the toggle matrix, cell by cell, and `verdict.json`.
"""
