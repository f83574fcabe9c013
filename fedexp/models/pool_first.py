"""Max-pooling before ReLU: an exact rewrite of a model's graph (torch.fx).

ReLU is monotone, so it commutes with taking a maximum: ``maxpool(relu(x)) = relu(maxpool(x))``
entry for entry, and the gradients agree too. Where a window's maximum is positive both send
the gradient to the same (first) maximal entry; where it is not, both give the window a zero
gradient (ReLU's derivative at and below zero is 0 in PyTorch, whichever entry the pooling
picks). Pooling first runs the ReLU and its backward on a quarter of the entries (2x2 windows):
the 2-conv CNN of the peers' benchmark (conv, ReLU, pool twice) took about 3.5 ms less a round
of 10 clients on the CPU, 5 %, to the same bits (docs/bench_peers.md: 1.45-1.52x pfl-research
in three runs, 1.40x before).

:func:`pool_first` traces a module with ``torch.fx`` and moves every ReLU whose only use is a
max-pooling after it: ``F.relu`` / ``torch.relu`` / ``Tensor.relu`` / ``nn.ReLU``, not in
place, followed by ``F.max_pool{1,2,3}d`` or ``nn.MaxPool{1,2,3}d`` without ``return_indices``
(the indices would differ where a window has no positive entry). The module is left as it is
where nothing matches, where it does not trace, where its traces in training and evaluation
mode differ (a ``self.training`` read in Python), or where the traced module's parameters and
buffers are not the original's, in the original's order (the flat vector's layout).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import fx
from torch import nn

log = logging.getLogger(__name__)

_RELUS = (F.relu, torch.relu)
_POOLS = (F.max_pool1d, F.max_pool2d, F.max_pool3d)
_POOL_MODULES = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)
_POOL_NAMES = frozenset({"max_pool1d", "max_pool2d", "max_pool3d"})
#: the position of ``return_indices`` among ``F.max_poolNd``'s arguments
_INDICES_ARG = 6
#: a module's stacked forward pass (:attr:`fedexp.models.flat.FlatModel.stacks`), kept
_STACKED = ("stacks", "stacked_params", "stacked_forward")


def _relu_input(node: fx.Node, modules: dict[str, nn.Module]) -> fx.Node | None:
    """The input of ``node`` if it is a ReLU that is not in place, else None."""
    if node.op == "call_function" and node.target in _RELUS:
        inplace = node.kwargs.get("inplace", node.args[1] if len(node.args) > 1 else False)
        ok = not inplace and set(node.kwargs) <= {"inplace"}
    elif node.op == "call_method" and node.target == "relu":
        ok = len(node.args) == 1 and not node.kwargs
    elif node.op == "call_module":
        module = modules.get(str(node.target))
        ok = type(module) is nn.ReLU and not module.inplace
    else:
        return None
    source = node.args[0] if node.args else None
    return source if ok and isinstance(source, fx.Node) else None


def _max_pool(node: fx.Node, modules: dict[str, nn.Module]) -> bool:
    """Whether ``node`` is a max-pooling that returns its values alone."""
    if node.op == "call_function" and node.target in _POOLS:
        indices = node.kwargs.get(
            "return_indices",
            node.args[_INDICES_ARG] if len(node.args) > _INDICES_ARG else False,
        )
        return indices is False
    if node.op == "call_module":
        module = modules.get(str(node.target))
        return type(module) in _POOL_MODULES and not module.return_indices
    return False


def _may_pool(module: nn.Module) -> bool:
    """Whether ``module`` holds a max-pooling layer or code that calls ``max_poolNd``.

    A look at each submodule's type and its ``forward``'s names, before a trace (the MONAI
    DenseNet's takes about 0.1 s).
    """
    for sub in module.modules():
        if isinstance(sub, _POOL_MODULES):
            return True
        code = getattr(type(sub).forward, "__code__", None)
        if code is not None and _POOL_NAMES & set(code.co_names):
            return True
    return False


def _trace(module: nn.Module, training: bool) -> fx.GraphModule:
    was = module.training
    try:
        module.train(training)
        return fx.symbolic_trace(module)
    finally:
        module.train(was)


def pool_first(module: nn.Module) -> nn.Module:
    """``module`` with each ReLU whose only use is a max-pooling moved after the pooling.

    Returns:
        A ``torch.fx.GraphModule`` computing the same values and gradients with the swaps made,
        sharing ``module``'s submodules, parameters and buffers (and its stacked forward
        pass, :data:`_STACKED`, where it has one); ``module`` itself where nothing is swapped
        (see the module's docstring).
    """
    if not _may_pool(module):  # as it is
        return module
    try:
        traced = _trace(module, True)
        if traced.code != _trace(module, False).code:  # Python reads the mode: not a graph
            return module
    except Exception:  # noqa: BLE001 - anything fx cannot trace is left as written
        return module
    graph, modules = traced.graph, dict(traced.named_modules())
    swaps = 0
    for node in list(graph.nodes):
        source = _relu_input(node, modules)
        if source is None or len(node.users) != 1:
            continue
        pool = next(iter(node.users))
        if not _max_pool(pool, modules) or pool.args[0] is not node:
            continue
        pool.replace_input_with(node, source)  # the pooling reads the ReLU's input
        with graph.inserting_after(pool):
            relu = graph.call_function(F.relu, (pool,))
        pool.replace_all_uses_with(relu, delete_user_cb=lambda user, new=relu: user is not new)
        graph.erase_node(node)
        swaps += 1
    if not swaps:
        return module
    graph.lint()
    rewritten = fx.GraphModule(traced, graph, class_name=type(module).__name__)
    same = [n for n, _ in rewritten.named_parameters()] == [
        n for n, _ in module.named_parameters()
    ] and [n for n, _ in rewritten.named_buffers()] == [n for n, _ in module.named_buffers()]
    if not same:  # the flat vector's layout would change
        return module
    rewritten.train(module.training)
    for name in _STACKED:  # a cohort's own forward pass (VGG8's), kept
        if hasattr(module, name):
            setattr(rewritten, name, getattr(module, name))
    log.debug("pool_first: %d ReLU(s) moved after their max-pooling", swaps)
    return rewritten
