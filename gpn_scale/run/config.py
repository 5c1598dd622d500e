"""The training run's configuration: a typed schema (dataclasses) loaded with OmegaConf.

`load_train_config(path, overrides)` reads a YAML file, applies `key=value` dotlist
overrides and returns a `TrainConfig`. Every key is checked against the schema *before*
OmegaConf merges it, so a misspelled key fails with one line naming the closest valid key
(OmegaConf's own error would name the dataclass, not the dotted path the user typed).

The sweep launcher relies on these exact keys: `model`, `seed`, `run_name`, `optim.lr`,
`schedule.warmup_steps`, `schedule.total_steps`, `data.remote`, `data.seq_len`,
`train.global_batch_size`, `checkpoint.root`, `logging.wandb.{project,group,job_type}`.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from gpn_scale.core.config import ConfigError, closest_key_hint, read_yaml, resolve_named_yaml
from gpn_scale.io import run_folder
from gpn_scale.io.run_folder import DEFAULT_CORPUS

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "train"


@dataclass
class DataSection:
    remote: str = DEFAULT_CORPUS  # MDS root: local dir, s3://bucket/prefix, or "default"
    local_cache: str | None = None  # streaming's local cache (default: <run_dir>/data/cache)
    seq_len: int = 256  # tokens per window; must equal the dataset's
    shuffle_seed: int = 0  # the sample order of every epoch
    # streaming's canonical nodes: fixes the global sample order across world sizes
    # (None: from the first run's node count, kept on resume)
    num_canonical_nodes: int | None = None
    num_workers: int = 0  # DataLoader worker processes per rank (0 = in the main process)
    # Bound on the shard cache per node (e.g. 20gb; None: every shard the run reads stays):
    # streaming evicts the least recently used shards beyond it. At least 4x the largest shard.
    cache_limit: str | None = None


@dataclass
class OptimSection:
    lr: float = 6e-4  # peak learning rate (AdamW), reached after the warm-up
    beta1: float = 0.9  # AdamW beta1, in [0, 1)
    beta2: float = 0.95  # AdamW beta2, in [0, 1)
    eps: float = 1e-8  # AdamW epsilon
    weight_decay: float = 0.1  # matrices only (ndim >= 2); never 1-D, A_log, dt_bias
    grad_clip: float = 1.0  # global-norm clip; 0 disables
    fused: bool = False  # torch's fused AdamW (GPU only)


@dataclass
class ScheduleSection:
    warmup_steps: int = 100  # linear from 0 to lr
    total_steps: int = 1000  # cosine ends at the last step
    min_lr_ratio: float = 0.1  # cosine floor as a fraction of lr


@dataclass
class TrainSection:
    global_batch_size: int = 8  # sequences per optimizer step, all ranks together
    # sequences per rank per forward; None = global / world (no gradient accumulation)
    micro_batch_size: int | None = None
    device: str = "auto"  # auto | cpu | cuda
    precision: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16
    # torch.use_deterministic_algorithms: auto = on on CPU (exact resume, the tests), off on
    # GPU (it fills every torch.empty with NaN and picks slower kernels); true/false force it.
    deterministic: Union[bool, str] = "auto"  # noqa: UP007 (OmegaConf reads typing.Union)
    num_threads: int | None = None  # torch.set_num_threads on CPU (None = leave as is)
    tbptt: int | None = None  # overrides the model's truncated-BPTT length when set
    stateful_windows: bool = False  # carry the (detached) state from one batch to the next
    max_nonfinite_in_a_row: int = 5  # stop after this many consecutive skipped steps
    log_every: int = 1  # a metrics line (and a plain step line off a terminal) every N steps
    progress_bar: bool = True  # a tqdm bar on a terminal; plain timestamped lines otherwise


@dataclass
class ParallelSection:
    backend: str = "auto"  # the sharding strategy: auto | none | fsdp2 | deepspeed
    zero_stage: int = 2  # DeepSpeed ZeRO stage (1, 2, 3)
    # ZeRO-3: parameters smaller than this stay whole on every rank (DeepSpeed default 1e5);
    # 0 partitions every parameter (tests use it so that tiny models are really sharded).
    zero3_persistence_threshold: int | None = None
    reduce_dtype: str = "fp32"  # FSDP2 mixed-precision gradient reduction dtype
    reshard_after_forward: bool = True  # FSDP2: free gathered weights after each forward
    tp: int = 1  # tensor parallel degree (mesh dim "tp", innermost; FSDP2 over "dp" = world/tp)


@dataclass
class EngineSection:
    # How the GPN engine runs a sequence, never what it computes (ops/gpn_step/options.py);
    # None keeps the model config's value. A checkpoint resumes under other values. GPN only.
    chunk_size: int | None = None  # steps per chunk (memory chunkwise form, BPTT recompute)
    loss_chunk_tokens: int | None = None  # decode + cross entropy over this many positions
    step_backend: str | None = None  # auto | reference | cpu | cuda (GPN_SCALE_STEP_KERNELS wins)
    cuda_graphs: bool | None = None  # CUDA backend: capture each chunk as CUDA graphs
    overlap_backward: bool | None = None  # CUDA: chunk-wide backward work on a second stream

    def given(self) -> dict[str, Any]:
        """The options this run sets (the rest stay the model config's)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass
class CompileSection:
    # torch.compile each block of the model (torchtitan's compile.enable: one compile per
    # block, after tensor parallelism, before FSDP2 / ZeRO). The first step pays the compile
    # (CPU: ~20 s for the tiny Transformer++, 40-65 s for the tiny Gated DeltaNet); the losses
    # stay the eager ones within float32 rounding. Transformer++ and Gated DeltaNet only
    # (GPN's engine runs its own kernels and refuses it), not under DeepSpeed ZeRO-3.
    enable: bool = False


@dataclass
class CheckpointSection:
    root: str | None = None  # local dir or s3://bucket/prefix (default <run_dir>/checkpoints)
    every_steps: int = 0  # 0 = only on preemption and at the end
    keep_last: int = 2  # complete checkpoints kept; older ones are deleted
    # The run's lease (<root>/LEASE: one job at a time): stale after this many seconds
    # without a heartbeat; 0 = no lease.
    lease_ttl_s: float = 300.0
    save_final: bool = True  # save a checkpoint at the last step
    # Also write <run_dir>/model_final.pt: the full fp32 weights as one plain state dict
    # (gathered from FSDP2 / ZeRO shards), loadable with GPN(cfg).load_state_dict.
    export_final: bool = False
    # Warm start: start from the weights of this checkpoint (a step dir local or s3:// of any
    # dp/tp layout, a checkpoint root or run dir: its newest; a model_final.pt; an export)
    # of the same family and shape, at step 0 with a fresh optimizer, schedule and data
    # position. Ignored once the run has a checkpoint of its own to resume.
    initial_load: str | None = None
    # false: the optimizer state too (a DCP checkpoint, not under DeepSpeed); schedule, step
    # and data position still start fresh.
    initial_load_model_only: bool = True
    # off | async | async_with_pinned_mem (torchtitan's names): the state is copied to CPU
    # (pinned memory with the latter, on a GPU) while training waits; the write, upload and
    # commit run in the background while it goes on, one save in flight at a time
    # (checkpoint/async_save.py). Not under DeepSpeed.
    async_mode: str = "off"


@dataclass
class WandbSection:
    mode: str = "disabled"  # online | offline | auto (online, else offline) | disabled
    # The W&B run id (sweeps derive it from sweep + run name: one W&B run per run, across
    # requeues and re-submissions); a checkpoint's recorded id wins on resume. None: new.
    run_id: str | None = None
    project: str = "gpn-scale"  # the W&B project
    entity: str | None = None  # the W&B entity (None: the account's default)
    group: str | None = None  # the W&B group (sweeps set the sweep's)
    job_type: str = "train"  # the W&B job type
    dir: str | None = None  # default <run_dir>
    init_timeout: float = 60.0  # online: seconds to reach the server before failing


@dataclass
class LoggingSection:
    jsonl: bool = True  # always on in practice; <run_dir>/metrics.jsonl
    wandb: WandbSection = field(default_factory=WandbSection)


@dataclass
class EvalSection:
    every_steps: int = 0  # 0 = only at the end
    batches: int = 4  # fixed held-out windows: batches x batch_size
    batch_size: int | None = None  # per rank (default: the training micro batch)
    at_end: bool = True  # evaluate after the last step (the DONE marker's final_eval_loss)


@dataclass
class AnalysisSection:
    # Live state analyses (gpn_scale/eval/analysis/live.py, docs/analysis.md): per-head
    # memory half-lives, stable rank and mean-direction norm of a slice of the batch.
    every_steps: int = 0  # 0 = off
    rows: int = 4  # batch rows run through the reference step path
    tokens: int = 256  # leading tokens of each row


@dataclass
class PreemptionSection:
    enabled: bool = True  # SIGUSR1 / SIGTERM -> save and exit 75
    requeue: bool = False  # under SLURM also `scontrol requeue $SLURM_JOB_ID`
    # Save and exit 75 this many seconds before SLURM_JOB_END_TIME (epoch seconds; set by
    # SLURM >= 23.02, by slurm/train.sbatch otherwise), whatever the signals do; 0: off.
    end_margin_s: float = 180.0


@dataclass
class ProfilingSection:
    # torch.profiler over training steps (train/profiling.py; torchtitan's profiling.*):
    # every `every` steps a window ends; its last `active` steps are recorded after `warmup`
    # profiled steps that are not, one Chrome trace per rank and window.
    enable: bool = False  # write rank<r>_step<n>.json traces (chrome://tracing, Perfetto)
    every: int = 100  # a window ends at every multiple of this many steps
    warmup: int = 3  # steps before each recorded span that run the profiler unrecorded
    active: int = 1  # steps recorded in each window (warmup + active <= every)
    folder: str | None = None  # local dir or s3://bucket/prefix (default <run_dir>/profiling)
    # CUDA memory snapshots (rank<r>_step<n>_memory.pickle at every window's end, _oom on
    # out-of-memory; https://pytorch.org/memory_viz); records the allocation history from
    # the first step (slower steps). CPU runs skip it.
    memory_snapshot: bool = False


@dataclass
class DebugSection:
    # Test hooks: the loss is replaced by NaN at these steps / from this step on.
    inject_nan_steps: list[int] = field(default_factory=list)
    inject_nan_from: int | None = None  # (None: never)
    # Sleep this many seconds after each step (tests that signal a running job).
    step_sleep: float = 0.0
    # Sleep this many seconds inside each held-out eval (tests that signal the final eval).
    eval_sleep: float = 0.0
    # Sleep this many seconds at the end of the setup (tests that signal during it).
    setup_sleep: float = 0.0

    def poisons(self, step: int) -> bool:
        """Whether optimizer step `step` (0-based) gets a NaN loss."""
        return step + 1 in self.inject_nan_steps or (
            self.inject_nan_from is not None and step + 1 >= self.inject_nan_from
        )


@dataclass
class TrainConfig:
    model: str = "tiny"  # configs/model/<name>.yaml or a path
    # model config fields to replace, e.g. {d_ffn: 1536} (checked by the model's family)
    model_overrides: dict[str, Any] = field(default_factory=dict)
    seed: int = 0  # initial weights and every rank's RNG
    run_name: str = "run"  # names the default run_dir and the W&B run
    run_dir: str | None = None  # default runs/<run_name>
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    train: TrainSection = field(default_factory=TrainSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    engine: EngineSection = field(default_factory=EngineSection)
    compile: CompileSection = field(default_factory=CompileSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    eval: EvalSection = field(default_factory=EvalSection)
    analysis: AnalysisSection = field(default_factory=AnalysisSection)
    preemption: PreemptionSection = field(default_factory=PreemptionSection)
    profiling: ProfilingSection = field(default_factory=ProfilingSection)
    debug: DebugSection = field(default_factory=DebugSection)

    # ----- derived paths ------------------------------------------------------------
    @property
    def resolved_run_dir(self) -> str:
        return self.run_dir or str(Path("runs") / self.run_name)

    @property
    def resolved_checkpoint_root(self) -> str:
        return self.checkpoint.root or str(Path(self.resolved_run_dir) / run_folder.CHECKPOINTS)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# One rule for every number of the schema: finite, never negative. Where 0 means "off" (or
# "none"), the message says so; any other lower bound is checked in `validate`.
ZERO_IS_OFF = {
    "checkpoint.every_steps": "0 = only on preemption and at the end",
    "checkpoint.lease_ttl_s": "0 = no lease",
    "eval.every_steps": "0 = only at the end",
    "analysis.every_steps": "0 = off",
    "preemption.end_margin_s": "0 = off",
    "optim.grad_clip": "0 = no clipping",
    "optim.weight_decay": "0 = no decay",
    "train.tbptt": "0 = full BPTT",
    "debug.step_sleep": "0 = off",
    "debug.eval_sleep": "0 = off",
    "debug.setup_sleep": "0 = off",
    "profiling.warmup": "0 = no warm-up steps",
}
# Keys that name a place on disk: a leading ~ is the user's home, as in a shell.
PATH_KEYS = (
    "model",
    "run_dir",
    "data.remote",
    "data.local_cache",
    "checkpoint.root",
    "logging.wandb.dir",
    "profiling.folder",
)

ASYNC_MODES = ("off", "async", "async_with_pinned_mem")
_ENUMS = {
    "train.device": ("auto", "cpu", "cuda"),
    "train.precision": ("auto", "fp32", "bf16"),
    "parallel.backend": ("auto", "none", "fsdp2", "deepspeed"),
    "parallel.reduce_dtype": ("fp32", "bf16"),
    "logging.wandb.mode": ("online", "offline", "auto", "disabled"),
    "checkpoint.async_mode": ASYNC_MODES,
}
# Keys whose value is a free mapping (validated elsewhere: model_overrides by GPNConfig).
_FREE_MAPPINGS = {"model_overrides"}


def _check_keys(values: Any, schema: type, prefix: str = "") -> None:
    """Raise ConfigError (one line, closest key) for any key the schema does not define."""
    if not isinstance(values, dict):
        return
    fields = {f.name: f for f in dataclasses.fields(schema)}
    for key, value in values.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            hint = closest_key_hint(str(key), [f"{prefix}{k}" for k in fields])
            if not hint:  # also try the whole schema (a key under the wrong section)
                hint = closest_key_hint(dotted, all_keys())
            raise ConfigError(f"{dotted}: unknown config key{hint}")
        if dotted in _FREE_MAPPINGS:
            continue
        ftype = fields[key].type
        sub = _SECTION_TYPES.get(
            ftype if isinstance(ftype, str) else getattr(ftype, "__name__", "")
        )
        if sub is not None:
            if not isinstance(value, dict):
                raise ConfigError(f"{dotted}: expected a section of keys, got {value!r}")
            _check_keys(value, sub, prefix=f"{dotted}.")


_SECTION_TYPES: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        DataSection,
        OptimSection,
        ScheduleSection,
        TrainSection,
        ParallelSection,
        EngineSection,
        CompileSection,
        CheckpointSection,
        WandbSection,
        LoggingSection,
        EvalSection,
        AnalysisSection,
        PreemptionSection,
        ProfilingSection,
        DebugSection,
    )
}


def all_keys(schema: type = TrainConfig, prefix: str = "") -> list[str]:
    """Every dotted key of the schema (for hints and docs)."""
    out: list[str] = []
    for f in dataclasses.fields(schema):
        ftype = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
        sub = _SECTION_TYPES.get(ftype)
        if sub is not None:
            out.extend(all_keys(sub, f"{prefix}{f.name}."))
        else:
            out.append(f"{prefix}{f.name}")
    return out


def _field_comments(cls: type) -> dict[str, str]:
    """Each field's meaning: the comments on its line and the comment block just above it,
    read from the dataclass's source (the schema's own comments, so the help cannot drift)."""
    import ast
    import inspect
    import io
    import textwrap
    import tokenize

    source = textwrap.dedent(inspect.getsource(cls))
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            comments[tok.start[0]] = text.split("(noqa", 1)[0].split("noqa:", 1)[0].strip()
    body = ast.parse(source).body[0]
    assert isinstance(body, ast.ClassDef)
    out: dict[str, str] = {}
    previous_end = body.lineno
    for node in body.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            end = node.end_lineno or node.lineno
            above = [
                comments[n]
                for n in range(previous_end + 1, node.lineno)
                if n in comments and comments[n]
            ]
            inline = [comments[n] for n in range(node.lineno, end + 1) if comments.get(n)]
            out[node.target.id] = " ".join(above + inline)
        previous_end = node.end_lineno or node.lineno
    return out


def config_help(schema: type = TrainConfig, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default, meaning) of every key of the schema, in schema order:
    what `gpn-scale train --help-config` prints (no config is read, nothing is checked)."""
    rows: list[tuple[str, str, str, str]] = []
    meanings = _field_comments(schema)
    defaults = schema()
    for f in dataclasses.fields(schema):
        ftype = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
        sub = _SECTION_TYPES.get(ftype)
        if sub is not None:
            rows.extend(config_help(sub, f"{prefix}{f.name}."))
            continue
        value = getattr(defaults, f.name)
        default = "null" if value is None else repr(value) if isinstance(value, str) else value
        kind = str(ftype).replace("Union[bool, str]", "bool | str")
        rows.append((f"{prefix}{f.name}", kind, str(default), meanings.get(f.name, "")))
    return rows


def format_config_help() -> str:
    lines = [
        "Every key of the training config (configs/train/*.yaml; override any with key=value)."
        " Type, default, meaning; numbers are finite and never negative (0 = off where a key"
        " has an off).",
        "",
    ]
    section = None
    for key, kind, default, meaning in config_help():
        head = key.split(".")[0] if "." in key else ""
        if head != section:
            section = head
            if head:
                lines += ["", f"[{head}]"]
        lines.append(f"  {key}: {kind} = {default}")
        if meaning:
            lines.append(f"      {meaning}")
    return "\n".join(lines)


def resolve_config_path(name_or_path: str | Path) -> Path:
    return resolve_named_yaml(name_or_path, CONFIG_DIR, "training config")


def load_train_config(
    name_or_path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()
) -> TrainConfig:
    """YAML file (or configs/train/<name>.yaml, or None for the defaults) + dotlist overrides."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    layers = []
    if name_or_path is not None:
        raw = _read_config_layer(name_or_path)
        _check_keys(raw, TrainConfig)
        layers.append(OmegaConf.create(raw))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"{item}: overrides are key=value (e.g. optim.lr=3e-4)")
    if overrides:
        try:
            dot = OmegaConf.from_dotlist(list(overrides))
        except OmegaConfBaseException as err:
            raise ConfigError(f"bad override: {str(err).splitlines()[0]}") from None
        _check_keys(OmegaConf.to_container(dot, resolve=False), TrainConfig)
        layers.append(dot)
    base = OmegaConf.structured(TrainConfig)
    try:
        merged = OmegaConf.merge(base, *layers)
        cfg: TrainConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as err:
        # Type errors: OmegaConf names the key and the value; keep its first line.
        msg = str(err).splitlines()[0]
        key = getattr(err, "full_key", None)
        raise ConfigError(f"{key}: {msg}" if key else msg) from None
    expand_user_paths(cfg)
    validate(cfg)
    return cfg


def _numbers(obj: Any, prefix: str = "") -> list[tuple[str, float]]:
    """(dotted key, value) of every number in the config (lists included; bools are not
    numbers; model_overrides is the model config's to check)."""
    out: list[tuple[str, float]] = []
    for f in dataclasses.fields(obj):
        key, value = f"{prefix}{f.name}", getattr(obj, f.name)
        if key in _FREE_MAPPINGS:
            continue
        if dataclasses.is_dataclass(value):
            out += _numbers(value, f"{key}.")
        elif isinstance(value, (list, tuple)):
            out += [
                (f"{key}[{i}]", v)
                for i, v in enumerate(value)
                if isinstance(v, (int, float)) and not isinstance(v, bool)
            ]
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out.append((key, value))
    return out


def check_numbers(cfg: TrainConfig) -> None:
    """Every number finite and >= 0 (the one rule; docs/training.md): `optim.lr=nan` or
    `checkpoint.every_steps=-1` is refused in one line naming the key, never read as "off"."""
    for key, value in _numbers(cfg):
        if not math.isfinite(value):
            raise ConfigError(f"{key}: must be a finite number, got {value}")
        if value < 0:
            off = ZERO_IS_OFF.get(key)
            raise ConfigError(
                f"{key}: must be >= 0{f' ({off})' if off else ''}, got {value}; negative "
                "numbers are never read as off"
            )


def expand_user_paths(cfg: TrainConfig) -> None:
    """A leading ~ in a path key is the home directory (never a folder named ~)."""
    for key in PATH_KEYS:
        *parents, name = key.split(".")
        owner: Any = cfg
        for part in parents:
            owner = getattr(owner, part)
        value = getattr(owner, name)
        if isinstance(value, str) and value.startswith("~"):
            expanded = os.path.expanduser(value)
            if expanded.startswith("~"):  # ~user of an unknown user
                raise ConfigError(
                    f"{key}={value}: cannot expand {value.split('/')[0]} (no such user's home); "
                    "give the path in full"
                )
            setattr(owner, name, expanded)


def _read_config_layer(name_or_path: str | Path) -> dict[str, Any]:
    """A training YAML's mapping; a run folder (or the config.yaml a run wrote in it) is
    its recorded config with the paths resolved for where the folder lies now
    (io/run_folder.py), so `gpn-scale eval runs/x` and `train runs/x` read runs/x."""
    shipped = "/" not in str(name_or_path) and (CONFIG_DIR / f"{name_or_path}.yaml").is_file()
    if run_folder.is_run_folder(name_or_path) and not shipped:  # a shipped name wins
        return run_folder.read_run_config(name_or_path)
    path = resolve_config_path(name_or_path)
    raw = read_yaml(path, resolve=False, what="training config")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of config sections")
    if path.name == run_folder.RUN_CONFIG and raw.get("run_dir") == run_folder.HERE:
        return run_folder.rebase_run_config(raw, str(path.parent))
    return raw


def _check_engine(section: EngineSection) -> None:
    """Each option the run sets, checked as the engine checks it, named engine.<key>."""
    if section.given():
        from gpn_scale.ops.gpn_step.options import EngineOptions

        EngineOptions.from_dict(section.given(), prefix="engine.")


def _check_parallel_and_analysis(cfg: TrainConfig) -> None:
    """parallel.* values, and the live analyses, which need the whole model on one rank."""
    if cfg.parallel.zero_stage not in (1, 2, 3):
        raise ConfigError(f"parallel.zero_stage: expected 1, 2 or 3, got {cfg.parallel.zero_stage}")
    if isinstance(cfg.parallel.tp, bool) or not isinstance(cfg.parallel.tp, int):
        raise ConfigError(f"parallel.tp: expected an integer, got {cfg.parallel.tp!r}")
    if cfg.parallel.tp < 1:
        raise ConfigError(f"parallel.tp: must be >= 1, got {cfg.parallel.tp}")
    if cfg.parallel.tp > 1 and cfg.parallel.backend in ("none", "deepspeed"):
        raise ConfigError(
            f"parallel.tp={cfg.parallel.tp}: tensor parallelism runs under "
            f"parallel.backend=fsdp2 (or auto), not {cfg.parallel.backend}; use fsdp2"
        )
    if cfg.checkpoint.async_mode != "off" and cfg.parallel.backend == "deepspeed":
        # DeepSpeed's engine.save_checkpoint writes its own files from its own buffers: no
        # staged copy of them to write from a background thread while training goes on.
        raise ConfigError(
            f"checkpoint.async_mode={cfg.checkpoint.async_mode}: background saves are for "
            "parallel.backend none / fsdp2 (DCP), not deepspeed; set checkpoint.async_mode=off"
        )
    if cfg.compile.enable and cfg.parallel.backend == "deepspeed" and cfg.parallel.zero_stage == 3:
        # ZeRO-3 gathers each submodule's weights in forward hooks DeepSpeed marks
        # torch.compiler.disable: inside a compiled block they break the graph at every
        # Linear (Transformer++'s one-graph compile fails on the first).
        raise ConfigError(
            "compile.enable: ZeRO-3 (parallel.zero_stage=3) gathers every submodule's "
            "weights in hooks torch.compile cannot trace; use parallel.zero_stage 1 or 2, "
            "parallel.backend=fsdp2, or compile.enable=false"
        )
    if cfg.analysis.every_steps < 0:
        raise ConfigError(
            f"analysis.every_steps: must be >= 0 (0 = off), got {cfg.analysis.every_steps}"
        )
    if cfg.analysis.every_steps and cfg.parallel.tp > 1:
        raise ConfigError(
            f"analysis.every_steps: the live analyses run the whole model on one rank, which "
            f"parallel.tp={cfg.parallel.tp} splits; set analysis.every_steps=0 and run "
            "`gpn-scale analyze` on a checkpoint (it loads the full model), or train at tp=1"
        )
    if cfg.analysis.rows < 1 or cfg.analysis.tokens < 3:
        raise ConfigError(
            f"analysis.rows / analysis.tokens: need rows >= 1 and tokens >= 3, got "
            f"{cfg.analysis.rows} / {cfg.analysis.tokens}"
        )


def _check_profiling(section: ProfilingSection) -> None:
    """profiling.*: a schedule that fits its period and a folder the storage layer opens."""
    for key in ("every", "active"):
        if getattr(section, key) < 1:
            raise ConfigError(f"profiling.{key}: must be >= 1, got {getattr(section, key)}")
    if section.warmup + section.active > section.every:
        raise ConfigError(
            f"profiling.warmup + profiling.active: must be <= profiling.every={section.every} "
            f"(one window per period), got {section.warmup} + {section.active}; raise "
            "profiling.every or shorten the window"
        )
    folder = section.folder
    if folder is not None and not folder.strip():
        raise ConfigError(
            "profiling.folder: empty; give a directory or s3://bucket/prefix, or null "
            "(<run_dir>/profiling)"
        )
    if folder is not None and "://" in folder and not folder.startswith(("s3://", "file://")):
        raise ConfigError(
            f"profiling.folder: {folder!r} uses unsupported scheme "
            f"'{folder.split('://', 1)[0]}'; use a directory or s3://bucket/prefix"
        )


_SIZE = re.compile(r"\s*(\d+(\.\d+)?)\s*(b|[kmgtp]b)?\s*", re.IGNORECASE)


def _check_cache_limit(limit: str | None) -> None:
    """data.cache_limit: a size streaming reads (`500mb`, `20gb`, bytes), above zero."""
    if limit is None:
        return
    match = _SIZE.fullmatch(str(limit))
    bytes_with_fraction = match and match.group(2) and (match.group(3) or "b").lower() == "b"
    if not match or float(match.group(1)) <= 0 or bytes_with_fraction:
        raise ConfigError(
            f"data.cache_limit: expected a size such as 500mb, 20gb or a number of bytes, got "
            f"{limit!r}; or null for no limit"
        )


def validate(cfg: TrainConfig) -> None:
    """Value checks the types cannot express (one line each)."""
    check_numbers(cfg)
    _check_cache_limit(cfg.data.cache_limit)
    if cfg.checkpoint.async_mode == "False":  # YAML reads off (and false, no) as a boolean
        cfg.checkpoint.async_mode = "off"
    for key, allowed in _ENUMS.items():
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        if value not in allowed:
            raise ConfigError(
                f"{key}: expected one of {', '.join(allowed)}, got {value!r}"
                f"{closest_key_hint(str(value), allowed)}"
            )
    _check_engine(cfg.engine)
    if cfg.train.deterministic not in (True, False, "auto"):
        raise ConfigError(
            f"train.deterministic: expected auto, true or false, got {cfg.train.deterministic!r}"
        )
    positive = {
        "data.seq_len": cfg.data.seq_len,
        "train.global_batch_size": cfg.train.global_batch_size,
        "schedule.total_steps": cfg.schedule.total_steps,
        "train.log_every": cfg.train.log_every,
        "eval.batches": cfg.eval.batches,
        "checkpoint.keep_last": cfg.checkpoint.keep_last,
        "train.max_nonfinite_in_a_row": cfg.train.max_nonfinite_in_a_row,
    }
    for key, number in positive.items():
        if number < 1:
            raise ConfigError(f"{key}: must be >= 1, got {number}")
    if cfg.schedule.warmup_steps < 0 or cfg.schedule.warmup_steps > cfg.schedule.total_steps:
        raise ConfigError(
            f"schedule.warmup_steps: must be in [0, schedule.total_steps="
            f"{cfg.schedule.total_steps}], got {cfg.schedule.warmup_steps}"
        )
    if not 0.0 <= cfg.schedule.min_lr_ratio <= 1.0:
        raise ConfigError(
            f"schedule.min_lr_ratio: must be in [0, 1], got {cfg.schedule.min_lr_ratio}"
        )
    if cfg.logging.wandb.init_timeout <= 0:
        raise ConfigError(
            f"logging.wandb.init_timeout: seconds, must be > 0, got "
            f"{cfg.logging.wandb.init_timeout}"
        )
    if cfg.optim.lr <= 0:
        raise ConfigError(f"optim.lr: must be > 0, got {cfg.optim.lr}")
    for key, beta in (("optim.beta1", cfg.optim.beta1), ("optim.beta2", cfg.optim.beta2)):
        if not 0.0 <= beta < 1.0:
            raise ConfigError(f"{key}: must be in [0, 1), got {beta}")
    if cfg.optim.eps <= 0:
        raise ConfigError(f"optim.eps: must be > 0, got {cfg.optim.eps}")
    _check_parallel_and_analysis(cfg)
    _check_profiling(cfg.profiling)
    mb = cfg.train.micro_batch_size
    if mb is not None and mb < 1:
        raise ConfigError(f"train.micro_batch_size: must be >= 1, got {mb}")
    if cfg.train.tbptt is not None and cfg.train.tbptt < 0:
        raise ConfigError(f"train.tbptt: must be >= 0, got {cfg.train.tbptt}")


def batch_layout(cfg: TrainConfig, world_size: int) -> tuple[int, int]:
    """(micro batch per rank, gradient-accumulation steps) for this world size.

    global_batch_size = micro * accum * world; a split that does not divide fails clearly.
    """
    gbs = cfg.train.global_batch_size
    if gbs % world_size:
        raise ConfigError(
            f"train.global_batch_size: {gbs} is not divisible by the world size {world_size}"
        )
    per_rank = gbs // world_size
    micro = cfg.train.micro_batch_size or per_rank
    if per_rank % micro:
        raise ConfigError(
            f"train.micro_batch_size: {micro} does not divide the per-rank batch "
            f"{per_rank} (= global_batch_size {gbs} / world size {world_size})"
        )
    return micro, per_rank // micro


def to_yaml(cfg: TrainConfig) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def relocatable(cfg: TrainConfig) -> TrainConfig:
    """The config as a run records it (config.yaml, every checkpoint's meta): defaults
    filled in, its run folder as `.` and every path inside it relative to it."""
    run_dir = cfg.resolved_run_dir
    out = copy.deepcopy(cfg)
    out.run_dir = run_folder.HERE
    out.checkpoint.root = run_folder.to_run_relative(cfg.resolved_checkpoint_root, run_dir)
    if cfg.data.remote != DEFAULT_CORPUS:
        out.data.remote = str(run_folder.to_run_relative(cfg.data.remote, run_dir))
    out.data.local_cache = run_folder.to_run_relative(cfg.data.local_cache, run_dir)
    out.logging.wandb.dir = run_folder.to_run_relative(cfg.logging.wandb.dir, run_dir)
    out.profiling.folder = run_folder.to_run_relative(cfg.profiling.folder, run_dir)
    if run_folder.looks_like_path(cfg.model) and Path(cfg.model).is_file():
        out.model = str(run_folder.to_run_relative(cfg.model, run_dir))
    return out
