"""fedexp: a Hydra-driven experiment runner for personalised federated learning."""

__version__ = "0.1.0"
