"""`gpn-scale sweep plan SWEEP` and `gpn-scale fit ...` (numpy/scipy/matplotlib load lazily).

`sweep` takes sub-commands; `plan` exists now, `submit` and `status` (submitit + SLURM)
will be registered beside it in `_register_sweep`.
"""

from __future__ import annotations

import argparse
import json
import sys

from gpn_scale.model.config import ConfigError


def register(subparsers: argparse._SubParsersAction) -> None:
    _register_sweep(subparsers)
    _register_fit(subparsers)


# ----------------------------------------------------------------------------- sweep

def _register_sweep(subparsers: argparse._SubParsersAction) -> None:
    sweep = subparsers.add_parser(
        "sweep", help="plan (and later submit/track) a sweep of runs from configs/sweeps/*.yaml",
        description="Sweeps: a grid of model sizes x seeds with per-size rules.")
    sweep.set_defaults(func=lambda args: (sweep.print_help(), 0)[1])
    sub = sweep.add_subparsers(dest="sweep_command", metavar="SUBCOMMAND")
    plan = sub.add_parser(
        "plan", help="validate a sweep file and print its expanded runs",
        description="Validate SWEEP (every key, every model config, every run's trainer "
                    "overrides) and print its runs: name, params, tokens, FLOPs, GPU-hours.")
    plan.add_argument("sweep", metavar="SWEEP", help="configs/sweeps/<name>.yaml or a path")
    plan.add_argument("--json", action="store_true", help="print the runs as JSON instead")
    plan.add_argument("--overrides", action="store_true",
                      help="also print each run's `gpn-scale train` arguments")
    plan.add_argument("--allow-few-seeds", action="store_true",
                      help="accept < 3 seeds (CI/smoke sweeps only; same as allow_few_seeds: true)")
    plan.set_defaults(func=cmd_sweep_plan)


def cmd_sweep_plan(args: argparse.Namespace) -> int:
    from gpn_scale.scaling.sweep import format_plan, load_sweep, validate_with_trainer

    sweep = load_sweep(args.sweep, allow_few_seeds=args.allow_few_seeds)
    validate_with_trainer(sweep)
    if args.json:
        print(json.dumps({"sweep": sweep.name, "path": str(sweep.path), "seeds": sweep.seeds,
                          "hardware": sweep.hardware, "notes": sweep.notes,
                          "total_flops": sweep.total_flops,
                          "total_gpu_hours": sweep.total_gpu_hours,
                          "runs": [r.to_dict() for r in sweep.runs]}, indent=1))
        return 0
    print(format_plan(sweep))
    if args.overrides:
        print()
        for r in sweep.runs:
            print(f"{r.name}: gpn-scale train {' '.join(r.train_argv())}")
    return 0


# ----------------------------------------------------------------------------- fit

def _register_fit(subparsers: argparse._SubParsersAction) -> None:
    fit = subparsers.add_parser(
        "fit", help="fit scaling laws (L(N), L(C), L(N,D)) with seed-bootstrap CIs",
        description="Collect the runs' final held-out losses, aggregate seeds, fit "
                    "L(N)=E+A·N^-alpha and L(C) per family (and L(N,D)=E+A/N^alpha+B/D^beta "
                    "where tokens per parameter vary) with the Epoch AI protocol, and write "
                    "report.md, fit.json and PNG plots.")
    fit.add_argument("roots", nargs="*", metavar="RUNS",
                     help="run directories or roots holding them (local or s3://)")
    fit.add_argument("--sweep", action="append", default=[], metavar="SWEEP",
                     help="take the runs of this sweep file (repeatable)")
    fit.add_argument("--table", action="append", default=[], metavar="CSV",
                     help="external results, CSV/JSONL with family,N,D,loss[,C,seed,run] "
                          "(e.g. Transformer++ / Gated DeltaNet baselines; repeatable)")
    fit.add_argument("--wandb", metavar="ENTITY/PROJECT", help="also read finished W&B runs")
    fit.add_argument("--wandb-group", metavar="GROUP", help="only this W&B group")
    fit.add_argument("--out", default="scaling_fit", help="output directory [scaling_fit]")
    fit.add_argument("--laws", nargs="+", default=["L(N)", "L(C)", "L(N,D)"],
                     help="laws to fit [L(N) L(C) L(N,D)]")
    fit.add_argument("--families", nargs="+", help="only these families")
    fit.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples (>= 1000)")
    fit.add_argument("--seed", type=int, default=0, help="bootstrap RNG seed [0]")
    fit.add_argument("--ci", type=float, default=0.95, help="interval level [0.95]")
    fit.add_argument("--allow-missing", action="store_true",
                     help="fit even if some runs of a sweep have no final loss yet")
    fit.add_argument("--allow-unfinished", action="store_true",
                     help="use the last eval/loss of runs without a DONE marker")
    fit.set_defaults(func=cmd_fit)


def cmd_fit(args: argparse.Namespace) -> int:
    from gpn_scale.scaling import collect as C
    from gpn_scale.scaling.fit import FitError, fit_observations
    from gpn_scale.scaling.report import write_outputs
    from gpn_scale.scaling.sweep import load_sweep

    if not (args.roots or args.sweep or args.table or args.wandb):
        raise FitError("nothing to fit: give run roots, --sweep, --table or --wandb")
    if not 0 < args.ci < 1:
        raise FitError(f"--ci: a level in (0, 1), got {args.ci}")
    parts = []
    for s in args.sweep:
        parts.append(C.collect_sweep(load_sweep(s, allow_few_seeds=True),
                                     allow_unfinished=args.allow_unfinished))
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
        raise FitError(f"{len(missing)} of {len(collection.records)} runs have no final loss "
                       f"(first: {first.name}: {first.detail}); wait for them or pass "
                       "--allow-missing")
    fits, notes = fit_observations(collection.observations(), laws=args.laws,
                                   families=args.families, resamples=args.resamples,
                                   seed=args.seed, ci_level=args.ci)
    settings = {"resamples": args.resamples, "seed": args.seed, "ci_level": args.ci}
    paths = write_outputs(args.out, fits, notes, collection, settings)
    for f in fits:
        ci = f.ci
        vals = ", ".join(f"{k}={v:.4g} [{ci[k][0]:.4g}, {ci[k][1]:.4g}]"
                         for k, v in f.params.items())
        print(f"{f.family:>16} {f.form.key:<7} ({f.n_points} points): {vals}")
    for n in notes:
        print(f"note: {n}")
    if missing:
        print(f"note: {len(missing)} runs missing (see report)", file=sys.stderr)
    print(f"wrote {paths['report']}, {paths['json']} and "
          f"{len([p for k, p in paths.items() if p.suffix == '.png'])} plots in {args.out}")
    return 0


__all__ = ["register", "cmd_fit", "cmd_sweep_plan", "ConfigError"]
