"""Stage 1, the experiment: everything every side is given, and nothing that runs a side.

- `spec`: the experiment spec (one TOML file in the scratch loop's vocabulary), its fields and checks;
- `models`: the checkpoint every side starts from (embedded, SmolLM2, local), tokenizer, dtype, device;
- `embedded`: the offline default (tiny seeded Qwen3, word-level tokenizer, synthetic GSM8K);
- `data`: prompt rows, the shared prompt schedule, prompt encoding;
- `rewards`: the reward functions both sides call, in TRL's reward contract.

Imports nothing from the rest of the harness but itself.
"""
