"""TRL's GRPOTrainer driven from the harness spec, logging the same metrics as the scratch loop."""
