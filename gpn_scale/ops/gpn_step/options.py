"""How the GPN engine runs a sequence, apart from what it computes: the engine options.

None of these but one changes the function the model computes (the op-level and engine
tests hold every chunk length, loss chunk and backend to the step-by-step reference). The
one, `bf16_memory_reads`, is off by default and rounds what the steps read, not the carried
state (its own tests hold it to a step-by-step reference with that rounding). So none is
part of a model's shape: a checkpoint resumes under other options. They reach the engine in
one place, the `StepPlan` (`interface.py`), and are set

- per model size in the model YAML (`chunk_size: 64`; the size's tuned defaults),
- per run in the train config's `engine:` section (`engine.chunk_size=128`), which wins,
- per process by the environment (`GPN_SCALE_STEP_KERNELS`, `registry.py`), for bisecting.

Torch-free: loading a config imports no torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpn_scale.core.config import ConfigError, closest_key_hint

STEP_BACKENDS = ("auto", "reference", "cpu", "cuda")
# The step's GEMMs by the weight they stream (the device check's ceilings time cuBLAS at the
# same shapes under these names, bench/gpu_ceilings.py): what `cublas_gemms` names.
PROJECTIONS = ("input", "input_dx", "down", "down_dx", "fuse_gate", "fuse_gate_dx")


@dataclass(frozen=True)
class EngineOptions:
    """The GPN engine's execution options, validated (an error is one line naming the option)."""

    # Steps per chunk: the memory's chunkwise form and the unit of BPTT recompute.
    chunk_size: int = 32
    # Decode + cross entropy run over this many positions at a time (never B x T x V at once).
    loss_chunk_tokens: int = 1024
    # Which backend runs the time steps (ops/gpn_step/registry.py): auto picks by device
    # (fused C++ kernels on CPU, Triton kernels on CUDA); reference = the PyTorch steps.
    step_backend: str = "auto"
    # CUDA backend: capture each chunk's steps and reverse sweep as CUDA graphs.
    cuda_graphs: bool = True
    # CUDA: the backward's chunk-wide work (the next chunk's recompute, the last one's weight
    # gradients) on a second stream beside the reverse sweep (overlap.py). Bit-identical;
    # holds one more chunk's activations.
    overlap_backward: bool = True
    # CUDA: the decode + cross-entropy of each chunk's predicted states on a second stream
    # beside the next chunk's forward steps (models/gpn/loss.py's ChunkFeed). Bit-identical;
    # off under tensor parallelism (its collectives stay on one stream).
    overlap_decode: bool = True
    # CUDA, Hopper and later: the time steps' kernels as programmatic dependent launches,
    # each starting while the one before finishes and waiting for it before its first read
    # (triton_kernels.py). Bit-identical.
    dependent_launch: bool = True
    # CUDA: the share of the SMs the memory kernels leave to the side streams' work (the
    # backward's beside overlap_backward, the forward's beside overlap_decode): their programs
    # there leave at once; the rest take the items from a counter (triton_kernels.
    # memory_backward_kernel). 0: none. Bit-identical.
    side_work_sm_share: float = 0.25
    # Changes results, so off by default: the time steps and the backward's recompute read
    # each chunk's start memory M0 from a bf16 copy (made once a chunk), while the memory
    # carried from chunk to chunk stays float32 and M0's gradient passes the rounding
    # unchanged. On CUDA it halves the bytes of the memory kernels, whose reads of M0 are
    # most of them (flash-linear-attention's chunked kernels keep their chunk states in the
    # input dtype the same way). Every backend computes the same function with it.
    bf16_memory_reads: bool = False
    # CUDA: the step GEMMs of these projections (comma-separated PROJECTIONS, "all" or
    # "none") as cuBLAS products, their scale and epilogue in a kernel of ours after, instead
    # of the Triton GEMMs that fuse both: whichever is faster at a shape (the device check
    # times both). The same function, summed in another order.
    cublas_gemms: str = "none"

    def __post_init__(self) -> None:
        for name in ("chunk_size", "loss_chunk_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{name}: expected an integer, got {value!r}")
            if value < 1:
                raise ConfigError(f"{name}: must be >= 1, got {value}")
        if self.step_backend not in STEP_BACKENDS:
            raise ConfigError(
                f"step_backend: expected {', '.join(STEP_BACKENDS[:-1])} or "
                f"{STEP_BACKENDS[-1]}, got {self.step_backend!r}"
            )
        for name in (
            "cuda_graphs",
            "overlap_backward",
            "overlap_decode",
            "dependent_launch",
            "bf16_memory_reads",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}: expected true or false, got {getattr(self, name)!r}")
        self.cublas_projections()  # one line naming a projection it does not know
        share = self.side_work_sm_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share < 1:
            raise ConfigError(
                f"side_work_sm_share: expected a number in [0, 1) (0.25: a quarter of the SMs, "
                f"0: none), got {share!r}"
            )

    def cublas_projections(self) -> frozenset[str]:
        """The projections `cublas_gemms` sends through cuBLAS."""
        value = self.cublas_gemms
        if not isinstance(value, str):
            raise ConfigError(
                f"cublas_gemms: expected comma-separated projections, all or none, got {value!r}"
            )
        names = [n.strip() for n in value.split(",") if n.strip()]
        if names in ([], ["none"]):
            return frozenset()
        if names == ["all"]:
            return frozenset(PROJECTIONS)
        for name in names:
            if name not in PROJECTIONS:
                raise ConfigError(
                    f"cublas_gemms: unknown projection {name!r}; expected comma-separated "
                    f"{', '.join(PROJECTIONS)}, or all, or none"
                )
        return frozenset(names)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def replace(self, **changes: Any) -> EngineOptions:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def check_keys(cls, values: Any, prefix: str = "engine.") -> None:
        """One line when `values` is not a mapping of engine options (naming the closest)."""
        if not isinstance(values, Mapping):
            raise ConfigError(f"{prefix.rstrip('.')}: expected a section of keys, got {values!r}")
        names = cls.field_names()
        for key in values:
            if key not in names:
                hint = closest_key_hint(str(key), names)
                raise ConfigError(f"{prefix}{key}: unknown engine option{hint}")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], prefix: str = "engine.") -> EngineOptions:
        """From a mapping; an unknown key is one line naming the closest option."""
        cls.check_keys(values, prefix)
        try:
            return cls(**values)
        except ConfigError as err:  # name the key as the caller's file spells it
            raise ConfigError(f"{prefix}{err}") from None
