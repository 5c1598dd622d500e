"""The training run's config schema: one dataclass per section (`DataSection`,
`OptimSection`, ...) and `TrainConfig` over them, with each field's default and, in the
comment beside it, its meaning (`gpn-scale train --help-config` prints those comments);
`all_keys()`, every dotted key of the schema. Loaded and checked by gpn_scale.run.config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from gpn_scale.io import run_folder
from gpn_scale.io.run_folder import DEFAULT_CORPUS


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
    # How the GPN engine runs a sequence (ops/gpn_step/options.py): never what it computes,
    # but for bf16_memory_reads (off by default). None keeps the model config's value. A
    # checkpoint resumes under other values. GPN only.
    chunk_size: int | None = None  # steps per chunk (memory chunkwise form, BPTT recompute)
    loss_chunk_tokens: int | None = None  # decode + cross entropy over this many positions
    step_backend: str | None = None  # auto | reference | cpu | cuda (GPN_SCALE_STEP_KERNELS wins)
    cuda_graphs: bool | None = None  # CUDA backend: capture each chunk as CUDA graphs
    overlap_backward: bool | None = None  # CUDA: chunk-wide backward work on a second stream
    overlap_decode: bool | None = None  # CUDA: each chunk's decode + loss on a second stream
    dependent_launch: bool | None = None  # CUDA, Hopper on: step kernels launched as dependents
    side_work_sm_share: float | None = None  # CUDA: SMs the memory kernels leave to side work
    bf16_memory_reads: bool | None = None  # the steps read each chunk's M0 in bf16 (numerics!)
    cublas_gemms: str | None = None  # CUDA: these step GEMMs through cuBLAS (e.g. down_dx,input)

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


SECTION_TYPES: dict[str, type] = {
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
        sub = SECTION_TYPES.get(ftype)
        if sub is not None:
            out.extend(all_keys(sub, f"{prefix}{f.name}."))
        else:
            out.append(f"{prefix}{f.name}")
    return out
