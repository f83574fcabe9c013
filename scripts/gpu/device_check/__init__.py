"""The device check's parts (issue 40); ``scripts/gpu/check.py`` is its command.

``sizes`` (the steps, their budgets and sizes), ``paths``, ``step`` (what a step's child
process gets), one module a step or family of steps (``environment``, ``cuda_tests``,
``golden_cases``, ``syncs``, ``workloads`` and ``bench``, ``kernel_profile``, ``conv_gemm``,
``sweep``), ``child`` (the steps' process), ``orchestrator`` and ``summary``.
"""
