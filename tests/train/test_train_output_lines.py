"""What a run prints besides errors: timestamped plain step lines (a SLURM log, a pipe), the
end-of-run summary, and the one notice that kernels are being built on a first step."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from train_helpers import train_args

from gpn_scale.cli import main
from gpn_scale.train.progress import FirstStepNotice, progress_line, run_summary

STAMP = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d\d:\d\d"


def test_plain_step_lines_lead_with_an_iso_timestamp():
    line = progress_line(3, 10, 2.5, 1e-3, 1234.0, None, 0.5)
    assert re.fullmatch(
        STAMP + r" step 3/10 \| loss 2\.5000 \| lr 1\.000e-03 \| 1,234 tok/s \| MFU n/a \| "
        r"ETA 0:00:04",
        line,
    ), line
    assert run_summary(12, 3725.4, 5432.1, 0.412) == (
        "summary: 12 step(s) in 1:02:05 wall time | mean 5,432 tok/s | mean MFU 41.2%"
    )
    assert run_summary(1, 2.0, None, None).endswith("mean n/a tok/s | mean MFU n/a")


def test_a_run_prints_timestamped_steps_and_a_summary(corpus, tmp_path, capsys):
    steps = ["schedule.total_steps=3", "schedule.warmup_steps=1", "checkpoint.every_steps=0"]
    assert main(train_args(corpus, tmp_path / "run", *steps)) == 0
    out = capsys.readouterr().out.splitlines()
    assert [int(m[1]) for ln in out if (m := re.match(STAMP + r" step (\d)/3 \| loss", ln))] == [
        1,
        2,
        3,
    ]
    summary = [ln for ln in out if ln.startswith("summary: ")]
    assert len(summary) == 1, out
    assert re.fullmatch(
        r"summary: 3 step\(s\) in 0:\d\d:\d\d wall time \| mean [\d,]+ tok/s \| mean MFU n/a",
        summary[0],
    )


def test_first_step_notice_on_a_gpu_once_and_only_when_slow():
    said: list[str] = []
    slow = FirstStepNotice(said.append, "cuda", 1, after_s=0.05)
    time.sleep(0.3)
    slow.done()
    assert len(said) == 1 and said[0].startswith("step 1 is still running after 0.05s:")
    assert "compiles its Triton kernels" in said[0]
    fast = FirstStepNotice(said.append, "cuda", 1, after_s=0.2)
    fast.done()  # the step finished in time: no word
    cpu = FirstStepNotice(said.append, "cpu", 1, after_s=0.01)  # CPU: the build says so itself
    time.sleep(0.3)
    cpu.done()
    assert len(said) == 1


def test_cpu_kernel_build_notice_also_when_a_stale_library_is_there(tmp_path, capsys):
    """A rebuild after an upgrade (an .so of the old source beside the new source) compiles
    for a minute too; the notice used to look only for any .so."""
    from gpn_scale.ops.gpn_step import step_kernels

    class Ext:
        @staticmethod
        def _get_build_directory(name, verbose=False):
            return str(tmp_path / name)

    build = tmp_path / "kern"
    build.mkdir()
    step_kernels._notice_first_build(Ext, "kern")  # nothing built yet
    assert "compiling the fused CPU step kernels" in capsys.readouterr().err
    lib = build / "kern.so"
    lib.write_bytes(b"")
    source_mtime = Path(step_kernels._SOURCE).stat().st_mtime
    os.utime(lib, (source_mtime + 10, source_mtime + 10))
    step_kernels._notice_first_build(Ext, "kern")  # built from this source: silent
    assert capsys.readouterr().err == ""
    os.utime(lib, (source_mtime - 10, source_mtime - 10))
    step_kernels._notice_first_build(Ext, "kern")  # older than the source: a rebuild
    assert "compiling the fused CPU step kernels" in capsys.readouterr().err
