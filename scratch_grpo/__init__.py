"""A hand-written GRPO loop in plain PyTorch + transformers (no TRL), and the rewards both loops share."""
