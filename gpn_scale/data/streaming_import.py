"""mosaicml-streaming, imported without the libraries it loads for code no run of ours reaches.

`import streaming` (0.13) imports transformers and torchvision: its package imports the
ready-made datasets of `streaming.text` (transformers' AutoTokenizer), `streaming.vision`
(torchvision) and `streaming.multimodal`, and `streaming.base.dataloader` imports
transformers' BatchEncoding and BatchFeature for one isinstance check in
StreamingDataLoader's batch count. The loader and the data tools use none of the datasets,
and their batches are tensors. Measured beside `import torch` on this 2-core machine, idle:
4.3 CPU-seconds for `import streaming`, 0.06 s through `import_streaming()`; a 6-step tiny
training process 8.4 -> 5.3 CPU-seconds. That start is paid by every rank of every run
(and by the hundreds of trainer processes the test suite starts), and a transformers that
does not import in this environment no longer stops training, which never uses it.

What `import_streaming()` changes, and why nothing observable differs:
- `streaming.text`, `streaming.vision` and `streaming.multimodal` are placed as packages that
  run their own `__init__` on the first attribute they lack (`streaming.text.StreamingC4`,
  `from streaming.vision import ...`): the same module objects, filled when first used.
- The two transformers names streaming.base.dataloader imports are classes whose isinstance
  asks transformers' own class, when transformers' module is loaded: an object can be an
  instance of BatchEncoding only once that module is, so the answer is the same. Their
  stand-in modules exist only while streaming imports; a later `import transformers` is the
  real one.
Where transformers is already imported, or streaming's layout is not the one this was
written against (a name the stand-ins lack), it is a plain `import streaming`."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

_DEFERRED_PACKAGES = ("streaming.text", "streaming.vision", "streaming.multimodal")
# module -> the class streaming.base.dataloader imports from it
_TRANSFORMERS_NAMES = {
    "transformers.feature_extraction_utils": "BatchFeature",
    "transformers.tokenization_utils_base": "BatchEncoding",
}


class _DeferredPackage(types.ModuleType):
    """A package whose `__init__` runs on the first attribute it lacks (into this object)."""

    def __getattr__(self, name: str) -> Any:
        spec = self.__dict__.get("__spec__")
        if spec is None or name.startswith("__"):
            raise AttributeError(name)
        self.__class__ = types.ModuleType  # type: ignore[assignment]  # an ordinary module now
        spec.loader.exec_module(self)
        return getattr(self, name)


class _AsksTransformers(type):
    """isinstance/issubclass against transformers' class of this name, once it is loaded."""

    _module: str

    def _real(cls) -> type | None:
        module = sys.modules.get(cls._module)
        real = getattr(module, cls.__name__, None) if module is not None else None
        return real if isinstance(real, type) and not isinstance(real, _AsksTransformers) else None

    def __instancecheck__(cls, obj: object) -> bool:
        real = cls._real()
        return real is not None and isinstance(obj, real)

    def __subclasscheck__(cls, sub: type) -> bool:
        real = cls._real()
        return real is not None and issubclass(sub, real)


def _stand_in(module: str, name: str) -> types.ModuleType:
    stand_in = types.ModuleType(module)
    setattr(stand_in, name, _AsksTransformers(name, (), {"_module": module}))
    return stand_in


def _deferred_package(name: str, root: Path) -> types.ModuleType | None:
    init = root / name.rsplit(".", 1)[1] / "__init__.py"
    if not init.is_file():
        return None
    spec = importlib.util.spec_from_file_location(
        name, init, submodule_search_locations=[str(init.parent)]
    )
    if spec is None or spec.loader is None:
        return None
    module = _DeferredPackage(name)
    for key, value in (
        ("__spec__", spec),
        ("__loader__", spec.loader),
        ("__file__", str(init)),
        ("__path__", [str(init.parent)]),
        ("__package__", name),
    ):
        module.__dict__[key] = value
    return module


def import_streaming() -> types.ModuleType:
    """`import streaming`, without transformers and torchvision (see the module docstring)."""
    if "streaming" in sys.modules:
        return sys.modules["streaming"]
    spec = importlib.util.find_spec("streaming")  # a top-level name: finds, runs nothing
    if "transformers" in sys.modules or spec is None or not spec.submodule_search_locations:
        return importlib.import_module("streaming")
    root = Path(next(iter(spec.submodule_search_locations)))
    for name in _DEFERRED_PACKAGES:
        package = _deferred_package(name, root)
        if package is not None and name not in sys.modules:
            sys.modules[name] = package
    stand_ins = [m for m in _TRANSFORMERS_NAMES if m not in sys.modules]
    for module in stand_ins:
        sys.modules[module] = _stand_in(module, _TRANSFORMERS_NAMES[module])
    try:
        return importlib.import_module("streaming")
    except ImportError:
        # Another streaming than the one this was written against: forget every module the
        # attempt left half-imported and import it plainly.
        for name in [n for n in sys.modules if n == "streaming" or n.startswith("streaming.")]:
            del sys.modules[name]
        for module in stand_ins:
            sys.modules.pop(module, None)
        stand_ins = []
        return importlib.import_module("streaming")
    finally:
        for module in stand_ins:
            sys.modules.pop(module, None)
