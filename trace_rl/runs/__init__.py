"""A run as a whole: its config loaded and checked, its directory started or resumed, the servers it needs
checked before step 1, and its metrics sent to the experiment trackers."""
