"""What a committed device run is priced with when the accounting is held against it
(`gpu_model --against RUN`, `gpu_report.against`): one object handed to each comparison
(the steps, the engine A/B, the step GEMMs' routes, the Transformer++), so that each prices
the run alike. Torch-free, as device_runs.py is."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpn_scale.accounting.ceilings import Ceilings
    from gpn_scale.models.gpn import GPNConfig


@dataclass(frozen=True)
class RunPricing:
    run: Path  # the run's folder
    blob: dict[str, Any]  # its results.json
    config: str  # the GPN config name its rows are of
    cfg: GPNConfig  # that config with the engine options the run ran under
    ceilings: Ceilings  # the run's measured ceilings over the defaults
    graphs: bool  # CUDA graphs on in the run
    placement: str  # the block scheduler's placement priced with (step_model._spare)
    batches: tuple[int, ...] | None = None  # only these batches; None: all the run measured

    @property
    def meta(self) -> dict[str, Any]:
        return self.blob.get("meta", {})

    @property
    def seq_len(self) -> int:
        return int(self.meta.get("seq_len", 2048))

    def wants(self, batch: int) -> bool:
        return self.batches is None or batch in self.batches
