"""`python -m gpn_scale.accounting.gpu_model`: the accounting's tables, its JSON, and its
prediction held against a committed device run.

    python -m gpn_scale.accounting.gpu_model gpn_m_130m --batch 64            # tables
    python -m gpn_scale.accounting.gpu_model gpn_m_130m --batch 64 --json     # one object
    python -m gpn_scale.accounting.gpu_model gpn_m_130m \\
        --against docs/device-runs/2026-12-04-h200 [--json]                  # vs measured
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from typing import Any

from gpn_scale.accounting import (
    baseline_report,
    ceilings,
    device_runs,
    gemm_routes,
    pricing,
    recorded,
)
from gpn_scale.accounting.run_pricing import RunPricing
from gpn_scale.accounting.step_model import (
    GPUS,
    PACKED,
    PLACEMENTS,
    SEQUENTIAL,
    SIDE_WORK,
    SPREAD,
    Accounting,
    Baseline,
    account,
    account_baseline,
    baseline_for,
    gpu_ceilings,
    predict,
)
from gpn_scale.accounting.step_model import role as step_role
from gpn_scale.models.gpn import GPNConfig, load_model_config
from gpn_scale.models.gpn.config import ConfigError


def _launches(acc: Accounting, phase: str) -> str:
    sums = acc.split_sums_per_step(phase)
    kernels = acc.launches_per_step(phase) - sums
    return f"{kernels:.0f}" + (f" + {sums:.0f} split-K sums" if sums else "")


def facts_sources(acc: Accounting) -> dict[str, int]:
    """Triton launches of the longer probe by where their compiled facts came from."""
    return dict(Counter(op.cost.facts for op in acc.ops if op.cost is not None))


def top_kernels(acc: Accounting, gpu: str, graphs: bool, n: int = 12) -> list[dict[str, Any]]:
    """The launch roles ranked by predicted seconds per training step, each with its counted
    bytes over that time as a share of the copy bandwidth (the issue's bar for a sequential
    kernel: 60% of the measured copy)."""
    p = predict(acc, gpu, graphs=graphs)
    copy = gpu_ceilings(gpu).copy_bytes_per_s
    top = sorted(p.per_role_seconds.items(), key=lambda kv: -kv[1])[:n]
    return [
        {
            "role": role,
            "predicted_s": s,
            "share": s / p.seconds,
            "bandwidth_share": acc.at_seq_len(
                lambda ops, r=role: sum(op.bytes for op in ops if step_role(op.name) == r)
            )
            / s
            / copy,
        }
        for role, s in top
    ]


def report(
    acc: Accounting,
    cfg: GPNConfig,
    gpus: list[str],
    before: Accounting | None = None,
    baseline: Baseline | None = None,
) -> str:
    lines = [
        f"# GPU accounting: {acc.config}, batch {acc.batch}, T = {acc.seq_len}, chunk "
        f"{acc.chunk}, {acc.n_layers} layer(s) (bf16 autocast; probes of "
        f"{' and '.join(map(str, sorted(acc.probes)))} steps, extrapolated)",
        "",
        f"Launches per time step (CUDA backend): forward {_launches(acc, SEQUENTIAL[0])}, "
        f"reverse sweep {_launches(acc, SEQUENTIAL[1])}",
    ]
    if acc.tp > 1:
        lines.append(
            f"Tensor parallelism: one rank of tp = {acc.tp}; all-reduces per time step: "
            f"forward {acc.collectives_per_step('sequential forward'):.0f}, reverse sweep "
            f"{acc.collectives_per_step('sequential backward'):.0f} (each priced at "
            f"{pricing.COLLECTIVE_S * 1e6:.0f} us)"
        )
    lines += ["", "| phase | launches | GB moved | GFLOP |", "|---|---|---|---|"]
    per_phase = acc.per_phase()
    for phase, row in sorted(per_phase.items(), key=lambda kv: -kv[1]["bytes"]):
        lines.append(
            f"| {phase} | {row['launches']:,.0f} | {row['bytes'] / 1e9:,.2f} | "
            f"{row['flops'] / 1e9:,.1f} |"
        )
    rows = [(f"CUDA backend, graphs {'on' if g else 'off'}", acc, g) for g in (True, False)]
    if before is not None:
        rows.append(("PyTorch steps (eager)", before, False))
    phases = sorted(per_phase, key=lambda ph: -per_phase[ph]["bytes"])
    lines += [
        "",
        "| GPU | path | predicted s/step | floor s/step | floor / predicted | "
        "tokens/s | MFU | " + " | ".join(phases) + " |",
        "|---|---|---|---|---|---|---|" + "---|" * len(phases),
    ]
    for key in gpus:
        for label, a, graphs in rows:
            p = predict(a, key, graphs=graphs, cfg=cfg)
            lines.append(
                f"| {p.gpu.name} | {label} | {p.seconds:.3f} | {p.floor_seconds:.3f} | "
                f"{p.floor_seconds / p.seconds:.0%} | {p.tokens_per_s:,.0f} | {p.mfu:.1%} | "
                + " | ".join(f"{p.per_phase_seconds.get(ph, 0):.3f}" for ph in phases)
                + " |"
            )
    lines += [
        "",
        f"Where the step goes on the {GPUS[gpus[-1]].name} (graphs on), launch roles by "
        "predicted time:",
        "",
        "| role | s/step | share | counted bytes / s/step, of the copy bandwidth |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {k['role']} | {k['predicted_s']:.4f} | {k['share']:.0%} | {k['bandwidth_share']:.0%} |"
        for k in top_kernels(acc, gpus[-1], True)
    ]
    lines += baseline_report.prediction_lines(acc, cfg, gpus, baseline)
    lines += _basis_lines(acc, cfg, gpus)
    return "\n".join(lines) + "\n"


def _basis_lines(acc: Accounting, cfg: GPNConfig, gpus: list[str]) -> list[str]:
    """The side work hidden, the ceilings and the kernel facts the prediction stands on."""
    lines = [
        *_side_work_lines(acc, cfg, gpus[-1]),
        "",
        "Ceilings priced with (accounting/ceilings.py):",
    ]
    for key in gpus:
        lines += [f"- {GPUS[key].name}: {d}" for d in ceilings.describe(GPUS[key])]
    lines += [
        "",
        f"Kernel facts (occupancy, pipelining, instructions): {facts_sources(acc)} launches; "
        f"{pricing.GRAPH_GAP_S * 1e6:.1f} us between graphed kernels, "
        f"{pricing.HOST_LAUNCH_S * 1e6:.0f} us host time per eager ATen launch, the host's "
        f"measured Triton binding + {pricing.LAUNCHER_S * 1e6:.0f} us per eager Triton launch.",
    ]
    return lines


def _side_work_lines(acc: Accounting, cfg: GPNConfig, gpu: str) -> list[str]:
    p = predict(acc, gpu, graphs=True, cfg=cfg)
    spread = predict(acc, gpu, graphs=True, cfg=cfg, placement=SPREAD)
    side = sum(p.per_phase_seconds.get(ph, 0.0) for ph in SIDE_WORK)
    return [
        "",
        f"Backward side work beside the reverse sweep (engine.overlap_backward, predicted): "
        f"{p.overlapped_seconds:.3f} s of {side:.3f} s hidden on the {p.gpu.name} (graphs "
        "on); the phases above list it whole.",
        f"Decode beside the forward steps (engine.overlap_decode, predicted): "
        f"{p.decode_overlapped_seconds:.3f} s of {p.per_phase_seconds.get('decode', 0.0):.3f} s "
        "hidden.",
        f"Both assume the side work fits in the slots a sweep launch leaves on the SMs it holds "
        f"(step_model._spare, '{PACKED}'). Were each sweep program alone on an SM "
        f"('{SPREAD}'): {spread.overlapped_seconds:.3f} s and "
        f"{spread.decode_overlapped_seconds:.3f} s hidden, {spread.seconds:.3f} s a step "
        f"({acc.batch * acc.seq_len / spread.seconds:,.0f} tokens/s). Not yet measured: the "
        "device check's overlap A/B decides (`--against`).",
    ]


def prediction_json(acc: Accounting, cfg: GPNConfig, gpu: str, baseline: Baseline | None) -> dict:
    p = predict(acc, gpu, graphs=True, cfg=cfg)
    c = GPUS[gpu]
    out: dict[str, Any] = {
        "config": acc.config,
        "batch": acc.batch,
        "seq_len": acc.seq_len,
        "gpu": c.name,
        "graphs": True,
        "predicted_s": p.seconds,
        "serial_floor_s": p.floor_seconds,
        "tokens_per_s": p.tokens_per_s,
        "mfu": p.mfu,
        "per_phase_s": p.per_phase_seconds,
        "overlapped_s": {
            "backward side work": p.overlapped_seconds,
            "decode": p.decode_overlapped_seconds,
        },
        "spread_placement": _spread_json(acc, cfg, gpu),
        "kernels": top_kernels(acc, gpu, True, n=len(p.per_role_seconds)),
        "ceilings": {
            k: {"value": getattr(c, k), "source": c.source(k)}
            for k in (*ceilings.MEASURED_KEYS, "sm_clock_hz", "dependent_issue_cycles")
        },
        "kernel_facts": facts_sources(acc),
    }
    if baseline is not None:
        comp = baseline.tokens_per_s(gpu, True)
        out.update(
            baseline=baseline.config,
            baseline_tokens_per_s=comp,
            baseline_eager_tokens_per_s=baseline.tokens_per_s(gpu, False),
            baseline_mfu=baseline.mfu(gpu, True),
            gpn_over_compiled_transformer=p.tokens_per_s / comp,
        )
    return out


def _spread_json(acc: Accounting, cfg: GPNConfig, gpu: str) -> dict[str, float]:
    """The prediction were each sweep program alone on an SM (step_model._spare)."""
    p = predict(acc, gpu, graphs=True, cfg=cfg, placement=SPREAD)
    return {
        "predicted_s": p.seconds,
        "backward side work hidden_s": p.overlapped_seconds,
        "decode hidden_s": p.decode_overlapped_seconds,
    }


def engine_ab(p: RunPricing) -> list[dict[str, Any]]:
    """The run's rows of `config` timed with an engine option changed (the device check's
    engine A/B) beside its shipped rows at the same batch: the time each option saves,
    measured and predicted (both priced from this tree's launches with the run's compiled
    facts). The shipped rows' side work is priced under each placement (step_model._spare),
    so the measured saving of the side streams says which holds; the changed rows' under
    the run's placement (its measured one, where it has it)."""
    cfg, c, config, graphs = p.cfg, p.ceilings, p.config, p.graphs
    shipped = {r["batch"]: r["step_s"] for r in device_runs.model_rows(p.blob, config)}
    on = dict(
        overlap=p.meta.get("overlap_backward", False),
        overlap_decode=p.meta.get("overlap_decode", False),
    )
    seq_len = p.seq_len
    out = []
    for label, options, rows in device_runs.engine_ab_rows(p.blob, config):
        for row in rows:
            b = row["batch"]
            if b not in shipped or not p.wants(b):
                continue
            facts = device_runs.kernel_facts(p.run, config, b) or None
            cfg_off = cfg.replace(**options)
            off = dict(
                overlap=options.get("overlap_backward", on["overlap"]),
                overlap_decode=options.get("overlap_decode", on["overlap_decode"]),
            )
            acc_on = account(cfg, b, seq_len, config, facts=facts)
            acc_off = account(cfg_off, b, seq_len, config, facts=facts)
            out.append(
                {
                    "label": label,
                    "batch": b,
                    "options": options,
                    "measured_s": {"shipped": shipped[b], "changed": row["step_s"]},
                    "predicted_s": {
                        **{
                            f"shipped, {pl}": predict(
                                acc_on, c, graphs, cfg, placement=pl, **on
                            ).seconds
                            for pl in PLACEMENTS
                        },
                        "changed": predict(
                            acc_off, c, graphs, cfg_off, placement=p.placement, **off
                        ).seconds,
                    },
                }
            )
    return out


def _run_config(config: str, meta: dict, chunk_size: int | None) -> GPNConfig:
    """`config` with the engine options a run's meta says it ran under. A run from before an
    option ran without it (2026-12-04: no side streams, no PDL, no SMs left to them)."""
    cfg = load_model_config(config).replace(
        dependent_launch=meta.get("dependent_launch", False),
        side_work_sm_share=meta.get("side_work_sm_share", 0.0),
        bf16_memory_reads=meta.get("bf16_memory_reads", False),
        cublas_gemms=meta.get("cublas_gemms", "none"),
    )
    return cfg if chunk_size is None else cfg.replace(chunk_size=chunk_size)


def against(
    config: str,
    run_arg: str,
    chunk_size: int | None = None,
    batches: list[int] | None = None,
) -> dict[str, Any]:
    """The accounting beside a committed device run: per measured batch of `config` the
    predicted and measured step, per launch role where the run kept a ledger, and its engine
    A/B (`engine_ab`). Priced with the run's ceilings, its recorded kernel facts and the
    block scheduler's placement it measured (packed where it did not)."""
    run = device_runs.resolve(run_arg)
    blob = device_runs.read_results(run)
    meta = blob.get("meta", {})
    gpu = ceilings.gpu_key(meta.get("device_name", ""))
    if gpu is None:
        raise ValueError(f"{run}: device {meta.get('device_name')!r} has no ceilings (H100, H200)")
    rows = device_runs.model_rows(blob, config)
    if not rows:
        models = [k for k, v in blob.get("summary", {}).items() if isinstance(v, dict)]
        raise ValueError(f"{run}: no measured rows for {config} (models: {', '.join(models)})")
    cfg = _run_config(config, meta, chunk_size)  # the side streams: those the run used
    graphs = meta.get("cuda_graphs", True)
    overlap, decode = meta.get("overlap_backward", False), meta.get("overlap_decode", False)
    ledger = device_runs.ledger_rows(blob, config)
    steps, kernels = [], []
    c = ceilings.with_measured(
        ceilings.DEFAULTS[gpu], blob.get("ceilings") or {}, f"measured, {run.name}"
    )
    measured_placement = device_runs.placement(blob)
    placement = measured_placement if measured_placement in PLACEMENTS else PACKED
    chosen = tuple(batches) if batches is not None else None
    pricing_ = RunPricing(run, blob, config, cfg, c, graphs, placement, chosen)
    seq_len = pricing_.seq_len
    priced = ""
    for row in sorted(rows, key=lambda r: r["batch"]):
        if not pricing_.wants(row["batch"]):
            continue
        acc, priced = _run_accounting(run, config, row["batch"], seq_len, cfg)
        p = predict(acc, c, graphs, cfg, overlap, decode, placement=placement)
        steps.append(
            {
                "batch": row["batch"],
                "predicted_s": p.seconds,
                "measured_s": row["step_s"],
                "predicted_over_measured": p.seconds / row["step_s"],
            }
        )
        for k in ledger:
            if k["batch"] == row["batch"] and k["role"] in p.per_role_seconds:
                kernels.append(
                    {
                        "batch": k["batch"],
                        "role": k["role"],
                        "predicted_s": p.per_role_seconds[k["role"]],
                        "measured_s": k["s_per_step"],
                    }
                )
    return {
        "run": run.name,
        "config": config,
        "gpu": c.name,
        "seq_len": seq_len,
        "graphs": graphs,
        "priced": priced,
        "placement": {"measured": measured_placement, "priced": placement},
        "engine_ab": engine_ab(pricing_),
        "gemm_routes": gemm_routes.against_run(pricing_),
        "transformer": baseline_report.against_run(pricing_),
        "ceilings": {
            k: {"value": getattr(c, k), "source": c.source(k)} for k in ceilings.MEASURED_KEYS
        },
        "steps": steps,
        "kernels": kernels,
    }


def _run_accounting(
    run, config: str, batch: int, seq_len: int, cfg: GPNConfig
) -> tuple[Accounting, str]:
    """A run's launches at `batch` and what priced them: the launches that ran there, as
    counted then, where the run recorded them; else this tree's, with the run's compiled
    facts where it has them."""
    acc = recorded.read(run, config, batch, seq_len)
    if acc is not None:
        return acc, f"{run.name}/{recorded.OPS}"
    facts = device_runs.kernel_facts(run, config, batch)
    acc = account(cfg, batch, seq_len, config, facts=facts or None)
    if facts:
        return acc, f"this tree's launches, {run.name}/{device_runs.KERNELS}"
    return acc, "this tree's launches and compiled kernels"


def against_table(result: dict[str, Any]) -> str:
    lines = [
        f"# {result['config']} against device run {result['run']} ({result['gpu']}, T = "
        f"{result['seq_len']}, graphs {'on' if result['graphs'] else 'off'}; priced: "
        f"{result['priced']})",
        "",
        "| batch | predicted s/step | measured s/step | predicted / measured |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {s['batch']} | {s['predicted_s']:.3f} | {s['measured_s']:.3f} | "
        f"{s['predicted_over_measured']:.2f} |"
        for s in result["steps"]
    ]
    if result["kernels"]:
        lines += ["", "| batch | role | predicted s/step | measured s/step |", "|---|---|---|---|"]
        lines += [
            f"| {k['batch']} | {k['role']} | {k['predicted_s']:.4f} | {k['measured_s']:.4f} |"
            for k in result["kernels"]
        ]
    else:
        lines += ["", "The run kept no per-launch ledger: steps only."]
    lines += _placement_lines(result.get("placement") or {})
    lines += _engine_ab_lines(result["engine_ab"])
    lines += gemm_routes.table(result.get("gemm_routes") or [])
    lines += baseline_report.table(result.get("transformer") or {})
    lines += ["", "Ceilings:"] + [
        f"- {k}: {v['value']:.4g} ({v['source']})" for k, v in result["ceilings"].items()
    ]
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gpn_scale.accounting.gpu_model",
        description="Launch, byte and FLOP accounting of a GPN training step on CUDA, and "
        "its predicted time on H100/H200",
    )
    parser.add_argument("config", help="model config name or path (e.g. gpn_m_130m)")
    parser.add_argument("--batch", type=int, default=64, help="sequences per GPU (default 64)")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (2048)")
    parser.add_argument("--chunk-size", type=int, default=None, help="override chunk_size")
    parser.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an engine option to price (repeatable; e.g. bf16_memory_reads=true, "
        "side_work_sm_share=0); ops/gpn_step/options.py lists them",
    )
    parser.add_argument(
        "--gpu",
        default=None,
        help=f"comma-separated, of {', '.join(GPUS)} (default: both; h200 with --json)",
    )
    parser.add_argument("--tp", type=int, default=1, help="one rank of a tp group of this size")
    parser.add_argument(
        "--compiled",
        default="auto",
        help="price each Triton launch with its kernel compiled for this target (sm_90, "
        "sm_80; accounting/gpu_compile.py, its facts cached in .cache/gpu-compile), 'none' "
        "(the facts cache or a device run's recorded kernels), or 'auto' (sm_90, unless "
        "this process runs Triton's interpreter)",
    )
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile processes")
    parser.add_argument(
        "--baseline",
        default="auto",
        help="the Transformer++ priced beside it: 'auto' (the one the device check trains "
        "beside this GPN: its width, about its parameters, tied), a config name (e.g. "
        "transformer_pp_130m, the ladder's), or 'none'",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--against",
        metavar="RUN",
        help="a committed device run (a folder, or its name under docs/device-runs): the "
        "prediction beside what it measured",
    )
    return parser


def with_engine_options(cfg: GPNConfig, given: list[str]) -> GPNConfig:
    """`cfg` with the engine options of `--engine KEY=VALUE`, each value spelled as the
    device check's config flags spell it (`device_runs.flag_value`) and applied as a run's
    `engine:` section is (the family's run option); a malformed or unknown one is a
    ConfigError naming it."""
    from gpn_scale.models.gpn.spec import SPEC

    changes: dict[str, Any] = {}
    for item in given:
        key, eq, value = item.partition("=")
        key = key.strip().removeprefix("engine.")
        if not eq or not key:
            raise ConfigError(f"--engine {item!r}: expected KEY=VALUE, e.g. bf16_memory_reads=true")
        changes[key] = device_runs.flag_value(value)
    return SPEC.run_options["engine"](cfg, changes) if changes else cfg


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.against:
        try:
            result = against(args.config, args.against, args.chunk_size)
        except (FileNotFoundError, ValueError, ConfigError) as exc:
            print(f"gpu_model: {exc}", file=sys.stderr)
            return 2
        print(json.dumps(result, indent=1) if args.json else against_table(result))
        return 0
    gpus = [
        g.strip().lower() for g in (args.gpu or ("h200" if args.json else "h100,h200")).split(",")
    ]
    gpus = [g for g in gpus if g]
    unknown = [g for g in gpus if g not in GPUS]
    if unknown or not gpus or args.batch < 1 or args.seq_len < 1 or args.tp < 1:
        problem = f"unknown GPU {unknown[0]}" if unknown else "batch, seq-len and tp must be >= 1"
        print(f"gpu_model: {problem} (GPUs: {', '.join(GPUS)})", file=sys.stderr)
        return 2
    compiled: str | None = args.compiled.lower()
    if compiled == "auto":
        compiled = None if os.environ.get("TRITON_INTERPRET") == "1" else "sm_90"
    elif compiled == "none":
        compiled = None
    if compiled is not None and compiled not in ("sm_90", "sm_80"):
        print(f"gpu_model: --compiled {compiled!r}: expected sm_90, sm_80 or none", file=sys.stderr)
        return 2
    try:
        cfg = load_model_config(args.config)
        if args.chunk_size is not None:
            cfg = cfg.replace(chunk_size=args.chunk_size)
        cfg = with_engine_options(cfg, args.engine)
        acc = account(
            cfg,
            args.batch,
            args.seq_len,
            args.config,
            tp=args.tp,
            compiled=compiled,
            jobs=max(1, args.jobs),
        )
        baseline = None
        if args.baseline.lower() != "none":
            model = baseline_for(cfg) if args.baseline == "auto" else args.baseline
            baseline = account_baseline(model, args.batch, args.seq_len)
    except ConfigError as exc:
        print(f"gpu_model: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(prediction_json(acc, cfg, gpus[0], baseline), indent=1))
        return 0
    before = account(cfg, args.batch, args.seq_len, args.config, backend="reference", tp=args.tp)
    print(report(acc, cfg, gpus, before, baseline))
    return 0


def _placement_lines(placement: dict[str, Any]) -> list[str]:
    measured, priced = placement.get("measured"), placement.get("priced", PACKED)
    if measured is None:
        said = "The run did not measure the block scheduler's placement (bench/gpu_placement.py)"
    else:
        said = f"The run measured the block scheduler's placement: {measured}"
    return ["", f"{said}; the side work is priced {priced} (step_model._spare)."]


def _engine_ab_lines(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return ["", "The run timed no engine A/B (`bench.gpu --no-engine-ab`, or before it)."]
    lines = [
        "",
        "Engine A/B: seconds a step with the shipped options and with the row's changed "
        f"(the side work priced {PACKED} / {SPREAD}, step_model._spare):",
        "",
        "| change | batch | measured shipped | measured changed | predicted shipped "
        f"({PACKED} / {SPREAD}) | predicted changed |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        m, p = r["measured_s"], r["predicted_s"]
        lines.append(
            f"| {r['label']} | {r['batch']} | {m['shipped']:.3f} | {m['changed']:.3f} | "
            f"{p[f'shipped, {PACKED}']:.3f} / {p[f'shipped, {SPREAD}']:.3f} | "
            f"{p['changed']:.3f} |"
        )
    return lines
