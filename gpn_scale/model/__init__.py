"""GPN / GPN+M: config, module, sequence engine, reference path, counts, reference format."""

from gpn_scale.model.config import ConfigError, GPNConfig, load_model_config
from gpn_scale.model.gpn import GPN, GPNOutput, GPNState

__all__ = ["ConfigError", "GPN", "GPNConfig", "GPNOutput", "GPNState", "load_model_config"]
