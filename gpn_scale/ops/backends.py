"""One registry for the ops that have several implementations, and one rule that picks among
them: the GPN step (`ops/gpn_step/registry.py`), the gated delta rule
(`ops/gated_delta_rule.py`), the decode's softmax cross-entropy (`ops/cross_entropy.py`) and
the recompute's fused chains (`ops/gpn_step/fused.py`); the last two are a PyTorch form and
a Triton one (`torch_or_triton`).

Each op declares its backends once. A backend carries its name (and aliases), the device
types `auto` may pick it for, a priority, a probe that says why it cannot run in this process
(None when it can, else the reason with its fix), whether it serves a tensor-parallel rank's
shard, and `build`, which returns the implementation the op calls. `OpRegistry.select` is the
one rule, for (asked, device, tp) alike in every op:

- the op's environment variable, when set, overrides the config's choice (benchmarks,
  bisecting a numerical difference, a cluster without a kernel's toolchain);
- `auto` takes the highest-priority backend that runs on the device (and splits under tp
  when tp > 1); when its probe fails, one warning names why and the best available one
  serves instead;
- a backend asked for by name runs or refuses in one line that names where the choice came
  from (the config key or the variable), why, and the choices that would serve.

`available(device_type)` lists what `auto` could choose from there: the backend tests run over
the registries, so a new backend is tested wherever it can run the moment it is registered.
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

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


@functools.cache
def warn_once(message: str) -> None:
    """One RuntimeWarning per distinct message (a fallback is worth saying once a process)."""
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _always_available() -> str | None:
    return None


def _no_other_devices(device_type: str) -> bool:
    return False


@dataclass(frozen=True)
class Request:
    """What an op asks of a backend: tensors on `device_type`, a tp group of `tp_size`."""

    device_type: str
    tp_size: int = 1


@dataclass(frozen=True)
class OpBackend:
    name: str
    devices: tuple[str, ...]  # device types `auto` may pick it for ("any": every device)
    priority: int = 0  # `auto` takes the available backend with the highest
    unavailable: Callable[[], str | None] = field(default=_always_available, compare=False)
    aliases: tuple[str, ...] = ()
    description: str = ""
    # The implementation the op calls (None: the backend itself, for ops that only branch).
    build: Callable[[Request], Any] | None = field(default=None, compare=False)
    # Serves one rank's shard under tensor parallelism (splits at the group's collectives).
    splits_tp: bool = True
    tp_refusal: str = ""  # why it does not, for the error
    # Further device types it serves when asked for by name (Triton's interpreter in tests).
    also_serves: Callable[[str], bool] = field(default=_no_other_devices, compare=False)
    wrong_device_hint: str = ""  # the fix, besides another backend, for tensors it cannot serve

    def runs_on(self, device_type: str) -> bool:
        return ANY_DEVICE in self.devices or device_type in self.devices

    def serves(self, request: Request) -> bool:
        device_ok = self.runs_on(request.device_type) or self.also_serves(request.device_type)
        return device_ok and (request.tp_size == 1 or self.splits_tp)

    def implementation(self, request: Request) -> Any:
        return self if self.build is None else self.build(request)


class OpRegistry:
    """The backends of one op, by name, and the rule that picks one; see the module docstring."""

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
    def backends(self) -> tuple[OpBackend, ...]:
        """Every registered backend, in registration order (the op tests run over these)."""
        return tuple(self._backends.values())

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

    def _asked(self, config_choice: str) -> tuple[str, str]:
        """(the backend asked for, where the choice came from, spelled `key='value'`)."""
        env = os.environ.get(self.env_var, "").strip()
        if env:
            return self.normalise(env, self.env_var), f"{self.env_var}={env!r}"
        return self.normalise(
            config_choice, self.config_key
        ), f"{self.config_key}={config_choice!r}"

    def requested(self, config_choice: str = "auto") -> str:
        """The backend asked for: the environment override if set, else the config's choice."""
        return self._asked(config_choice)[0]

    def available(self, device_type: str) -> tuple[OpBackend, ...]:
        """The backends `auto` could pick for tensors on `device_type`, best first."""
        found = [
            b for b in self._backends.values() if b.runs_on(device_type) and b.unavailable() is None
        ]
        return tuple(sorted(found, key=lambda b: -b.priority))

    def preferred(self, device_type: str, tp_size: int = 1) -> OpBackend:
        """The highest-priority backend for `device_type`, whether or not it can run here."""
        found = self._candidates(Request(device_type, tp_size))
        if not found:
            raise self.error(f"{self.op}: no backend runs on {device_type} tensors")
        return found[0]

    def auto(self, device_type: str) -> OpBackend:
        """What `auto` picks on `device_type` (the highest-priority available backend)."""
        found = self.available(device_type)
        if not found:
            raise self.error(f"{self.op}: no backend runs on {device_type} tensors here")
        return found[0]

    def _candidates(self, request: Request) -> list[OpBackend]:
        found = [
            b
            for b in self._backends.values()
            if b.runs_on(request.device_type) and (request.tp_size == 1 or b.splits_tp)
        ]
        return sorted(found, key=lambda b: -b.priority)

    def select(self, config_choice: str, device_type: str, tp_size: int = 1) -> Any:
        """The implementation that serves tensors on `device_type` in a tp group of `tp_size`
        (the rule in the module docstring)."""
        request = Request(device_type, tp_size)
        choice, where = self._asked(config_choice)
        if choice == "auto":
            return self._pick_auto(request).implementation(request)
        backend = self._backends[choice]
        refusal = self._refusal(backend, request)
        if refusal is not None:
            raise self.error(f"{where}: {self.op} backend {backend.name!r} {refusal}")
        return backend.implementation(request)

    def _pick_auto(self, request: Request) -> OpBackend:
        found = self._candidates(request)
        if not found:
            raise self.error(f"{self.op}: no backend runs on {request.device_type} tensors")
        why = found[0].unavailable()
        if why is None:
            return found[0]
        fallback = next((b for b in found[1:] if b.unavailable() is None), None)
        if fallback is None:
            raise self.error(f"{self.op}: no backend can run here ({why})")
        warn_once(f"{why} (using {fallback.description or fallback.name}: same results, slower)")
        return fallback

    def _refusal(self, backend: OpBackend, request: Request) -> str | None:
        """Why `backend`, asked for by name, cannot serve `request` (with the fix), or None."""
        others = [
            b.name for b in self._backends.values() if b.serves(request) and b.unavailable() is None
        ]
        instead = (
            "use " + ", ".join(["auto", *others[:-1]]) + (f" or {others[-1]}" if others else "")
        )
        device = request.device_type
        if not (backend.runs_on(device) or backend.also_serves(device)):
            served = "/".join(d.upper() for d in backend.devices)
            hint = f"{backend.wrong_device_hint}, or " if backend.wrong_device_hint else ""
            return f"serves {served} tensors, not {device}; {hint}{instead}"
        if request.tp_size > 1 and not backend.splits_tp:
            return (
                f"does not run under tensor parallelism (tp={request.tp_size}): "
                f"{backend.tp_refusal or 'it does not split at the group collectives'}; {instead}"
            )
        why = backend.unavailable()
        if why is not None:
            return f"cannot run here ({why})"
        return None


def torch_or_triton(
    op: str,
    env_var: str,
    error: type[Exception],
    torch_form: Any,
    triton_form: Any,
    triton_description: str,
) -> OpRegistry:
    """The registry of an op with two forms: PyTorch ops (the reference, any device) and
    Triton kernels (CUDA, where Triton imports). The op's `select` is
    `select_torch_or_triton`."""

    def triton_missing() -> str | None:
        why = import_error("triton")
        return None if why is None else f"the {op} kernels need Triton ({why})"

    registry = OpRegistry(op, env_var, env_var, error)
    registry.register(
        OpBackend(
            "torch",
            (ANY_DEVICE,),
            0,
            description="PyTorch ops: the reference",
            build=lambda request: torch_form,
        )
    )
    registry.register(
        OpBackend(
            "triton",
            ("cuda",),
            10,
            triton_missing,
            description=triton_description,
            build=lambda request: triton_form,
        )
    )
    return registry


def select_torch_or_triton(registry: OpRegistry, like: Any, reference: Any) -> Any:
    """The form for operands like `like` (a tensor): the kernels on CUDA, `reference` (the
    PyTorch form) on CPU and in float64 (the kernels compute in float32). Under
    `execution(triton_anywhere=True)` (the interpreter in tests) and in the dry launch
    accounting on meta tensors they are served as CUDA's would be. The registry's variable
    set to torch keeps the PyTorch form everywhere (bisecting)."""
    import torch

    from gpn_scale.ops.execution import current
    from gpn_scale.ops.launch import is_dry

    if like.dtype == torch.float64:
        return reference
    device = like.device.type
    if current().triton_anywhere or (device == "meta" and is_dry()):
        device = "cuda"
    return registry.select("auto", device)
