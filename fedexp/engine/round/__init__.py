"""The round: the engine's loop and its stages, the messages' transport, evaluation, the ledger.

``engine.py`` holds ``Engine.run_round`` (Algorithm 1 of every paper), ``stages.py`` what varies
between runs (who takes part, the uplink's chain), ``exchange.py`` what the run's processes
exchange in a round, ``transport.py`` the channels, ``evaluation.py`` the batched scoring of
clients, ``ledger.py`` the bytes each way.
"""
