"""``hydra/launcher=stacked``: the Hydra side of :mod:`fedexp.sweep.stacked` (issue 41).

Hydra finds launchers in the ``hydra_plugins`` namespace package; this module registers the
config ``hydra/launcher=stacked`` and the launcher class, and leaves the work to fedexp. No
``from __future__ import annotations`` here: Hydra loads its plugins without registering
their modules, and a dataclass of string annotations needs its module registered.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.plugins.launcher import Launcher


@dataclass
class StackedLauncherConf:
    """``hydra/launcher=stacked``'s settings.

    Attributes:
        max_runs: the most runs in one group (one merged cohort a round).
        n_jobs: groups run at a time, each in a worker process: -1 a process a core (at most
            one a group; joblib's convention: -2 all cores but one), 1 every group in this one.
    """

    _target_: str = "hydra_plugins.fedexp_stacked.stacked_launcher.StackedLauncher"
    max_runs: int = 64
    n_jobs: int = -1


ConfigStore.instance().store(
    group="hydra/launcher", name="stacked", node=StackedLauncherConf, provider="fedexp"
)


class StackedLauncher(Launcher):
    """Runs a sweep's jobs that differ in seed and partition only as one stack of runs."""

    def __init__(self, max_runs: int = 64, n_jobs: int = -1) -> None:
        self.max_runs, self.n_jobs = max_runs, n_jobs
        self.config: Any = None
        self.hydra_context: Any = None
        self.task_function: Any = None

    def setup(self, *, hydra_context: Any, task_function: Any, config: Any) -> None:
        """Keep what the jobs need (Hydra calls this before :meth:`launch`).

        The context's config loader, shared with the sweeper, derives a group's configs from
        its first (:func:`fedexp.sweep.stacked.derive_configs`).
        """
        from fedexp.sweep.stacked import derive_configs

        derive_configs(hydra_context)
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence:
        """The jobs, grouped and stacked (:func:`fedexp.sweep.stacked.launch`)."""
        from fedexp.sweep.stacked import launch

        return launch(self, job_overrides, initial_job_idx)
