"""Instantiate ``_target_`` nodes after checking their keys and value types.

Hydra checks the run settings against :class:`fedexp.config.schema.RunConfig` at compose
time; group nodes are free-form ``_target_`` nodes, so they are checked here, against the
signature of their target, before anything is built or run. The error names the full key.
"""

from __future__ import annotations

import inspect
import types
import typing
from typing import Any

import hydra.utils
from omegaconf import DictConfig, ListConfig, OmegaConf

from fedexp.errors import ConfigError, FedexpError

_HYDRA_KEYS = {"_target_", "_partial_", "_recursive_", "_convert_", "_args_"}
_SCALARS = (bool, int, float, str)


def _accepts(annotation: Any, value: Any) -> bool:
    """Whether a plain config value fits a (simple) type annotation."""
    if annotation is inspect.Parameter.empty or annotation is Any:
        return True
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(a, value) for a in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation in (bool, str):
        return isinstance(value, annotation)
    if origin in (list, tuple, typing.Sequence) or annotation in (list, tuple):
        return isinstance(value, list | tuple | ListConfig)
    return True  # complex annotations are left to the target


def check_node(node: DictConfig | dict, path: str, extra: set[str] | None = None) -> None:
    """Raise :class:`ConfigError` if ``node``'s keys or scalar values do not fit its target.

    Args:
        node: a ``_target_`` config node.
        path: its full key in the run config, for the message (e.g. ``"algorithm"``).
        extra: argument names the caller passes at instantiation (not expected in the node).
    """
    target = node.get("_target_")
    if target is None:
        raise ConfigError(f"config node '{path}' has no _target_ (expected a class path)")
    try:
        obj = hydra.utils.get_object(target)
    except Exception as exc:  # noqa: BLE001 - any import failure is a config error
        raise ConfigError(f"{path}._target_: cannot import '{target}' ({exc})") from None
    fn = obj.__init__ if inspect.isclass(obj) else obj
    sig = inspect.signature(obj)  # a class's signature is its constructor's, without self
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - unresolvable annotations: check names only
        hints = {}
    params = {n: p for n, p in sig.parameters.items() if n != "self"}
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    for key in node:
        if key in _HYDRA_KEYS:
            continue
        value = node[key]
        full = f"{path}.{key}"
        if key in (extra or set()):
            raise ConfigError(f"{full}: this key is set by fedexp, remove it from the config")
        if key not in params:
            if var_kw:
                continue
            allowed = ", ".join(sorted(k for k in params if k not in (extra or set())))
            raise ConfigError(f"unknown key '{full}' for {target} (expected one of: {allowed})")
        if isinstance(value, DictConfig) and "_target_" in value:
            check_node(value, full)
            continue
        if isinstance(value, ListConfig):
            for i, item in enumerate(value):
                if isinstance(item, DictConfig) and "_target_" in item:
                    check_node(item, f"{full}[{i}]")
            continue
        if isinstance(value, _SCALARS) or value is None:
            ann = hints.get(key, params[key].annotation)
            if not _accepts(ann, value):
                raise ConfigError(
                    f"{full}={value!r}: expected {getattr(ann, '__name__', ann)}, "
                    f"got {type(value).__name__}"
                )


def instantiate_checked(node: DictConfig, path: str, **kwargs: Any) -> Any:
    """Check ``node`` against its target's signature, then instantiate it with ``kwargs``."""
    check_node(node, path, extra=set(kwargs))
    container = OmegaConf.to_container(node, resolve=True)
    try:
        return hydra.utils.instantiate(container, **kwargs, _convert_="all")
    except FedexpError:
        raise
    except Exception as exc:
        cause = exc.__cause__ or exc
        if isinstance(cause, FedexpError):
            raise cause from None
        if isinstance(cause, ValueError | TypeError):
            raise ConfigError(f"{path}: {cause}") from None
        raise
