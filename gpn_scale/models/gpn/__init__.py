"""GPN / GPN+M: config, module, sequence engine, reference path, counts, reference format.

The torch-dependent names load on first use, so that importing the config (as the CLI does
for `--help` and for error types) does not import torch.
"""

from typing import Any

from gpn_scale.models.gpn.config import ConfigError, GPNConfig, load_model_config

__all__ = ["ConfigError", "GPN", "GPNConfig", "GPNOutput", "GPNState", "load_model_config"]

_LAZY = {"GPN", "GPNOutput", "GPNState"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from gpn_scale.models.gpn import gpn

        return getattr(gpn, name)
    raise AttributeError(f"module 'gpn_scale.models.gpn' has no attribute {name!r}")
