"""Predicted step time of tensor parallelism (tp = 1, 2, 4, 8 on one 8-GPU node), on paper.

    python -m gpn_scale.accounting.tp_model gpn_m_1b --per-gpu 16

A GPN+M time step is bound by streaming its loop weights, not by FLOPs, at the paper's
16 sequences per GPU. With n GPUs and tp ranks per group, each group runs n/tp * per_gpu
sequences with 1/tp of the sharded weights (the memory heads, the FFN hidden units, the
read's out-projection); the predict and fuse gates (d x d each) stay whole on every rank.
Per time step, forward and reverse sweep each:

  weights  sharded bytes / tp + replicated bytes, streamed from L2 when they fit in it
           (~50 MB on H100/H200), else from HBM; M0 (float32, its heads / tp) per sequence
           from HBM (twice in the reverse sweep: M0 and dM0's reads);
  FLOPs    2 x B_group x loop parameters per GPU, at EFF_FLOPS of the dense bf16 peak;
  kernels  the CUDA backend's launches per step at that tp (`gpu_model.account(tp=)`, one
           rank's split steps counted from the code) x the graph gap;
  collectives  per layer forward one all-reduce of the row-parallel output (GPN+M: its read
           and FFN parts (B, 2d) and the read norm's sums in the same buffer); backward one
           (B, d) of the sharded input gradient and (GPN+M) one of B x 2 floats: three
           latency-bound all-reduces per step and layer for GPN+M (two for GPN), ~25 us each
           with NCCL on 8 NVLink GPUs, ~12 us with symmetric-memory one-shot kernels
           (spec/gpu-engine.md; vLLM's figures).

The chunk-wide work (parallel recompute, weight gradients, memory advance) is taken from the
tp = 1 accounting and divided by tp (its GEMMs shard like the weights): a group runs tp
times the sequences, so per GPU it costs what it costs at tp = 1, and it bounds the
speed-up (Amdahl: only the sequential part shrinks with tp). Decode and loss are
vocabulary-parallel: each GPU scores its group's rows against V/tp of the vocabulary, so
its logits work is the tp = 1 figure, while the decoder's d -> e projection of those rows
runs on every rank of the group (tp times the rows); plus the window's embedding all-reduce
(rows x e, forward) and the decoder input-gradient all-reduce (rows x e, backward), moved
at NVLink bus bandwidth. Estimates, not measurements: they say which tp to try, not what a
run will measure.
"""

from __future__ import annotations

import argparse
import functools
import sys
from dataclasses import dataclass
from typing import Any

from gpn_scale.models.gpn import GPNConfig, load_model_config
from gpn_scale.models.gpn.config import ConfigError

L2_BYTES = 50e6  # H100 SXM / H200 L2
L2_BYTES_PER_S = 10e12  # est.: several times HBM; the reason tp pays beyond 1/tp
ALLREDUCE_S = {"nccl": 25e-6, "symm_mem": 12e-6}
NVLINK_BUS_BYTES_PER_S = 350e9  # NCCL all-reduce bus bandwidth, 8 x H100/H200 NVLink (est.)
VOCAB_PARALLEL_PHASES = ("decode",)


def decode_seconds(
    cfg: GPNConfig, tp: int, per_gpu: int, seq_len: int, tp1_seconds: float
) -> float:
    """Vocabulary-parallel decode + loss per GPU at `tp`, from its tp = 1 time: the logits
    (rows x e x V/tp for tp times the rows) cost the same, the replicated d -> e projection
    tp times as much; plus two (rows x e) fp32 all-reduces at NVLink bus bandwidth."""
    d, e, V = cfg.d_state, cfg.d_emb, cfg.vocab_size
    compute = tp1_seconds * (tp * d + V) / (d + V)
    if tp == 1:
        return compute
    rows = tp * per_gpu * seq_len
    moved = 2 * (2.0 * (tp - 1) / tp) * 4.0 * rows * e
    return compute + moved / NVLINK_BUS_BYTES_PER_S


@dataclass(frozen=True)
class TpPrediction:
    tp: int
    group_batch: int
    weight_bytes_per_gpu: float
    in_l2: bool
    allreduce_bytes_per_step: float  # forward + backward, per time step, all layers
    allreduces_per_step: int
    step_seconds: dict[str, float]  # optimizer step over the global batch, per collective kind


def loop_weight_bytes(cfg: GPNConfig, tp: int, shard_gates: bool = False) -> tuple[float, float]:
    """(sharded bytes per GPU, replicated bytes) of the loop weights in bf16. shard_gates:
    the predict and fuse gates column-sharded along d too (not built: see the docs)."""
    d, f, L = cfg.d_state, cfg.d_ffn, cfg.n_layers
    H, dk, dv = cfg.n_heads, cfg.d_key, cfg.d_value
    replicated = (L + 1) * d * d  # predict gates + fuse gate
    sharded = L * d * 3 * f  # W_1 (both halves) + W_2
    if cfg.memory:
        sharded += d * H * (dk + dv + 2)  # the write
        sharded += L * d * H * (dk + 2 * dv)  # each read's q, gate and W_o
    if shard_gates:
        return 2.0 * (sharded + replicated) / tp, 0.0
    return 2.0 * sharded / tp, 2.0 * replicated


def predict_tp(
    cfg: GPNConfig,
    tp: int,
    per_gpu: int,
    seq_len: int,
    n_gpus: int,
    gpu: str,
    sequential_launches: float,
    chunk_seconds: float,
    decode_tp1_seconds: float,
    shard_gates: bool = False,
    allreduces_per_step: float | None = None,
) -> TpPrediction:
    from gpn_scale.accounting.step_model import GPUS, GRAPH_GAP_S

    spec = GPUS[gpu]  # its ceilings: measured copy bandwidth and GEMM rate (ceilings.py)
    B = per_gpu * tp  # a group of tp GPUs runs the sequences of tp GPUs
    sharded, replicated = loop_weight_bytes(cfg, tp, shard_gates)
    w = sharded + replicated
    in_l2 = w <= L2_BYTES
    bw = L2_BYTES_PER_S if in_l2 else spec.copy_bytes_per_s
    m0 = 4.0 * B * (cfg.n_heads // tp) * cfg.d_key * cfg.d_value if cfg.memory else 0.0
    flops = 2.0 * B * w / 2.0  # 2 FLOPs per weight per sequence
    peak = spec.matmul_flops_per_s
    hbm = spec.copy_bytes_per_s
    fwd = max(w / bw + m0 / hbm, flops / peak)
    bwd = max(w / bw + 2 * m0 / hbm, flops / peak)
    gaps = sequential_launches * GRAPH_GAP_S
    # Gates sharded along d: the state is sharded between layers, so each all-reduce becomes
    # a reduce-scatter + an all-gather (the same bytes, two latencies).
    # Per layer forward one all-reduce (GPN+M: the down partials and the read norm's sums in
    # one buffer), backward one (B, d) and for GPN+M one of the norm's (B, 2) sums
    # (collectives.py's fixed points): counted from the CUDA backend's code path by
    # gpu_model.account(tp=) when given, this formula otherwise; d-sharded gates add a
    # reduce-scatter + all-gather pair in place of each (B, d) sum.
    per_layer = (3 if cfg.memory else 2) + (2 if shard_gates else 0)
    n_ar = 0 if tp == 1 else cfg.n_layers * per_layer
    if allreduces_per_step is not None and tp > 1:
        n_ar = int(round(allreduces_per_step)) + (2 * cfg.n_layers if shard_gates else 0)
    ar_bytes = 0.0 if tp == 1 else 2 * cfg.n_layers * 4.0 * B * cfg.d_state
    decode = decode_seconds(cfg, tp, per_gpu, seq_len, decode_tp1_seconds)
    seconds = {
        "sequential": seq_len * (fwd + bwd + gaps),
        "chunk-wide": chunk_seconds,
        "decode": decode,
    }
    for kind, lat in ALLREDUCE_S.items():
        per_step = fwd + bwd + gaps + n_ar * lat
        # per_gpu sequences' chunk-wide work at tp = 1; a group does tp times the sequences
        # with 1/tp of the weights: the same per GPU.
        seconds[kind] = seq_len * per_step + chunk_seconds + decode
    return TpPrediction(tp, B, w, in_l2, ar_bytes, n_ar, seconds)


@functools.lru_cache(maxsize=32)
def _rank_accounting(cfg: GPNConfig, per_gpu: int, seq_len: int, tp: int) -> Any:
    from gpn_scale.accounting.step_model import account

    return account(cfg, per_gpu, seq_len, tp=tp)


def tp_table(
    cfg: GPNConfig,
    per_gpu: int,
    seq_len: int,
    gpu: str,
    n_gpus: int = 8,
    shard_gates: bool = False,
) -> list[TpPrediction]:
    from gpn_scale.accounting.step_model import GPUS, SEQUENTIAL, account, predict

    acc = account(cfg, per_gpu, seq_len)
    p = predict(acc, GPUS[gpu], graphs=True, cfg=cfg)
    chunk = sum(
        s
        for ph, s in p.per_phase_seconds.items()
        if ph not in SEQUENTIAL and ph not in VOCAB_PARALLEL_PHASES
    )
    dec = sum(p.per_phase_seconds.get(ph, 0.0) for ph in VOCAB_PARALLEL_PHASES)
    out = []
    for tp in (1, 2, 4, 8):
        if tp > n_gpus or (cfg.memory and cfg.n_heads % tp) or cfg.d_ffn % tp:
            continue
        # One rank's time step under tp, counted from the CUDA backend's code (its split
        # steps: 6 / 8 launches for 1 layer instead of 4 / 6, and the group's all-reduces).
        rank = acc if tp == 1 else _rank_accounting(cfg, per_gpu, seq_len, tp)
        launches = sum(rank.launches_per_step(ph) for ph in SEQUENTIAL)
        n_ar = sum(rank.collectives_per_step(ph) for ph in SEQUENTIAL)
        out.append(
            predict_tp(
                cfg, tp, per_gpu, seq_len, n_gpus, gpu, launches, chunk, dec, shard_gates, n_ar
            )
        )
    return out


def predicted_mfu_at_tp(cfg: GPNConfig, per_gpu: int, seq_len: int, gpu: str, tp: int) -> float:
    """The MFU `gpn-scale sweep plan` prices a run with at `parallel.tp = tp`: the launch
    accounting's tp = 1 MFU (gpu_model.predicted_mfu) times this model's predicted speed-up
    of tp over tp = 1 (NCCL; each GPU does the same FLOPs at any tp)."""
    from gpn_scale.accounting.step_model import predicted_mfu

    base = predicted_mfu(cfg, per_gpu, seq_len, gpu)
    if tp == 1:
        return base
    rows = {r.tp: r for r in tp_table(cfg, per_gpu, seq_len, gpu)}
    if tp not in rows:
        raise ValueError(
            f"parallel.tp={tp}: the prediction covers tp = {sorted(rows)} on one 8-GPU node"
        )
    return base * rows[1].step_seconds["nccl"] / rows[tp].step_seconds["nccl"]


def report(cfg: GPNConfig, name: str, per_gpu: int, seq_len: int, gpus: list[str]) -> str:
    lines = [
        f"# Tensor parallelism on one 8-GPU node: {name}, {per_gpu} sequences per GPU "
        f"(global batch {8 * per_gpu}), T = {seq_len}",
        "",
        "| GPU | gates | tp | sequences per group | loop weights per GPU (MB) | in L2 | "
        "all-reduces per step | all-reduce MB per step | sequential s | chunk-wide s | "
        "decode s | s/step NCCL | s/step symm-mem | speed-up (NCCL) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for gpu, shard_gates in [(g, sg) for g in gpus for sg in (False, True)]:
        rows = tp_table(cfg, per_gpu, seq_len, gpu, shard_gates=shard_gates)
        base = rows[0].step_seconds["nccl"] if rows and rows[0].tp == 1 else None
        for r in rows:
            # tp = 1: each GPU runs one optimizer step's share alone; a step over the global
            # batch takes as long as one GPU's window. tp > 1: likewise for each group.
            speed = f"{base / r.step_seconds['nccl']:.1f}x" if base else "-"
            lines.append(
                f"| {gpu} | {'d-sharded*' if shard_gates else 'replicated'} | {r.tp} | "
                f"{r.group_batch} | {r.weight_bytes_per_gpu / 1e6:,.0f} | "
                f"{'yes' if r.in_l2 else 'no'} | {r.allreduces_per_step} | "
                f"{r.allreduce_bytes_per_step / 1e6:.2f} | "
                f"{r.step_seconds['sequential']:.3f} | {r.step_seconds['chunk-wide']:.3f} | "
                f"{r.step_seconds['decode']:.3f} | {r.step_seconds['nccl']:.3f} | "
                f"{r.step_seconds['symm_mem']:.3f} | {speed} |"
            )
    lines += [
        "",
        f"Assumptions: L2 {L2_BYTES / 1e6:.0f} MB at ~{L2_BYTES_PER_S / 1e12:.0f} TB/s (est.); "
        f"all-reduce latency NCCL {ALLREDUCE_S['nccl'] * 1e6:.0f} us, symmetric memory "
        f"{ALLREDUCE_S['symm_mem'] * 1e6:.0f} us, bus bandwidth "
        f"{NVLINK_BUS_BYTES_PER_S / 1e9:.0f} GB/s; gpu_model's efficiencies and graph gap. "
        "sequential: the time loop's weights, M0 and launch gaps (no all-reduce latency); "
        "decode: vocabulary-parallel, with its two all-reduces.",
        "* gates d-sharded: the predict and fuse gates column-sharded along d as well (NOT "
        "built: models/gpn/parallelize.py replicates them today); shown because at d >= 2500 "
        "they are most of what tp = 8 still streams.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="model config name or path (e.g. gpn_m_1b)")
    parser.add_argument("--per-gpu", type=int, default=16, help="sequences per GPU (16)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--gpu", default="h100,h200")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=INT",
        help="override an integer model field (e.g. n_heads=16: the 130M's 15 heads do not split)",
    )
    args = parser.parse_args(argv)
    overrides: dict[str, int | None] = {}
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key] = int(value)
    if "n_heads" in overrides:  # the config's redundant cell count would contradict it
        overrides.setdefault("memory_cells", None)
    try:
        cfg = load_model_config(args.config, overrides or None)
    except ConfigError as err:
        print(f"tp_model: {err}", file=sys.stderr)
        return 2
    gpus = [g.strip() for g in args.gpu.split(",") if g.strip()]
    print(
        report(
            cfg,
            args.config + "".join(f" {k}={v}" for k, v in overrides.items()),
            args.per_gpu,
            args.seq_len,
            gpus,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
