"""Device names -> dense bf16 peak (gpn_scale/core/hardware.py): exact model words, the
form factor where it changes the peak, None and one stderr line when unknown."""

from __future__ import annotations

import pytest
import torch

from gpn_scale.core import hardware
from gpn_scale.core.hardware import PEAK_BF16_FLOPS, device_key, peak_bf16_flops

# torch.cuda.get_device_name() strings as the devices report them.
NAMES = {
    "NVIDIA H100 80GB HBM3": "H100 SXM",
    "NVIDIA H100": "H100 SXM",
    "NVIDIA H100 PCIe": "H100 PCIe",
    "NVIDIA H100 NVL": "H100 NVL",
    "NVIDIA H200": "H200 SXM",
    "NVIDIA H200 NVL": "H200 NVL",
    "NVIDIA GH200 480GB": "GH200",
    "NVIDIA H20": "H20",
    "NVIDIA H800 PCIe": "H800 PCIe",
    "NVIDIA A100-SXM4-80GB": "A100 SXM",
    "NVIDIA A100-SXM4-40GB": "A100 SXM",
    "NVIDIA A100-PCIE-40GB": "A100 PCIe",
    "NVIDIA A100 80GB PCIe": "A100 PCIe",
    "NVIDIA L40S": "L40S",
    "NVIDIA L40": "L40",
    "NVIDIA L4": "L4",
    "NVIDIA A10": "A10",
    "NVIDIA B200": "B200",
    "NVIDIA GB200": "GB200",
    "AMD Instinct MI300X": "MI300X",
    "AMD Instinct MI300X VF": "MI300X",
}


@pytest.mark.parametrize("name,key", NAMES.items())
def test_device_names_match_their_own_entry(name, key):
    assert device_key(name) == key
    assert peak_bf16_flops(name) == PEAK_BF16_FLOPS[key]


def test_variants_that_a_substring_match_confused_get_their_own_peak():
    assert (
        peak_bf16_flops("NVIDIA H100 PCIe")
        < peak_bf16_flops("NVIDIA H100 NVL")
        < peak_bf16_flops("NVIDIA H100 80GB HBM3")
    )
    assert peak_bf16_flops("NVIDIA L40") != peak_bf16_flops("NVIDIA L4")
    assert peak_bf16_flops("NVIDIA B200") is not None


@pytest.mark.parametrize("name", ["NVIDIA A10G", "Tesla T4", "NVIDIA GeForce RTX 9999", ""])
def test_unknown_devices_give_none_and_one_warning_line(name, capsys, monkeypatch):
    monkeypatch.setattr(hardware, "_warned", set())
    assert peak_bf16_flops(name) is None
    assert peak_bf16_flops(name) is None  # warned once per name
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("MFU not reported") and repr(name) in err[0]


def test_cpu_has_no_peak():
    assert hardware.device_peak_flops(torch.device("cpu")) is None
