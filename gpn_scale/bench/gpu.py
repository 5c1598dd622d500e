"""The device check: one script for a session that is lent a GPU (results under --out).

    python -m gpn_scale.bench.gpu --out "$OUT"              # on the GPU machine (<= 9 min)
    python -m gpn_scale.bench.gpu --device cpu --config tiny,tiny_2l --seq-len 16 \\
        --batches 2,4 --ledger-batches 2 --steps 1 --warmup 0 --fp32 --out /tmp/gpu-smoke

Decision data first, each part written under --out as soon as it is measured
(results.json and results.md rewritten after every step, so a run cut short keeps what it
measured; the format: accounting/device_runs.py):

0. CUDA usable? With --device cuda and no usable CUDA it stops at once with one line.
   Every Triton variant the check launches is compiled into --triton-cache first, one
   process per CPU core (accounting/gpu_compile.py; best effort).
1. Exactness on the device (bench/gpu_exactness.py): the engine against the step-by-step
   reference (float64; float32 with and without CUDA graphs; a bf16 step), the engine
   options that change no value each on against off, bit for bit (the side streams,
   dependent launches, the memory backward leaving SMs to the side work), and Gated
   DeltaNet's fla kernels against our chunkwise op.
2. The ledger (bench/gpu_ledger.py): the first config at --ledger-batches (64, 128), every
   launch of one forward and one reverse chunk timed in sequence and alone, with its bytes,
   FLOPs, rates, compiled facts and the accounting's prediction; kernels.json records what
   this machine's Triton compiled. Beside it the what-ifs: the memory backward and forward
   alone with the launch settings the accounting chose against (warps, registers, stages,
   column blocks).
3. The phase split (bench/gpu_profile.py): one step by engine phase, at the same batches.
4. Ceilings (bench/gpu_ceilings.py): copy, L2 over all SMs and one SM, dependent-load
   latency idle and under load, cuBLAS at the step GEMMs' shapes: what the accounting
   prices with once this run is committed. Beside them the block scheduler's placement
   (bench/gpu_placement.py): whether a grid that fits at once is packed onto few SMs or
   spread over all, and whether a second stream's kernel runs beside the first's; the
   accounting prices the side streams with it (`gpu_model --against`).
5. Nsight Compute on the ledger's replay of the top kernels, and a gzipped Chrome trace of a
   64-step window (best effort, one line each on failure).
6. Throughput (bench/gpu_throughput.py): each --config (1- and 2-layer GPN+M) at --batches,
   the first config again with each of its engine A/B options changed at the last ledger
   batch (gpu_throughput.ENGINE_AB: the side streams, dependent launches, the SMs left to
   side work off; bf16 memory reads on; every step GEMM through cuBLAS), and the Transformer++
   of the first config's size, eager and compiled (compile.enable),
   all at --seq-len, bf16 autocast, fused AdamW; each row's GPU busy fraction over a full
   profiled window. The headline: GPN+M / compiled Transformer++, each at its best batch.

`--max-seconds` (480) bounds the whole run: the throughput models share what is left when
they start, and a batch is not started when twice the previous one's steady cost would
overrun its share. Nothing is asserted here; the exactness tolerances are those of
tests/models/gpn/test_engine.py and the verdict is printed next to each error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

from gpn_scale.accounting import device_runs
from gpn_scale.bench import gpu_exactness as exactness
from gpn_scale.bench import gpu_throughput as throughput
from gpn_scale.bench.gpu_exactness import error_line
from gpn_scale.bench.gpu_results_md import markdown
from gpn_scale.models.gpn import load_model_config
from gpn_scale.ops.gpn_step.options import EngineOptions

EXIT_NO_CUDA = 2


# --------------------------------------------------------------------------- 0. CUDA usable
def driver_version() -> str:
    """The NVIDIA driver's version (nvidia-smi), else the CUDA driver API's, else 'unknown'."""
    if shutil.which("nvidia-smi"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=15,
                check=False,
            ).stdout.split()
            if out:
                return out[0]
    with contextlib.suppress(Exception):
        v = int(torch._C._cuda_getDriverVersion())  # type: ignore[attr-defined]
        if v > 0:
            return f"CUDA driver API {v // 1000}.{v % 1000 // 10}"
    return "unknown"


def cuda_problem() -> str | None:
    """Why CUDA cannot be used here (one line), or None when a tiny kernel runs."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
    if not available:
        said = next((str(w.message).splitlines()[0] for w in caught), "")
        return "torch.cuda.is_available() is False" + (f": {said}" if said else "")
    try:
        (torch.ones(1, device="cuda") + 1).item()
    except Exception as exc:  # noqa: BLE001 - any failure means "not usable", said in one line
        return f"a first kernel failed: {type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
    return None


# --------------------------------------------------------------------------- results file
class Results:
    """meta, checks, runs, summary and the decision data (ledger, phases, ceilings,
    profiles); both files rewritten (atomically) after every step."""

    def __init__(self, out: Path, meta: dict) -> None:
        self.out, self.meta = out, meta
        self.checks: list[dict] = []
        self.runs: list[dict] = []
        self.summary: dict[str, Any] = {}
        self.extra: dict[str, Any] = {}  # ledger, phases, ceilings, ncu, trace

    def save(self) -> None:
        self.meta["elapsed_s"] = round(throughput._clock() - self.meta["_t0"], 1)
        blob = dict(
            meta={k: v for k, v in self.meta.items() if not k.startswith("_")},
            checks=self.checks,
            runs=self.runs,
            summary=self.summary,
            **self.extra,
        )
        for name, text in (
            (device_runs.RESULTS, json.dumps(blob, indent=2)),
            (device_runs.REPORT, markdown(blob)),
        ):
            tmp = self.out / f".{name}.tmp"
            tmp.write_text(text)
            os.replace(tmp, self.out / name)


# ------------------------------------------------------------------ kernels compiled first
PREBUILD_BATCHES = (8, 16, 32, 64, 128, 256, 512)
# The engine A/B rows' kernel variants (gpu_throughput.ENGINE_AB): the side streams off take
# the plain memory backward too, as its side-work SMs off does; bf16 memory reads, the memory
# kernels' bf16 M0 variants; cuBLAS step GEMMs, the reduce kernels applying their epilogues.
PREBUILD_AB = (
    "dependent_launch=false",
    "side_work_sm_share=0.0",
    "bf16_memory_reads=true",
    "cublas_gemms=all",
)


def default_triton_cache() -> Path:
    return Path(__file__).resolve().parents[2] / ".cache" / "triton-device"


def prebuild_triton_cache(
    cache_dir: Path,
    configs: list[str],
    seq_len: int,
    arch: str,
    log: Path,
    timeout_s: float,
    ab_batch: int | None = None,
) -> dict:
    """Compile the check's kernel variants into `cache_dir` (a Triton cache) in parallel
    processes (accounting/gpu_compile.py --triton-cache); what it did, for results.json.
    `ab_batch`: also the first config's launches without dependent launches there (its A/B
    row: other variants, which the timed process would otherwise compile one by one)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    batches = ",".join(map(str, PREBUILD_BATCHES))
    runs = [
        ["testing_tiny", "--set", "n_layers=2", "--dtype", "fp64", "--batch", "3"],
        ["testing_tiny", "--set", "n_layers=2", "--dtype", "fp32", "--batch", "3"],
        [*configs, "--batch", batches, "--seq-len", str(seq_len)],
    ]
    if ab_batch is not None:  # the rows' other variants (with the side streams off, too)
        runs += [
            [configs[0], "--set", flag, "--batch", str(ab_batch), "--seq-len", str(seq_len)]
            for flag in PREBUILD_AB
        ]
    t0 = time.perf_counter()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with open(log, "w") as out:
        for extra in runs:
            cmd = [sys.executable, "-m", "gpn_scale.accounting.gpu_compile", *extra, "--arch", arch]
            cmd += ["--triton-cache", str(cache_dir), "--jobs", str(os.cpu_count() or 1)]
            left = timeout_s - (time.perf_counter() - t0)
            try:
                done = subprocess.run(
                    cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=max(1, left)
                )
            except subprocess.TimeoutExpired:
                return dict(ok=False, dir=str(cache_dir), error=f"timed out after {timeout_s} s")
            if done.returncode != 0:
                return dict(ok=False, dir=str(cache_dir), error=f"exit {done.returncode}: {log}")
    entries = sum(1 for _ in cache_dir.iterdir())
    return dict(ok=True, dir=str(cache_dir), entries=entries, seconds=time.perf_counter() - t0)


def use_triton_cache(cache_dir: Path) -> None:
    """Point this process's Triton JIT at `cache_dir` (before its first compile)."""
    os.environ["TRITON_CACHE_DIR"] = str(cache_dir)
    with contextlib.suppress(ImportError, AttributeError):
        import triton

        triton.knobs.cache.dir = str(cache_dir)


def _step_form(device: torch.device) -> str:
    """The step backend the GPN runs on `device` (cuda: the Triton kernels; cpu: the fused
    C++ kernels; reference: the PyTorch steps)."""
    from gpn_scale.ops.gpn_step.registry import select_backend

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a fallback's warning comes again at the first step
        return select_backend("auto", device).name


def _commit() -> str:
    from gpn_scale.accounting.run_kernels import _commit as commit

    return commit()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for results.json / results.md")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--config",
        default="gpn_m_130m,gpn_m_130m_2l",
        help="comma-separated model configs (names or paths); the ledger, phases and "
        "the Transformer++ follow the first",
    )
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument(
        "--batches",
        default="64,128,256",
        help="throughput batch sizes: a comma-separated list, or 'auto' (doubling from "
        "--min-batch up to the first that does not fit)",
    )
    parser.add_argument("--ledger-batches", default="64,128", help="the ledger's and phases'")
    parser.add_argument("--min-batch", type=int, default=8)
    parser.add_argument("--max-batch", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per batch size")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5, help="the ledger's replays per launch")
    parser.add_argument("--fp32", action="store_true", help="no bf16 autocast")
    parser.add_argument("--no-transformer", action="store_true", help="skip the baseline")
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=480.0,
        help="time budget for the whole check (default: 8 of an H200's 15 minutes)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace results already in --out")
    parser.add_argument(
        "--triton-cache",
        type=Path,
        default=default_triton_cache(),
        help="Triton cache the check's kernels are compiled into first, then used",
    )
    parser.add_argument(
        "--no-prebuild", action="store_true", help="compile kernels on first use instead"
    )
    parser.add_argument(
        "--no-ledger",
        action="store_true",
        help="skip the ledger, phases, Nsight Compute and the trace (a throughput-only rerun)",
    )
    parser.add_argument(
        "--no-ceilings", action="store_true", help="skip the ceilings and the placement probe"
    )
    parser.add_argument(
        "--no-engine-ab",
        action="store_true",
        help="skip the first config with each of gpu_throughput.ENGINE_AB's engine options "
        "changed (the side streams, dependent launches, side-work SMs off; bf16 memory reads "
        "on), at the last ledger batch",
    )
    return parser


def _batches(text: str, flag: str) -> list[int]:
    try:
        return [int(b) for b in text.split(",") if b.strip()]
    except ValueError:
        raise SystemExit(f"device check: {flag} {text!r}: expected integers like 64,128") from None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    t0 = throughput._clock()
    device = torch.device(args.device)
    if device.type == "cuda":
        problem = cuda_problem()
        if problem:
            print(
                f"device check: CUDA is not usable on --device {args.device} ({problem}); "
                f"torch {torch.__version__} built for CUDA {torch.version.cuda}, driver "
                f"{driver_version()}; nothing measured (--device cpu runs the smoke mode)",
                file=sys.stderr,
                flush=True,
            )
            return EXIT_NO_CUDA
    out = Path(args.out)
    if (out / device_runs.RESULTS).exists() and not args.overwrite:
        print(
            f"device check: {out / device_runs.RESULTS} exists; pick another --out or pass "
            "--overwrite",
            file=sys.stderr,
        )
        return 2
    ledger_batches = _batches(args.ledger_batches, "--ledger-batches")
    if args.batches != "auto":
        _batches(args.batches, "--batches")
    out.mkdir(parents=True, exist_ok=True)
    names = args.config.split(",")
    configs = [load_model_config(name) for name in names]
    ab_batch = None if args.no_engine_ab else ledger_batches[-1]  # the engine A/B rows' batch
    candidates, only_at = throughput.candidates(
        configs,
        args.seq_len,
        transformer=not args.no_transformer,
        compiled=device.type == "cuda",  # inductor on a CPU is the tests' business (tests/train)
        ab_batch=ab_batch,
    )
    results = Results(out, _meta(args, device, candidates, t0))
    results.save()
    print(f"device check on {results.meta['device_name']} (torch {torch.__version__})", flush=True)
    if device.type == "cuda":
        _prebuild(args, results, names, ab_batch)
    for row in [*exactness.check_exactness(device), *exactness.check_gated_deltanet_fla(device)]:
        results.checks.append(row)
        results.save()
        print(f"  {row['check']}: {'ok' if row['ok'] else 'FAILED'} {row}", flush=True)
    label = configs[0].name or Path(names[0]).stem  # a config given by path: its file's stem
    _decision_data(args, results, device, configs[0], label, ledger_batches, names[0])

    def record(row: dict) -> None:
        results.runs.append(row)
        _summarise(results, candidates)
        results.save()

    deadline = t0 + args.max_seconds
    for i, cand in enumerate(candidates):
        now = throughput._clock()
        share = now + (deadline - now) / (len(candidates) - i)
        throughput.sweep(
            cand,
            only_at.get(cand.name)
            or throughput.batch_sizes(args.batches, args.min_batch, args.max_batch),
            args.seq_len,
            device,
            args.steps,
            args.warmup,
            not args.fp32,
            share,
            record,
        )
    _summarise(results, candidates)
    results.save()
    print((out / device_runs.REPORT).read_text())
    return 0 if all(c["ok"] for c in results.checks) else 1


def _meta(args, device: torch.device, candidates: list, t0: float) -> dict[str, Any]:
    import platform

    import triton

    return dict(
        torch=torch.__version__,
        torch_cuda=torch.version.cuda,
        triton=triton.__version__,
        python=platform.python_version(),
        driver=driver_version() if device.type == "cuda" else "-",
        device=str(device),
        device_name=(torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"),
        sm_count=(
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else None
        ),
        commit=_commit(),
        seq_len=args.seq_len,
        bf16=not args.fp32,
        step_form=_step_form(device),
        cuda_graphs=True,
        # the engine's options (each A/B row says otherwise for itself); the accounting
        # prices a run with the options it ran under (gpu_report.against)
        overlap_backward=True,
        overlap_decode=True,
        dependent_launch=True,
        side_work_sm_share=EngineOptions().side_work_sm_share,
        bf16_memory_reads=EngineOptions().bf16_memory_reads,
        cublas_gemms=EngineOptions().cublas_gemms,
        max_seconds=args.max_seconds,
        params={c.name: c.params for c in candidates},
        _t0=t0,
    )


def _prebuild(args, results: Results, names: list[str], ab_batch: int | None) -> None:
    if not args.no_prebuild:
        major, minor = torch.cuda.get_device_capability()
        results.meta["triton_prebuild"] = prebuild_triton_cache(
            args.triton_cache,
            names,
            args.seq_len,
            f"sm_{major}{minor}",
            Path(args.out) / "triton-prebuild.log",
            timeout_s=args.max_seconds / 4,
            ab_batch=ab_batch,
        )
        print(f"  Triton kernels prebuilt: {results.meta['triton_prebuild']}", flush=True)
        results.save()
    use_triton_cache(args.triton_cache)


def _guard(what: str, fn, *a, **kw) -> Any:
    """fn's result, or {"error": one line} (the traceback in the log): the check goes on."""
    try:
        return fn(*a, **kw)
    except Exception as exc:  # noqa: BLE001 - recorded, and the rest of the check runs
        traceback.print_exc()
        print(f"  {what} failed: {error_line(exc)}", flush=True)
        return {"error": error_line(exc)}


def _decision_data(
    args, results: Results, device, cfg, name: str, batches: list[int], source: str = ""
) -> None:
    """The ledger, the phase split, the ceilings, the accounting's prediction for each
    ledger row, Nsight Compute's counters and a trace, in that order (steps 2-5)."""
    from gpn_scale.bench import gpu_ceilings, gpu_ledger, gpu_placement, gpu_profile

    bf16 = not args.fp32
    rows: list[dict] = []
    if not args.no_ledger:
        results.extra["ledger"] = {"rows": rows}
    for b in [] if args.no_ledger else batches:
        got = _guard(
            f"ledger B={b}",
            gpu_ledger.ledger,
            cfg,
            b,
            device,
            bf16,
            args.repeats,
            config_name=name,
            seq_len=args.seq_len,
        )
        if isinstance(got, dict):
            results.extra["ledger"].setdefault("errors", []).append({"batch": b, **got})
        else:
            rows += got
        results.save()
        got = _guard(
            f"what-ifs B={b}", gpu_ledger.what_ifs, cfg, b, device, bf16, args.repeats, name
        )
        if isinstance(got, dict):
            results.extra["ledger"].setdefault("errors", []).append({"batch": b, **got})
        else:
            results.extra["ledger"].setdefault("what_ifs", []).extend(got)
        results.save()
    for b in [] if args.no_ledger else batches:
        got = _guard(f"phases B={b}", gpu_profile.phase_split, cfg, b, args.seq_len, device, bf16)
        results.extra.setdefault("phases", []).append({"config": name, "batch": b, **got})
        results.save()
    if not args.no_ceilings:
        scale = "full" if device.type == "cuda" else "tiny"
        results.extra["ceilings"] = _guard("ceilings", gpu_ceilings.measure_ceilings, device, scale)
        results.save()
        results.extra["placement"] = _guard("placement", gpu_placement.measure_placement, device)
        results.save()
    if args.no_ledger:
        return
    _predict_ledger(results, cfg, name, args.seq_len)
    facts = gpu_ledger.device_facts(rows)
    if facts["variants"]:
        import triton

        facts.update(
            triton=triton.__version__,
            commit=results.meta["commit"],
            recorded="on the device (the ledger's launches)",
        )
        (Path(args.out) / device_runs.KERNELS).write_text(json.dumps(facts, indent=1) + "\n")
    if device.type == "cuda" and rows:
        top = [r["kernel"] for r in next(iter(gpu_ledger.by_role(rows).values()))][:6]
        kernels = list(dict.fromkeys(top))[:3]
        results.extra["ncu"] = _guard(
            "ncu",
            gpu_profile.ncu_counters,
            source or name,
            batches[0],
            kernels,
            Path(args.out),
            timeout_s=min(120.0, args.max_seconds / 6),
        )
        results.save()
    trace = Path(args.out) / f"trace-{name}-B{batches[0]}.json.gz"
    window = cfg.engine.chunk_size
    results.extra["trace"] = _guard(
        "trace", gpu_profile.chrome_trace, cfg, batches[0], window, device, trace, bf16
    )
    results.save()


def _predict_ledger(results: Results, cfg, name: str, seq_len: int) -> None:
    """Each ledger row's predicted seconds per step: the accounting at this run's measured
    ceilings and this machine's compiled kernels (a failure: one line)."""
    from gpn_scale.accounting import ceilings as ceilings_
    from gpn_scale.bench import gpu_ledger

    rows = results.extra["ledger"]["rows"]
    measured = results.extra.get("ceilings") or {}
    key = ceilings_.gpu_key(results.meta["device_name"]) or "h200"
    c = ceilings_.with_measured(ceilings_.DEFAULTS[key], measured, "measured by this run")
    copy = measured.get("copy_bytes_per_s")
    for r in rows:  # each launch alone against the copy bandwidth this run measured
        if isinstance(copy, (int, float)) and copy > 0 and r.get("gbytes_per_s"):
            r["copy_share"] = r["gbytes_per_s"] * 1e9 / copy
    facts = gpu_ledger.device_facts(rows)
    for b in sorted({r["batch"] for r in rows}):
        got = _guard(
            f"prediction B={b}",
            gpu_ledger.predicted_per_role,
            cfg,
            b,
            seq_len,
            c,
            _facts_by_name(facts, name, b),
        )
        if isinstance(got, dict) and "error" in got:
            results.extra["ledger"].setdefault("errors", []).append({"batch": b, **got})
            continue
        for r in rows:
            if r["batch"] == b:
                r["predicted_s_per_step"] = got.get(r["role"])
    results.save()


def _facts_by_name(facts: dict, config: str, batch: int) -> dict:
    out: dict = {}
    for v in facts["variants"]:
        if f"{config} bf16 B={batch}" not in v["cases"]:
            continue
        out.setdefault((v["kernel"], ""), v)
        for n in v["names"]:
            out.setdefault((v["kernel"], n), v)
    return out


def _summarise(results: Results, candidates: list) -> None:
    results.summary = throughput.summary(results.runs, candidates)


if __name__ == "__main__":
    sys.exit(main())
