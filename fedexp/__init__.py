"""fedexp: a Hydra-driven experiment runner for personalised federated learning."""

import os

__version__ = "0.1.0"

# MLflow's usage telemetry stays off unless the environment says otherwise (README, "What is
# logged"): a run sends nothing but to its own tracking server. MLflow's telemetry thread also
# unsets an environment variable when it cannot reach its server (offline, as on a hospital's
# network) while the run's HTTP client reads the environment: a run's start against a tracking
# server failed so, once in this project's CI (KeyError '_MLFLOW_TELEMETRY_SESSION_ID').
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
