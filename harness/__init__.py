"""GRPO parity harness: run a hand-written GRPO loop and TRL's GRPOTrainer from one spec and compare them.

The folders follow the data: `experiment` (spec, model, data, rewards) -> `runlog` (the one log format) ->
`rollouts` (where completions come from) -> the sides (`scratch_grpo`, `trl_runner`, top-level packages)
-> `diagnose` (preflight, comparison, attribution, matrix) -> `reports`. The front ends sit here: `cli`,
`pytest_plugin`, `bench`, `record`. docs/architecture.md draws it.
"""

__version__ = "0.1.0"
