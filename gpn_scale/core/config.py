"""Helpers every package uses: the one-line configuration error and YAML config resolution.

A leaf module (no gpn_scale imports), so data, checkpoint and scaling can report bad input
without importing the model package.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A configuration value is wrong; the message is one line naming the field and the fix."""


def closest_key_hint(key: str, valid: list[str] | tuple[str, ...]) -> str:
    """' (did you mean 'x'?)' for the valid key closest to `key`, or '' when none is close."""
    match = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
    return f" (did you mean '{match[0]}'?)" if match else ""


def check_fields(cls: Any, values: Mapping[str, Any], unknown: str = "unknown key") -> None:
    """One ConfigError line for the first key of `values` that is not a field of the
    dataclass `cls` (naming the closest field) or the first required field it lacks."""
    valid = [f.name for f in dataclasses.fields(cls)]
    for key in values:
        if key not in valid:
            raise ConfigError(f"model.{key}: {unknown}{closest_key_hint(str(key), valid)}")
    for f in dataclasses.fields(cls):
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            if f.name not in values:
                raise ConfigError(f"model.{f.name}: required key is missing")


def check_float_fields(cfg: Any, prefix: str = "model.") -> None:
    """One ConfigError line for the first float field of the dataclass `cfg` (declared
    `float`) that is not a finite number >= 0: every float of a model config is a scale (an
    epsilon, an init std, a rope base), and nan / inf / a string such as 'nan' from a dotlist
    otherwise fail only once training has started."""
    import math

    for f in dataclasses.fields(cfg):
        declared = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
        if declared != "float":
            continue
        value = getattr(cfg, f.name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{prefix}{f.name}: expected a number, got {value!r}")
        if not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"{prefix}{f.name}: must be a finite number >= 0, got {value}")


def read_yaml(path: str | Path, *, resolve: bool = True, what: str = "YAML") -> Any:
    """A YAML file as plain containers (OmegaConf: `${...}` interpolation when `resolve`).

    A syntax error is one ConfigError line naming the file and the line (PyYAML's own error
    is a multi-line traceback); unreadable files and bad interpolations are one line too.
    Without OmegaConf (a bare CUDA image running the device check from a checkout) a file
    with no interpolation is read with PyYAML as OmegaConf would read it.
    """
    import yaml

    omegaconf_errors: tuple[type[Exception], ...] = ()
    try:
        from omegaconf import OmegaConf
        from omegaconf.errors import OmegaConfBaseException

        omegaconf_errors = (OmegaConfBaseException,)
    except ImportError:
        OmegaConf = None  # type: ignore[assignment,misc]  # noqa: N806
    try:
        if OmegaConf is None:
            return _read_yaml_without_omegaconf(Path(path), resolve, what)
        return OmegaConf.to_container(OmegaConf.load(path), resolve=resolve)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"{path}, line {mark.line + 1}, column {mark.column + 1}" if mark else str(path)
        problem = err.problem or err.context or type(err).__name__
        if err.problem and err.context and err.context_mark is not None:
            problem += f" ({err.context} at line {err.context_mark.line + 1})"
        raise ConfigError(
            f"{where}: YAML syntax error in the {what}: {problem}; fix the file"
        ) from None
    except ConfigError:
        raise
    except (yaml.YAMLError, OSError, ValueError, *omegaconf_errors) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"{path}: cannot read the {what}: {first}") from None


def _read_yaml_without_omegaconf(path: Path, resolve: bool, what: str) -> Any:
    """PyYAML with OmegaConf's one change to YAML 1.1 (floats such as 1e-5, which YAML 1.1
    reads as strings, are floats); `${...}` needs OmegaConf and is one line naming it."""
    import re

    import yaml

    text = path.read_text()
    if resolve and "${" in text:
        raise ConfigError(
            f"{path}: the {what} uses ${{...}} interpolation, which needs omegaconf; "
            "pip install omegaconf"
        )

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(
            r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
            |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
            |\.[0-9_]+(?:[eE][-+][0-9]+)?
            |[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*
            |[-+]?\.(?:inf|Inf|INF)
            |\.(?:nan|NaN|NAN))$""",
            re.X,
        ),
        list("-+0123456789."),
    )
    return yaml.load(text, Loader=Loader)  # noqa: S506 (a SafeLoader subclass)


def resolve_named_yaml(
    name_or_path: str | Path, directory: Path, what: str, error: type[ConfigError] = ConfigError
) -> Path:
    """A YAML path as given, or `directory/<name>.yaml`; `what` names it in the one-line
    error (with the closest shipped name when the name is unknown)."""
    path = Path(name_or_path)
    # A path if it looks like one; a bare name is a shipped config first (a directory that
    # happens to be called `demo` in the current directory must not shadow the shipped one).
    if path.suffix in (".yaml", ".yml") or "/" in str(name_or_path):
        if not path.is_file():
            raise error(f"{path}: {what} file not found")
        return path
    candidate = directory / f"{name_or_path}.yaml"
    if not candidate.is_file() and path.is_file():
        return path
    if not candidate.is_file():
        names = sorted(p.stem for p in directory.glob("*.yaml"))
        raise error(
            f"{what} '{name_or_path}' not found in {directory}"
            f"{closest_key_hint(str(name_or_path), names)}"
        )
    return candidate
