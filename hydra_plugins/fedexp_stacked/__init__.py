"""fedexp's Hydra launcher ``stacked`` (``fedexp.sweep.stacked``)."""
