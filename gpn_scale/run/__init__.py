"""A training run's configuration, read by whatever handles runs: the schema and its loader
(`config.py`) and the model a run trains (`model.py`). Below the trainer, evaluation and
sweeps alike, so each reads a run without importing the others; torch-free."""
