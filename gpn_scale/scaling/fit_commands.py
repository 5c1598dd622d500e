"""`gpn-scale fit ...`: collect the runs' final losses, fit the scaling laws, compare the
families and write the report (numpy/scipy/matplotlib load lazily, inside the command)."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def register_fit(subparsers: argparse._SubParsersAction) -> None:
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
    _add_sources(fit)
    _add_out(fit)
    _add_laws(fit)
    _add_bootstrap(fit)
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


def _add_sources(fit: argparse.ArgumentParser) -> None:
    """Where the runs come from: run roots, sweeps, tables, W&B."""
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


def _add_out(fit: argparse.ArgumentParser) -> None:
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


def _add_laws(fit: argparse.ArgumentParser) -> None:
    """What is fitted (laws, families) and where the families' gaps are evaluated."""
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


def _add_bootstrap(fit: argparse.ArgumentParser) -> None:
    """The fitting protocol's knobs: bootstrap resamples, L-BFGS starts, seed, interval."""
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


def cmd_fit(args: argparse.Namespace) -> int:
    from gpn_scale.scaling.fit import DEFAULT_MAX_STARTS, aggregate, fit_observations
    from gpn_scale.scaling.gaps import compare
    from gpn_scale.scaling.report import write_outputs

    _check_args(args)
    check_fit_out(args.out, args.overwrite)  # before collecting: nothing found is lost
    collection = _collect(args)
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
    if args.overwrite:
        remove_fit_outputs(args.out)  # the old fit goes only once the new one exists
    settings = _settings(args, comparison)
    paths = write_outputs(args.out, fits, notes, collection, settings, comparison)
    _print_fits(fits, notes, comparison)
    if collection.missing:
        print(f"note: {len(collection.missing)} runs missing (see report)", file=sys.stderr)
    print(
        f"wrote {paths['report']}, {paths['json']} and "
        f"{len([p for k, p in paths.items() if p.suffix == '.png'])} plots in {args.out}"
    )
    return 0


def _check_args(args: argparse.Namespace) -> None:
    from gpn_scale.scaling.fit import FitError

    if not (args.roots or args.sweep or args.table or args.wandb):
        raise FitError("nothing to fit: give run roots, --sweep, --table or --wandb")
    if not 0 < args.ci < 1:
        raise FitError(f"--ci: a level in (0, 1), got {args.ci}")
    if args.max_starts is not None and args.max_starts < 1:
        raise FitError(f"--max-starts: at least 1 start, got {args.max_starts}")


def _collect(args: argparse.Namespace) -> Any:
    """The runs of every source merged, refused while some lack a final loss (unless
    --allow-missing)."""
    from gpn_scale.scaling import collect as C
    from gpn_scale.scaling.fit import FitError
    from gpn_scale.scaling.sweep import load_sweep

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
    return collection


def _settings(args: argparse.Namespace, comparison: Any) -> dict[str, Any]:
    """The fit's settings as fit.json and the report record them."""
    settings: dict[str, Any] = {"resamples": args.resamples, "seed": args.seed, "ci_level": args.ci}
    if args.families:
        settings["families"] = list(args.families)
    if args.max_starts is not None:
        settings["max_starts"] = args.max_starts
    if comparison is not None:
        settings["reference"] = comparison.reference
    return settings


def _print_fits(fits: list[Any], notes: list[str], comparison: Any) -> None:
    """One line per law fitted (its parameters and intervals), per gap, per note."""
    from gpn_scale.scaling.gaps import MEASURES, format_point, format_value

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
