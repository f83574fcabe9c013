"""Processes: one run over several, and what they exchange in a round.

``ranks.py`` (torch.distributed collectives), ``exchange.py`` (the round's exchange: one
process or ranks), ``launch.py`` (``distributed.nproc=P`` started by fedexp),
``shared_data.py`` (a data set loaded once a machine).
"""
