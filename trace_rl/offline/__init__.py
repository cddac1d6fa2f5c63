"""Work on a finished run's saved artifacts: replaying its traces through new algorithms, exporting a step's
weights."""
