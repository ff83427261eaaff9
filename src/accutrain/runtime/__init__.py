"""Starting a run: the ranks' processes and one rank's session."""
