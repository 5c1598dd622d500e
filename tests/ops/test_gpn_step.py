"""Every step backend (gpn_scale/ops/gpn_step) equals the PyTorch steps: the loss, the final
carry and every gradient, over the same configurations (1-3 layers, GPN without memory,
chunk sizes that do and do not divide T, carried state, truncated BPTT).

Backends: `cpu` (the fused C++ kernels), `cuda` (the Triton kernels, run on CPU tensors by
Triton's interpreter here: float32/float64 only) and `cuda-graphs` (the same, through the
chunk-graph machinery with the capture call replaced by its eager stand-in)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from gpn_scale.models.gpn import GPNState
from gpn_scale.ops.execution import execution
from gpn_scale.ops.gpn_step import graphs, registry
from gpn_scale.ops.gpn_step.registry import ENV_VAR, select_backend
from gpn_scale.ops.gpn_step.workspace import release_workspaces
from gpn_scale.testing.models import gpn_cases, perturbed_model, tiny_config

CASES = gpn_cases(
    "1-layer",
    "2-layer",
    "3-layer",
    "gpn-no-memory",
    "gpn-2-layer",
    "decoder-bias",
    "chunk-1",
    "chunk-not-dividing",
    "chunk-longer-than-T",
    "tbptt",
    "tbptt-2-layer",
    "wide-heads",
)
# The interpreter runs a Triton program instance at a time in numpy: the graph variant (the
# same kernels again) runs on the cases that exercise its shape keys (several chunks, a
# partial last chunk, several layers, no memory).
GRAPH_CASES = ("2-layer", "chunk-not-dividing", "gpn-no-memory", "tbptt")
# Every registered backend but the reference itself (a new one is tested once registered),
# and the CUDA backend once more through its graphs.
BACKENDS = (*(b.name for b in registry.BACKENDS.backends if b.name != "reference"), "cuda-graphs")


@contextlib.contextmanager
def _backend(name: str, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    if name == "cuda-graphs":
        with execution(graph_capture=graphs.eager_capture):
            yield "cuda", True
    else:
        yield name, False


def _state(cfg, B: int, dtype) -> GPNState:
    """A non-zero initial carry (as in a stateful window) that also receives gradients."""
    g = torch.Generator().manual_seed(7)
    s = torch.randn(B, cfg.d_state, generator=g, dtype=dtype)
    s_prev = torch.randn(B, cfg.d_state, generator=g, dtype=dtype)
    M = (
        torch.randn(B, cfg.n_heads, cfg.d_key, cfg.d_value, generator=g, dtype=dtype) * 0.3
        if cfg.memory
        else None
    )
    return GPNState(*(t.requires_grad_() if t is not None else None for t in (s, s_prev, M)))


def _run(cfg, model, tokens, state, backend: str, graphs_on: bool) -> tuple:
    model.config = cfg.replace(step_backend=backend, cuda_graphs=graphs_on)
    out = model(tokens, state=state, return_state=True)
    wrt = [*model.parameters(), *(t for t in state if t is not None and t.requires_grad)]
    return out, torch.autograd.grad(out.loss, wrt)


def compare(
    cfg,
    backend: str,
    dtype,
    monkeypatch,
    rtol: float,
    atol: float,
    value_tol: float | None = None,
    T: int = 13,
    B: int = 3,
) -> None:
    model = perturbed_model(cfg, dtype)
    tokens = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(3))
    state = _state(cfg, B, dtype)
    want, g_want = _run(cfg, model, tokens, state, "reference", False)
    with _backend(backend, monkeypatch) as (name, graphs_on):
        got, g_got = _run(cfg, model, tokens, state, name, graphs_on)
    torch.testing.assert_close(got.loss, want.loss, rtol=min(rtol, 1e-5), atol=0)
    for a, b in zip(got.state, want.state):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=value_tol or rtol, atol=value_tol or atol)
    names = [n for n, _ in model.named_parameters()] + ["s0", "s_prev0", "M0"]
    for name, a, b in zip(names, g_got, g_want):
        scale = b.abs().max().item()
        torch.testing.assert_close(
            a, b, rtol=rtol, atol=atol + rtol * scale, msg=lambda m, name=name: f"{name}: {m}"
        )


def _params(backends=BACKENDS):
    for backend in backends:
        for case in CASES:
            if backend == "cuda-graphs" and case not in GRAPH_CASES:
                continue
            marks = [pytest.mark.slow] if backend.startswith("cuda") else []
            yield pytest.param(backend, case, id=f"{backend}-{case}", marks=marks)


@pytest.mark.parametrize("backend,case", list(_params()))
def test_backend_equals_pytorch_steps_float64(backend, case, monkeypatch):
    compare(tiny_config(**CASES[case]), backend, torch.float64, monkeypatch, rtol=1e-11, atol=1e-13)


@pytest.mark.slow
def test_cuda_backend_with_partial_key_and_value_blocks_float64(monkeypatch):
    """d_key = 6 and d_value = 10 in the interpreter's blocks of 4 key and 8 value columns:
    the memory kernels' loops over both end in a masked partial block."""
    cfg = tiny_config(n_heads=2, d_key=6, d_value=10, chunk_size=5)
    compare(cfg, "cuda", torch.float64, monkeypatch, rtol=1e-11, atol=1e-13)


# (backend, layers, chunk, T): chunks of several sweep blocks, each over three chunks, the
# last one short. In 4-step blocks (the Triton kernels under the interpreter) 20, 17 and 19
# are whole blocks, blocks and one step, blocks and a partial one; 8, 9 and 7 are the same
# layouts in fewer steps, which the interpreter, running every launch in Python, needs
# (T = 45 took it 28-100 s a case).
LONG_CHUNKS = [
    ("cpu", 1, 20, 45),
    ("cpu", 1, 17, 45),
    ("cpu", 2, 19, 45),
    pytest.param("cuda", 1, 8, 21, marks=pytest.mark.slow),
    pytest.param("cuda", 1, 9, 21, marks=pytest.mark.slow),
    pytest.param("cuda", 2, 7, 17, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("backend,layers,chunk,T", LONG_CHUNKS)
def test_backend_equals_pytorch_steps_long_chunks_float64(backend, layers, chunk, T, monkeypatch):
    """Chunks of several sweep blocks (the reverse sweeps defer the history pushes of a block
    of steps onto earlier steps: 8 in the C++, 4 in the Triton kernels under the interpreter,
    16 on a GPU): whole blocks, a partial last block, a block of one step. Long perturbed
    recurrences amplify float64 rounding to ~1e-11 in the state."""
    compare(
        tiny_config(n_layers=layers, chunk_size=chunk),
        backend,
        torch.float64,
        monkeypatch,
        rtol=1e-10,
        atol=1e-12,
        value_tol=1e-10,
        T=T,
    )


def _float32_params():
    # The interpreted CUDA backend runs the cases whose float32 code differs: the write's
    # kernels (1-layer), no memory, truncation. Its later layers' and partial value blocks'
    # float32 kernels are the same code at other constants: float64 holds them to 1e-11 (a
    # wrong index is O(1) there too), and the bf16-reads test below runs two layers in float32.
    for case in ("1-layer", "2-layer", "gpn-no-memory", "tbptt", "wide-heads"):
        yield pytest.param("cpu", case, id=f"{case}-cpu")
        if case in ("1-layer", "gpn-no-memory", "tbptt"):
            yield pytest.param("cuda", case, id=f"{case}-cuda", marks=pytest.mark.slow)


@pytest.mark.parametrize("backend,case", list(_float32_params()))
def test_backend_equals_pytorch_steps_float32(backend, case, monkeypatch):
    # The engine tests' float32 tolerances: loss 1e-5, gradients 1e-5 + 1e-4 relative, state
    # 1e-4 (13 steps of a perturbed recurrence amplify rounding differences). The Triton
    # GEMMs apply the RMSNorm as a row scale after the product and sum in other orders: their
    # float32 gradients differ by up to ~4e-4 relative (float64 above: 1e-11).
    rtol = 1e-4 if backend == "cpu" else 1e-3
    compare(
        tiny_config(**CASES[case]),
        backend,
        torch.float32,
        monkeypatch,
        rtol=rtol,
        atol=1e-5,
        value_tol=1e-4,
    )


def _bf16_read_params():
    slow = pytest.mark.slow
    for backend, dtype in [
        ("cpu", torch.float64),
        ("cpu", torch.float32),
        ("cuda", torch.float64),
        ("cuda", torch.float32),
        ("cuda-graphs", torch.float64),  # the graphs' static bf16 copy (float32: the same)
    ]:
        marks = [slow] if backend.startswith("cuda") else []
        yield pytest.param(backend, dtype, id=f"{backend}-{str(dtype)[6:]}", marks=marks)


@pytest.mark.parametrize("backend,dtype", list(_bf16_read_params()))
def test_backend_with_bf16_memory_reads_equals_pytorch_steps(backend, dtype, monkeypatch):
    """engine.bf16_memory_reads: every backend reads the same bf16 copy of each chunk's M0
    (the Triton kernels load it as bf16, the others widen it first) and keeps the carried
    memory exact. Two layers, a partial last chunk, a non-zero M0 entering the window."""
    cfg = tiny_config(n_layers=2, chunk_size=5, bf16_memory_reads=True)
    if dtype == torch.float64:
        compare(cfg, backend, dtype, monkeypatch, rtol=1e-11, atol=1e-13)
    else:
        rtol = 1e-4 if backend == "cpu" else 1e-3
        compare(cfg, backend, dtype, monkeypatch, rtol=rtol, atol=1e-5, value_tol=1e-4)


@pytest.mark.slow
def test_cuda_backend_with_cublas_gemms_equals_pytorch_steps(monkeypatch):
    """engine.cublas_gemms=all: every step GEMM a cuBLAS product (torch.mm here) with the
    scale and epilogue in the reduce kernel after, the split-K partials and the sums in
    the consumer gone; through the chunk graphs (their eager stand-in). Two layers (the
    upper input GEMM's read norm split over K), a partial last chunk, a non-zero carry."""
    cfg = tiny_config(n_layers=2, chunk_size=5, cublas_gemms="all")
    compare(cfg, "cuda-graphs", torch.float64, monkeypatch, rtol=1e-11, atol=1e-13)


@pytest.fixture
def uninitialised_is_nan(monkeypatch):
    """Every float tensor made by torch.empty / new_empty starts as NaN: a backend that read
    a buffer it was handed uninitialised (the interface's WRITTEN_WHOLE fields: P, S, the
    sweep's per-step adjoints) would carry the NaN into the loss or a gradient."""
    empty, new_empty = torch.empty, torch.Tensor.new_empty
    release_workspaces()  # the kept workspaces (activations, adjoints) are made again, poisoned

    def poisoned(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poisoned(empty(*a, **k)))
    monkeypatch.setattr(
        torch.Tensor, "new_empty", lambda s, *a, **k: poisoned(new_empty(s, *a, **k))
    )


@pytest.mark.parametrize("backend", ["cpu", pytest.param("cuda-graphs", marks=pytest.mark.slow)])
def test_backends_write_whole_what_they_are_handed_uninitialised(
    backend, uninitialised_is_nan, monkeypatch
):
    compare(tiny_config(chunk_size=5), backend, torch.float64, monkeypatch, rtol=1e-11, atol=1e-13)


def test_a_replay_copies_in_only_what_its_kernels_read():
    """The forward's P and S and the sweep's per-step adjoints are written whole by the
    kernels (`WRITTEN_WHOLE`): copied out after a replay, never in."""
    from gpn_scale.ops.gpn_step.interface import ChunkForward

    def chunk(value: float) -> ChunkForward:
        full = lambda *shape: torch.full(shape, value)  # noqa: E731
        return ChunkForward(
            full(2, 3, 4), full(2, 4), full(2, 4), None, full(2, 3, 4), full(2, 3, 4)
        )

    static = chunk(0.0)
    graph = graphs._Graph(static, weights=None, replay=lambda: None, outputs=None)
    graph.weights_of = lambda: "W"  # the loop weights are current: not copied
    graphs.ChunkGraphs()._replay(graph, "W", chunk(1.0))
    assert all(bool((t == 1).all()) for t in (static.fuse, static.s, static.s_prev))
    assert bool((static.P == 0).all()) and bool((static.S == 0).all())
    read = graphs._read_part(static)
    assert read.P is None and read.S is None and read.fuse is static.fuse
    # a replay's record: what it reads in (fuse, s, s_prev), P and S out, its outputs cloned
    out = (torch.zeros(2, 4),)
    assert graphs.replay_copy_bytes(static, (static.P, static.S), out) == 2 * 4 * (
        24 + 8 + 8 + 24 + 24 + 8
    )


def test_a_reverse_replay_copies_no_activation_but_the_carry_it_was_handed():
    """The recompute writes every activation the sweep reads into the engine's workspaces
    (`ChunkActs.BOUND`): a reverse graph binds them by address, keeps no static copy and a
    replay copies none in. `hidden` feeds the weight gradients only: neither kept nor copied.
    Only s_prev (the forward's carry, not the recompute's) is copied in."""
    from gpn_scale.ops.gpn_step.interface import ChunkActs

    one = lambda: torch.ones(2, 3)  # noqa: E731
    acts = ChunkActs(*[[one()] for _ in range(8)], one(), one(), one())
    acts.s_prev = torch.ones(2, 5)
    acts.n_sprev, acts.k_pre, acts.k, acts.v = (one() for _ in range(4))
    acts.beta, acts.U, acts.G, acts.pred, acts.rk = (one() for _ in range(5))
    static = graphs._static_like(acts)
    assert static.hidden == [] and static.y[0] is acts.y[0] and static.U is acts.U
    assert static.s_prev is not acts.s_prev and torch.equal(static.s_prev, acts.s_prev)
    read = graphs._read_part(acts)
    assert read.hidden == [] and read.c == [] and read.U is None and read.s_prev is acts.s_prev
    assert acts.hidden[0].shape == (2, 3)  # the caller's tree is left as it was
    assert graphs.replay_copy_bytes(acts, (), None) == 2 * 4 * 10  # s_prev in
    bound = {t.data_ptr() for t in graphs._bound_leaves(acts)}
    assert len(bound) == 7 + 3 + 9 and acts.s_prev.data_ptr() not in bound


@pytest.mark.slow
def test_chunk_graphs_capture_once_per_shape_and_replay(monkeypatch):
    """T = 13 in chunks of 5: chunks of 5, 5, 3 -> one forward graph per chunk length and one
    reverse graph per (length, adjoint workspace): (3, set 0), (5, set 1), (5, set 0);
    replayed for every chunk; a second engine call replays without capturing (the
    workspaces stay where they are)."""
    cfg = tiny_config(chunk_size=5, step_backend="cuda")
    model = perturbed_model(cfg, torch.float64)
    tokens = torch.randint(0, cfg.vocab_size, (2, 13), generator=torch.Generator().manual_seed(1))
    monkeypatch.delenv(ENV_VAR, raising=False)
    backend = select_backend("cuda", torch.device("cpu"))
    backend.graphs = graphs.ChunkGraphs()
    with execution(graph_capture=graphs.eager_capture):
        model(tokens).loss.backward()
        assert (backend.graphs.captures, backend.graphs.replays) == (5, 6)
        model(tokens).loss.backward()
        assert (backend.graphs.captures, backend.graphs.replays) == (5, 12)


@pytest.mark.slow
def test_chunk_graph_capture_failure_warns_and_runs_eagerly(monkeypatch):
    def failing(fn):
        raise RuntimeError("operation not permitted when stream is capturing")

    cfg = tiny_config(step_backend="cuda")
    model = perturbed_model(cfg, torch.float64)
    tokens = torch.randint(0, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(1))
    monkeypatch.delenv(ENV_VAR, raising=False)
    backend = select_backend("cuda", torch.device("cpu"))
    backend.graphs = graphs.ChunkGraphs()
    want = perturbed_model(tiny_config(step_backend="reference"), torch.float64)(tokens).loss
    with execution(graph_capture=failing), pytest.warns(RuntimeWarning, match="capture .* failed"):
        got = model(tokens).loss
    assert backend.graphs.failed and "not permitted" in backend.graphs.failed
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


@pytest.mark.slow
def test_chunk_graphs_are_keyed_on_shapes_bounded_and_cleared(monkeypatch):
    """A window of another length reuses the graphs of its chunk shapes (the static copies
    are compact, so the views' strides do not matter); the cache holds at most max_graphs,
    least recently used out; clear() drops them all."""
    cfg = tiny_config(chunk_size=5, step_backend="cuda")
    model = perturbed_model(cfg, torch.float64)
    g = torch.Generator().manual_seed(1)
    tokens13 = torch.randint(0, cfg.vocab_size, (2, 13), generator=g)
    tokens8 = torch.randint(0, cfg.vocab_size, (2, 8), generator=g)
    monkeypatch.delenv(ENV_VAR, raising=False)
    backend = select_backend("cuda", torch.device("cpu"))
    backend.graphs = graphs.ChunkGraphs()
    with execution(graph_capture=graphs.eager_capture):
        model(tokens13).loss.backward()  # chunks 5, 5, 3: two forward, three reverse
        assert backend.graphs.captures == 5
        # chunks 5, 3: the same shapes, other strides; the 3 now on adjoint workspace 1
        model(tokens8).loss.backward()
        assert (backend.graphs.captures, len(backend.graphs)) == (6, 6)
        backend.graphs = graphs.ChunkGraphs(max_graphs=2)
        model(tokens13).loss.backward()
        assert len(backend.graphs) == 2 and backend.graphs.evictions == 3
        want = perturbed_model(tiny_config(step_backend="reference"), torch.float64)(tokens8)
        got = model(tokens8)  # evicted shapes are captured again, and still exact
        torch.testing.assert_close(got.loss, want.loss, rtol=1e-12, atol=0)
        backend.graphs.clear()
        assert len(backend.graphs) == 0


@pytest.mark.slow
def test_chunk_graph_capture_out_of_memory_is_raised_and_graphs_stay_on(monkeypatch):
    """Out of memory during a capture is the batch's problem, raised to the caller (the
    device check's batch search stops there); graphs are not turned off for later models."""
    calls = []

    def out_of_memory_once(fn):
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return graphs.eager_capture(fn)

    cfg = tiny_config(step_backend="cuda")
    model = perturbed_model(cfg, torch.float64)
    tokens = torch.randint(0, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(1))
    monkeypatch.delenv(ENV_VAR, raising=False)
    backend = select_backend("cuda", torch.device("cpu"))
    backend.graphs = graphs.ChunkGraphs()
    with execution(graph_capture=out_of_memory_once):
        with pytest.raises(torch.OutOfMemoryError):
            model(tokens)
        assert backend.graphs.failed is None
        model(tokens)
        assert backend.graphs.captures >= 1 and backend.graphs.replays >= 1


@pytest.mark.slow
def test_cuda_backend_at_the_gpus_block_sizes_equals_pytorch_steps_float64(monkeypatch):
    """The GPU's own block sizes, which the other tests' interpreter-sized blocks never run:
    64-wide GEMM tiles (every one partial here) and the split-K a 132-SM GPU gets, d_value
    blocks of 32 forward / 16 backward, tl.dot's 16-wide minimum on the memory tiles, sweep
    blocks of 16 steps with their flush (a chunk of 20: a full and a partial block), the
    fused input's 16-element padded rows. (Loops over several GPU-sized blocks would need
    d > 1024 and take the interpreter a quarter of an hour: the compile gate sees those
    sizes compiled, the other tests their loops at the interpreter's block sizes.)"""
    from gpn_scale.ops.gpn_step import geometry

    monkeypatch.setattr(geometry, "interpreting", lambda t: False)
    cfg = tiny_config(  # two layers: the write's and a read-only layer's kernels
        n_layers=2, d_state=40, d_ffn=36, n_heads=3, d_key=16, d_value=40, chunk_size=20
    )
    # 21-23 steps of two perturbed layers amplify float64 rounding: the carried state differs
    # from the PyTorch steps by up to 4.6e-10 here (scale 15), and by 2.8e-9 at the
    # interpreter's own block sizes; the gradients by up to 3.3e-9 of their largest element
    # (fuse_norm_weight, on an AVX2 machine: the BLAS's summation order differs by machine).
    # 1e-8 on both still catches any index or mask error (those are O(1)).
    compare(
        cfg, "cuda", torch.float64, monkeypatch, rtol=1e-8, atol=1e-11, value_tol=1e-8, T=23, B=2
    )
