"""What a run leaves on disk: atomic files, checkpoints, status.json and the run directory."""
