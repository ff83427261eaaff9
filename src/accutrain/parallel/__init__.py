"""How several ranks share the model: DDP, FSDP2, and the state a checkpoint holds under each."""
