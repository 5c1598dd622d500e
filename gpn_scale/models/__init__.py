"""Model families behind one language-model interface (`protocol.py`) and a registry.

One folder per family, its `FamilySpec` in `<family>/spec.py`: `gpn/` (GPN / GPN+M),
`transformer_pp/`, `gated_deltanet/`; `registry.py` maps a config's `family:` to it and
`commands.py` is `gpn-scale info` for all of them. Everything outside the models (trainer,
eval, sweeps, fits) goes through `protocol.LanguageModel` and the family's `FamilySpec`,
never through a family's internals nor its name (docs/families.md, "Adding a family").
"""
