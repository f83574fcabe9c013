"""The ``system`` config group: devices, links and availability on a simulated clock (issue 67).

:mod:`fedexp.system.settings` holds the group's node (``system=none|uniform|lognormal|trace``)
and builds each client's profile, :mod:`fedexp.system.trace` reads the trace files (CSV forms
of FedScale's device-capacity and availability traces), :mod:`fedexp.system.clock` is the
round's stage that turns the ledger's bytes and the clients' steps into simulated seconds,
drops the clients a deadline or over-selection leaves out, and samples available clients
only; :mod:`fedexp.system.buffer` holds FedBuff's clients in flight (``system.buffer``). The
reasoning: docs/design.md, "Time on a simulated clock".
"""
