"""Client-level differential privacy: mechanisms on the uplink and their accounting."""
