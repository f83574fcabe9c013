"""Errors a user can act on: the CLI prints them as one line, without a traceback."""


class FedexpError(Exception):
    """Bad input or a failed run, with a message naming what is wrong and what was expected."""


class ConfigError(FedexpError):
    """A configuration value is missing, unknown or of the wrong type."""


class DataError(FedexpError):
    """A data file is missing or malformed, or a partition leaves a client without data."""


class DivergenceError(FedexpError):
    """The training loss became NaN or infinite."""


class TrackerError(FedexpError):
    """The tracking store cannot be reached (e.g. no MLflow server answers at the URI)."""


class CheckpointError(FedexpError):
    """A checkpoint file is missing, unreadable, or its tensors fail their checksum."""


class RankDied(FedexpError):
    """A process of a ``distributed.nproc`` run ended while the others still needed it.

    Its message is the whole line (``rank 1 died (signal 9, SIGKILL) in round 17``); the CLI
    adds the resume command of the last checkpoint.
    """


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the run's main thread by the CLI: the run stops as on Ctrl-C.

    The tracker's run ends KILLED and the last checkpoint is kept.
    """
