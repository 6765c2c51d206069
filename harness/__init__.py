"""GRPO parity harness: run a hand-written GRPO loop and TRL's GRPOTrainer from one spec and compare them."""

__version__ = "0.1.0"
