"""The folder `gpn-scale export` writes, as checkpoint sources read it (run/sources.py: the
trainer's warm start, eval, generation, export): file names, the config entry, the weights.
Apart from eval/export.py, the writer, so that the readers need not import it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpn_scale.core.config import ConfigError

if TYPE_CHECKING:
    import torch

EXPORT_FORMAT = "gpn_scale.export/1"
HF_KEY = "gpn_scale"  # our entry in a Hugging Face config.json
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
ORIGINAL_TOKENIZER_FILE = "gpn_scale_tokenizer.json"  # --format hf: the training tokenizer
FORMATS = ("safetensors", "hf")
START_TOKEN = "<|gpn_start|>"


def _read_config(path: str | Path) -> dict[str, Any] | None:
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_export_dir(path: str | Path) -> bool:
    """A directory `gpn-scale export` wrote (either layout)."""
    data = _read_config(path)
    if data is None or not (Path(path) / WEIGHTS_FILE).is_file():
        return False
    return data.get("format") == EXPORT_FORMAT or isinstance(data.get(HF_KEY), dict)


def read_export_meta(path: str | Path) -> dict[str, Any]:
    """The checkpoint-like meta of an export: model_config, tokenizer, step, source, layout."""
    data = _read_config(path) or {}
    if data.get("format") == EXPORT_FORMAT:
        return {**data, "layout": "safetensors"}
    return {**dict(data.get(HF_KEY) or {}), "layout": "hf"}


def read_export_weights(path: str | Path, spec: Any, cfg: Any) -> dict[str, torch.Tensor]:
    """The model's state dict (our names) from an export directory."""
    from safetensors.torch import load_file

    state = load_file(str(Path(path) / WEIGHTS_FILE))
    if read_export_meta(path)["layout"] == "hf":
        return hf_module(spec.name, "--format hf").from_llama(state, cfg)
    return state


def hf_module(family: str, what: str) -> Any:
    """The family's Hugging Face adapter (`FamilySpec.hf_adapter`), or one line naming the
    families that have one."""
    from gpn_scale.models.registry import families_where, get_family

    adapter = get_family(family).hf_adapter
    if adapter is None:
        takers = [s.name for s in families_where(lambda s: s.hf_adapter is not None)]
        raise ConfigError(
            f"{what}: the {family} family has no Hugging Face architecture of the same "
            f"network (only {', '.join(takers)} maps onto LlamaForCausalLM); export it "
            "with --format safetensors"
        )
    return adapter()
