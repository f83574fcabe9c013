"""Client storage: the clients' states, the channels' per-client memories, the training pool.

``states.py`` (state columns, in memory or memory-mapped), ``part_memory.py`` (error-feedback
residuals, replicas, references), ``pool.py`` (every client's training data in one tensor),
``hugepages.py`` (large CPU tensors on transparent huge pages).
"""
