"""The tokenizer a dataset was built with (and so a checkpoint trained with), rebuilt from
its identity.

`gpn-data build` records the tokenizer in the dataset metadata (kind, name, sha256, eod id;
data_tools/tokenizer.py). Eval must encode text exactly as the training data was encoded, so a
Hugging Face tokenizer is reloaded from the recorded path and its serialisation is checked
against the recorded sha256; the byte tokenizer is UTF-8 bytes with EOD = 256. This module
re-implements the two encoders (a few lines) instead of importing data_tools, which imports
gpn_scale and not the reverse.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from gpn_scale.core.config import ConfigError

# A Hugging Face tokenizer's file: its name in a directory, in each step folder that carries
# it (run/sources.py) and in an export.
TOKENIZER_FILE = "tokenizer.json"
BYTE_EOD_ID = 256
BYTE_VOCAB_SIZE = 257


class Tokenizer:
    """encode / decode text; `eod_token_id` ends a document (the only special token used)."""

    kind: str = ""
    name: str = ""
    vocab_size: int = 0
    eod_token_id: int = 0

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def identity(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.name, "eod_token_id": self.eod_token_id}

    def serialized(self) -> str | None:
        """Its tokenizer.json content (None for the byte tokenizer, which has no file)."""
        return None


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes are the ids (data_tools' built-in byte tokenizer, vocab 257)."""

    kind, name, vocab_size, eod_token_id = "byte", "byte", BYTE_VOCAB_SIZE, BYTE_EOD_ID

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        # EOD (and any id outside a byte) has no text; a cut multi-byte character decodes to
        # U+FFFD rather than failing (generation can stop mid-character).
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizers` tokenizer (what `gpn-data build --tokenizer PATH` used)."""

    kind = "huggingface"

    def __init__(self, tok: Any, name: str, eod_token_id: int) -> None:
        self._tok = tok
        self.name = name
        self.eod_token_id = int(eod_token_id)
        vocab = tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(tok.get_vocab_size(with_added_tokens=True), max(vocab.values()) + 1)

    def identity(self) -> dict[str, Any]:
        return {
            **super().identity(),
            "sha256": hashlib.sha256(self._tok.to_str().encode()).hexdigest(),
        }

    def serialized(self) -> str | None:
        return str(self._tok.to_str())

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode([int(i) for i in ids], skip_special_tokens=True))


def _load_hf(name: str, what: str) -> Any:
    from tokenizers import Tokenizer as HF

    path = Path(name).expanduser()
    if path.is_dir():
        path = path / TOKENIZER_FILE
    if path.is_file():
        try:
            return HF.from_file(str(path))
        except Exception as err:  # noqa: BLE001 - the Rust side raises plain Exceptions
            raise ConfigError(f"{what}: {path} is not a tokenizer.json ({err})") from None
    raise ConfigError(
        f"{what}: tokenizer {name} not found (the dataset recorded it at that path); pass "
        "--tokenizer PATH to the tokenizer.json the data was built with"
    )


def from_identity(
    identity: dict[str, Any], where: str = "dataset metadata", serialized: str | None = None
) -> Tokenizer:
    """The tokenizer a dataset's metadata names, checked against its recorded sha256.
    `serialized`: its tokenizer.json content (the copy a checkpoint carries) instead of the
    file at the recorded path."""
    kind = identity.get("kind")
    if kind == "byte":
        return ByteTokenizer()
    if kind != "huggingface":
        raise ConfigError(f"{where}: unknown tokenizer kind {kind!r}; pass --tokenizer")
    name = str(identity.get("name"))
    if serialized is not None:
        from tokenizers import Tokenizer as HF

        try:
            tok = HF.from_str(serialized)
        except Exception as err:  # noqa: BLE001 - the Rust side raises plain Exceptions
            raise ConfigError(f"{where}: its tokenizer.json does not parse ({err})") from None
    else:
        tok = _load_hf(name, where)
    want = identity.get("sha256")
    have = hashlib.sha256(tok.to_str().encode()).hexdigest()
    if want and have != want:
        raise ConfigError(
            f"{where}: the tokenizer at {name} is not the one the data was built with (sha256 "
            f"{have[:12]} != {str(want)[:12]}); pass --tokenizer PATH to the original"
        )
    eod = identity.get("eod_token_id")
    if eod is None:
        raise ConfigError(f"{where}: the tokenizer identity has no eod_token_id")
    return HFTokenizer(tok, name, int(eod))


def from_name(name: str) -> Tokenizer:
    """`--tokenizer byte` or a tokenizer.json (or its directory): an explicit override."""
    if name == "byte":
        return ByteTokenizer()
    tok = _load_hf(name, "--tokenizer")
    vocab = tok.get_vocab(with_added_tokens=True)
    for candidate in (
        "<|endoftext|>",
        "</s>",
        "<|end_of_text|>",
        "<eos>",
        "<|eot_id|>",
        "[SEP]",
        "<eod>",  # the byte tokenizer as `gpn-scale export` writes it
    ):
        if candidate in vocab:
            return HFTokenizer(tok, name, vocab[candidate])
    raise ConfigError(f"--tokenizer {name}: no end-of-document token in its vocabulary")
