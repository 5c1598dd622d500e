"""The GPU session's device-check script runs end to end (here on CPU, as its smoke mode)."""

from __future__ import annotations

import json

import torch

from gpn_scale.bench import gpu


def test_device_check_runs_and_records(tmp_path):
    rc = gpu.main(["--device", "cpu", "--config", "tiny", "--seq-len", "32", "--batches", "4,2",
                   "--steps", "1", "--warmup", "0", "--out", str(tmp_path)])
    assert rc == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert [c["ok"] for c in result["checks"]] == [True, True, True]
    assert [r["batch"] for r in result["runs"]] == [2, 4]          # increasing order
    assert all(r["tokens_per_s"] > 0 and r["mfu"] is None for r in result["runs"])
    assert "| 4 |" in (tmp_path / "results.md").read_text()


def test_batch_search_stops_at_the_first_out_of_memory(tmp_path, monkeypatch):
    real = gpu.measure_throughput

    def fake(cfg, batch, *args):
        if batch >= 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(cfg, batch, *args)

    monkeypatch.setattr(gpu, "measure_throughput", fake)
    rc = gpu.main(["--device", "cpu", "--config", "tiny", "--seq-len", "16", "--batches",
                   "2,4,8", "--steps", "1", "--warmup", "0", "--out", str(tmp_path)])
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert rc == 0 and [r["batch"] for r in runs] == [2, 4] and runs[1] == {"batch": 4, "oom": True}
    assert "out of memory" in (tmp_path / "results.md").read_text()
