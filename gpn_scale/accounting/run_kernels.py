"""Record, into a device-run folder, the kernels a run launched: every Triton variant's compiled
facts (`kernels.json`) and every launch role's count, bytes and FLOPs per training step
(`launches.json`), so that the accounting prices exactly the kernels that ran
(`gpu_model --against`).

    python -m gpn_scale.accounting.run_kernels docs/device-runs/2026-12-04-h200 \\
        --config gpn_m_130m,gpn_m_130m_2l --batch 8,16,32,64,128

On the device machine `bench/gpu.py` calls it with that machine's Triton; here, without a
GPU, the ptxas of the installed Triton compiles for --arch (put the run's Triton version on
PYTHONPATH to record what that machine compiled: kernels.json names the version used).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from gpn_scale.accounting import device_runs, gpu_compile


def _commit() -> str:
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=False,
            timeout=10,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# What a Triton launch of the CUDA path is made of: the kernels, the code that launches them
# (grids, blocks, meta-parameters) and the byte/FLOP counts the accounting reads.
KERNEL_SOURCES = (
    "gpn_scale/ops/gpn_step/triton_kernels.py",
    "gpn_scale/ops/gpn_step/cuda.py",
    "gpn_scale/ops/gpn_step/cuda_forward.py",
    "gpn_scale/ops/gpn_step/cuda_reverse.py",
    "gpn_scale/ops/gpn_step/cuda_shared.py",
    "gpn_scale/ops/gpn_step/gemm.py",
    "gpn_scale/ops/gpn_step/geometry.py",
    "gpn_scale/ops/cross_entropy_kernels.py",
    "gpn_scale/ops/cross_entropy.py",
)


def kernels_unchanged_since(commit: str) -> bool:
    """Whether the kernel sources of the working tree equal those of `commit`."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        ["git", "-C", str(root), "diff", "--quiet", commit, "--", *KERNEL_SOURCES],
        check=False,
        timeout=30,
    )
    return done.returncode == 0


def kernel_rows(
    configs: list[str], batches: list[int], arch: str, jobs: int, seq_len: int = 0
) -> list[dict[str, Any]]:
    """One row per distinct compiled variant over the configs and batches: its kernel, the
    launch names it serves and what the compiler made of it."""
    target = gpu_compile.TARGETS[arch]
    cases = [gpu_compile.Case(c, b, seq_len=seq_len) for c in configs for b in batches]
    rows = gpu_compile.build_rows(
        cases,
        [target],
        jobs,
        gpu_compile.FactsCache(gpu_compile.default_cache_path()),
        progress=False,
    )
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        entry = out.get(r.variant.key)
        if entry is None:
            f = dataclasses.asdict(r.facts)
            # this machine's: the compile time, and the source lines (of this checkout's
            # file) that only a compile of the same tree may read (kernel_costs)
            for local in ("compile_s", "line_instructions", "source_file"):
                f.pop(local, None)
            entry = out[r.variant.key] = dict(
                kernel=r.variant.kernel,
                key=r.variant.key,
                names=set(),
                cases=set(),
                num_warps=r.variant.num_warps,
                blocks_per_sm=r.blocks_per_sm(),
                **f,
            )
        entry["names"] |= r.variant.names
        entry["cases"].add(r.case.label)
    return [
        {**e, "names": sorted(e["names"]), "cases": sorted(e["cases"])}
        for e in sorted(out.values(), key=lambda e: (e["kernel"], sorted(e["names"])))
    ]


def launch_rows(
    configs: list[str], batches: list[int], seq_len: int, kept: list | None = None
) -> dict[str, Any]:
    """Per config and batch, per launch role: launches, bytes and FLOPs per training step at
    `seq_len` (the launch accounting's dry run of this tree, its kernels' facts from the
    facts cache kernel_rows filled); each accounting is also appended to `kept`."""
    from gpn_scale.accounting.step_model import account, role
    from gpn_scale.models.gpn import load_model_config

    out: dict[str, Any] = {}
    for config in configs:
        cfg = load_model_config(config)
        for batch in batches:
            acc = account(cfg, batch, seq_len, config)
            if kept is not None:
                kept.append(acc)
            roles = sorted({role(op.name) for op in acc.ops if op.triton})
            rows = [
                {
                    "role": r,
                    "launches": acc.at_seq_len(lambda ops, r=r: len(_of(ops, r))),
                    "bytes": acc.at_seq_len(lambda ops, r=r: sum(o.bytes for o in _of(ops, r))),
                    "flops": acc.at_seq_len(lambda ops, r=r: sum(o.flops for o in _of(ops, r))),
                }
                for r in roles
            ]
            out.setdefault(config, {})[str(batch)] = rows
    return out


AHEAD_OF_TIME = "ahead of time, with the installed Triton's ptxas (no GPU)"


def _of(ops: list, r: str) -> list:
    from gpn_scale.accounting.step_model import role

    return [op for op in ops if op.triton and role(op.name) == r]


def record(
    run: Path,
    configs: list[str],
    batches: list[int],
    arch: str,
    jobs: int,
    seq_len: int,
    where: str = AHEAD_OF_TIME,
    measured: str | None = None,
) -> None:
    """Write kernels.json, launches.json and ops.json.gz into `run` (`where`: how the facts
    were got;
    `measured`: the commit the run measured, whose kernel sources must equal this tree's)."""
    import triton

    run.mkdir(parents=True, exist_ok=True)
    commit = _commit()
    if measured is not None:
        same = kernels_unchanged_since(measured)
        if not same:
            raise ValueError(
                f"the kernels changed since {measured} ({', '.join(KERNEL_SOURCES)}): "
                "record them from a checkout of that commit"
            )
        commit = measured
    blob = dict(
        triton=triton.__version__,
        arch=arch,
        commit=commit,
        compiled_from=_commit(),
        recorded=where,
        configs=configs,
        batches=batches,
        variants=kernel_rows(configs, batches, arch, jobs),
    )
    (run / device_runs.KERNELS).write_text(json.dumps(blob, indent=1) + "\n")
    kept: list = []
    launches = dict(
        commit=commit,
        compiled_from=blob["compiled_from"],
        seq_len=seq_len,
        configs=launch_rows(configs, batches, seq_len, kept),
    )
    (run / "launches.json").write_text(json.dumps(launches, indent=1) + "\n")
    from gpn_scale.accounting import recorded

    recorded.write(run, kept)  # every launch with what its price needs (--against)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="the device-run folder to write into")
    parser.add_argument("--config", default="gpn_m_130m,gpn_m_130m_2l")
    parser.add_argument("--batch", default="8,16,32,64,128")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--arch", default="sm_90", choices=sorted(gpu_compile.TARGETS))
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--measured-commit",
        help="the commit the run measured (its kernel sources must equal this tree's)",
    )
    args = parser.parse_args(argv)
    try:
        batches = [int(b) for b in args.batch.split(",") if b.strip()]
    except ValueError:
        print(f"run_kernels: --batch {args.batch!r}: expected integers like 8,16", file=sys.stderr)
        return 2
    configs = [c.strip() for c in args.config.split(",") if c.strip()]
    try:
        record(
            args.run,
            configs,
            batches,
            args.arch,
            max(1, args.jobs),
            args.seq_len,
            measured=args.measured_commit,
        )
    except ValueError as exc:
        print(f"run_kernels: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.run / device_runs.KERNELS} and {args.run / 'launches.json'}")
    return 0


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    sys.exit(main())
