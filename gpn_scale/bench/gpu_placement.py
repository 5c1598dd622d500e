"""Where the block scheduler puts a launch's programs, measured on the device: the fact the
accounting's pricing of the side streams turns on (`accounting/step_model._spare`, PACKED or
SPREAD), and which until now only the engine A/B rows could say, indirectly.

    python -m gpn_scale.bench.gpu_placement --out "$OUT"                 # on the GPU (~1 s)
    python -m gpn_scale.bench.gpu_placement --out /tmp/p --device cpu    # smoke test

Three probes, each a few launches of a program that records the SM it runs on (%smid) and
the global timer when it starts and when it stops spinning (so that every program of a grid
is resident at once):
- **placement**: grids of P programs that all fit at once (16 warps a program: a quarter of
  an sm_80 / sm_90 SM's 64 warp slots, PER_SM = 4 resident a SM). PACKED puts them on
  ceil(P / 4) SMs, SPREAD on min(P, SMs); the SMs a grid held say which, per grid and
  over all (`placement_of`, `verdict`).
- **beside**: a long grid of one program per SM on one stream, and while it spins a short
  one of as many on a second stream: how many of the second's programs start before the
  first's end, and how many of those on an SM the first holds. It says whether two streams'
  kernels share the GPU (and its SMs) here at all (CUDA_DEVICE_MAX_CONNECTIONS=1, as
  Megatron-LM sets it, or MPS limits can serialise them); the accounting assumes they do.
- **green context**: the same grid of one program per SM launched on a stream of a CUDA green
  context of GREEN_SMS SMs (`torch.cuda.green_contexts`, by the API this torch has): whether
  a Triton kernel launches there at all, and whether its programs stay on that many SMs. A
  partition of the SMs between the sweep and the side streams would need no item queue in
  the memory kernels (`engine.side_work_sm_share`); this says whether the GPU image allows it.

What it does not say: whether a given side kernel's registers and shared memory fit beside a
given sweep program (the probe's programs take little of either); the accounting's SPREAD
assumes they do not.

Under TRITON_INTERPRET=1 (`--device cpu`) the program stands on SM (its index mod
EMULATED_SMS) and the timer reads 0: the code paths run, the figures mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer, smid

from gpn_scale.accounting.step_model import PACKED, SPREAD
from gpn_scale.bench.gpu_exactness import error_line

WARPS = 16  # a program's warps: a quarter of the SM's 64 warp slots (sm_80, sm_90)
WARP_SLOTS_PER_SM = 64
PER_SM = WARP_SLOTS_PER_SM // WARPS
GRID_SHARES = (0.25, 0.5, 1.0, 2.0)  # the placement probe's grids, in SMs
SPIN_NS = 200_000  # each placement program spins this long: the grid's launch takes ~10 us
LONG_SPIN_NS = 2_000_000  # the beside probe's first grid
SHORT_SPIN_NS = 20_000  # ... and its second
EMULATED_SMS = 8  # the interpreter's stand-in SMs
GREEN_SMS = 32  # the green context's SMs: a multiple of 8 (Hopper's partition granularity)
NEITHER = "neither"  # a grid held as many SMs as neither placement gives
MIXED = "mixed"  # the grids disagree
EXIT_BAD_INPUT = 2


@functools.cache
def _kernels(interpret: bool) -> SimpleNamespace:
    """The probe kernel, built on first use so that TRITON_INTERPRET is read then; one per
    mode. It names only module globals, which older Triton's compiler cannot see past."""
    del interpret  # the cache key: the environment it was built under

    @triton.jit(do_not_specialize=["spin_ns"])
    def placement_probe_kernel(SM, START, END, spin_ns, EMULATED: tl.constexpr):
        pid = tl.program_id(0)
        if EMULATED > 0:  # the interpreter: no %smid, no timer
            tl.store(SM + pid, pid % EMULATED)
            tl.store(START + pid, pid.to(tl.int64) * 0)
            tl.store(END + pid, pid.to(tl.int64) * 0)
        else:
            t0 = globaltimer()
            t = t0
            while t - t0 < spin_ns:
                t = globaltimer()
            tl.store(SM + pid, smid())
            tl.store(START + pid, t0)
            tl.store(END + pid, t)

    return SimpleNamespace(probe=placement_probe_kernel)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def probe(programs: int, spin_ns: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Launch `programs` probe programs on the current stream; each one's SM and its start
    and end on the global timer (ns), once the launch is done."""
    sm = torch.full((programs,), -1, dtype=torch.int32, device=device)
    start = torch.zeros(programs, dtype=torch.int64, device=device)
    end = torch.zeros(programs, dtype=torch.int64, device=device)
    emulated = EMULATED_SMS if device.type != "cuda" else 0
    _kernels(_interpreting()).probe[(programs,)](
        sm, start, end, spin_ns, EMULATED=emulated, num_warps=WARPS
    )
    return {"sm": sm, "start": start, "end": end}


def _lists(got: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    return {k: [int(x) for x in v.tolist()] for k, v in got.items()}


def expected_sms(programs: int, sm_count: int, per_sm: int = PER_SM) -> dict[str, int]:
    """The SMs a grid of `programs` holds under each placement: PACKED ceil(programs /
    per_sm), SPREAD min(programs, sm_count)."""
    return {
        PACKED: min(sm_count, math.ceil(programs / per_sm)),
        SPREAD: min(programs, sm_count),
    }


def placement_of(programs: int, sms_held: int, sm_count: int, per_sm: int = PER_SM) -> str | None:
    """Which placement a grid of `programs` that held `sms_held` SMs shows (`expected_sms`):
    PACKED, SPREAD, NEITHER (nearer neither than a quarter of the gap between them), or
    None where the two give the same."""
    expected = expected_sms(programs, sm_count, per_sm)
    packed, spread = expected[PACKED], expected[SPREAD]
    if packed == spread:
        return None
    near = abs(spread - packed) / 4
    if abs(sms_held - spread) <= near:
        return SPREAD
    if abs(sms_held - packed) <= near:
        return PACKED
    return NEITHER


def verdict(grids: list[dict[str, Any]]) -> str | None:
    """The placement the informative grids agree on, MIXED where they do not, None without
    one (or where a grid's programs were not all resident at once)."""
    if any(not g["co_resident"] for g in grids):
        return None
    seen = {g["fits"] for g in grids if g["fits"] is not None}
    if not seen:
        return None
    return seen.pop() if len(seen) == 1 else MIXED


def _grid_row(programs: int, got: dict[str, list[int]], sm_count: int) -> dict[str, Any]:
    held = len(set(got["sm"]))
    # every program started before any stopped: all resident at once (the timer reads 0 in
    # the interpreter, whose programs run one after another: taken as resident there)
    co_resident = max(got["start"]) <= min(got["end"])
    return {
        "programs": programs,
        "sms_held": held,
        **expected_sms(programs, sm_count),
        "most_on_one_sm": max(got["sm"].count(s) for s in set(got["sm"])),
        "co_resident": co_resident,
        "fits": placement_of(programs, held, sm_count),
    }


def _beside(device: torch.device, sm_count: int) -> dict[str, Any]:
    """A long grid on this stream, a short one on another while it spins."""
    other = torch.cuda.Stream(device) if device.type == "cuda" else None
    long_got = probe(sm_count, LONG_SPIN_NS, device)
    with torch.cuda.stream(other) if other is not None else contextlib.nullcontext():
        short_got = probe(sm_count, SHORT_SPIN_NS, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    first, second = _lists(long_got), _lists(short_got)
    first_end = min(first["end"])
    held = set(first["sm"])
    beside = [i for i, t in enumerate(second["start"]) if t < first_end]
    return {
        "programs": sm_count,
        "started_beside": len(beside),
        "on_sms_the_first_holds": sum(1 for i in beside if second["sm"][i] in held),
        "share_beside": len(beside) / sm_count,
    }


def green_context_runner(sms: int, device_id: int) -> contextlib.AbstractContextManager:
    """A context in which this process's CUDA work runs on a green context of `sms` SMs:
    torch >= 2.12 makes one with keyword arguments and gives it streams (`Stream()`);
    earlier ones (the GPU image's 2.11) take them positionally and push the context
    (`set_context` / `pop_context`)."""
    from torch.cuda.green_contexts import GreenContext

    create: Any = GreenContext.create  # its signature is the torch version's
    try:
        ctx = create(num_sms=sms, device_id=device_id)
    except TypeError:  # the positional one
        ctx = create(sms, device_id)
    if hasattr(ctx, "Stream"):
        return torch.cuda.stream(ctx.Stream())
    return _pushed(ctx)


@contextlib.contextmanager
def _pushed(ctx: Any):
    ctx.set_context()
    try:
        yield ctx
    finally:
        ctx.pop_context()


def _green(device: torch.device, sm_count: int) -> dict[str, Any]:
    """One program per SM on a green context of GREEN_SMS SMs: the SMs they held."""
    if device.type != "cuda":
        return {"skipped": "needs CUDA"}
    try:
        with green_context_runner(GREEN_SMS, device.index or 0):
            got = probe(sm_count, SPIN_NS, device)
        torch.cuda.synchronize(device)
    except Exception as exc:  # noqa: BLE001 - an image without green contexts is a finding
        return {"error": error_line(exc)}
    held = len(set(_lists(got)["sm"]))
    return {
        "requested_sms": GREEN_SMS,
        "programs": sm_count,
        "sms_held": held,
        "confined": held <= GREEN_SMS,
    }


def measure_placement(device: torch.device) -> dict[str, Any]:
    """The three probes on `device` (see the module docstring); on CPU under the
    interpreter."""
    if device.type == "cpu" and not _interpreting():
        raise ValueError("on CPU the probe needs TRITON_INTERPRET=1 in the environment")
    sm_count = (
        int(torch.cuda.get_device_properties(device).multi_processor_count)
        if device.type == "cuda"
        else EMULATED_SMS
    )
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        probe(sm_count, 0, device)  # compiled and loaded before anything is timed
        grids = []
        for share in GRID_SHARES:
            programs = max(1, round(sm_count * share))
            got = probe(programs, SPIN_NS, device)
            grids.append(_grid_row(programs, _lists(got), sm_count))
        beside = _beside(device, sm_count)
        green = _green(device, sm_count)
    return {
        "placement": verdict(grids),
        "sm_count": sm_count,
        "warps": WARPS,
        "per_sm": PER_SM,
        "grids": grids,
        "beside": beside,
        "green_context": green,
        "cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
        "emulated": device.type != "cuda",
    }


def markdown(result: dict[str, Any]) -> list[str]:
    """results.md's lines for a measured placement (or its error)."""
    if "error" in result:
        return ["", f"placement: {result['error']}"]
    lines = [
        "",
        f"Block scheduler placement (bench/gpu_placement.py, {result['per_sm']} programs of "
        f"{result['warps']} warps fit an SM): **{result['placement'] or 'not settled'}**"
        + (" (emulated SMs: means nothing)" if result.get("emulated") else ""),
        "",
        f"| programs | SMs held | {PACKED} | {SPREAD} | most on one SM | all resident | fits |",
        "|---|---|---|---|---|---|---|",
    ]
    for g in result["grids"]:
        lines.append(
            f"| {g['programs']} | {g['sms_held']} | {g[PACKED]} | {g[SPREAD]} | "
            f"{g['most_on_one_sm']} | {'yes' if g['co_resident'] else 'no'} | {g['fits']} |"
        )
    b = result["beside"]
    lines += [
        "",
        f"A second stream's {b['programs']} programs, launched while a first grid of as many "
        f"spun: {b['started_beside']} started beside it, {b['on_sms_the_first_holds']} of "
        f"them on SMs it held (CUDA_DEVICE_MAX_CONNECTIONS: "
        f"{result.get('cuda_device_max_connections') or 'unset'}).",
    ]
    g = result.get("green_context") or {}
    if "sms_held" in g:
        lines.append(
            f"On a green context of {g['requested_sms']} SMs, {g['programs']} programs held "
            f"{g['sms_held']} SMs ({'confined' if g['confined'] else '**not confined**'})."
        )
    elif g:
        lines.append(f"Green context: {g.get('error') or g.get('skipped')}.")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for placement.json")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type not in ("cuda", "cpu"):
        print(f"gpu_placement: --device {args.device}: use cuda or cpu", file=sys.stderr)
        return EXIT_BAD_INPUT
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_placement: no usable CUDA here; --device cpu runs the smoke test", file=sys.stderr
        )
        return EXIT_BAD_INPUT
    if device.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernel is built (on first use)
    result = measure_placement(device)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "placement.json").write_text(json.dumps(result, indent=2) + "\n")
    print("\n".join(markdown(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
