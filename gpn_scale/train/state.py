"""What a training run carries from step to step, what it is built from, and what it returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch's import, which the launch checks (train.sbatch) do without
    from gpn_scale.parallel.train_module import TrainModule


class TrainingError(RuntimeError):
    """The run cannot continue; the message is one line and says what to do."""


@dataclass
class RunResult:
    exit_code: int
    step: int
    tokens: int
    run_dir: str
    checkpoint: str | None = None
    final_eval: dict[str, float] = field(default_factory=dict)
    skipped_steps: int = 0
    message: str = ""


@dataclass
class TrainState:
    """The run's position: the counters a checkpoint records, and the loop's own."""

    step: int = 0
    tokens: int = 0
    skipped: int = 0  # steps whose update was skipped (non-finite), in total
    wandb_id: str | None = None  # kept in later checkpoints even if W&B is off this time
    last_ckpt: str | None = None  # the newest checkpoint this run can continue from
    in_a_row: int = 0  # consecutive skipped steps
    carry: Any = None  # the recurrent state between windows (train.stateful_windows)
    final_eval: dict[str, float] = field(default_factory=dict)


@dataclass
class Components:
    """What the setup built: the loop reads these and never rebuilds them."""

    mgr: Any  # checkpoint.CheckpointManager of the run's checkpoint root
    train_module: TrainModule
    model_cfg: Any  # the family's model config
    train_loader: Any
    val_loader: Any
    val_start: dict  # the validation loader's start: every eval reads the same windows
    micro: int  # micro batch per data-parallel rank
    accum: int  # micro batches per optimizer step
    n_params: int
    flops_per_token: float  # training FLOPs (forward + backward)
