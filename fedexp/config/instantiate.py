"""Instantiate ``_target_`` nodes after checking their keys and value types.

Hydra checks the run settings against :class:`fedexp.config.schema.RunConfig` at compose
time; group nodes are free-form ``_target_`` nodes, so they are checked here, against the
signature of their target, before anything is built or run. The error names the full key.

Only fedexp's own code can be configured: every ``_target_`` anywhere in a node (nested dicts
and lists included) must name a class or function *defined* in a ``fedexp.`` module
(:data:`ALLOWED_TARGET_PACKAGES`); anything else is refused before it is imported, and
``_args_`` (positional arguments, which bypass the signature check) is refused everywhere.
"""

from __future__ import annotations

import importlib
import inspect
import math
import os
import types
import typing
from typing import Any

import hydra.utils
from omegaconf import DictConfig
from omegaconf import ListConfig
from omegaconf import OmegaConf

from fedexp.config.ranges import range_of
from fedexp.errors import ConfigError
from fedexp.errors import FedexpError

_HYDRA_KEYS = {"_target_", "_partial_", "_recursive_", "_convert_", "_args_"}
_SCALARS = (bool, int, float, str)

#: The only packages whose classes and functions a config ``_target_`` may name. Every YAML
#: under conf/ points to fedexp's own classes, so no third-party package is needed here.
ALLOWED_TARGET_PACKAGES = ("fedexp",)


def _refuse(key: str, target: Any) -> ConfigError:
    allowed = ", ".join(f"{p}.*" for p in ALLOWED_TARGET_PACKAGES)
    return ConfigError(f"{key}={target!r}: only fedexp's own classes can be configured ({allowed})")


def check_target_name(target: Any, key: str) -> None:
    """Refuse a ``_target_`` outside :data:`ALLOWED_TARGET_PACKAGES`, by its text alone.

    Nothing is imported: the dotted path must start with an allowed package and every part
    must be a public identifier (no ``__dunder__`` or private attribute walks).
    """
    if not isinstance(target, str):
        raise _refuse(key, target)
    parts = target.split(".")
    if parts[0] not in ALLOWED_TARGET_PACKAGES or len(parts) < 2:
        raise _refuse(key, target)
    if not all(p.isidentifier() and not p.startswith("_") for p in parts):
        raise _refuse(key, target)


def check_targets(node: Any, path: str, *, locate: bool = False) -> Any:
    """Walk ``node`` (a config node, dict or list, any depth) and refuse every foreign target.

    Every ``_target_`` must pass :func:`check_target_name` (with ``locate``, also
    :func:`locate_target`, which imports it); ``_args_`` is refused anywhere. Values are
    resolved first, so an interpolation cannot hide a target.

    Returns:
        the resolved plain container; with ``locate``, every ``_target_`` in it replaced by the
        object it names, so that instantiation builds exactly what was checked.
    """
    if isinstance(node, DictConfig | ListConfig):
        try:
            node = OmegaConf.to_container(node, resolve=True)
        except Exception as exc:  # noqa: BLE001 - a broken interpolation is a config error
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ConfigError(f"{path or 'config'}: {first}") from None
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            full = f"{path}.{key}" if path else str(key)
            if key == "_target_":
                check_target_name(value, full)
                out[key] = locate_target(value, full) if locate else value
            elif key == "_args_":
                raise ConfigError(
                    f"{full}: positional arguments cannot be configured; "
                    "name each argument as a key"
                )
            else:
                out[key] = check_targets(value, full, locate=locate)
        return out
    if isinstance(node, list | tuple):
        return [check_targets(v, f"{path}[{i}]", locate=locate) for i, v in enumerate(node)]
    return node


def locate_target(target: str, key: str) -> Any:
    """Import and return the object ``target`` names, only if fedexp itself defines it.

    ``target`` must be ``<fedexp module>.<name>`` where the module defines ``name`` (its
    ``__module__`` is a fedexp module): a name a fedexp module merely imports (``os``,
    ``torch.load``, ``safetensors.torch.save_file``) is refused.
    """
    check_target_name(target, key)
    module_name, _, attr = target.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{key}: cannot import '{target}' ({exc})") from None
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"{key}: cannot import '{target}' (no {attr} in {module_name})") from None
    owner = getattr(obj, "__module__", None) or ""
    if not (inspect.isclass(obj) or inspect.isfunction(obj)) or owner.split(".")[0] not in (
        ALLOWED_TARGET_PACKAGES
    ):
        raise _refuse(key, target)
    return obj


def _accepts(annotation: Any, value: Any) -> bool:
    """Whether a plain config value fits a (simple) type annotation."""
    if annotation is inspect.Parameter.empty or annotation is Any:
        return True
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _accepts(annotation.__origin__, value)
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
    check_targets(node, path, locate=True)
    target = node.get("_target_")
    if target is None:
        raise ConfigError(f"config node '{path}' has no _target_ (expected a class path)")
    obj = locate_target(target, f"{path}._target_")
    fn = obj.__init__ if inspect.isclass(obj) else obj
    sig = inspect.signature(obj)  # a class's signature is its constructor's, without self
    try:
        hints = typing.get_type_hints(fn, include_extras=True)
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
                    f"{full}={value!r}: expected {_type_name(ann)}, got {type(value).__name__}"
                )
            _check_range(full, value, ann)


def _type_name(annotation: Any) -> str:
    """``float``, ``int | None``: the annotation as a user reads it (ranges left out)."""
    if typing.get_origin(annotation) is typing.Annotated:
        return _type_name(annotation.__origin__)
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    return "None" if annotation is type(None) else getattr(annotation, "__name__", str(annotation))


def _check_range(key: str, value: Any, annotation: Any) -> None:
    """Refuse a non-finite float and a number outside the range ``annotation`` declares.

    NaN is refused for every float setting, infinity unless its :class:`Range` allows it
    (``inf=True``), whether or not a range is declared.
    """
    if not isinstance(value, int | float) or isinstance(value, bool):
        return
    declared = range_of(annotation)
    if declared is None:
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}={value!r}: expected a finite number")
        return
    if not declared.contains(float(value)):
        raise ConfigError(f"{key}={value!r}: expected {declared.describe()}")


def instantiate_checked(node: DictConfig, path: str, **kwargs: Any) -> Any:
    """Check ``node`` against its target's signature, then instantiate it with ``kwargs``."""
    check_node(node, path, extra=set(kwargs))
    container = check_targets(node, path, locate=True)
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


#: The run folders :func:`fresh_dir` made in this process, each with the parent folders made
#: for it (innermost first): :func:`discard_fresh_dir` removes them again.
_MADE: dict[str, list[str]] = {}

#: What Hydra writes to a run's folder before fedexp's code runs: its config, the log file.
_HYDRA_FILES = frozenset({".hydra", "cli.log"})


def fresh_dir(base: str | os.PathLike) -> str:
    """Create and return a run folder of its own: ``base``, else ``base-1``, ``base-2``, ...

    The folder is created here with ``exist_ok=False``, so two runs (or two processes started
    in the same second) never get the same one, and an existing folder is never reused.
    """
    base = os.fspath(base)
    parent = os.path.dirname(base)
    made = []
    if parent:
        up = parent
        while up and not os.path.exists(up):  # what makedirs makes (outputs/<date>, ...)
            made.append(up)
            up = os.path.dirname(up)
        os.makedirs(parent, exist_ok=True)
    for n in range(100_000):
        path = base if n == 0 else f"{base}-{n}"
        try:
            os.mkdir(path)
        except FileExistsError:
            continue
        _MADE[os.path.abspath(path)] = [os.path.abspath(m) for m in made]
        return path
    raise ConfigError(f"no free run folder next to {base}")


def note_given_dir(path: str | os.PathLike) -> None:
    """Count ``hydra.run.dir=<path>`` as made by this command when it does not exist yet.

    Hydra makes it; a run refused before it started then removes it as it removes a fresh
    folder (:func:`discard_fresh_dir`; issue 70, item 11: a refused run given
    ``hydra.run.dir`` left that folder with ``.hydra/`` and ``cli.log``). An existing folder
    is the user's and is left alone.
    """
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path):
        return
    made, up = [], os.path.dirname(path)
    while up and not os.path.exists(up):  # the parents Hydra's makedirs will make
        made.append(up)
        up = os.path.dirname(up)
    _MADE[path] = made


def discard_fresh_dir(path: str | os.PathLike) -> bool:
    """Remove a run folder that :func:`fresh_dir` made in this process and nothing used.

    A run refused before it started (a setting the data cannot meet) leaves no empty
    ``outputs/<date>/<time>/`` behind: the folder goes when it holds nothing but Hydra's own
    files (``.hydra/``, an empty ``cli.log``), and so do the parent folders made for it once
    they are empty. A folder fresh_dir did not make (``hydra.run.dir=...``, a sweep job's
    folder) or one a run wrote to is left alone.

    Returns:
        Whether the folder was removed.
    """
    import shutil

    path = os.path.abspath(path)
    if path not in _MADE:
        return False
    try:
        names = set(os.listdir(path))
        log = os.path.join(path, "cli.log")
        if not names <= _HYDRA_FILES or (os.path.exists(log) and os.path.getsize(log) > 0):
            return False
        shutil.rmtree(path)
    except OSError:
        return False
    for parent in _MADE.pop(path):
        try:
            os.rmdir(parent)  # only when empty: another run may have put its folder there
        except OSError:
            break
    return True


def resumed_run_dir(resume: str | os.PathLike | None) -> str | None:
    """The run folder a checkpoint belongs to, or None.

    ``resume=<run>/checkpoints`` (or a file in it, ``good.safetensors``) belongs to
    ``<run>``: a resumed run writes its results there, beside its checkpoints, so that one
    folder holds the run's rounds 0..R (``rounds.csv``, ``clients_rounds.csv``, the plots,
    ``clients.csv``, ``config.yaml``), whatever the number of resumes. None for no resume,
    for a folder that does not exist, or for one not named ``checkpoints`` (a copied
    checkpoint): that run writes into a fresh folder, as a new run does.
    """
    if not resume:
        return None
    path = os.fspath(resume)
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    if os.path.basename(os.path.normpath(folder)) != "checkpoints" or not os.path.isdir(folder):
        return None
    return os.path.dirname(os.path.normpath(folder)) or "."


def discard_resume_record(output_dir: str | os.PathLike, subdir: str) -> bool:
    """Remove Hydra's record (``.hydra/resume-<stamp>``) of a resume that was refused.

    A resume refused before it ran (a changed setting, a bad checkpoint) leaves its run's
    folder as it was. Returns whether a record was removed.
    """
    import shutil

    if not str(subdir).startswith(".hydra/resume-"):
        return False
    record = os.path.join(os.fspath(output_dir), subdir)
    if not os.path.isdir(record):
        return False
    shutil.rmtree(record, ignore_errors=True)
    return True


def run_dir(resume: str | None, base: str) -> str:
    """``hydra.run.dir``: a resumed run's own folder, else a fresh one.

    :func:`resumed_run_dir` of ``resume``, else :func:`fresh_dir` of ``base``.
    """
    return resumed_run_dir(resume) or fresh_dir(base)


def hydra_subdir(resume: str | None, stamp: str) -> str:
    """``hydra.output_subdir``: ``.hydra``, or ``.hydra/resume-<stamp>`` for a resumed run.

    A run resumed in its own folder (:func:`resumed_run_dir`) leaves Hydra's record of the
    first command in ``.hydra`` and puts each resume's beside it, in a folder it claims
    (``resume-<stamp>-1``, ... for resumes started in the same second).
    """
    run = resumed_run_dir(resume)
    if run is None:
        return ".hydra"
    os.makedirs(os.path.join(run, ".hydra"), exist_ok=True)
    for n in range(100_000):
        name = f"resume-{stamp}" if n == 0 else f"resume-{stamp}-{n}"
        try:
            os.mkdir(os.path.join(run, ".hydra", name))
        except FileExistsError:
            continue
        return f".hydra/{name}"
    raise ConfigError(f"no free record folder in {run}/.hydra")


def register_resolvers() -> None:
    """The resolvers of conf/config.yaml's ``hydra`` node.

    ``${fedexp.fresh_dir:<base>}`` (``hydra.sweep.dir``), ``${fedexp.run_dir:<resume>,<base>}``
    (``hydra.run.dir``) and ``${fedexp.hydra_subdir:<resume>,<stamp>}``
    (``hydra.output_subdir``). Cached like Hydra's ``${now:...}`` (Hydra copies the cache
    into every sweep job's config), so one run or one sweep claims exactly one folder.
    """
    for name, fn in (
        ("fedexp.fresh_dir", fresh_dir),
        ("fedexp.run_dir", run_dir),
        ("fedexp.hydra_subdir", hydra_subdir),
    ):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn, use_cache=True)
