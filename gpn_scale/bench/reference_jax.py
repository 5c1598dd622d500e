"""The paper's own JAX implementation, driven beside our engine for `gpn_scale.bench.engine
--reference-jax PATH`: the code a user would otherwise run, so that the engine's speed-up is
quoted against it and not only against our step-by-step PyTorch reference path.

Nothing of it is copied here. PATH is a checkout of
https://github.com/steve-z-wang/grounded-prediction-network (`git clone` it anywhere); its
package `src` is imported from there, and its training step runs through its own public
classes: the model `SoTM` (GPN+M; `src.jax.models.sot_m`), its trainer `SoTMTrainer` (`setup`
builds its optax chain: global-norm clipping + AdamW with a warmup-cosine schedule, `run` its
loop of two jitted calls per step: `jax.value_and_grad` of the scanned loss, then the optimizer
update) and its `BaseTrainConfig`. The loop pulls its batches from a dataset object; ours hands
it the same (B, T) tokens as the engine gets and times the trainer's whole loop body per step
(the loop syncs on the loss and the gradient norm every step, so each step has finished when
the next batch is asked for). Between two of its steps the caller's own steps run: the paths
alternate step by step, so machine load hits them alike.

The model starts from our model's weights (`export_reference`, the reference's parameter
layout), so both sides train the same network at the same shapes; `reference_loss` gives the
JAX loss of those weights, to check that.

Needs jax, flax and optax (`pip install -e '.[jax]'`; CPU wheels suffice). fp32, full BPTT
(`checkpoint_every=0`, the trainer's default), as our benchmark runs.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from gpn_scale.models.gpn import GPN
from gpn_scale.models.gpn.reference_format import export_reference

REPOSITORY = "https://github.com/steve-z-wang/grounded-prediction-network"
MODEL_FILE = Path("src/jax/models/sot_m/model.py")


class ReferenceJaxError(RuntimeError):
    """The checkout or its dependencies are missing; the message names the fix."""


def check_checkout(path: str | os.PathLike[str]) -> Path:
    """The checkout's root, or ReferenceJaxError naming how to get one."""
    root = Path(path).expanduser().resolve()
    if not (root / MODEL_FILE).is_file():
        raise ReferenceJaxError(
            f"--reference-jax {path}: not a checkout of the paper's JAX code (no {MODEL_FILE}); "
            f"get one with `git clone {REPOSITORY}` and pass its directory"
        )
    return root


def require_jax() -> None:
    """ReferenceJaxError naming the fix unless jax, flax and optax import."""
    try:
        import flax  # noqa: F401
        import jax  # noqa: F401
        import optax  # noqa: F401
    except ImportError as err:
        raise ReferenceJaxError(
            f"--reference-jax needs jax, flax and optax ({err}); install "
            "them with `pip install -e '.[jax]'`"
        ) from None


def _import(checkout: str | os.PathLike[str]) -> dict[str, Any]:
    root = check_checkout(checkout)
    require_jax()
    import jax
    import jax.numpy as jnp

    # Its modules import one another as `src.…`, from the checkout's root.
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    loaded = sys.modules.get("src")
    if loaded is not None and Path(getattr(loaded, "__file__", "") or "").parent.parent != root:
        raise ReferenceJaxError(
            f"another package named 'src' is already imported "
            f"({loaded.__file__}); run the benchmark in a fresh process"
        )
    try:
        from src.jax.models.sot_m import SoTM, SoTMConfig
        from src.jax.models.sot_m.trainer import SoTMTrainer
        from src.jax.training import BaseTrainConfig
    except ImportError as err:
        raise ReferenceJaxError(
            f"--reference-jax {checkout}: cannot import its JAX model "
            f"({err}); is it a complete checkout of {REPOSITORY}?"
        ) from None
    return dict(
        jax=jax,
        jnp=jnp,
        SoTM=SoTM,
        SoTMConfig=SoTMConfig,
        SoTMTrainer=SoTMTrainer,
        BaseTrainConfig=BaseTrainConfig,
    )


def _model_and_params(mods: dict[str, Any], model: GPN, B: int, T: int) -> tuple[Any, Any]:
    """Its SoTM with our model's architecture, and our weights in its parameter tree."""
    cfg = model.config
    if not cfg.memory:
        raise ReferenceJaxError("--reference-jax compares GPN+M (memory: true) configurations")
    jcfg = mods["SoTMConfig"](
        vocab_size=cfg.vocab_size,
        d_state=cfg.d_state,
        d_emb=cfg.d_emb,
        d_ffn=cfg.d_ffn,
        n_heads=cfg.n_heads,
        d_key=cfg.d_key,
        d_val=cfg.d_value,
        n_layers=cfg.n_layers,
        use_decoder_bias=cfg.decoder_bias,
    )
    jmodel = mods["SoTM"](cfg=jcfg)
    jax, jnp = mods["jax"], mods["jnp"]
    # Its own init, traced only, says which parameters it has and their shapes.
    shapes = jax.eval_shape(jmodel.init, jax.random.PRNGKey(0), jnp.zeros((B, T), dtype=jnp.int32))[
        "params"
    ]
    ours = export_reference(model)
    want = {k: tuple(v.shape) for k, v in shapes.items()}
    have = {k: tuple(v.shape) for k, v in ours.items()}
    if want != have:
        raise ReferenceJaxError(f"the JAX model's parameters differ from ours: {want} vs {have}")
    return jmodel, {k: jnp.asarray(v) for k, v in ours.items()}


def reference_loss(checkout: str | os.PathLike[str], model: GPN, tokens: Any) -> float:
    """The JAX model's loss on `tokens` (B, T) with our model's weights."""
    mods = _import(checkout)
    B, T = tokens.shape
    jmodel, params = _model_and_params(mods, model, B, T)
    batch = mods["jnp"].asarray(np.asarray(tokens, dtype=np.int32))
    loss, _state, _metrics = jmodel.apply({"params": params}, batch)
    return float(loss)


class _Batches:
    """The dataset its trainer reads: the same batch every step, timing each step of the loop
    and running `between` after it."""

    def __init__(self, tokens: np.ndarray, steps: int, between: Callable[[int], None]):
        self.batch = tokens
        self.steps = steps
        self.between = between
        self.total_tokens = int(tokens.size) * steps
        self.seconds: list[float] = []

    def batches(self, batch_size: int, start: int = 0) -> Iterator[np.ndarray]:
        for step in range(self.steps):
            begin = time.perf_counter()
            yield self.batch
            # back here: the trainer's loop body for this batch is done (it synced)
            self.seconds.append(time.perf_counter() - begin)
            self.between(step)
        # One more, untimed: the trainer leaves its loop right after its last step, without
        # asking for another batch (which is where a step's time is read).
        yield self.batch


def train_steps(
    checkout: str | os.PathLike[str],
    model: GPN,
    tokens: Any,
    steps: int,
    between: Callable[[int], None] = lambda step: None,
    lr: float = 1e-4,
) -> list[float]:
    """Run `steps` training steps of the JAX implementation's own trainer on `tokens` (B, T),
    starting from `model`'s weights; `between(step)` runs after each. Returns the seconds of
    each step (the first includes jit compilation)."""
    mods = _import(checkout)
    batch = np.ascontiguousarray(np.asarray(tokens, dtype=np.int32))
    B, T = batch.shape
    jmodel, params = _model_and_params(mods, model, B, T)
    data = _Batches(batch, steps, between)
    with tempfile.TemporaryDirectory(prefix="gpn-jax-bench-") as tmp:
        cfg = mods["BaseTrainConfig"](
            name="bench",
            data_dir=tmp,
            checkpoint_dir=os.path.join(tmp, "ckpt"),
            log_dir=os.path.join(tmp, "log"),
            model=jmodel.cfg,
            batch_size=B,
            seq_len=T,
            grad_accum=1,
            total_steps=max(steps + 1, 1000),
            run_steps=steps + 1,
            seed=0,
            resume="",
            learning_rate=lr,
            adam_beta1=0.9,
            adam_beta2=0.95,
            weight_decay=0.1,
            warmup_steps=10,
            min_lr_ratio=0.1,
            grad_clip_norm=1.0,
            # no logging or saving inside the timed steps (it saves once after the loop)
            log_every=10**9,
            save_every=10**9,
            checkpoint_every=0,
            bf16=False,
        )
        trainer = mods["SoTMTrainer"]()
        trainer.setup(jmodel, params, data, cfg)
        # its summary and progress bar would interleave with our tables
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            trainer.run()
    if len(data.seconds) != steps:
        raise ReferenceJaxError(f"the JAX trainer ran {len(data.seconds)} steps, not {steps}")
    return data.seconds
