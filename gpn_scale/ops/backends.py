"""One registry for the ops that have several implementations: the GPN step
(`ops/gpn_step/registry.py`), the gated delta rule (`ops/gated_delta_rule.py`) and the decode's
softmax cross-entropy (`ops/cross_entropy.py`).

Each op declares its backends once: a name (and aliases), the device types `auto` may pick it
for, a priority, and a probe that says why it cannot run in this process (None when it can).
One rule serves all three:

- the op's environment variable, when set, overrides the config's choice (benchmarks,
  bisecting a numerical difference, a cluster without a kernel's toolchain);
- `auto` prefers the highest-priority backend that runs on the device; when its probe fails
  the op falls back to the best available one with one warning (`preferred` / `auto`);
- a backend asked for by name is the op's to check (the fix for "cannot run here" differs per
  op, so the op words that error).

`available(device_type)` lists what `auto` could choose from there: the backend tests run over
it, so a new backend is tested wherever it can run the moment it is registered.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field

ANY_DEVICE = "any"


@functools.cache
def import_error(
    module: str, catch: tuple[type[BaseException], ...] = (ImportError,)
) -> str | None:
    """Why `module` does not import here (the probe of a backend that needs it), or None."""
    try:
        importlib.import_module(module)
    except catch as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _always_available() -> str | None:
    return None


@dataclass(frozen=True)
class OpBackend:
    name: str
    devices: tuple[str, ...]  # device types `auto` may pick it for ("any": every device)
    priority: int = 0  # `auto` takes the available backend with the highest
    unavailable: Callable[[], str | None] = field(default=_always_available, compare=False)
    aliases: tuple[str, ...] = ()
    description: str = ""

    def runs_on(self, device_type: str) -> bool:
        return ANY_DEVICE in self.devices or device_type in self.devices


class OpRegistry:
    """The backends of one op, by name; see the module docstring."""

    def __init__(
        self, op: str, env_var: str, config_key: str, error: type[Exception] = ValueError
    ) -> None:
        self.op, self.env_var, self.config_key, self.error = op, env_var, config_key, error
        self._backends: dict[str, OpBackend] = {}

    def register(self, backend: OpBackend) -> OpBackend:
        taken = {backend.name, *backend.aliases} & {"auto", *self._names_and_aliases()}
        if taken:
            raise ValueError(f"{self.op}: backend name {sorted(taken)[0]!r} is registered twice")
        self._backends[backend.name] = backend
        return backend

    def _names_and_aliases(self) -> set[str]:
        return {n for b in self._backends.values() for n in (b.name, *b.aliases)}

    @property
    def choices(self) -> tuple[str, ...]:
        return ("auto", *self._backends)

    @property
    def aliases(self) -> dict[str, str]:
        return {a: b.name for b in self._backends.values() for a in b.aliases}

    def get(self, name: str) -> OpBackend:
        return self._backends[name]

    def normalise(self, choice: str, where: str) -> str:
        """`choice` as a registered name ("auto" included): one error line naming `where`."""
        value = (choice or "auto").strip().lower()
        value = self.aliases.get(value, value)
        if value not in self.choices:
            hint = ", ".join(f"{a}={b}" for a, b in self.aliases.items())
            raise self.error(
                f"{where}={choice!r}: expected one of {', '.join(self.choices)}"
                + (f" (aliases: {hint})" if hint else "")
                + f" ({self.op} backend)"
            )
        return value

    def requested(self, config_choice: str = "auto") -> str:
        """The backend asked for: the environment override if set, else the config's choice."""
        env = os.environ.get(self.env_var, "").strip()
        if env:
            return self.normalise(env, self.env_var)
        return self.normalise(config_choice, self.config_key)

    def available(self, device_type: str) -> tuple[OpBackend, ...]:
        """The backends `auto` could pick for tensors on `device_type`, best first."""
        found = [
            b for b in self._backends.values() if b.runs_on(device_type) and b.unavailable() is None
        ]
        return tuple(sorted(found, key=lambda b: -b.priority))

    def preferred(self, device_type: str) -> OpBackend:
        """The highest-priority backend for `device_type`, whether or not it can run here."""
        found = [b for b in self._backends.values() if b.runs_on(device_type)]
        if not found:
            raise self.error(f"{self.op}: no backend runs on {device_type} tensors")
        return max(found, key=lambda b: b.priority)

    def auto(self, device_type: str) -> OpBackend:
        """What `auto` picks on `device_type` (the highest-priority available backend)."""
        found = self.available(device_type)
        if not found:
            raise self.error(f"{self.op}: no backend runs on {device_type} tensors here")
        return found[0]
