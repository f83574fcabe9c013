"""Processes: one run over several.

``share.py`` (a process's place among the processes: rank r of P, its clients), ``ranks.py``
(torch.distributed collectives), ``launch.py`` (``distributed.nproc=P`` started by
fedexp), ``shared_data.py`` (a data set loaded once a machine). What the processes exchange in a
round is the round's: ``fedexp.engine.round.exchange``.
"""
