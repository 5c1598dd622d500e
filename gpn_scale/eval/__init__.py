"""Evaluation of a trained model: loading it for inference (load.py), LAMBADA, lm-eval,
generation, export; analysis/ (the paper's state analyses). The held-out loss is the
trainer's (train/heldout.py)."""
