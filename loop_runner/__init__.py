"""Your own GRPO loop as a side: the harness runs its command under the file-and-environment contract.

A side: it imports only the foundation (`harness.experiment`, `harness.runlog`, `harness.rollouts`)."""
