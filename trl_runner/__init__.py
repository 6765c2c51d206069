"""TRL's GRPOTrainer driven from the harness spec, logging the same metrics as the scratch loop.

A side: it imports only the foundation (`harness.experiment`, `harness.runlog`, `harness.rollouts`)."""
