"""A hand-written GRPO loop in plain PyTorch + transformers (no TRL): `train.py` top to bottom, its math in `core.py`.

A side: it imports only the foundation (`harness.experiment`, `harness.runlog`, `harness.rollouts`)."""
