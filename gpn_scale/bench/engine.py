"""Engine benchmark: the sequence engine vs the step-by-step reference path, side by side.

    python -m gpn_scale.bench.engine            # everything (about 10-15 min on 2 cores)
    python -m gpn_scale.bench.engine --only speed,roofline
    python -m gpn_scale.bench.engine --only speed --reference-jax ~/grounded-prediction-network

Tables:
  speed     training step (forward + backward + AdamW, fp32) tokens/s, engine vs reference,
            on SMALL (8 x 256) and MEDIUM (4 x 512); the two alternate step by step so that
            machine noise hits both alike. With --reference-jax PATH also the paper's JAX
            implementation (a checkout of github.com/steve-z-wang/grounded-prediction-network;
            needs the `jax` extra), its own trainer from our model's weights, in the same
            alternation (gpn_scale/bench/reference_jax.py).
  roofline  per engine phase: its time next to the time of its bare matmuls at the same shapes;
            for the sequential phases also their other work alone (the phase timed on a
            benchmark build of the kernels that leaves the matmuls out), so that a phase's
            time splits into matmuls, other work, and what the two cost each other.
  memory    peak memory (peak RSS, VmHWM, of a fresh process) for SMALL at T = 256 ... 2048,
            B = 8.
  budget    best tokens/s each path reaches within a peak-memory budget at T = 2048.
Prints tables only; nothing here is asserted (timings belong to benchmarks, not tests).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable

import torch

from gpn_scale.models.gpn import GPN, GPNConfig, load_model_config
from gpn_scale.models.gpn.engine import input_column_blocks
from gpn_scale.models.gpn.reference import reference_forward
from gpn_scale.ops.execution import execution
from gpn_scale.ops.gpn_step import step_kernels
from gpn_scale.ops.gpn_step.phases import phase_timer
from gpn_scale.ops.gpn_step.registry import kernels_for, requested
from gpn_scale.ops.gpn_step.step_kernels import ENV_VAR

SHAPES = {"SMALL": ("small", 8, 256), "MEDIUM": ("medium", 4, 512)}


def _train_step(model: GPN, opt: torch.optim.Optimizer, tokens: torch.Tensor, path: str) -> float:
    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss = model(tokens).loss if path == "engine" else reference_forward(model, tokens).loss
    loss.backward()
    opt.step()
    return time.perf_counter() - start


def _setup(config: str, B: int, T: int, seed: int = 0):
    torch.manual_seed(seed)
    cfg = load_model_config(config)
    model = GPN(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))
    return cfg, model, opt, tokens


def _our_steps(
    model: GPN, opt: torch.optim.Optimizer, tokens: torch.Tensor, times: dict[str, list[float]]
) -> Callable[[int], None]:
    """One training step of each of our paths per call, timed into `times` (step 0: warm-up,
    for allocations and first-touch, not recorded)."""

    def ours(step: int) -> None:
        for path in times:
            seconds = _train_step(model, opt, tokens, path)
            if step > 0:
                times[path].append(seconds)

    return ours


def bench_speed(
    repeats: int, reference_jax: str | None = None, shapes: dict[str, tuple[str, int, int]] = SHAPES
) -> list[dict]:
    """Training-step tokens/s of the engine and the reference path (and, with
    `reference_jax`, of the paper's JAX trainer), best of `repeats` after one warm-up step,
    the paths alternating step by step."""
    rows = []
    for label, (config, B, T) in shapes.items():
        _, model, opt, tokens = _setup(config, B, T)
        times: dict[str, list[float]] = {"engine": [], "reference": []}
        ours = _our_steps(model, opt, tokens, times)
        jax_times: list[float] = []
        if reference_jax:
            from gpn_scale.bench import reference_jax as jax_bench

            # Its step 0 compiles (jit); ours run after each of its steps.
            jax_times = jax_bench.train_steps(
                reference_jax, model, tokens.numpy(), repeats + 1, between=ours
            )[1:]
        else:
            for step in range(repeats + 1):  # interleaved: same noise for both
                ours(step)
        eng = B * T / min(times["engine"])
        ref = B * T / min(times["reference"])
        row = dict(shape=f"{label} {B}x{T}", engine=eng, reference=ref, ratio=eng / ref)
        if jax_times:
            row.update(jax=B * T / min(jax_times), ratio_jax=eng / (B * T / min(jax_times)))
        rows.append(row)
    return rows


def _time(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def bench_roofline(repeats: int, shape: tuple[str, int, int] = SHAPES["SMALL"]) -> list[dict]:
    """Engine phases of a training step vs bare matmuls of the same shapes; with the fused
    kernels, also each sequential phase with its matmuls left out (its other work alone)."""
    config, B, T = shape
    cfg, model, opt, tokens = _setup(config, B, T)
    loops = _bare_matmul_loops(cfg, B, T)
    without_matmuls = (
        step_kernels.benchmark_build(step_kernels.WITHOUT_STEP_MATMULS)
        if kernels_for(torch.device("cpu")) is not None
        else None
    )
    best: dict[str, float] = {}
    bare: dict[str, float] = {}
    rest: dict[str, float] = {}
    # Rounds alternate the engine's step and the bare loops, so that machine load hits both
    # alike; each bare loop runs a whole phase's worth (T steps, every chunk) like the phase.
    for _ in range(repeats + 1):
        with phase_timer() as phases:
            _train_step(model, opt, tokens, "engine")
        for key, value in phases.items():
            best[key] = min(best.get(key, float("inf")), value)
        if without_matmuls is not None:
            # Same model, same inputs; the step's result is meaningless, so nothing is
            # updated (no optimizer step) and the gradients are dropped.
            with execution(step_kernels=without_matmuls), phase_timer() as phases:
                model(tokens).loss.backward()
            model.zero_grad(set_to_none=True)
            for key, value in phases.items():
                rest[key] = min(rest.get(key, float("inf")), value)
        for key, loop in loops.items():
            bare[key] = min(bare.get(key, float("inf")), _time(loop, 1))
    rows = []
    for phase in (
        "sequential forward",
        "sequential backward",
        "parallel recompute",
        "memory carry backward",
        "weight gradients",
        "decode",
    ):
        if phase not in bare:  # a model without memory has no memory phase
            continue
        seconds = best.get(phase, float("nan"))
        with_memory = bare.get(phase + " +memory", bare[phase])
        other = rest.get(phase) if phase.startswith("sequential") else None
        rows.append(
            dict(
                phase=phase,
                seconds=seconds,
                bare_matmuls=bare[phase],
                ratio=seconds / bare[phase],
                with_memory=with_memory,
                ratio_with_memory=seconds / with_memory,
                other_work=other,
                ratio_of_sum=None if other is None else (bare[phase] + other) / bare[phase],
            )
        )
    return rows


def _bare_matmul_loops(cfg: GPNConfig, B: int, T: int) -> dict[str, Callable[[], None]]:
    """The matmuls each phase must do, alone at the same shapes: per phase, a function that
    runs a whole phase's worth of them (every step, or every chunk)."""
    (seq_fwd, seq_bwd), weights = _step_matmuls(cfg, B)
    recompute, memory_carry, wgrad = _chunk_matmuls(cfg, B, weights)
    decode = _decode_matmuls(cfg, B, T)
    chunks = -(-T // cfg.engine.chunk_size)
    return {
        "sequential forward": _times(seq_fwd, T),
        "sequential backward": _times(seq_bwd, T),
        **(
            {
                "sequential forward +memory": _times(lambda: seq_fwd(True), T),
                "sequential backward +memory": _times(lambda: seq_bwd(True), T),
                "memory carry backward": _times(memory_carry, chunks - 1),
            }
            if cfg.memory
            else {}
        ),
        "parallel recompute": _times(recompute, chunks),
        "weight gradients": _times(wgrad, chunks),
        "decode": decode,
    }


def _times(fn: Callable[[], None], n: int) -> Callable[[], None]:
    def loop() -> None:
        for _ in range(n):
            fn()

    return loop


def _widths(cfg: GPNConfig) -> tuple[list[int], int]:
    """The width of each layer's fused input matmul, and of the output matmul's input."""
    widths_in = [sum(input_column_blocks(cfg, i)) for i in range(cfg.n_layers)]
    width_out = cfg.n_heads * cfg.d_value + cfg.d_ffn if cfg.memory else cfg.d_ffn
    return widths_in, width_out


# The projections' weights (W_in per layer, W_out, W_fg): the step's and the chunk's matmuls
# read the same ones.
_Weights = tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]


def _step_matmuls(
    cfg: GPNConfig, B: int
) -> tuple[tuple[Callable[..., None], Callable[..., None]], _Weights]:
    """One time step's matmuls of the sequential forward and backward (B rows each), with
    the per-step memory reads when called with memory=True; and the weights (W_in, W_out,
    W_fg), which the chunks' matmuls read too."""
    d = cfg.d_state
    widths_in, width_out = _widths(cfg)
    r = torch.randn
    x = r(B, d)
    W_in = [r(d, n) for n in widths_in]
    h = r(B, width_out)
    W_out = r(width_out, d)
    W_fg = r(d, d)
    dy_in = [r(B, n) for n in widths_in]
    dz = r(B, d)
    # The backward's dy @ W^T against contiguous transposes, as the engine does (a transposed
    # view makes these few-row matmuls ~2.5x slower and would flatter the ratio).
    Wt_in = [W.t().contiguous() for W in W_in]
    Wt_out = W_out.t().contiguous()
    Wt_fg = W_fg.t().contiguous()
    # The per-step memory reads are matmuls too: M0^T [k; q] (forward, layer 0; M0^T q for
    # the other layers) and M0 [drq; drk] (backward), batched over B*H.
    H, dk, dv, L = cfg.n_heads, cfg.d_key, cfg.d_value, cfg.n_layers
    M0 = r(B * H, dk, dv)
    M0t = M0.mT.contiguous()
    kq = [r(B * H, 2 if i == 0 else 1, dk) for i in range(L)]
    dkq = [r(B * H, 2 if i == 0 else 1, dv) for i in range(L)]

    def seq_fwd(memory: bool = False):
        for W, a in zip(W_in, kq):
            x @ W
            if memory:
                a @ M0
            h @ W_out
        x @ W_fg

    def seq_bwd(memory: bool = False):
        for dy, W, a in zip(dy_in, Wt_in, dkq):
            dy @ W
            if memory:
                a @ M0t
            dz @ Wt_out
        dz @ Wt_fg

    return (seq_fwd, seq_bwd), (W_in, W_out, W_fg)


def _chunk_matmuls(
    cfg: GPNConfig, B: int, weights: _Weights
) -> tuple[Callable[[], None], Callable[[], None], Callable[[], None]]:
    """One chunk's matmuls (C * B rows) of the parallel recompute, the memory carry's
    backward and the weight gradients."""
    W_in, W_out, W_fg = weights
    d, C, H, dk, dv = cfg.d_state, cfg.engine.chunk_size, cfg.n_heads, cfg.d_key, cfg.d_value
    widths_in, width_out = _widths(cfg)
    r = torch.randn
    X = r(C * B, d)
    H_ = r(C * B, width_out)
    dY = [r(C * B, n) for n in widths_in]
    dZ = r(C * B, d)

    def recompute():
        for W in W_in:
            X @ W
            H_ @ W_out
        X @ W_fg

    # Per chunk, the end memory's gradient onto the chunk's keys and values: K dM, U dM^T.
    Kc, Uc, dM = r(B * H, C, dk), r(B * H, C, dv), r(B * H, dk, dv)

    def memory_carry():
        Kc @ dM
        Uc @ dM.mT

    def wgrad():
        for dy in dY:
            X.t() @ dy
            H_.t() @ dZ
        X.t() @ dZ

    return recompute, memory_carry, wgrad


def _decode_matmuls(cfg: GPNConfig, B: int, T: int) -> Callable[[], None]:
    """The decode's matmuls over the whole sequence: the logits and their gradients, loss
    chunk by loss chunk, and the state's projection to the embedding."""
    d, e, V = cfg.d_state, cfg.d_emb, cfg.vocab_size
    r = torch.randn
    N = B * T
    rows = min(cfg.engine.loss_chunk_tokens, N)
    Hd = r(rows, e)
    E = r(V, e)
    G = r(rows, V)
    P = r(N, d)
    W_dec = r(d, e)
    dH = r(N, e)

    def decode():
        for _ in range(N // rows):
            Hd @ E.t()
            G @ E
            G.t() @ Hd
        P @ W_dec
        dH @ W_dec.t()
        P.t() @ dH

    return decode


def _child(path: str, config: str, B: int, T: int) -> None:
    """One training step in a fresh process; prints peak RSS growth and tokens/s as JSON."""
    _, model, opt, tokens = _setup(config, B, T)
    _train_step(model, opt, tokens[:, :8], path)  # creates grads and AdamW state
    base = _proc_status_bytes("VmRSS")
    seconds = _train_step(model, opt, tokens, path)
    peak = _proc_status_bytes("VmHWM")
    print(
        json.dumps(
            dict(peak=peak, base=base, activation_peak=peak - base, tokens_per_s=B * T / seconds)
        )
    )


def _proc_status_bytes(field: str) -> int:
    """VmRSS / VmHWM of this process. (Not getrusage's ru_maxrss: that survives execve, so a
    child would report its parent's peak.)"""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _run_child(path: str, config: str, B: int, T: int) -> dict:
    # Large blocks straight from mmap, so freed memory leaves the RSS at once and the peak
    # RSS is the peak of live memory (glibc's adaptive threshold would keep freed blocks).
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run(
        [sys.executable, "-m", "gpn_scale.bench.engine", "--child", path, config, str(B), str(T)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_memory(paths: tuple[str, ...] = ("engine", "reference")) -> list[dict]:
    config, B, _ = SHAPES["SMALL"]
    rows = []
    for T in (256, 512, 1024, 2048):
        row: dict = dict(T=T)
        for path in paths:
            row[path] = _run_child(path, config, B, T)["peak"]
        rows.append(row)
    return rows


def bench_budget(budget_gb: float) -> list[dict]:
    config, _, _ = SHAPES["SMALL"]
    T = 2048
    rows = []
    for path, batches in (("engine", (8, 16, 32, 64, 96)), ("reference", (2, 4, 8, 12, 16))):
        best = None
        for B in batches:
            res = _run_child(path, config, B, T)
            if res["peak"] > budget_gb * 1e9:
                break
            if best is None or res["tokens_per_s"] > best["tokens_per_s"]:
                best = dict(path=path, batch=B, **res)
        rows.append(best or dict(path=path, batch=0, tokens_per_s=0.0, peak=0))
    return rows


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.child:
        path, config, B, T = args.child
        _child(path, config, int(B), int(T))
        return 0
    tables = set(args.only.split(","))
    if args.reference_jax:
        error = _reference_jax_error(args.reference_jax, tables)
        if error:
            print(f"gpn_scale.bench.engine: error: {error}", file=sys.stderr)
            return 2
    kernels = kernels_for(torch.device("cpu")) is not None
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, engine steps: "
        f"{'fused CPU kernels' if kernels else 'PyTorch ops'} ({ENV_VAR}={requested()})"
    )
    if "speed" in tables:
        _print_speed(args.repeats, args.reference_jax)
    if "roofline" in tables:
        _print_roofline(args.repeats)
    if "memory" in tables:
        _print_memory()
    if "budget" in tables:
        _print_budget(args.budget_gb)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog="--reference-jax needs a checkout of the paper's code: git clone "
        "https://github.com/steve-z-wang/grounded-prediction-network (any directory), "
        "and jax, flax, optax: pip install -e '.[jax]' (CPU wheels suffice).",
    )
    parser.add_argument(
        "--only",
        default="speed,roofline,memory,budget",
        help="comma-separated tables to run (speed, roofline, memory, budget)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget-gb", type=float, default=4.0)
    parser.add_argument(
        "--reference-jax",
        metavar="PATH",
        default=None,
        help="also time the paper's JAX implementation (its own trainer, from "
        "our model's weights) in the speed table, alternating with ours; "
        "PATH: a checkout of its repository (see below). Default: off",
    )
    parser.add_argument(
        "--child", nargs=4, metavar=("PATH", "CONFIG", "B", "T"), help=argparse.SUPPRESS
    )
    return parser


def _reference_jax_error(path: str, tables: set[str]) -> str | None:
    """Why --reference-jax PATH cannot run with these tables (None: it can)."""
    from gpn_scale.bench import reference_jax as jax_bench

    try:
        jax_bench.check_checkout(path)
        jax_bench.require_jax()
    except jax_bench.ReferenceJaxError as err:
        return str(err)
    if "speed" not in tables:
        return "--reference-jax adds to the speed table; include speed in --only"
    return None


def _print_speed(repeats: int, reference_jax: str | None) -> None:
    print(
        f"\n## Training step tokens/s (forward + backward + AdamW), best of {repeats}, interleaved"
    )
    jax_cols = f" {'JAX (paper)':>11} {'vs JAX':>7}" if reference_jax else ""
    print(f"{'shape':<18} {'engine':>10} {'reference':>10} {'ratio':>7}" + jax_cols)
    for r in bench_speed(repeats, reference_jax):
        jax = f" {r['jax']:>11.0f} {r['ratio_jax']:>6.2f}x" if "jax" in r else ""
        print(
            f"{r['shape']:<18} {r['engine']:>10.0f} {r['reference']:>10.0f} "
            f"{r['ratio']:>6.2f}x" + jax
        )


def _print_roofline(repeats: int) -> None:
    roofline = bench_roofline(repeats)  # before the header: it may build the kernels
    print("\n## Roofline, SMALL 8x256: engine phase vs its bare matmuls at the same shapes")
    print(
        "(+memory: also the per-step memory-read matmuls M0^T [k; q] / M0 [drq; drk];\n"
        " rest: the phase with its projection matmuls left out (a benchmark build of the\n"
        " kernels), i.e. all its other work; sum: (matmuls + rest) / matmuls, the ratio\n"
        " the phase would have if the two did not slow each other down)"
    )
    print(
        f"{'phase':<22} {'phase s':>9} {'matmuls s':>10} {'ratio':>7} "
        f"{'+memory s':>10} {'ratio':>7} {'rest s':>8} {'sum':>7}"
    )
    for r in roofline:
        split = (
            f" {r['other_work']:>8.3f} {r['ratio_of_sum']:>6.2f}x"
            if r["other_work"] is not None
            else f" {'-':>8} {'-':>7}"
        )
        print(
            f"{r['phase']:<22} {r['seconds']:>9.3f} {r['bare_matmuls']:>10.3f} "
            f"{r['ratio']:>6.2f}x {r['with_memory']:>10.3f} {r['ratio_with_memory']:>6.2f}x" + split
        )


def _print_memory() -> None:
    print("\n## Peak memory (peak RSS of a fresh process, MB), SMALL B=8, one training step")
    print(f"{'T':>6} {'engine':>10} {'reference':>10}")
    rows = bench_memory()
    for r in rows:
        print(f"{r['T']:>6} {r['engine'] / 1e6:>10.0f} {r['reference'] / 1e6:>10.0f}")
    growth = {p: (rows[-1][p] - rows[0][p]) / 1e6 for p in ("engine", "reference")}
    print(
        f"T=2048 minus T=256: engine {growth['engine']:.0f} MB, "
        f"reference {growth['reference']:.0f} MB"
    )


def _print_budget(budget_gb: float) -> None:
    print(f"\n## Best tokens/s within {budget_gb:g} GB peak memory, SMALL at T=2048")
    print(f"{'path':<10} {'batch':>6} {'tokens/s':>10} {'peak MB':>9}")
    rows = bench_budget(budget_gb)
    for r in rows:
        print(f"{r['path']:<10} {r['batch']:>6} {r['tokens_per_s']:>10.0f} {r['peak'] / 1e6:>9.0f}")
    if rows[1]["tokens_per_s"]:
        print(f"engine / reference: {rows[0]['tokens_per_s'] / rows[1]['tokens_per_s']:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
