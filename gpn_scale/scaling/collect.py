"""Collect each run's final held-out loss: from run directories (local or s3://), a table
of external results (baselines trained elsewhere), or the W&B API.

Where a run leaves what (see gpn_scale.train.loop):
    <checkpoint root>/DONE            {"step", "tokens", "final_eval_loss", "params", "flops",
                                       "run_dir", ...} written when the run finished; the
                                      default checkpoint root is <run_dir>/checkpoints
    <run_dir>/metrics.jsonl           one JSON per line; eval lines carry "eval/loss", "tokens"
    <run_dir>/config.yaml             the resolved training config (model name, seed, ...)
    <checkpoint root>/step_N.lambada.json   `gpn-scale eval RUN --task lambada` of the final
                                      step N (optional; the report's paper comparison)

The DONE marker is authoritative. Without a loss in it, or without a marker, the last
`eval/loss` of metrics.jsonl is used only when the run provably reached its planned token
budget (known from the sweep) or when the caller allows unfinished runs; anything else is
reported as missing rather than silently fitted.
"""

from __future__ import annotations

import csv
import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard, cast

from gpn_scale.core.config import ConfigError
from gpn_scale.io.run_folder import CHECKPOINTS, DONE, METRICS, step_dir_name
from gpn_scale.io.run_folder import RUN_CONFIG as CONFIG
from gpn_scale.scaling.fit import FitError, Observation

LOSS_KEY = "eval/loss"


@dataclass
class RunRecord:
    """What the collector found for one run."""

    name: str
    status: str  # "done" | "metrics" (fallback) | "missing"
    location: str
    family: str = ""
    seed: int | None = None
    N: float | None = None
    D: float | None = None
    C: float | None = None
    loss: float | None = None
    detail: str = ""
    # LAMBADA of the final checkpoint, when it was evaluated (gpn_scale/eval/lambada.py)
    lambada_acc: float | None = None
    lambada_ppl: float | None = None

    def observation(self) -> Observation:
        # only called for usable records, whose N, D, C and loss are all set
        N, D, C, loss = cast(
            "tuple[float, float, float, float]", (self.N, self.D, self.C, self.loss)
        )
        return Observation(
            family=self.family,
            N=float(N),
            D=float(D),
            C=float(C),
            loss=float(loss),
            seed=self.seed,
            run=self.name,
        )


@dataclass
class Collection:
    records: list[RunRecord]
    sources: list[str]

    @property
    def usable(self) -> list[RunRecord]:
        return [r for r in self.records if r.status != "missing"]

    @property
    def missing(self) -> list[RunRecord]:
        return [r for r in self.records if r.status == "missing"]

    def observations(self) -> list[Observation]:
        return [r.observation() for r in self.usable]


# ----------------------------------------------------------------------------- storage

_BUCKETS: dict[tuple[str, str], Any] = {}


def _storage(uri: str):
    from gpn_scale.checkpoint import open_storage

    return open_storage(uri)


def _bucket_storage(bucket: str):
    """One S3 client per bucket (and endpoint) for all the runs read from it."""
    from gpn_scale.io.storage import endpoint_url

    endpoint = endpoint_url() or ""
    key = (bucket, endpoint)
    if key not in _BUCKETS:
        if len(_BUCKETS) > 32:
            _BUCKETS.clear()
        _BUCKETS[key] = _storage(f"s3://{bucket}")
    return _BUCKETS[key]


def read_at(uri: str, key: str) -> bytes | None:
    """Bytes of <uri>/<key>, or None when absent (local path or s3://, endpoint as gpn_scale.io
    resolves it)."""
    try:
        if uri.startswith("s3://"):
            bucket, _, prefix = uri[len("s3://") :].partition("/")
            prefix = prefix.strip("/")
            return _bucket_storage(bucket).get_bytes(f"{prefix}/{key}" if prefix else key)
        return _storage(uri).get_bytes(key)
    except ConfigError as err:
        raise FitError(f"cannot read {uri.rstrip('/')}/{key}: {err}") from None


def _list_dirs(uri: str) -> list[str]:
    try:
        return _storage(uri).list_dirs()
    except ConfigError as err:
        raise FitError(f"cannot list {uri}: {err}") from None


def json_object(data: bytes | None, where: str) -> dict[str, Any] | None:
    """`data` (bytes of `where`) as a JSON object; None when absent; FitError naming `where`
    when it is not one."""
    if data is None:
        return None
    try:
        value = json.loads(data.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise FitError(
            f"{where}: not valid JSON ({err.msg if hasattr(err, 'msg') else err}); "
            "fix or delete the file"
        ) from None
    if not isinstance(value, dict):
        raise FitError(f"{where}: expected a JSON object")
    return value


def last_eval(metrics: bytes | None) -> dict[str, Any] | None:
    """The last metrics.jsonl line with a finite eval/loss (torn last lines are ignored)."""
    if metrics is None:
        return None
    best = None
    for line in metrics.decode(errors="replace").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        loss = rec.get(LOSS_KEY) if isinstance(rec, dict) else None
        if isinstance(loss, (int, float)) and math.isfinite(loss):
            best = rec
    return best


def _finite(x: Any) -> TypeGuard[float]:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


# ----------------------------------------------------------------------------- one run


def read_run(
    name: str,
    locations: Sequence[str],
    *,
    family: str | None = None,
    seed: int | None = None,
    params: float | None = None,
    flops_per_token: float | None = None,
    planned_tokens: int | None = None,
    allow_unfinished: bool = False,
) -> RunRecord:
    """Look for DONE / metrics.jsonl / config.yaml in `locations` (first hit wins each)."""
    locations = [loc for loc in dict.fromkeys(locations) if loc]
    done = done_at = None
    for loc in locations:
        done = json_object(read_at(loc, DONE), f"{loc.rstrip('/')}/{DONE}")
        if done is not None:
            done_at = loc
            break
    if done and isinstance(done.get("run_dir"), str) and done_at is not None:
        run_dir = _recorded_path(done["run_dir"], done_at)
        if run_dir not in locations:
            locations.append(run_dir)
    config = None
    for loc in locations:
        raw = read_at(loc, CONFIG)
        if raw is not None:
            config = _parse_config(raw, f"{loc.rstrip('/')}/{CONFIG}")
            break
    if config:
        overrides = config.get("model_overrides")
        overrides = overrides if isinstance(overrides, dict) else None
        if family is None and isinstance(config.get("model"), str):
            family = _family_of(config["model"], overrides)
        if seed is None and isinstance(config.get("seed"), int):
            seed = config["seed"]
        if params is None or flops_per_token is None:
            p, f = _counts_of(config.get("model"), config.get("data", {}).get("seq_len"), overrides)
            params = params if params is not None else p
            flops_per_token = flops_per_token if flops_per_token is not None else f
    if seed is None:
        m = re.search(r"-s(\d+)$", name)
        seed = int(m.group(1)) if m else None
    rec = RunRecord(
        name=name,
        status="missing",
        location=done_at or (locations[0] if locations else ""),
        family=family or "",
        seed=seed,
    )

    if done is not None and done_at is not None:
        rec.lambada_acc, rec.lambada_ppl = _lambada_of(done_at, done)
    if done is not None and _finite(done.get("final_eval_loss")):
        rec.status, rec.loss = "done", float(done["final_eval_loss"])
        rec.N = done.get("params") if _finite(done.get("params")) else params
        rec.D = done.get("tokens") if _finite(done.get("tokens")) else None
        rec.C = done.get("flops") if _finite(done.get("flops")) else None
    else:
        metrics = last_eval(
            next((m for m in (read_at(loc, METRICS) for loc in locations) if m is not None), None)
        )
        if metrics is None:
            rec.detail = (
                "DONE has no final_eval_loss and " if done is not None else "no DONE marker and "
            ) + "no eval/loss in metrics.jsonl"
            return rec
        tokens = metrics.get("tokens")
        finished = done is not None or (
            planned_tokens is not None and _finite(tokens) and tokens >= planned_tokens
        )
        if not (finished or allow_unfinished):
            rec.detail = f"unfinished: no DONE marker; last eval at {tokens} tokens" + (
                f" of {planned_tokens}" if planned_tokens else ""
            )
            return rec
        rec.status, rec.loss = "metrics", float(metrics[LOSS_KEY])
        rec.D = tokens if _finite(tokens) else None
        rec.N = (done or {}).get("params") if _finite((done or {}).get("params")) else params
        rec.detail = "loss from the last eval/loss in metrics.jsonl" + (
            "" if done is not None or finished else " (run unfinished)"
        )
    if rec.C is None and rec.D is not None and flops_per_token:
        rec.C = float(flops_per_token) * float(rec.D)
    lacking = [k for k in ("N", "D", "C") if not _finite(getattr(rec, k))]
    if not rec.family:
        lacking.append("family")
    if lacking:
        rec.status = "missing"
        rec.detail = (
            f"found a loss but not {', '.join(lacking)} (no config.yaml/DONE fields); "
            "pass the sweep file (--sweep) so the plan supplies them"
        )
    return rec


def _lambada_of(root: str, done: dict[str, Any]) -> tuple[float | None, float | None]:
    """(accuracy, ppl) from the LAMBADA result of the run's final step, written by `gpn-scale
    eval ... --task lambada` beside the checkpoint as <step dir>.lambada.json; (None, None)
    when there is none."""
    names = []
    if isinstance(done.get("checkpoint"), str):
        names.append(done["checkpoint"].rstrip("/").rpartition("/")[2] + ".lambada.json")
    if isinstance(done.get("step"), int) and not isinstance(done.get("step"), bool):
        names.append(f"{step_dir_name(done['step'])}.lambada.json")
    for name in dict.fromkeys(names):
        result = json_object(read_at(root, name), f"{root.rstrip('/')}/{name}")
        metrics = (result or {}).get("metrics")
        if isinstance(metrics, dict):
            acc, ppl = metrics.get("accuracy"), metrics.get("ppl")
            return (
                float(acc) if isinstance(acc, (int, float)) and math.isfinite(acc) else None,
                float(ppl) if _finite(ppl) else None,
            )
    return None, None


def _recorded_path(value: str, base: str) -> str:
    """DONE records the run folder relative to the checkpoint root holding it (`..` in the
    default layout) when both are local; older markers, and S3 roots, hold it whole."""
    import os

    if "://" in value or os.path.isabs(value) or "://" in base:
        return value
    beside = os.path.normpath(os.path.join(base, value))
    # A marker written before that rule holds it relative to the launch directory.
    return value if not os.path.isdir(beside) and os.path.isdir(value) else beside


def _parse_config(raw: bytes, where: str) -> dict[str, Any]:
    from omegaconf import OmegaConf

    try:
        value = OmegaConf.to_container(OmegaConf.create(raw.decode()), resolve=False)
    except Exception as err:  # noqa: BLE001 - any YAML problem becomes one line
        raise FitError(f"{where}: cannot read YAML: {str(err).splitlines()[0]}") from None
    return {str(k): v for k, v in value.items()} if isinstance(value, dict) else {}


def _family_of(model: str, overrides: dict[str, Any] | None = None) -> str:
    """The run's family label (gpn_scale.scaling.families), "" when its config is unreadable."""
    from gpn_scale.scaling.families import model_facts

    try:
        return model_facts(model, 2048, overrides).label
    except ConfigError:
        return ""


def _counts_of(
    model: Any, seq_len: Any, overrides: dict[str, Any] | None = None
) -> tuple[float | None, float | None]:
    """(parameters, training FLOPs per token) from the run's family's FamilySpec."""
    if not isinstance(model, str):
        return None, None
    from gpn_scale.scaling.families import model_facts

    try:
        facts = model_facts(model, int(seq_len or 2048), overrides)
    except (ConfigError, ImportError):
        return None, None
    return float(facts.params), facts.flops_per_token


# ----------------------------------------------------------------------------- sources


def collect_sweep(sweep, *, allow_unfinished: bool = False) -> Collection:
    """Every run of an expanded sweep (gpn_scale.scaling.sweep.Sweep), planned facts from the
    plan, measured ones from the run's checkpoint root and run dir."""
    records = []
    for spec in sweep.runs:
        records.append(
            read_run(
                spec.name,
                [spec.checkpoint_root] + ([spec.run_dir] if spec.run_dir else []),
                family=spec.family,
                seed=spec.seed,
                params=spec.params,
                flops_per_token=spec.flops / spec.tokens,
                planned_tokens=spec.tokens,
                allow_unfinished=allow_unfinished,
            )
        )
    return Collection(records, [str(sweep.path)])


def collect_roots(roots: Iterable[str], *, allow_unfinished: bool = False) -> Collection:
    """Runs found as sub-directories of each root (a sweep's checkpoint root or run root), or
    the root itself when it is a run directory."""
    records, sources = [], []

    def places(loc: str) -> list[str]:  # a checkpoint root itself, or a run dir holding one
        return [loc, f"{loc.rstrip('/')}/{CHECKPOINTS}"]

    for root in roots:
        sources.append(root)
        if any(read_at(loc, key) is not None for loc in places(root) for key in (DONE, METRICS)):
            names = [""]
        else:
            names = _list_dirs(root)
            if not names:
                raise FitError(
                    f"{root}: no run directories (nor DONE/metrics.jsonl) found; check the path"
                )
        for sub in names:
            loc = f"{root.rstrip('/')}/{sub}" if sub else root
            name = sub or Path(root.rstrip("/")).name
            if not sub or any(read_at(loc, key) is not None for key in (DONE, METRICS, CONFIG)):
                records.append(read_run(name, places(loc), allow_unfinished=allow_unfinished))
    return Collection(records, sources)


TABLE_COLUMNS = ("family", "N", "D", "C", "loss", "seed", "run", "lambada_acc", "lambada_ppl")


def read_table(path: str | Path) -> Collection:
    """External results (e.g. Transformer++ / Gated DeltaNet baselines) from CSV or JSONL with
    columns family, N, D, loss and optionally C (default 6·N·D), seed, run, lambada_acc,
    lambada_ppl (the final checkpoint's LAMBADA, for the report's paper comparison)."""
    path = Path(path)
    if not path.is_file():
        raise FitError(f"{path}: table not found")
    text = path.read_text()
    if path.suffix in (".jsonl", ".json"):
        rows = []
        for i, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise FitError(f"{path}:{i}: not valid JSON ({err.msg})") from None
    else:
        rows = list(
            csv.DictReader(
                line
                for line in text.splitlines()
                if line.strip() and not line.lstrip().startswith("#")
            )
        )
    records = []
    for i, row in enumerate(rows, 1):
        where = f"{path}: row {i}"
        unknown = [k for k in row if k not in TABLE_COLUMNS]
        if unknown:
            raise FitError(
                f"{where}: unknown column '{unknown[0]}'; columns are {', '.join(TABLE_COLUMNS)}"
            )
        try:
            vals = {k: float(row[k]) for k in ("N", "D", "loss")}
            C = float(row["C"]) if row.get("C") not in (None, "") else 6.0 * vals["N"] * vals["D"]
            seed = int(float(row["seed"])) if row.get("seed") not in (None, "") else None
            lambada = {
                k: float(row[k]) if row.get(k) not in (None, "") else None
                for k in ("lambada_acc", "lambada_ppl")
            }
        except KeyError as err:
            raise FitError(
                f"{where}: missing column {err.args[0]}; need family, N, D, loss"
            ) from None
        except (TypeError, ValueError):
            raise FitError(
                f"{where}: N, D, C, loss, seed and the lambada columns must be numbers"
            ) from None
        family = str(row.get("family") or "").strip()
        if not family:
            raise FitError(f"{where}: empty family")
        records.append(
            RunRecord(
                name=str(row.get("run") or f"{path.stem}:{i}"),
                status="done",
                location=str(path),
                family=family,
                seed=seed,
                N=vals["N"],
                D=vals["D"],
                C=C,
                loss=vals["loss"],
                detail="table",
                lambada_acc=lambada["lambada_acc"],
                lambada_ppl=lambada["lambada_ppl"],
            )
        )
    return Collection(records, [str(path)])


def collect_wandb(project: str, *, group: str | None = None, api: Any = None) -> Collection:
    """Finished runs of a W&B project ("entity/project"), optionally one group: loss from the
    summary's eval/loss; params, tokens, flops from the summary (as the trainer's DONE
    marker has them) and family/seed from the run config."""
    if api is None:
        import wandb

        api = wandb.Api()
    filters = {"group": group} if group else {}
    records = []
    for run in api.runs(project, filters=filters):
        summary = dict(getattr(run, "summary", {}) or {})
        config = dict(getattr(run, "config", {}) or {})
        rec = RunRecord(
            name=getattr(run, "name", "?"),
            status="missing",
            location=f"wandb:{project}/{getattr(run, 'id', '?')}",
        )
        if getattr(run, "state", "finished") != "finished":
            rec.detail = f"W&B state {getattr(run, 'state', '?')}"
            records.append(rec)
            continue
        model = config.get("model")
        rec.family = str(
            config.get("family") or (_family_of(model) if isinstance(model, str) else "")
        )
        rec.seed = config.get("seed") if isinstance(config.get("seed"), int) else None
        loss = summary.get("final_eval_loss", summary.get(LOSS_KEY))
        rec.N = summary.get("params")
        rec.D = summary.get("tokens")
        rec.C = summary.get("flops")
        if _finite(loss) and all(_finite(v) for v in (rec.N, rec.D, rec.C)) and rec.family:
            rec.status, rec.loss = "done", float(loss)
        else:
            rec.detail = "W&B summary lacks eval/loss, params, tokens or flops"
        records.append(rec)
    return Collection(records, [f"wandb:{project}" + (f" group {group}" if group else "")])


def merge(collections: Iterable[Collection]) -> Collection:
    records, sources = [], []
    for c in collections:
        records += c.records
        sources += c.sources
    return Collection(records, sources)
