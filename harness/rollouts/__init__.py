"""Stage 3, the rollouts: where completions come from, and how lockstep hands the same ones to every side.

- `lockstep`: `RecordingSource` (the first side samples and records each round), `ReplaySource` (the other
  sides replay the record), `rollouts.jsonl`, the shared micro-batch shuffle seed;
- `generate`: transformers' `generate`, padding, and a sampler's per-token log-probs;
- `fastgen`: the static-KV-cache decoder (CUDA graphs on GPUs);
- `samplers`: separate samplers (the emulated vLLM stand-in, vLLM colocated).

Imports only `harness.experiment` and `harness.runlog`.
"""
