"""Evaluation: held-out loss / perplexity over fixed windows (heldout.py)."""
