"""The device-run format: what `python -m gpn_scale.bench.gpu` leaves and the repository keeps
under `docs/device-runs/<date>-<gpu>/`, and what the accounting reads back.

A run folder holds:
- `results.json`: `meta` (device, torch, triton, the commit measured), `checks` (exactness),
  `runs` (one row per model and batch), `summary` (per model a `rows` list of
  `{"batch", "tokens_per_s", "step_s", "mfu"}`, and the headline
  `gpn_over_compiled_transformer`), and where measured `ceilings` (copy, L2, latency, GEMM
  rates: `accounting/ceilings.py` prices with them), `phases` (seconds per engine phase),
  `ledger` (per launch role: measured and predicted microseconds) and `placement` (the block
  scheduler's, `bench/gpu_placement.py`: its `placement` is what `_spare` prices with);
- `results.md`: the same for people;
- `kernels.json` (optional): the compiled facts of the kernels that ran (registers, warps,
  shared memory, resident programs per SM, cp.async operands, instruction counts) as that
  run's Triton compiled them, by kernel and launch name: `gpu_model --against` prices the
  run's own kernels with them.

Torch-free: sweeps and the accounting read it without a GPU.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

RESULTS = "results.json"
REPORT = "results.md"
KERNELS = "kernels.json"
HEADLINE = "gpn_over_compiled_transformer"
NOT_RECORDED = "not recorded"
# A row of a model run compiled (compile.enable) is named "<model><COMPILED>" in the summary
COMPILED = " compiled"


def default_runs_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "docs" / "device-runs"


def device_runs(runs_dir: Path | None = None) -> list[Path]:
    """The committed device runs (folders with a results.json), oldest first by name
    (<date>-<gpu>)."""
    root = runs_dir or default_runs_dir()
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if (p / RESULTS).is_file())


def read_results(run: Path) -> dict[str, Any]:
    return json.loads((run / RESULTS).read_text())


def summary(runs: Iterable[dict], configs: dict[str, str], headline: float | None) -> dict:
    """results.json's `summary`: per model (its name) the config it was built from and its
    measured rows, and the headline ratio (None: not measured)."""
    out: dict[str, Any] = {}
    for r in runs:
        if "tokens_per_s" not in r:
            continue
        entry = out.setdefault(
            r["model"], {"config": configs.get(r["model"], r["model"]), "rows": []}
        )
        entry["rows"].append(
            {
                "batch": r["batch"],
                "tokens_per_s": r["tokens_per_s"],
                "step_s": r["step_s"],
                "mfu": r.get("mfu"),
            }
        )
    out[HEADLINE] = headline
    return out


def model_rows(blob: dict, config: str) -> list[dict]:
    """The summary rows of the model built from `config` (a config name such as
    gpn_m_130m), or []."""
    for name, entry in blob.get("summary", {}).items():
        if isinstance(entry, dict) and "rows" in entry and config in (name, entry.get("config")):
            return list(entry["rows"])
    return []


def engine_ab_rows(blob: dict, config: str) -> list[tuple[str, dict[str, Any], list[dict]]]:
    """The rows of `config` the run also timed with engine options changed (the device
    check's `gpu_throughput.ENGINE_AB`: a summary entry "<model> (<label>)" built from
    "<config> engine.<option>=<value> ..."): (label, the options as that row ran, its rows)."""
    out = []
    for name, entry in blob.get("summary", {}).items():
        if not isinstance(entry, dict) or "rows" not in entry:
            continue
        words = str(entry.get("config", "")).split()
        flags = words[1:]
        if not flags or words[0] != config or not all(_is_flag(w) for w in flags):
            continue
        options: dict[str, Any] = {}
        for flag in flags:
            key, value = flag.removeprefix("engine.").split("=", 1)
            options[key] = flag_value(value)
        label = name[name.rfind("(") + 1 : -1] if name.endswith(")") else name
        out.append((label, options, list(entry["rows"])))
    return out


def _is_flag(word: str) -> bool:
    return word.startswith("engine.") and "=" in word


def flag_value(text: str) -> Any:
    """An option's value as a config flag spells it: true / false, a number, or the text."""
    if text in ("true", "false"):
        return text == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def ledger_rows(blob: dict, config: str) -> list[dict]:
    """The run's per-launch ledger rows of `config` ({"batch", "role", "us_per_step", ...}),
    or [] where the run kept no ledger."""
    return [r for r in blob.get("ledger", {}).get("rows", []) if r.get("config") == config]


def placement(blob: dict) -> str | None:
    """Where the run's block scheduler put a grid's programs (packed / spread, as
    `accounting/step_model.PLACEMENTS` names them), or None where it did not measure it or
    the probe's grids did not agree."""
    measured = blob.get("placement")
    if not isinstance(measured, dict) or measured.get("emulated"):
        return None
    value = measured.get("placement")
    return value if isinstance(value, str) else None


def kernel_facts(run: Path, config: str | None = None, batch: int | None = None) -> dict:
    """(kernel, launch name) -> the compiled facts `kernels.json` recorded (also under
    (kernel, "") for the kernel's first variant); given `config` and `batch`, only the
    variants that run compiled for that model at that batch (a GEMM's tiles, and so its
    registers and occupancy, change with the batch)."""
    path = run / KERNELS
    if not path.is_file():
        return {}
    out: dict[tuple[str, str], dict] = {}
    for row in json.loads(path.read_text())["variants"]:
        if config is not None and not any(
            _case_matches(label, config, batch) for label in row.get("cases", [])
        ):
            continue
        out.setdefault((row["kernel"], ""), row)
        for name in row.get("names", []):
            out.setdefault((row["kernel"], name), row)
    return out


def _case_matches(label: str, config: str, batch: int | None) -> bool:
    """gpu_compile.Case.label is '<config>[ overrides] <dtype> B=<batch>'."""
    head, _, b = label.rpartition(" B=")
    return head.split(" ")[0] == config and (batch is None or b == str(batch))


def newest_kernel_facts(runs_dir: Path | None = None) -> tuple[dict[tuple[str, str], dict], str]:
    """The kernel facts of the newest committed run that recorded them, and its name."""
    for run in reversed(device_runs(runs_dir)):
        facts = kernel_facts(run)
        if facts:
            return facts, run.name
    return {}, ""


def resolve(path: str) -> Path:
    """A run given on the command line: a folder, or a name under docs/device-runs."""
    p = Path(path)
    if (p / RESULTS).is_file():
        return p
    q = default_runs_dir() / path
    if (q / RESULTS).is_file():
        return q
    raise FileNotFoundError(
        f"{path}: no {RESULTS} there or under {default_runs_dir()} (runs: "
        f"{', '.join(r.name for r in device_runs()) or 'none'})"
    )
