"""`gpn-scale sweep plan SWEEP` and `gpn-scale fit ...` (numpy/scipy/matplotlib load lazily).

`sweep` takes sub-commands: `plan`; `submit` and `status` (submitit, gpn_scale.scaling.submit
and .status); `pending` and `run-argv`, the helpers of slurm/sweep.sh and slurm/train.sbatch.
`fit` is registered from fit_commands.py.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from gpn_scale.core.config import ConfigError
from gpn_scale.scaling.fit_commands import register_fit


def register(subparsers: argparse._SubParsersAction) -> None:
    _register_sweep(subparsers)
    register_fit(subparsers)


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
    _add_plan(sub)
    _add_pending(sub)
    _add_snapshot(sub)
    _add_run_argv(sub)
    _add_submit(sub)
    _add_status(sub)


def _add_plan(sub: argparse._SubParsersAction) -> None:
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


def _add_pending(sub: argparse._SubParsersAction) -> None:
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


def _add_snapshot(sub: argparse._SubParsersAction) -> None:
    snap = sub.add_parser(
        "snapshot",
        help="freeze every run's train argv into a JSON table (slurm/sweep.sh)",
        description="Write the `gpn-scale train` argv of every run of SWEEP to OUT (JSON), "
        "so that queued array tasks keep their runs whatever happens to the YAML.",
    )
    snap.add_argument("sweep", metavar="SWEEP", help="configs/sweeps/<name>.yaml or a path")
    snap.add_argument("out", metavar="OUT", help="the table to write (.json)")
    snap.set_defaults(func=cmd_sweep_snapshot)


def _add_run_argv(sub: argparse._SubParsersAction) -> None:
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


def _add_submit(sub: argparse._SubParsersAction) -> None:
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
    _add_slurm_options(submit)
    submit.add_argument(
        "--only",
        type=int,
        nargs="+",
        metavar="INDEX",
        help="only these run indices (if unfinished)",
    )
    submit.add_argument("--wait", action="store_true", help="wait for the jobs and report")
    submit.set_defaults(func=cmd_sweep_submit)


def _add_slurm_options(submit: argparse.ArgumentParser) -> None:
    """`sweep submit`'s job resources, each defaulting to slurm/sweep.sh's variable."""
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


def _add_status(sub: argparse._SubParsersAction) -> None:
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


__all__ = ["register", "cmd_sweep_plan", "ConfigError"]
