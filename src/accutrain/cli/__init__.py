"""The console entry points: accutrain, accutrain-check and accutrain-report."""
