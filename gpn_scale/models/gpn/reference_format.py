"""Import and export of the reference (JAX) implementation's parameters.

The reference stores a flat mapping name -> array with every matrix as (in, out), y = x @ W
(`shared/spec/gpn-model.md`, last table); nn.Linear stores (out, in), so matrices are
transposed on the way in and out. Import infers the architecture from the shapes.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpn_scale.models.gpn.config import ConfigError, GPNConfig
from gpn_scale.models.gpn.gpn import GPN


def reference_layout(model: GPN) -> dict[str, tuple[torch.Tensor, bool]]:
    """reference name -> (our parameter, stored transposed?)."""
    cfg = model.config
    out: dict[str, tuple[torch.Tensor, bool]] = {
        "embedding": (model.embedding.weight, False),
        "decode_norm_w": (model.decode_norm_weight, False),
        "decode_proj_k": (model.decode.weight, True),
        "fuse_norm_w": (model.fuse_norm_weight, False),
        "fuse_proj_k": (model.fuse.weight, True),
        "fg_norm_w": (model.fuse_gate.norm_weight, False),
        "fg_gate_k": (model.fuse_gate.proj.weight, True),
        "fg_gate_b": (model.fuse_gate.proj.bias, False),
    }
    if model.decode.bias is not None:
        out["decode_bias"] = (model.decode.bias, False)
    if model.write is not None:
        w = model.write
        out.update(
            {
                "write_norm_w": (w.norm_weight, False),
                "write_W_k_k": (w.key.weight, True),
                "write_W_k_b": (w.key.bias, False),
                "write_W_v_k": (w.value.weight, True),
                "write_W_beta_k": (w.beta.weight, True),
                "write_W_a_k": (w.decay.weight, True),
                "write_A_log": (w.A_log, False),
                "write_dt_bias": (w.dt_bias, False),
            }
        )
    for i, layer in enumerate(model.predictor_layers):
        # The memory-less reference names its single layer without the L{i}_ prefix.
        p = f"L{i}_" if cfg.memory else ""
        out.update(
            {
                f"{p}ffn_norm_w": (layer.ffn.norm_weight, False),
                f"{p}ffn_w1_k": (layer.ffn.w1.flat(), True),
                f"{p}ffn_w2_k": (layer.ffn.w2.weight, True),
                f"{p}pg_norm_w": (layer.gate.norm_weight, False),
                f"{p}pg_gate_k": (layer.gate.proj.weight, True),
                f"{p}pg_gate_b": (layer.gate.proj.bias, False),
            }
        )
        if layer.read is not None:
            r = layer.read
            out.update(
                {
                    f"{p}read_norm_w": (r.norm_weight, False),
                    f"{p}read_W_q_k": (r.query.weight, True),
                    f"{p}read_W_q_b": (r.query.bias, False),
                    f"{p}read_W_gate_k": (r.gate.weight, True),
                    f"{p}read_out_norm_w": (r.out_norm_weight, False),
                    f"{p}read_W_o_k": (r.out.weight, True),
                }
            )
    return out


def export_reference(model: GPN) -> dict[str, np.ndarray]:
    """Our model's weights in the reference's flat (in, out) layout, as float32 numpy."""
    return {
        name: (t.detach().t() if transposed else t.detach()).float().cpu().numpy().copy()
        for name, (t, transposed) in reference_layout(model).items()
    }


def config_from_reference(params: Mapping[str, Any], **overrides: Any) -> GPNConfig:
    """Infer the architecture from the reference parameter shapes."""
    _require(params, "embedding")
    _require(params, "decode_norm_w")
    V, e = np.shape(params["embedding"])
    d = np.shape(params["decode_norm_w"])[0]
    memory = "write_A_log" in params
    if memory:
        n_layers = 0
        while f"L{n_layers}_ffn_w1_k" in params:
            n_layers += 1
        _require(params, "L0_ffn_w1_k")
        f = np.shape(params["L0_ffn_w1_k"])[1] // 2
        H = np.shape(params["write_A_log"])[0]
        _require(params, "write_W_k_k")
        _require(params, "write_W_v_k")
        dk = np.shape(params["write_W_k_k"])[1] // H
        dv = np.shape(params["write_W_v_k"])[1] // H
        fields = dict(memory=True, n_layers=n_layers, n_heads=H, d_key=dk, d_value=dv)
    else:
        _require(params, "ffn_w1_k")
        f = np.shape(params["ffn_w1_k"])[1] // 2
        fields = dict(memory=False, n_layers=1)
    values: dict[str, Any] = dict(
        vocab_size=int(V),
        d_state=int(d),
        d_emb=int(e),
        d_ffn=int(f),
        decoder_bias="decode_bias" in params,
        **fields,
    )
    values.update(overrides)
    # Shapes come as numpy integers; Any, as the fields differ in type (the checker would
    # otherwise check the union of the values against every field).
    plain: dict[str, Any] = {
        k: (int(v) if isinstance(v, np.integer) else v) for k, v in values.items()
    }
    return GPNConfig.from_dict(plain)  # an engine option may be given flat (chunk_size=8)


def import_reference(params: Mapping[str, Any], **config_overrides: Any) -> GPN:
    """A model holding exactly the given reference weights (shapes checked, names complete)."""
    cfg = config_from_reference(params, **config_overrides)
    model = GPN(cfg)
    layout = reference_layout(model)
    unknown = sorted(set(params) - set(layout))
    if unknown:
        raise ConfigError(
            f"reference parameter '{unknown[0]}' has no place in a {cfg.family} "
            f"with {cfg.n_layers} layer(s); is this checkpoint from another model?"
        )
    with torch.no_grad():
        for name, (tensor, transposed) in layout.items():
            _require(params, name)
            value = torch.as_tensor(np.asarray(params[name]), dtype=torch.float32)
            if transposed:
                value = value.t()
            if tuple(value.shape) != tuple(tensor.shape):
                raise ConfigError(
                    f"reference parameter '{name}': shape "
                    f"{tuple(np.shape(params[name]))} does not fit the inferred "
                    f"architecture; the checkpoint is inconsistent"
                )
            tensor.copy_(value)
    return model


def _require(params: Mapping[str, Any], name: str) -> None:
    if name not in params:
        raise ConfigError(
            f"reference parameter '{name}' is missing; expected a full reference "
            "parameter mapping (see docs/model.md)"
        )


class _Opaque:
    """Stands in for any non-numpy class inside a reference pickle (optimizer states etc.)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Rebuilds numpy arrays and plain containers only; never imports or runs other code."""

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        if module == "collections" and name == "OrderedDict":
            return dict
        return _Opaque


def load_reference_params(path: str | Path) -> dict[str, np.ndarray]:
    """Read reference parameters from an .npz file or the reference trainer's checkpoint.pkl.

    The pickle is read with an unpickler that only rebuilds numpy arrays, so a checkpoint
    cannot run code here.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "checkpoint.pkl"
    if not path.is_file():
        raise ConfigError(f"{path}: reference checkpoint not found")
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as data:
            return {k: data[k] for k in data.files}
    with open(path, "rb") as fh:
        blob = _NumpyOnlyUnpickler(fh).load()
    params = blob.get("params", blob) if isinstance(blob, dict) else None
    if isinstance(params, dict) and "params" in params and isinstance(params["params"], dict):
        params = params["params"]  # flax's {'params': {...}} collection
    if not isinstance(params, dict):
        raise ConfigError(f"{path}: no 'params' mapping inside; not a reference checkpoint")
    return {k: np.asarray(v) for k, v in params.items()}
