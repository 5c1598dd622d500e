"""Makes `lm_eval --model gpn_scale` work without lm_eval knowing about gpn_scale.

lm-evaluation-harness (0.4.13) has no plugin discovery: its CLI finds models only in its own
registry. `gpn_scale_lm_eval.pth` (put into site-packages by setup.py's build_py, for wheel
and editable installs) imports this module at interpreter start. It imports nothing heavy:
it waits for `lm_eval.api.registry` to be imported and then registers `gpn_scale` as a lazy
entry ("module:Class", loaded only when a run asks for that model). It also imports
`lm_eval.models`, whose import registers the harness's own models, since the harness loads
those only while its registry is empty. Importing this module imports gpn_scale/__init__.py
and gpn_scale/eval/__init__.py too: keep both free of heavy imports (a test checks).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import Any

TARGET = "lm_eval.api.registry"
MODEL_NAME = "gpn_scale"
MODEL_PATH = "gpn_scale.eval.lm_eval_adapter:GPNScaleLM"


def register(registry: ModuleType) -> None:
    """Register the adapter lazily in an imported lm_eval.api.registry (idempotent)."""
    models = registry.model_registry
    if MODEL_NAME not in models:
        models.register(MODEL_NAME, target=MODEL_PATH)


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        import lm_eval.models  # noqa: F401 - the harness's own models, before ours

        register(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != TARGET:
            return None
        sys.meta_path.remove(self)  # one shot: find the real module, wrap its loader
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    if TARGET in sys.modules:  # already imported (e.g. the hook installed late)
        register(sys.modules[TARGET])
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


install()
