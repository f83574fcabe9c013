"""Hyper-parameter search (``hparams_search``, docs/tuning.md).

* :mod:`fedexp.tuning.objective`: what a Hydra sweeper maximises (the headline metric on the
  validation splits) and the callback that makes a failed trial a failed Hydra job;
* :mod:`fedexp.tuning.search_space`: the Optuna sweeper's search space checked before Hydra
  composes anything (imports neither Hydra's sweeper nor Optuna nor torch).

Nothing is imported here, so that the command line's check of a search space stays light.
"""
