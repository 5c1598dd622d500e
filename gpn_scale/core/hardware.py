"""Accelerators by name: the dense bf16 peak each MFU figure is measured against.

`torch.cuda.get_device_name()` strings ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe",
"NVIDIA A100-SXM4-40GB", "AMD Instinct MI300X") are split into words and matched on the
model word exactly, then on the form factor (PCIe / NVL / SXM) where it changes the peak:
a substring match gave H100 PCIe and NVL the SXM figure and "NVIDIA L40" the L4's.
An unknown device gives None (MFU is then not reported) and one line on stderr, once.

Figures: vendor datasheets, dense (no 2:4 sparsity) BF16 tensor-core FLOP/s per GPU.
Also the device a `--device` flag names (`pick_device`: the checkpoint-reading commands).
Pure: no torch import except in `device_peak_flops` and `pick_device`, so sweep planning can
use the table.
"""

from __future__ import annotations

import re
import sys
from typing import TYPE_CHECKING, Any

from gpn_scale.core.config import ConfigError

if TYPE_CHECKING:
    import torch

# key -> dense bf16 FLOP/s. A key is the model word, plus the form factor for models whose
# variants differ (SXM is the default form factor of those).
PEAK_BF16_FLOPS: dict[str, float] = {
    "H100 SXM": 989e12,
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H200 SXM": 989e12,
    "H200 NVL": 835e12,
    "GH200": 989e12,
    "H800 SXM": 989e12,
    "H800 PCIe": 756e12,
    "H20": 148e12,
    "A100 SXM": 312e12,
    "A100 PCIe": 312e12,  # 40 GB and 80 GB alike
    "A800 SXM": 312e12,
    "A800 PCIe": 312e12,
    "B200": 2250e12,
    "GB200": 2500e12,
    "L40S": 362e12,
    "L40": 181e12,
    "L4": 121e12,
    "A10": 125e12,
    "MI300X": 1307e12,
    "MI325X": 1307e12,
    "MI300A": 981e12,
    "MI250X": 383e12,
}
# Models whose form factors have different peaks; for the rest the model word is the key.
_FORM_FACTORS = {"H100", "H200", "H800", "A100", "A800"}
_VENDOR_WORDS = {"NVIDIA", "AMD", "INSTINCT", "TESLA"}
_warned: set[str] = set()


def device_key(name: str) -> str | None:
    """The table key for a device name, or None when the model is not in the table."""
    words = [w for w in re.split(r"[\s\-_]+", name.upper()) if w and w not in _VENDOR_WORDS]
    if not words:
        return None
    model = words[0]
    if model in _FORM_FACTORS:
        rest = set(words[1:])
        form = "PCIe" if "PCIE" in rest else "NVL" if "NVL" in rest else "SXM"
        key = f"{model} {form}"
    else:
        key = model
    return key if key in PEAK_BF16_FLOPS else None


def peak_bf16_flops(name: str, warn: bool = True) -> float | None:
    """Dense bf16 peak FLOP/s of the named device; None (and one stderr line) if unknown."""
    key = device_key(name)
    if key is None:
        if warn and name not in _warned:
            _warned.add(name)
            print(
                f"MFU not reported: no dense bf16 peak known for {name!r} (add it to "
                "PEAK_BF16_FLOPS in gpn_scale/core/hardware.py)",
                file=sys.stderr,
                flush=True,
            )
        return None
    return PEAK_BF16_FLOPS[key]


def device_peak_flops(device: Any) -> float | None:
    """Peak for a torch.device: None on CPU (a shared CPU has no meaningful peak)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    return peak_bf16_flops(torch.cuda.get_device_name(device))


def pick_device(device: str = "auto") -> torch.device:
    """The torch.device a `--device` flag names (auto, cpu, cuda or cuda:N): one-line
    ConfigError for a device that is not there or not a device."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: CUDA is not available here; use --device cpu")
    try:
        return torch.device(device)
    except RuntimeError:
        raise ConfigError(f"--device {device!r}: expected auto, cpu, cuda or cuda:N") from None
