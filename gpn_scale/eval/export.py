"""`gpn-scale export STEP_OR_RUN --out DIR`: any checkpoint as weights others can load.

Source: any checkpoint reference (run/sources.py: a step directory local or s3:// of any
dp/tp layout, DCP reassembling the shards on one process; a checkpoint root or run folder:
its newest checkpoint; a model_final.pt; another export). Two layouts:

  --format safetensors (default, every family)
      model.safetensors   the model's state dict (our parameter names), float32 by default
      config.json         {"format": "gpn_scale.export/1", "family", "model_config",
                           "tokenizer": {identity}, "step", "source", "dtype"}
      tokenizer.json      the training tokenizer (the byte tokenizer as its Hugging Face
                          byte-level equivalent: ids are the UTF-8 bytes, <eod> = 256)
  --format hf (Transformer++ only)
      a Hugging Face Llama checkpoint (`LlamaForCausalLM.from_pretrained(DIR)`,
      `AutoTokenizer.from_pretrained(DIR)`): config.json (+ a `gpn_scale` entry with the
      model config and tokenizer identity), model.safetensors, generation_config.json,
      tokenizer files whose encoding starts with the start token (models/transformer_pp/hf.py)

Both load back with eval/generate/analyze (`gpn-scale eval DIR --task ...`). The output is
written into a temporary sibling directory and renamed into place once complete, so a failed
export leaves nothing, and `--overwrite` replaces an earlier export only when the new one is
whole. safetensors (not torch.save): loading it runs no pickled code, and other frameworks
read it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gpn_scale.core.config import ConfigError
from gpn_scale.data.tokenizer import TOKENIZER_FILE
from gpn_scale.run.export_format import (
    CONFIG_FILE,
    EXPORT_FORMAT,
    FORMATS,
    HF_KEY,
    ORIGINAL_TOKENIZER_FILE,
    START_TOKEN,
    WEIGHTS_FILE,
    hf_module,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_out_dir(out: str, overwrite: bool) -> None:
    """Before any work: --out is a local directory that may be written (one line if not)."""
    from gpn_scale.io.outputs import check_out_dir as check_writable
    from gpn_scale.io.storage import writable_dir

    if not out or "://" in out:
        raise ConfigError(f"--out {out!r}: give a local directory (copy it to S3 afterwards)")
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--out {out} is a file; give a directory")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise ConfigError(
            f"--out {out} is not empty; pass --overwrite to replace it, or another --out"
        )
    # The staging directory sits beside --out (renamed into place), so the nearest existing
    # folder above it must take new files.
    check_writable(out, "--out", error=ConfigError, probe=False)  # a file in the way
    probe = path.absolute().parent
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if not writable_dir(probe):
        raise ConfigError(f"--out {out}: {probe} is not writable; choose another --out")


@dataclass
class ExportResult:
    out: str
    source: str
    step: int | None
    family: str
    layout: str
    parameters: int


def peek_family(ref: str) -> str:
    """The family a reference holds, from its manifest / config (no tensors read)."""
    from gpn_scale.models.registry import DEFAULT_FAMILY
    from gpn_scale.run.sources import open_source

    saved = open_source(ref).meta.get("model_config") or {}
    return str(saved.get("family", DEFAULT_FAMILY)) if isinstance(saved, dict) else DEFAULT_FAMILY


def export_checkpoint(
    ref: str,
    out: str,
    *,
    layout: str = "safetensors",
    overwrite: bool = False,
    tokenizer: str | None = None,
    dtype: str = "float32",
    log: Any = None,
) -> ExportResult:
    """Write the export of `ref` into `out` (see the module docstring)."""
    from gpn_scale.eval.load import describe_loaded, load

    if layout not in FORMATS:
        raise ConfigError(f"--format {layout}: expected one of {', '.join(FORMATS)}")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype}: expected one of {', '.join(DTYPES)}")
    check_out_dir(out, overwrite)
    if layout == "hf":
        hf_module(peek_family(ref), "--format hf")  # refused before the weights load
    loaded = load(ref, device="cpu", tokenizer=tokenizer)
    if log is not None:
        log(describe_loaded(loaded))
    parent = Path(out).absolute().parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{Path(out).name}.export-", dir=parent))
    try:
        if layout == "hf":
            _write_hf(loaded, tmp, DTYPES[dtype])
        else:
            _write_native(loaded, tmp, DTYPES[dtype])
        target = Path(out)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportResult(
        out,
        loaded.checkpoint,
        loaded.step,
        loaded.spec.name,
        layout,
        sum(p.numel() for p in loaded.model.parameters()),
    )


def _state(loaded: Any, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    # Own, contiguous tensors: safetensors refuses views and storage shared between keys.
    return {
        k: v.detach().to("cpu", dtype if v.is_floating_point() else v.dtype).contiguous().clone()
        for k, v in loaded.model.state_dict().items()
    }


def _identity(loaded: Any, file: str = TOKENIZER_FILE) -> dict[str, Any]:
    identity = dict(loaded.meta.get("tokenizer") or loaded.tokenizer.identity())
    if identity.get("kind") == "huggingface":
        identity["name"] = file  # the copy beside the weights (relative to DIR)
    return identity


def _write_native(loaded: Any, out: Path, dtype: torch.dtype) -> None:
    from safetensors.torch import save_file

    save_file(_state(loaded, dtype), str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / TOKENIZER_FILE).write_text(hf_tokenizer(loaded.tokenizer).to_str())
    config = {
        "format": EXPORT_FORMAT,
        "family": loaded.spec.name,
        "model_config": loaded.config.to_dict(),
        "tokenizer": _identity(loaded),
        "step": loaded.step,
        "source": loaded.checkpoint,
        "dtype": str(dtype).removeprefix("torch."),
    }
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n")


def hf_tokenizer(tok: Any) -> Any:
    """A `tokenizers.Tokenizer` that encodes as `tok` does: its own tokenizer.json, or for
    the byte tokenizer a byte-level one whose ids are the UTF-8 bytes (<eod> = 256)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    text = tok.serialized()
    if text is not None:
        return Tokenizer.from_str(text)
    chars = _byte_chars()
    hf = Tokenizer(models.BPE(vocab={c: b for b, c in chars.items()}, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken("<eod>", special=True)])
    assert hf.token_to_id("<eod>") == tok.eod_token_id
    return hf


def _byte_chars() -> dict[int, str]:
    """Byte -> the printable character byte-level BPE writes it as (the GPT-2 convention
    `tokenizers`' ByteLevel pre-tokenizer uses: printable Latin-1 bytes stand for
    themselves, the others take the code points from 256 on, in byte order)."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    out, shifted = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + shifted)
            shifted += 1
    return out


def _write_hf(loaded: Any, out: Path, dtype: torch.dtype) -> None:
    from transformers import GenerationConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    hf = hf_module(loaded.spec.name, "--format hf")
    cfg, tok = loaded.config, loaded.tokenizer
    seq_len = int(((loaded.meta.get("config") or {}).get("data") or {}).get("seq_len") or 2048)
    config = hf.llama_config(cfg, eos_token_id=tok.eod_token_id, max_positions=max(seq_len, 2048))
    setattr(config, HF_KEY, {
        "format": EXPORT_FORMAT,
        "model_config": cfg.to_dict(),
        "tokenizer": _identity(loaded, ORIGINAL_TOKENIZER_FILE),
        "step": loaded.step,
        "source": loaded.checkpoint,
    })  # fmt: skip
    text = tok.serialized()
    if text is not None:  # tokenizer.json gains the start token; ours reads the original
        (out / ORIGINAL_TOKENIZER_FILE).write_text(text)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_state_dict(hf.to_llama(_state(loaded, dtype), cfg), strict=True, assign=True)
    if cfg.tie_embeddings:
        model.tie_weights()
    start = hf.start_token_id(cfg)
    # Never predicted: the start token, and padded ids beyond the tokenizer's vocabulary.
    model.generation_config = GenerationConfig(
        bos_token_id=start,
        eos_token_id=tok.eod_token_id,
        suppress_tokens=list(range(tok.vocab_size, start + 1)),
    )
    model.save_pretrained(str(out), safe_serialization=True)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=_with_start_token(hf_tokenizer(tok), tok.vocab_size, start),
        bos_token=START_TOKEN,
        eos_token=_token_name(tok),
    )
    fast.save_pretrained(str(out))


def _token_name(tok: Any) -> str:
    return "<eod>" if tok.kind == "byte" else str(hf_tokenizer(tok).id_to_token(tok.eod_token_id))


def _with_start_token(hf: Any, tok_vocab: int, start: int) -> Any:
    """The tokenizer with ids up to the model's vocabulary: placeholders for the padded ids,
    then the start token at id V, prepended to every encoding (as our model reads it)."""
    from tokenizers import AddedToken, processors

    hf.add_special_tokens(
        [AddedToken(f"<|gpn_pad_{i}|>", special=True) for i in range(tok_vocab, start)]
    )
    hf.add_special_tokens([AddedToken(START_TOKEN, special=True)])
    if hf.token_to_id(START_TOKEN) != start:
        raise ConfigError(
            f"--format hf: the tokenizer's ids are not contiguous (the start token landed at "
            f"id {hf.token_to_id(START_TOKEN)}, not {start}); use --format safetensors"
        )
    template = processors.TemplateProcessing(
        single=f"{START_TOKEN} $A",
        pair=f"{START_TOKEN} $A $B:1",
        special_tokens=[(START_TOKEN, start)],
    )
    hf.post_processor = (
        template
        if hf.post_processor is None
        else processors.Sequence([hf.post_processor, template])
    )
    return hf
