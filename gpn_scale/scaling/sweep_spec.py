"""What an expanded sweep is: one `RunSpec` per run, the `Sweep` that holds them, and
`SweepError`. The launchers (slurm_launch.py, submit.py, status.py) and the fits read these;
sweep.py reads the sweep file into them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpn_scale.core.config import ConfigError


class SweepError(ConfigError):
    """A sweep file is invalid; the message names the key and the fix."""


@dataclass(frozen=True)
class RunSpec:
    """Everything one training run of a sweep needs, plus what `plan` reports about it."""

    name: str
    sweep: str
    family: str  # the label fits compare (gpn_scale.scaling.families.family_label)
    registry_family: str  # the FamilySpec that builds it ("gpn", "transformer_pp", ...)
    size: str  # the size's label (default: model config name)
    model: str  # model config name (configs/model/<model>.yaml) or a path
    seed: int
    params: int  # all parameters, embedding included
    tokens: int  # steps * global_batch_size * seq_len
    tokens_per_param: float
    total_steps: int
    global_batch_size: int  # sequences per optimizer step
    seq_len: int
    lr: float
    warmup_steps: int
    min_lr_ratio: float | None
    data_remote: str
    checkpoint_root: str  # this run's own checkpoint prefix: <sweep root>/<name>
    run_dir: str | None  # this run's local dir (metrics.jsonl), when run_root is set
    wandb_project: str
    wandb_group: str
    wandb_job_type: str
    flops: float  # training FLOPs (3 x forward) for `tokens`
    gpu_hours: float  # flops / (peak * mfu)
    base_config: str | None = None
    extra_overrides: tuple[str, ...] = ()
    model_overrides: tuple[tuple[str, Any], ...] = ()  # (field, value) of the model config
    checkpoint_every_steps: int = 0
    wandb_mode: str = "auto"

    @property
    def wandb_run_id(self) -> str:
        """One W&B run per sweep run, the same across requeues and re-submissions (even
        before the first checkpoint records it): the run name plus a hash of sweep + name."""
        import hashlib
        import re as _re

        digest = hashlib.sha1(f"{self.sweep}/{self.name}".encode()).hexdigest()[:10]
        return f"{_re.sub(r'[^A-Za-z0-9_-]', '-', self.name)[:50]}-{digest}"

    def train_overrides(self) -> list[str]:
        """OmegaConf dotlist overrides for `gpn-scale train [base_config] <overrides>`."""
        out = [
            f"model={self.model}",
            f"seed={self.seed}",
            f"run_name={self.name}",
            f"optim.lr={self.lr!r}",
            f"schedule.warmup_steps={self.warmup_steps}",
            f"schedule.total_steps={self.total_steps}",
            f"data.remote={self.data_remote}",
            f"data.seq_len={self.seq_len}",
            f"train.global_batch_size={self.global_batch_size}",
            f"checkpoint.root={self.checkpoint_root}",
            f"logging.wandb.project={self.wandb_project}",
            f"logging.wandb.group={self.wandb_group}",
            f"logging.wandb.job_type={self.wandb_job_type}",
            f"logging.wandb.mode={self.wandb_mode}",
            f"logging.wandb.run_id={self.wandb_run_id}",
            f"checkpoint.every_steps={self.checkpoint_every_steps}",
        ]
        out += [f"model_overrides.{k}={_dotlist_value(v)}" for k, v in self.model_overrides]
        if self.min_lr_ratio is not None:
            out.append(f"schedule.min_lr_ratio={self.min_lr_ratio!r}")
        if self.run_dir is not None:
            out.append(f"run_dir={self.run_dir}")
        return out + list(self.extra_overrides)

    def train_argv(self) -> list[str]:
        """`gpn-scale train` arguments: the base config (when any) then the overrides."""
        return ([self.base_config] if self.base_config else []) + self.train_overrides()

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["extra_overrides"] = list(self.extra_overrides)
        d["model_overrides"] = dict(self.model_overrides)
        d["train_overrides"] = self.train_overrides()
        return d


@dataclass
class Sweep:
    name: str
    path: Path
    runs: list[RunSpec]
    seeds: list[int]
    hardware: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    description: str = ""

    @property
    def total_gpu_hours(self) -> float:
        return sum(r.gpu_hours for r in self.runs)

    @property
    def total_flops(self) -> float:
        return sum(r.flops for r in self.runs)


def _dotlist_value(value: Any) -> str:
    """A model field's value as OmegaConf's dotlist parses it back (null, true, 1e-05, ...)."""
    import json

    return "null" if value is None else json.dumps(value) if isinstance(value, bool) else str(value)
