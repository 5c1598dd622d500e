"""Scheduled profiling (gpn_scale/train/profiling.py, `profiling.*`): the schedule, the
traces and memory snapshots it writes (local and S3), its one-line config errors, that off
costs nothing, and one tiny training run whose trace is Chrome trace JSON of its step."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from train_helpers import train_args

from gpn_scale.cli import main
from gpn_scale.core.config import ConfigError
from gpn_scale.io.run_folder import rebase_run_config
from gpn_scale.io.storage import LocalStorage, open_storage
from gpn_scale.run.config import ProfilingSection, load_train_config, relocatable
from gpn_scale.train import profiling
from gpn_scale.train.profiling import NONE, OFF, RECORD, SAVE, WARMUP, StepProfiler, action_at

CPU = torch.device("cpu")


def _steps(prof: StepProfiler | profiling.Off, first: int, last: int) -> None:
    """Training steps first..last with a small autograd workload, the loop's calls around."""
    x = torch.randn(32, 32, requires_grad=True)
    for step in range(first, last + 1):
        (x @ x).tanh().sum().backward()
        prof.step(step)
    prof.close()


def _trace(path: Path | bytes) -> dict:
    data = json.loads(path if isinstance(path, bytes) else path.read_text())
    assert data["traceEvents"], "an empty trace"
    return data


def _span_names(trace: dict) -> list[str]:
    return sorted(
        e["name"] for e in trace["traceEvents"] if str(e.get("name", "")).startswith("Profiler")
    )


def test_schedule_records_each_window_end_and_skips_windows_begun_before_the_start():
    every, warmup, active = 10, 3, 2
    actions = {s: action_at(s, every, warmup, active) for s in range(1, 31)}
    assert [s for s, a in actions.items() if a == SAVE] == [10, 20, 30]
    assert [s for s, a in actions.items() if a == RECORD] == [9, 19, 29]
    assert [s for s, a in actions.items() if a == WARMUP] == [6, 7, 8, 16, 17, 18, 26, 27, 28]
    assert all(actions[s] == NONE for s in (1, 5, 11, 15))
    # a resume after step 6 (inside the first window's warm-up): that window is not recorded
    resumed = {s: action_at(s, every, warmup, active, start=6) for s in range(7, 21)}
    assert [s for s, a in resumed.items() if a != NONE] == [16, 17, 18, 19, 20]
    # the whole period recorded (no wait, no warm-up): every step its own window
    assert {action_at(s, 1, 0, 1) for s in range(1, 5)} == {SAVE}


def test_traces_at_the_scheduled_steps_only(tmp_path):
    """A process resumed after step 2, 3 to 13 of every=4, warmup=1, active=2: the window
    ending at 4 began at 2 (before it) and the one ending at 16 is unfinished: 8 and 12."""
    section = ProfilingSection(enable=True, every=4, warmup=1, active=2)
    lines: list[str] = []
    prof = profiling.open_profiler(section, 0, str(tmp_path), 2, CPU, lines.append)
    assert isinstance(prof, StepProfiler)
    _steps(prof, 3, 13)
    folder = tmp_path / "profiling"
    assert sorted(p.name for p in folder.iterdir()) == ["rank0_step12.json", "rank0_step8.json"]
    assert _span_names(_trace(folder / "rank0_step8.json")) == ["ProfilerStep#7", "ProfilerStep#8"]
    assert _span_names(_trace(folder / "rank0_step12.json")) == [
        "ProfilerStep#11",
        "ProfilerStep#12",
    ]
    assert any("step 8 trace ->" in line for line in lines), lines


class FakeMemory:
    """A MemoryHistory without CUDA: counts its calls, 'dumps' a small pickle."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def start(self) -> None:
        self.calls.append("start")

    def dump(self, path: Path) -> None:
        self.calls.append("dump")
        path.write_bytes(pickle.dumps({"segments": []}))

    def stop(self) -> None:
        self.calls.append("stop")


def test_memory_snapshots_on_the_schedule_and_on_out_of_memory(tmp_path):
    memory = FakeMemory()
    section = ProfilingSection(memory_snapshot=True, every=3)
    storage = LocalStorage(tmp_path)
    prof = StepProfiler(section, 1, storage, 0, print, memory=memory)
    for step in range(1, 8):
        prof.step(step)
    prof.close(torch.OutOfMemoryError("CUDA out of memory"))  # step 8 ran out
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [
        "rank1_step3_memory.pickle",
        "rank1_step6_memory.pickle",
        "rank1_step8_oom.pickle",
    ]
    assert memory.calls == ["start", "dump", "dump", "dump", "stop"]
    assert pickle.loads((tmp_path / "rank1_step8_oom.pickle").read_bytes()) == {"segments": []}


def test_memory_snapshot_on_cpu_is_skipped_without_an_error(tmp_path):
    lines: list[str] = []
    section = ProfilingSection(memory_snapshot=True)
    assert profiling.cuda_memory_history(CPU) is None
    assert profiling.open_profiler(section, 0, str(tmp_path), 0, CPU, lines.append) is OFF
    assert lines == ["profiling.memory_snapshot: no CUDA device (cpu): no memory snapshots"]
    assert not (tmp_path / "profiling").exists()


def test_off_makes_no_profiler(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a profiler was made")

    monkeypatch.setattr(torch.profiler, "profile", refuse)
    monkeypatch.setattr(profiling, "open_storage", refuse)
    prof = profiling.open_profiler(ProfilingSection(), 0, str(tmp_path), 0, CPU, print)
    assert prof is OFF
    _steps(prof, 1, 3)
    assert list(tmp_path.iterdir()) == []


def test_traces_go_to_an_s3_folder(s3_bucket, s3_endpoint, tmp_path):
    folder = f"{s3_bucket}/runs/a/profiling"
    section = ProfilingSection(enable=True, every=2, warmup=0, active=1, folder=folder)
    prof = profiling.open_profiler(section, 3, str(tmp_path / "run"), 0, CPU, print)
    _steps(prof, 1, 4)
    storage = open_storage(folder)
    assert sorted(storage.list()) == ["rank3_step2.json", "rank3_step4.json"]
    assert _span_names(_trace(storage.get_bytes("rank3_step4.json") or b"")) == ["ProfilerStep#4"]
    assert not (tmp_path / "run").exists()  # nothing staged in the run folder


def test_unwritable_folder_fails_before_the_steps_and_a_failed_write_does_not(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    section = ProfilingSection(enable=True, every=1, warmup=0, folder=str(blocker / "prof"))
    with pytest.raises(ConfigError, match="profiling folder") as err:
        profiling.open_profiler(section, 0, str(tmp_path), 0, CPU, print)
    assert "\n" not in str(err.value)

    class Refusing(LocalStorage):
        def put_file(self, local_path, key):
            raise ConfigError("disk full")

    lines: list[str] = []
    section.folder = None
    prof = StepProfiler(section, 0, Refusing(tmp_path / "p"), 0, lines.append)
    _steps(prof, 1, 2)
    assert [line for line in lines if "could not write" in line] == [
        f"profiling: could not write {tmp_path / 'p'}/rank0_step{n}.json (disk full); "
        "training goes on"
        for n in (1, 2)
    ]
    assert list((tmp_path / "p").iterdir()) == []  # no staged file left behind


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("profiling.every=0", "profiling.every: must be >= 1, got 0"),
        ("profiling.active=0", "profiling.active: must be >= 1, got 0"),
        ("profiling.warmup=-1", "profiling.warmup: must be >= 0 (0 = no warm-up steps)"),
        ("profiling.every=3", "profiling.warmup + profiling.active: must be <= profiling.every"),
        ("profiling.folder=''", "profiling.folder: empty"),
        ("profiling.folder=gs://b/p", "uses unsupported scheme 'gs'"),
        ("profiling.enable=sometimes", "profiling.enable"),
        ("profiling.evry=10", "did you mean 'profiling.every'"),
    ],
)
def test_bad_values_are_one_line_errors(override, message, capsys):
    with pytest.raises(ConfigError) as err:
        load_train_config("ci_tiny", [override])
    assert message in str(err.value) and "\n" not in str(err.value)
    if override == "profiling.every=0":  # and through the CLI: exit 2, one line
        assert main(["train", "ci_tiny", override]) == 2
        assert capsys.readouterr().err.strip().count("\n") == 0


def test_a_folder_in_the_run_is_recorded_relative_to_it(tmp_path):
    cfg = load_train_config("ci_tiny", [f"run_dir={tmp_path}", f"profiling.folder={tmp_path}/p"])
    assert relocatable(cfg).profiling.folder == "p"
    moved = rebase_run_config({"run_dir": ".", "profiling": {"folder": "p"}}, "/moved/run")
    assert moved["profiling"]["folder"] == "/moved/run/p"  # read where the folder lies now


def test_a_training_run_writes_a_chrome_trace_of_its_step(corpus, tmp_path):
    """profiling.enable on a tiny CPU run of 3 steps, every=2: step 2 only (the window
    ending at 4 is unfinished), a Chrome trace holding the step's forward, backward and
    optimizer step."""
    run = tmp_path / "run"
    args = (
        "schedule.total_steps=3", "schedule.warmup_steps=1", "checkpoint.every_steps=0",
        "eval.at_end=false", "profiling.enable=true", "profiling.every=2",
        "profiling.warmup=1", "profiling.active=1",
    )  # fmt: skip
    assert main(train_args(corpus, run, *args)) == 0
    assert sorted(p.name for p in (run / "profiling").iterdir()) == ["rank0_step2.json"]
    trace = _trace(run / "profiling" / "rank0_step2.json")
    names = {str(e.get("name")) for e in trace["traceEvents"]}
    assert _span_names(trace) == ["ProfilerStep#2"]
    assert any(n.startswith("aten::") for n in names)
    assert any(n.startswith("Optimizer.step#") for n in names), sorted(names)[:50]
    assert any("Backward" in n for n in names)
