"""Layer 5: the stages a user runs (generate, calibrate, export, bench, report) and the command line."""
