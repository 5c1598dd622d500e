"""Model families behind one language-model interface (`protocol.py`) and a registry.

GPN / GPN+M lives in `gpn_scale.model`; the baselines live beside this file. Everything
outside the models (trainer, eval, sweeps, fits) goes through `protocol.LanguageModel` and
the family's `FamilySpec`, never through a family's internals.
"""
