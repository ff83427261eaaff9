"""Reading run directories back: summaries, plots and the multirun callback."""
