"""`gpn-scale sweep plan SWEEP` and `gpn-scale fit ...` (numpy/scipy/matplotlib load lazily).

`sweep` takes sub-commands: `plan`; `submit` and `status` (submitit, gpn_scale.scaling.submit
and .status); `pending` and `run-argv`, the helpers of slurm/sweep.sh and slurm/train.sbatch.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any

from gpn_scale.core.config import ConfigError


def register(subparsers: argparse._SubParsersAction) -> None:
    _register_sweep(subparsers)
    _register_fit(subparsers)


# ----------------------------------------------------------------------------- sweep


def _register_sweep(subparsers: argparse._SubParsersAction) -> None:
    sweep = subparsers.add_parser(
        "sweep",
        help="plan, submit and track a sweep of runs from configs/sweeps/*.yaml",
        description="Sweeps: a grid of model sizes x seeds with per-size rules. Exit "
        "codes: 0 done, 2 bad sweep file or input (one line on stderr).",
    )
    sweep.set_defaults(func=lambda args: (sweep.print_help(), 0)[1])
    sub = sweep.add_subparsers(dest="sweep_command", metavar="SUBCOMMAND")
    plan = sub.add_parser(
        "plan",
        help="validate a sweep file and print its expanded runs",
        description="Validate SWEEP (every key, every model config, every run's trainer "
        "overrides) and print its runs: name, params, tokens, FLOPs, GPU-hours.",
    )
    plan.add_argument("sweep", metavar="SWEEP", help="configs/sweeps/<name>.yaml or a path")
    plan.add_argument("--json", action="store_true", help="print the runs as JSON instead")
    plan.add_argument(
        "--overrides", action="store_true", help="also print each run's `gpn-scale train` arguments"
    )
    plan.add_argument(
        "--allow-few-seeds",
        action="store_true",
        help="accept < 3 seeds (CI/smoke sweeps only; same as allow_few_seeds: true)",
    )
    plan.set_defaults(func=cmd_sweep_plan)

    pend = sub.add_parser(
        "pending",
        help="indices of the runs without a DONE marker (for slurm/sweep.sh)",
        description="Print the indices of SWEEP's unfinished runs (no DONE marker in the run's "
        "checkpoint root, local or s3://) as one comma-separated line, e.g. "
        "'0,2,3' (an empty line when all are finished): the --array of sweep.sh.",
    )
    pend.add_argument("sweep", metavar="SWEEP", help="configs/sweeps/<name>.yaml or a path")
    pend.add_argument("--names", action="store_true", help="print 'INDEX NAME' lines instead")
    pend.add_argument(
        "--shell",
        action="store_true",
        help="print SWEEP_NAME=<name> and PENDING=<indices> lines (sweep.sh)",
    )
    pend.add_argument(
        "--validate",
        action="store_true",
        help="first check every run's config with the trainer (as `plan` does)",
    )
    pend.set_defaults(func=cmd_sweep_pending)

    snap = sub.add_parser(
        "snapshot",
        help="freeze every run's train argv into a JSON table (slurm/sweep.sh)",
        description="Write the `gpn-scale train` argv of every run of SWEEP to OUT (JSON), "
        "so that queued array tasks keep their runs whatever happens to the YAML.",
    )
    snap.add_argument("sweep", metavar="SWEEP", help="configs/sweeps/<name>.yaml or a path")
    snap.add_argument("out", metavar="OUT", help="the table to write (.json)")
    snap.set_defaults(func=cmd_sweep_snapshot)

    argv = sub.add_parser(
        "run-argv",
        help="the `gpn-scale train` arguments of run INDEX (for slurm/train.sbatch)",
        description="Print the `gpn-scale train` arguments of SWEEP's run INDEX, one per line.",
    )
    argv.add_argument(
        "sweep", metavar="SWEEP", help="configs/sweeps/<name>.yaml, a path, or a snapshot .json"
    )
    argv.add_argument("index", metavar="INDEX", type=int, help="run index (SLURM_ARRAY_TASK_ID)")
    argv.add_argument(
        "--if-pending",
        action="store_true",
        help="print nothing (exit 0) when the run already has its DONE marker",
    )
    argv.set_defaults(func=cmd_sweep_run_argv)

    submit = sub.add_parser(
        "submit",
        help="submit the unfinished runs through submitit (SLURM or local)",
        description="Submit one submitit job per unfinished run of SWEEP (runs with a DONE "
        "marker are skipped). --executor slurm on a cluster, local on a laptop.",
    )
    submit.add_argument("sweep", metavar="SWEEP", help="configs/sweeps/<name>.yaml or a path")
    submit.add_argument(
        "--executor",
        default="auto",
        choices=("auto", "slurm", "local"),
        help="auto: slurm when sbatch is on PATH, else local [auto]",
    )
    submit.add_argument("--folder", help="submitit logs/pickles [<run_root>/submitit]")
    submit.add_argument(
        "-p",
        "--partition",
        default=os.environ.get("SWEEP_PARTITION"),
        help="SLURM partition (default: $SWEEP_PARTITION, else the cluster's)",
    )
    submit.add_argument(
        "-A",
        "--account",
        default=os.environ.get("SWEEP_ACCOUNT"),
        help="SLURM account (default: $SWEEP_ACCOUNT, else the user's)",
    )
    submit.add_argument(
        "-q",
        "--qos",
        default=os.environ.get("SWEEP_QOS"),
        help="SLURM QOS (default: $SWEEP_QOS, else none)",
    )
    submit.add_argument(
        "-t",
        "--time",
        "--time-min",
        dest="time_min",
        type=slurm_minutes,
        metavar="TIME",
        default=os.environ.get("SWEEP_TIME") or os.environ.get("SWEEP_TIME_MIN") or "1440",
        help="time limit per job, as for sbatch and slurm/sweep.sh -t: minutes "
        "(90) or [D-]HH:MM:SS (1-00:00:00, 24:00:00) (default: "
        "$SWEEP_TIME, else $SWEEP_TIME_MIN, else 1440 = 24 h)",
    )
    submit.add_argument(
        "--nodes",
        type=int,
        default=int(os.environ.get("SWEEP_NODES", 1)),
        help="nodes per run (default: $SWEEP_NODES, else 1)",
    )
    submit.add_argument(
        "--gpus",
        type=int,
        default=int(os.environ.get("SWEEP_GPUS", 0)),
        help="GPUs per node = tasks per node (0: CPU, one task) [0]",
    )
    submit.add_argument(
        "--cpus-per-task",
        type=int,
        default=None,
        help="CPUs per task (default: submitit's / the partition's)",
    )
    submit.add_argument(
        "--mem-gb",
        type=float,
        default=None,
        help="memory per node in GB (default: the partition's)",
    )
    submit.add_argument(
        "--signal-delay-s",
        type=int,
        default=300,
        help="seconds before the time limit to save and requeue [300]",
    )
    submit.add_argument(
        "--only",
        type=int,
        nargs="+",
        metavar="INDEX",
        help="only these run indices (if unfinished)",
    )
    submit.add_argument("--wait", action="store_true", help="wait for the jobs and report")
    submit.set_defaults(func=cmd_sweep_submit)

    status = sub.add_parser(
        "status",
        help="table of every run: state, step, tokens, last eval loss, restarts",
        description="One row per run of SWEEP from its DONE marker, latest checkpoint, "
        "metrics.jsonl and (when squeue is on PATH) its SLURM job.",
    )
    status.add_argument("sweep", metavar="SWEEP", help="configs/sweeps/<name>.yaml or a path")
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    status.add_argument("--no-scheduler", action="store_true", help="do not ask squeue")
    status.set_defaults(func=cmd_sweep_status)


_SLURM_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def slurm_minutes(text: str) -> int:
    """A time limit in sbatch's formats (M, M:S, H:M:S, D-H, D-H:M, D-H:M:S) as whole minutes
    (seconds round up), so that `sweep submit -t` reads what `sweep.sh -t` passes to sbatch."""
    m = _SLURM_TIME.match(str(text).strip())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not minutes or [D-]HH:MM:SS")
    days, a, b, c = m.groups()
    if days is not None:  # D-H[:M[:S]]
        seconds = ((int(days) * 24 + int(a)) * 60 + int(b or 0)) * 60 + int(c or 0)
    elif c is not None:  # H:M:S
        seconds = (int(a) * 60 + int(b)) * 60 + int(c)
    elif b is not None:  # M:S
        seconds = int(a) * 60 + int(b)
    else:  # M
        seconds = int(a) * 60
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the time limit must be > 0")
    return -(-seconds // 60)


def cmd_sweep_plan(args: argparse.Namespace) -> int:
    from gpn_scale.scaling.sweep import format_plan, load_sweep, validate_with_trainer

    sweep = load_sweep(args.sweep, allow_few_seeds=args.allow_few_seeds)
    validate_with_trainer(sweep)
    if args.json:
        print(
            json.dumps(
                {
                    "sweep": sweep.name,
                    "path": str(sweep.path),
                    "seeds": sweep.seeds,
                    "hardware": sweep.hardware,
                    "notes": sweep.notes,
                    "total_flops": sweep.total_flops,
                    "total_gpu_hours": sweep.total_gpu_hours,
                    "runs": [r.to_dict() for r in sweep.runs],
                },
                indent=1,
            )
        )
        return 0
    print(format_plan(sweep))
    if args.overrides:
        print()
        for r in sweep.runs:
            print(f"{r.name}: gpn-scale train {' '.join(r.train_argv())}")
    return 0


def cmd_sweep_pending(args: argparse.Namespace) -> int:
    from gpn_scale.scaling.slurm_launch import live_runs, load, pending_indices

    sweep = load(args.sweep)
    if args.validate:
        from gpn_scale.scaling.sweep import validate_with_trainer

        validate_with_trainer(sweep)
    live = live_runs(sweep)
    todo = pending_indices(sweep, live)
    for i, why in sorted(live.items()):
        print(f"skipping run {i} ({sweep.runs[i].name}): {why}", file=sys.stderr)
    if args.shell:
        print(f"SWEEP_NAME={sweep.name}")
        print(f"PENDING={','.join(str(i) for i in todo)}")
        print(f"LIVE={','.join(str(i) for i in sorted(live))}")
    elif args.names:
        for i in todo:
            print(f"{i} {sweep.runs[i].name}")
    else:
        print(",".join(str(i) for i in todo))
    return 0


def cmd_sweep_run_argv(args: argparse.Namespace) -> int:
    from gpn_scale.scaling.slurm_launch import TableRun, is_done, load, run_at, table_run_at
    from gpn_scale.scaling.sweep import RunSpec

    run: RunSpec | TableRun
    if args.sweep.endswith(".json"):  # the table snapshotted at submit time
        run = table_run_at(args.sweep, args.index)
    else:
        run = run_at(load(args.sweep), args.index)
    if args.if_pending and is_done(run):
        print(
            f"run {args.index} ({run.name}) is already finished ({run.checkpoint_root}/DONE)",
            file=sys.stderr,
        )
        return 0
    print("\n".join(run.train_argv()))
    return 0


def cmd_sweep_snapshot(args: argparse.Namespace) -> int:
    from gpn_scale.scaling.slurm_launch import load, write_table

    if not args.out.endswith(".json"):
        raise ConfigError(f"snapshot: OUT must end in .json, got {args.out!r}")
    write_table(load(args.sweep), args.out)
    print(args.out)
    return 0


def cmd_sweep_submit(args: argparse.Namespace) -> int:
    from gpn_scale.scaling.slurm_launch import load
    from gpn_scale.scaling.submit import SubmitOptions, submit_sweep

    sweep = load(args.sweep)
    opts = SubmitOptions(
        executor=args.executor,
        folder=args.folder,
        partition=args.partition,
        account=args.account,
        qos=args.qos,
        time_min=args.time_min,
        nodes=args.nodes,
        gpus_per_node=args.gpus,
        cpus_per_task=args.cpus_per_task,
        mem_gb=args.mem_gb,
        signal_delay_s=args.signal_delay_s,
        only=args.only,
    )
    kind, jobs = submit_sweep(sweep, opts)
    if not jobs:
        print(
            f"nothing to submit: every run of sweep {sweep.name} is finished or has a live job"
            + (" (of --only)" if args.only else "")
        )
        return 0
    for i, job in jobs:
        print(f"submitted {sweep.runs[i].name} (run {i}) as {kind} job {job.job_id}")
    if args.wait:
        failed = 0
        for i, job in jobs:
            try:
                job.result()
            except Exception as err:  # noqa: BLE001 - report every job, then fail once
                failed += 1
                first = str(err).strip().splitlines()[-1] if str(err).strip() else repr(err)
                print(f"run {i} ({sweep.runs[i].name}) failed: {first}", file=sys.stderr)
        if failed:
            raise ConfigError(
                f"{failed} of {len(jobs)} jobs failed; see the logs under "
                f"{opts.folder or 'the submitit folder'}"
            )
        print(f"all {len(jobs)} jobs finished")
    return 0


def cmd_sweep_status(args: argparse.Namespace) -> int:
    from gpn_scale.scaling.slurm_launch import load
    from gpn_scale.scaling.status import format_status, sweep_status

    sweep = load(args.sweep)
    rows = sweep_status(sweep, scheduler=not args.no_scheduler)
    if args.json:
        print(json.dumps({"sweep": sweep.name, "runs": [r.to_dict() for r in rows]}, indent=1))
    else:
        print(format_status(sweep, rows))
    return 0


# ----------------------------------------------------------------------------- fit


def _register_fit(subparsers: argparse._SubParsersAction) -> None:
    fit = subparsers.add_parser(
        "fit",
        help="fit scaling laws (L(N), L(C), L(N,D)) with seed-bootstrap CIs",
        description="Collect the runs' final held-out losses, aggregate seeds, fit "
        "L(N)=E+A·N^-alpha and L(C) per family (and L(N,D)=E+A/N^alpha+B/D^beta "
        "where tokens per parameter vary) with the Epoch AI protocol, and write "
        "report.md, fit.json and PNG plots. A law the data cannot determine is "
        "skipped with a note. Exit codes: 0 written, 2 bad input or nothing "
        "fittable (one line on stderr).",
    )
    fit.add_argument(
        "roots",
        nargs="*",
        metavar="RUNS",
        help="run directories or roots holding them (local or s3://)",
    )
    fit.add_argument(
        "--sweep",
        action="append",
        default=[],
        metavar="SWEEP",
        help="take the runs of this sweep file (repeatable)",
    )
    fit.add_argument(
        "--table",
        action="append",
        default=[],
        metavar="CSV",
        help="external results, CSV/JSONL with family,N,D,loss[,C,seed,run] "
        "(e.g. Transformer++ / Gated DeltaNet baselines; repeatable)",
    )
    fit.add_argument("--wandb", metavar="ENTITY/PROJECT", help="also read finished W&B runs")
    fit.add_argument("--wandb-group", metavar="GROUP", help="only this W&B group")
    fit.add_argument(
        "--out",
        default="scaling_fit",
        help="output directory [scaling_fit]; one that holds a fit is refused unless --overwrite",
    )
    fit.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the fit already in --out (its report.md, fit.json and plots)",
    )
    fit.add_argument(
        "--laws",
        nargs="+",
        default=["L(N)", "L(C)", "L(N,D)"],
        help="laws to fit [L(N) L(C) L(N,D)]",
    )
    fit.add_argument("--families", nargs="+", help="only these families (labels)")
    fit.add_argument(
        "--reference",
        metavar="FAMILY",
        help="the family the others' gaps are measured against [gpn+m when it has runs, "
        "else the first family in sorted order]",
    )
    fit.add_argument(
        "--at-N",
        dest="at_N",
        type=float,
        action="append",
        default=[],
        metavar="N",
        help="also evaluate the gaps at this parameter count (an extrapolation target; repeatable)",
    )
    fit.add_argument(
        "--at-C",
        dest="at_C",
        type=float,
        action="append",
        default=[],
        metavar="C",
        help="also evaluate the gaps at this training compute in FLOPs (a target; repeatable)",
    )
    fit.add_argument(
        "--resamples", type=int, default=1000, help="bootstrap resamples, >= 1000 [1000]"
    )
    fit.add_argument(
        "--max-starts",
        type=int,
        default=None,
        metavar="K",
        help="run L-BFGS from only the K grid points with the lowest initial loss: quicker, "
        "and it may miss the best optimum (a smoke test, a first look) [the protocol's: "
        "all 150 of L(N) and L(C), the best 200 of L(N,D)'s 4500]",
    )
    fit.add_argument("--seed", type=int, default=0, help="bootstrap RNG seed [0]")
    fit.add_argument("--ci", type=float, default=0.95, help="interval level [0.95]")
    fit.add_argument(
        "--allow-missing",
        action="store_true",
        help="fit even if some runs of a sweep have no final loss yet",
    )
    fit.add_argument(
        "--allow-unfinished",
        action="store_true",
        help="use the last eval/loss of runs without a DONE marker",
    )
    fit.set_defaults(func=cmd_fit)


def cmd_fit(args: argparse.Namespace) -> int:
    from gpn_scale.scaling import collect as C
    from gpn_scale.scaling.fit import DEFAULT_MAX_STARTS, FitError, aggregate, fit_observations
    from gpn_scale.scaling.gaps import MEASURES, compare, format_point, format_value
    from gpn_scale.scaling.report import write_outputs
    from gpn_scale.scaling.sweep import load_sweep

    if not (args.roots or args.sweep or args.table or args.wandb):
        raise FitError("nothing to fit: give run roots, --sweep, --table or --wandb")
    if not 0 < args.ci < 1:
        raise FitError(f"--ci: a level in (0, 1), got {args.ci}")
    if args.max_starts is not None and args.max_starts < 1:
        raise FitError(f"--max-starts: at least 1 start, got {args.max_starts}")
    check_fit_out(args.out, args.overwrite)  # before collecting: nothing found is lost
    parts = []
    for s in args.sweep:
        parts.append(
            C.collect_sweep(
                load_sweep(s, allow_few_seeds=True, price=False),
                allow_unfinished=args.allow_unfinished,
            )
        )
    if args.roots:
        parts.append(C.collect_roots(args.roots, allow_unfinished=args.allow_unfinished))
    for t in args.table:
        parts.append(C.read_table(t))
    if args.wandb:
        parts.append(C.collect_wandb(args.wandb, group=args.wandb_group))
    collection = C.merge(parts)
    missing = collection.missing
    if missing and not args.allow_missing:
        first = missing[0]
        raise FitError(
            f"{len(missing)} of {len(collection.records)} runs have no final loss "
            f"(first: {first.name}: {first.detail}); wait for them or pass "
            "--allow-missing"
        )
    fits, notes = fit_observations(
        collection.observations(),
        laws=args.laws,
        families=args.families,
        resamples=args.resamples,
        seed=args.seed,
        ci_level=args.ci,
        max_starts=DEFAULT_MAX_STARTS if args.max_starts is None else args.max_starts,
    )
    cells = [
        c
        for c in aggregate(collection.observations())
        if not args.families or c.family in args.families
    ]
    comparison = compare(
        fits, cells, reference=args.reference, at_N=args.at_N, at_C=args.at_C, seed=args.seed
    )
    settings: dict[str, Any] = {"resamples": args.resamples, "seed": args.seed, "ci_level": args.ci}
    if args.families:
        settings["families"] = list(args.families)
    if args.max_starts is not None:
        settings["max_starts"] = args.max_starts
    if comparison is not None:
        settings["reference"] = comparison.reference
    if args.overwrite:
        remove_fit_outputs(args.out)  # the old fit goes only once the new one exists
    paths = write_outputs(args.out, fits, notes, collection, settings, comparison)
    for f in fits:
        ci = f.ci
        vals = ", ".join(
            f"{k}={v:.4g}" + ("" if f.interpolates else f" [{ci[k][0]:.4g}, {ci[k][1]:.4g}]")
            for k, v in f.params.items()
        )
        how = " = parameters: interpolates, no interval" if f.interpolates else ""
        print(f"{f.family:>16} {f.form.key:<7} ({f.n_points} points{how}): {vals}")
    if comparison is not None:
        for g in comparison.gaps:
            print(
                f"{g.family:>16} vs {g.reference}: {MEASURES[g.measure][1]} at "
                f"{format_point(g)}: {format_value(g)}"
            )
    for n in notes + (comparison.notes if comparison is not None else []):
        print(f"note: {n}")
    if missing:
        print(f"note: {len(missing)} runs missing (see report)", file=sys.stderr)
    print(
        f"wrote {paths['report']}, {paths['json']} and "
        f"{len([p for k, p in paths.items() if p.suffix == '.png'])} plots in {args.out}"
    )
    return 0


def check_fit_out(out: str, overwrite: bool) -> None:
    """`fit --out`: a directory this command can write (gpn_scale/io/outputs.py), holding no
    earlier fit unless `overwrite` (one line, exit 2, before any run is read)."""
    from gpn_scale.io.outputs import check_out_dir
    from gpn_scale.scaling.fit import FitError
    from gpn_scale.scaling.report import fit_output_files

    if not check_out_dir(out, "--out", error=FitError) or overwrite:
        return
    found = fit_output_files(out)
    if found:
        raise FitError(
            f"--out {out} already holds a fit ({', '.join(p.name for p in found[:3])}"
            f"{', ...' if len(found) > 3 else ''}); pass --overwrite to replace it or choose "
            "another --out"
        )


def remove_fit_outputs(out: str) -> None:
    """Delete the files an earlier fit wrote in `out` (a plot of a family no longer fitted
    would otherwise stay beside the new report)."""
    from gpn_scale.scaling.report import fit_output_files

    for path in fit_output_files(out):
        path.unlink(missing_ok=True)


__all__ = ["register", "cmd_fit", "cmd_sweep_plan", "ConfigError"]
