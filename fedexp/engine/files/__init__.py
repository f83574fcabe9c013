"""Run files: checkpoints, outputs (tables and plots), resuming, progress."""
