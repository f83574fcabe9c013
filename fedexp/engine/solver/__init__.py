"""The local solver: what algorithms are handed and how a cohort's local steps run.

``context.py`` (the run's facts for the algorithm hooks), ``steps.py`` (every client of a cohort
trained as one computation), ``objective.py`` and ``losses.py`` (what a step minimises),
``optim.py`` (the optimisers over stacked states), ``draws.py`` (a cohort's minibatches and
noise), ``passes.py`` (shuffled passes: a client's stream as a loader's epochs, ``Stream``),
``passes_cpu.py`` (their compiled kernel).
"""
