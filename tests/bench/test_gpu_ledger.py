"""bench/gpu_ledger.py: the device check's per-launch ledger, in Triton's interpreter on the
tests' tiny GPN+M (its times mean nothing here; its bookkeeping is what is held)."""

from __future__ import annotations

import json

import pytest
import torch

from gpn_scale.bench import gpu_ledger
from gpn_scale.testing.models import tiny_config

CFG = tiny_config(chunk_size=4)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def rows():
    return gpu_ledger.ledger(CFG, 2, CPU, bf16=False, repeats=1, config_name="tiny", seq_len=8)


def test_every_launch_of_the_recorded_step_has_a_row_with_its_counts(rows):
    recorded = gpu_ledger.record_step(CFG, 2, CPU, bf16=False)
    assert {r.role for r in recorded} == {r["role"] for r in rows}
    by_role: dict[str, int] = {}
    for r in recorded:
        by_role[r.role] = by_role.get(r.role, 0) + 1
    for row in rows:
        assert row["bytes"] > 0 and row["alone_s"] > 0 and row["in_sequence_s"] > 0
        assert row["launches_per_chunk"] == by_role[row["role"]]
        # seq_len 8 = two chunks of 4: the role's chunk time twice over
        assert row["s_per_step"] == pytest.approx(row["us_per_time_step"] * 8 / 1e6)
    # the memory kernels at their chunk's first, middle and last step
    taus = sorted(r["tau"] for r in rows if r["role"] == "memory/FFN backward 0")
    assert taus == [0, 2, 3]


def test_roles_merge_their_distinct_launches_largest_first(rows):
    (key, roles), *_ = gpu_ledger.by_role(rows).items()
    assert key == ("tiny", 2)
    assert len({r["role"] for r in roles}) == len(roles)
    assert [r["s_per_step"] for r in roles] == sorted(
        (r["s_per_step"] for r in roles), reverse=True
    )
    text = gpu_ledger.markdown(rows)
    assert "memory/FFN backward 0" in text and text.count("\n") == len(rows) + 2


def test_what_ifs_time_each_alternative_beside_the_shipped_settings():
    rows = gpu_ledger.what_ifs(CFG, 2, CPU, bf16=False, repeats=1, config_name="tiny")
    roles = {
        "memory_backward_kernel": "memory/FFN backward 0",
        "memory_forward_kernel": "memory/FFN 0",
    }
    assert set(gpu_ledger.WHAT_IFS) == {*roles, "linear_kernel"}
    # the GEMM's what-if is a function of the launch: for the input GEMM's dy W^T only,
    # once a launch (the interpreter's tiles are the same either way)
    gemm = [r for r in rows if r["kernel"] == "linear_kernel"]
    assert {r["role"] for r in gemm} == {"input dy W^T 0"}
    assert [r["setting"] for r in gemm] == ["shipped", "128-wide panels (the sm_80 plan)"]
    for kernel, role in roles.items():
        alternatives = gpu_ledger.WHAT_IFS[kernel]
        settings = ["shipped", *(label for label, _ in alternatives)]
        # at the chunk's first, middle and last step, every setting, the shipped one first
        for tau in (0, 2, 3):
            mine = [r for r in rows if r["tau"] == tau and r["role"] == role]
            assert [r["setting"] for r in mine] == settings
            assert mine[0]["vs_shipped"] == 1.0 and all(r["alone_s"] > 0 for r in mine)
            for r, (_, change) in zip(mine[1:], alternatives):
                if callable(change):  # the memory forward's other row block
                    assert r["meta"]["BLOCK_R"] != mine[0]["meta"]["BLOCK_R"]
                else:
                    assert change.items() <= r["meta"].items()
    text = gpu_ledger.what_ifs_markdown(rows)
    assert text.count("\n") == len(rows) + 2 and "8 warps" in text


def test_device_facts_become_the_kernels_json_the_accounting_reads():
    rows = [
        dict(config="gpn_m_130m", batch=64, role="memory/FFN backward 0",
             kernel="memory_backward_kernel", registers=255, shared=4096, num_warps=8,
             spills=0, instructions=2700, loop_instructions=[126, 667]),
        dict(config="gpn_m_130m", batch=64, role="row backward", kernel="rev_row_kernel",
             registers=None),
    ]  # fmt: skip
    facts = gpu_ledger.device_facts(rows)
    (v,) = facts["variants"]
    assert v["blocks_per_sm"] == 1 and v["cases"] == ["gpn_m_130m bf16 B=64"]
    assert v["names"] == ["memory/FFN backward 0"]
    json.dumps(facts)


def test_cli_writes_the_ledger_and_refuses_bad_input(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(gpu_ledger, "load_model_config", lambda name: CFG)
    assert gpu_ledger.main(["--device", "cpu", "--config", "tiny", "--batches", "2",
                            "--repeats", "1", "--fp32", "--out", str(tmp_path)]) == 0  # fmt: skip
    blob = json.loads((tmp_path / "ledger.json").read_text())
    assert blob["rows"] and (tmp_path / "ledger.md").is_file()
    capsys.readouterr()
    (tmp_path / "file").write_text("")
    assert gpu_ledger.main(["--out", str(tmp_path / "file")]) == 2
    assert gpu_ledger.main(["--out", str(tmp_path), "--batches", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "is a file" in err[0] and "--batches" in err[1]
