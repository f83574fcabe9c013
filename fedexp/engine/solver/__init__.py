"""The local solver: what algorithms are handed and how a cohort's local steps run.

``context.py`` (the run's facts for the algorithm hooks), ``steps.py`` (every client of a cohort
trained as one computation), ``objective.py`` and ``losses.py`` (what a step minimises),
``optim.py`` (the optimisers over stacked states), ``passes_cpu.py`` (shuffled passes' draws).
"""
