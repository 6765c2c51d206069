"""Stage 2, the run log: the one format every side writes and every diagnosis reads.

- `log`: `metrics.jsonl` (one line per optimizer step), `manifest.json`, `completions.jsonl`, the reader;
- `params`: the parameter sketch both sides record after each step (weight distance between the sides);
- `stops`: graceful SIGINT/SIGTERM at step boundaries;
- `tensors`: the first steps' tensors along a GRPO step's dataflow (`tensors.jsonl`), for the tensor diff;
- `atomic`: whole-file writes a reader never sees half of (every JSON document, summary and report the harness
  writes goes through it).

Imports only `harness.experiment`.
"""
