"""``fedexp run``'s command line, checked before Hydra composes anything.

Each check returns its errors as lines (``algorithm=fedavgg: no such option; did you mean
fedavg? ...``); :func:`fedexp.cli.main` prints them as one line and exits :data:`USAGE`, before
Hydra makes a folder or anything runs. Hydra itself is imported only to read a value that
could be a sweep (:func:`sweep_without_multirun`).
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

from fedexp.errors import ConfigError

#: Exit status of a command refused for a bad setting (nothing ran); a run that fails exits 1.
USAGE = 2

#: The configs ``fedexp run`` composes (the checkout's ``conf/``).
CONFIG_DIR = str(Path(__file__).resolve().parents[2] / "conf")

#: Parts of a ``hydra.*`` key, and words in its value, that make Hydra import and call code
#: before fedexp sees the config (callbacks, launcher/sweeper targets, logging classes).
_HYDRA_CODE_WORDS = ("_target_", "_args_", "callbacks", "class", "()")
_HYDRA_CODE_VALUE = re.compile(r"_target_|_args_|callbacks|(\bclass|\(\))\s*:")


def hydra_code_override(args: list[str]) -> str | None:
    """The key of the first command-line override that makes Hydra run code, or None."""
    for arg in args:
        if "=" not in arg or arg.startswith("-"):
            continue
        key, value = arg.split("=", 1)
        key = key.lstrip("+~")
        if key == "hydra" or key.startswith("hydra."):
            if any(w in key.split(".") for w in _HYDRA_CODE_WORDS) or _HYDRA_CODE_VALUE.search(
                value
            ):
                return key
    return None


#: A sweep value Hydra expands itself (``choice(a,b)``, ``glob(*)``, ``range(3)``, ...).
_SWEEP_FUNCTION = re.compile(r"^\s*\w+\(")


def group_option_errors(args: list[str]) -> list[str]:
    """``algorithm=nope``: one line naming the options, before Hydra's multi-line message.

    The closest options come first, as for a mistyped key (``algorithm=fedavgg: no such
    option; did you mean fedavg? (expected one of: ...)``).

    Looks at ``group=option`` (and ``group=a,b`` sweeps) where ``group`` is a folder of
    fedexp's ``conf/``; Hydra's own groups (``hydra/launcher=joblib`` comes from a plugin),
    package overrides (``@``), nested keys and Hydra's sweep functions are left to Hydra.
    """
    errors = []
    for arg in args:
        key, sep, value = arg.lstrip("+~").partition("=")
        folder = Path(CONFIG_DIR) / key
        if not sep or "." in key or "@" in key or key.startswith("hydra") or not folder.is_dir():
            continue
        if _SWEEP_FUNCTION.match(value) or arg.startswith("~"):
            continue
        options = sorted(p.stem for p in folder.glob("*.yaml"))
        for option in value.split(","):  # (Hydra fails on GROUP=null with a traceback)
            if option.strip() not in options:
                close = difflib.get_close_matches(option.strip(), options, 3)
                hint = f"; did you mean {', '.join(close)}?" if close else ""
                errors.append(
                    f"{key}={option}: no such option{hint} (expected one of: {', '.join(options)})"
                )
    return errors


#: Hydra's own command-line flags (``fedexp run --cfg job``...), those that take a value after.
_HYDRA_FLAGS = frozenset(
    {"-m", "--multirun", "--resolve", "--hydra-help", "--run", "-r", "--version", "--info", "-i"}
)
_HYDRA_VALUE_FLAGS = frozenset(
    {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
     "--config-dir", "-cd", "--experimental-rerun", "--shell-completion", "-sc"}
)  # fmt: skip


_INFO_VALUES = frozenset({"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"})


def override_shape_errors(args: list[str]) -> list[str]:
    """``rounds 10`` or ``--rounds=10``: one line saying to write ``rounds=10``.

    Hydra takes its overrides as ``key=value`` (``+key=value``, ``~key``); anything else that
    is not one of Hydra's own flags would meet Hydra's parser error or its usage text.
    """
    errors: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg in _HYDRA_VALUE_FLAGS:
            i += 1  # its value
            continue
        if arg in ("--info", "-i") and i < len(args) and args[i] in _INFO_VALUES:
            i += 1  # its optional value
            continue
        if arg in _HYDRA_FLAGS or arg.startswith("~") or ("=" in arg and arg[0] != "-"):
            continue
        if arg.startswith("-") and arg.split("=")[0] in _HYDRA_VALUE_FLAGS | _HYDRA_FLAGS:
            continue  # --cfg=job, --info=plugins
        key, sep, value = arg.lstrip("-").partition("=")
        if not sep and i < len(args) and "=" not in args[i] and not args[i].startswith("-"):
            value, sep = args[i], "="
            i += 1
        shown = f"{arg} {value}" if sep and "=" not in arg else arg
        example = f"{key}={value}" if sep and value else f"{key}=<value>"
        errors.append(f"{shown!r}: overrides are written key=value, e.g. {example}")
    return errors


def sweep_without_multirun(args: list[str]) -> list[str]:
    """``seed=0,1`` without ``-m``: one line saying to add it (Hydra's own error is five lines).

    Hydra sweeps an override of several values (``a,b``, ``range(...)``, ``choice(...)``) only
    in multirun mode. Read by Hydra's own parser, only where a value could be one (a comma or
    a parenthesis in it); a quoted value is one string, not a sweep.
    """
    if any(a in ("-m", "--multirun") for a in args):
        return []
    maybe = [
        a for a in args if "=" in a and a[0] != "-" and any(c in a.partition("=")[2] for c in ",(")
    ]
    if not maybe:
        return []
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    errors = []
    for arg in maybe:
        try:
            (override,) = parser.parse_overrides([arg])
        except OverrideParseException:
            continue  # (Hydra's own message follows, one line)
        if override.is_sweep_override():
            key = override.get_key_element()
            errors.append(
                f"{arg}: several values are a sweep, run with -m (fedexp run -m {arg}); "
                f"a list is written {key}=[...]"
            )
    return errors


def checked_paths(args: list[str]) -> tuple[list[str], list[str]]:
    """The paths a run reads, checked before Hydra makes its folder (nothing is created).

    ``dataset.path`` (:func:`fedexp.config.keys.dataset_path_errors`) and ``resume``
    (:func:`fedexp.engine.files.resume.resume_target`, which also takes a run's folder for
    its ``checkpoints/``: the override is rewritten so). A sweep of resumes (several values,
    a sweep function) and an interpolation are left to the run.

    Returns:
        (the command line, with ``resume=<run>`` as ``resume=<run>/checkpoints``; the errors).
    """
    from fedexp.config.keys import dataset_path_errors

    errors = dataset_path_errors(args, CONFIG_DIR)
    out = []
    for arg in args:
        key, sep, value = arg.partition("=")
        if key == "resume" and sep and value and value != "null":
            if not (_SWEEP_FUNCTION.match(value) or any(c in value for c in ",$[")):
                from fedexp.engine.files.resume import resume_target

                try:
                    arg = f"resume={resume_target(value)}"
                except ConfigError as exc:
                    errors.append(str(exc))
        out.append(arg)
    return out, errors
