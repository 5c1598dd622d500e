"""Model families behind one language-model interface (`protocol.py`) and a registry.

One folder per family: `gpn/` (GPN / GPN+M), `transformer_pp/`, `gated_deltanet/`. Everything
outside the models (trainer, eval, sweeps, fits) goes through `protocol.LanguageModel` and
the family's `FamilySpec`, never through a family's internals.
"""
