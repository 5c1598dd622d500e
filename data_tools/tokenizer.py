"""Tokenizers for the build: a built-in byte-level one, Hugging Face `tokenizers` ones
(local tokenizer.json / directory, or a Hub name on a machine with internet), and BPE
training on a corpus.

A tokenizer is described by a small picklable `TokenizerSpec` so that worker processes
rebuild it from its JSON serialisation instead of downloading it again.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gpn_scale.data.errors import DataError

BYTE_VOCAB = 256
BYTE_EOD_ID = 256
BYTE_VOCAB_SIZE = 257  # 256 byte values + the end-of-document id
# Candidates tried, in order, when no --eod-token is given.
EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "[SEP]")


@dataclass(frozen=True)
class TokenizerSpec:
    kind: str  # "byte" or "huggingface"
    name: str  # "byte", a path, or a Hub name
    vocab_size: int
    eod_token: str
    eod_token_id: int
    serialized: str = ""  # tokenizer.json content for "huggingface"

    @property
    def sha256(self) -> str:
        payload = self.serialized if self.kind == "huggingface" else "gpn-byte-tokenizer-v1"
        return hashlib.sha256(payload.encode()).hexdigest()

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.uint16 if self.vocab_size <= 1 << 16 else np.uint32)

    def identity(self) -> dict[str, Any]:
        """What goes into the dataset metadata."""
        return {
            "kind": self.kind,
            "name": self.name,
            "sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "eod_token": self.eod_token,
            "eod_token_id": self.eod_token_id,
        }


def _load_hf(name_or_path: str) -> tuple[Any, str]:
    from tokenizers import Tokenizer

    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return Tokenizer.from_file(str(path / "tokenizer.json")), str(path)
        raise DataError(
            f"{path}: no tokenizer.json in this directory; convert the tokenizer "
            "to the fast format (transformers' save_pretrained writes one) or point "
            "at the tokenizer.json file"
        )
    if path.is_file():
        try:
            return Tokenizer.from_file(str(path)), str(path)
        except Exception as err:  # noqa: BLE001
            raise DataError(
                f"{path}: not a Hugging Face tokenizer.json ({err}); pass a "
                "tokenizer.json, a directory holding one, or 'byte'"
            ) from None
    if os.sep in name_or_path and not name_or_path.count("/") == 1:
        raise DataError(f"{name_or_path}: no such tokenizer file or directory; fix the path")
    try:
        return Tokenizer.from_pretrained(name_or_path), name_or_path
    except Exception as err:  # noqa: BLE001 - offline, unknown name, gated repo
        raise DataError(
            f"tokenizer {name_or_path!r}: not a local path and could not be loaded "
            f"from the Hugging Face Hub ({type(err).__name__}); pass a local "
            "tokenizer.json (or its directory), or 'byte'"
        ) from None


def resolve_tokenizer(name: str, eod_token: str | None = None) -> TokenizerSpec:
    """'byte' -> the built-in byte tokenizer; otherwise a Hugging Face tokenizer."""
    if name == "byte":
        return TokenizerSpec("byte", "byte", BYTE_VOCAB_SIZE, "<eod>", BYTE_EOD_ID)
    tok, resolved = _load_hf(name)
    vocab = tok.get_vocab(with_added_tokens=True)
    candidates = (eod_token,) if eod_token else EOD_CANDIDATES
    for candidate in candidates:
        if candidate in vocab:
            eod = candidate
            break
    else:
        raise DataError(
            f"tokenizer {resolved}: no end-of-document token among "
            f"{list(candidates)}; pass --eod-token with one of its special tokens"
        )
    vocab_size = max(tok.get_vocab_size(with_added_tokens=True), max(vocab.values()) + 1)
    return TokenizerSpec("huggingface", resolved, vocab_size, eod, vocab[eod], tok.to_str())


class Encoder:
    """Turns a batch of documents into one token array, EOD after every document."""

    def __init__(self, spec: TokenizerSpec):
        self.spec = spec
        self._tok = None
        if spec.kind == "huggingface":
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_str(spec.serialized)

    def encode_documents(self, texts: list[str]) -> np.ndarray:
        dtype = self.spec.dtype
        if self._tok is None:  # byte level: UTF-8 bytes are the ids
            parts = []
            eod = np.array([BYTE_EOD_ID], dtype=dtype)
            for text in texts:
                parts.append(np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(dtype))
                parts.append(eod)
            return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
        encodings = self._tok.encode_batch(texts, add_special_tokens=False)
        eod_id = self.spec.eod_token_id
        lengths = [len(e.ids) + 1 for e in encodings]
        out = np.empty(sum(lengths), dtype=dtype)
        pos = 0
        for enc, length in zip(encodings, lengths):
            out[pos : pos + length - 1] = enc.ids
            out[pos + length - 1] = eod_id
            pos += length
        return out


# Worker-process state for multiprocess tokenisation (one Encoder per process).
_WORKER_ENCODER: Encoder | None = None


def init_worker(spec: TokenizerSpec) -> None:
    global _WORKER_ENCODER
    # The Rust tokenizer would otherwise also spawn threads in every worker process.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER_ENCODER = Encoder(spec)


def encode_in_worker(texts: list[str]) -> np.ndarray:
    assert _WORKER_ENCODER is not None, "init_worker was not called"
    return _WORKER_ENCODER.encode_documents(texts)


def train_bpe(
    documents: Iterable[str],
    out: str,
    *,
    vocab_size: int,
    eod_token: str = "<|endoftext|>",
    min_frequency: int = 2,
    show_progress: bool = True,
) -> TokenizerSpec:
    """Train a byte-level BPE tokenizer (the `tokenizers` library) and save tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + 1:
        raise DataError(
            f"--vocab-size {vocab_size}: a byte-level BPE needs at least 257 "
            "(256 bytes + the end-of-document token)"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[eod_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tok.train_from_iterator(documents, trainer=trainer)
    out_path = Path(out)
    if out_path.suffix != ".json":
        out_path.mkdir(parents=True, exist_ok=True)
        out_path = out_path / "tokenizer.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_path))
    return resolve_tokenizer(str(out_path), eod_token)
