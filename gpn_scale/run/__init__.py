"""A training run, read by whatever handles runs: the schema and its loader (`config.py`), the
model a run trains (`model.py`), and the checkpoints it leaves: what a checkpoint reference
is, resolving it, reading its weights and its tokenizer identity (`sources.py`; an export
folder's format, `export_format.py`). Below the trainer, evaluation and sweeps alike, so each
reads a run without importing the others; torch-free at import (the weights' readers import
it when called)."""
