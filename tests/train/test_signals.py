"""`StopConditions` (gpn_scale/train/signals.py) in this process: when a run stops early (a
preemption signal, Ctrl-C, the job's deadline), what it says why, that it takes over a
signal the early flag recorded, and that it gives every handler back. Real signals to this
process, with the handlers installed; each test restores the handlers it found.
(The trainer's behaviour on them: test_train_logs_signals.py, test_train_preempt_windows.py.)"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import pytest

from gpn_scale.train import signals
from gpn_scale.train.signals import StopConditions

WATCHED = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)


@pytest.fixture(autouse=True)
def _handlers_restored(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No early flag of another test, no SLURM end time of the host; the handlers as found."""
    monkeypatch.setattr(signals, "_early", None)
    monkeypatch.delenv("SLURM_JOB_END_TIME", raising=False)
    before = {sig: signal.getsignal(sig) for sig in WATCHED}
    yield
    for sig, handler in before.items():
        signal.signal(sig, handler)


def test_off_stops_on_nothing_and_installs_nothing():
    before = {sig: signal.getsignal(sig) for sig in WATCHED}
    stops = StopConditions.off()
    assert stops.flag is None and not stops.local_request()
    stops.training_started()
    stops.uninstall()
    assert {sig: signal.getsignal(sig) for sig in WATCHED} == before


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_a_preemption_signal_is_only_recorded_and_handlers_come_back(sig):
    before = {s: signal.getsignal(s) for s in WATCHED}
    stops = StopConditions(enabled=True, end_margin_s=0, requeue=True)
    assert not stops.local_request()
    signal.raise_signal(sig)  # the process lives on: the handler only sets the flag
    assert stops.local_request()
    assert stops.why_preempted() == f"signal {int(sig)}"
    assert stops.why_stopped_in_setup() == f"signal {int(sig)}"
    stops.uninstall()
    assert {s: signal.getsignal(s) for s in WATCHED} == before


def test_disabled_installs_no_handler_and_ignores_the_deadline(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_END_TIME", str(int(time.time()) - 10))
    before = {s: signal.getsignal(s) for s in WATCHED}
    stops = StopConditions(enabled=False, end_margin_s=60, requeue=True)
    assert stops.flag is None and stops.deadline is None and not stops.local_request()
    assert {s: signal.getsignal(s) for s in WATCHED} == before


def test_the_deadline_is_the_job_end_less_the_margin(monkeypatch):
    end = int(time.time()) + 100
    monkeypatch.setenv("SLURM_JOB_END_TIME", str(end))
    far = StopConditions(enabled=True, end_margin_s=10, requeue=False)
    assert far.deadline == end - 10
    assert not far.local_request() and not far.deadline_hit
    far.uninstall()
    near = StopConditions(enabled=True, end_margin_s=200, requeue=False)
    assert near.local_request() and near.deadline_hit  # 200 s before an end 100 s away: now
    assert near.why_preempted().startswith("the job's time limit is 200s away")
    assert near.why_stopped_in_setup() == near.why_preempted()
    near.uninstall()


@pytest.mark.parametrize("raw", ["", "0", "soon", "-5", " 17e9 "])
def test_no_usable_job_end_time_means_no_deadline(raw):
    assert signals.job_deadline({"SLURM_JOB_END_TIME": raw}, 60.0) is None
    assert signals.job_deadline({"SLURM_JOB_END_TIME": "2000000000"}, 0) is None  # margin 0
    assert signals.job_deadline({"SLURM_JOB_END_TIME": " 2000000000 "}, 60) == 2000000000 - 60


def test_a_signal_on_another_rank_is_said_so():
    stops = StopConditions(enabled=True, end_margin_s=0, requeue=False)
    assert stops.why_preempted() == "signal on another rank"  # no signal here, no deadline
    stops.uninstall()


def test_the_trainer_takes_over_a_signal_the_early_flag_recorded():
    signals.install_early()
    signal.raise_signal(signal.SIGTERM)  # during the imports, before the trainer exists
    stops = StopConditions(enabled=True, end_margin_s=0, requeue=False)
    assert signals._early is None  # taken over, not left to be released again
    assert stops.local_request() and stops.why_stopped_in_setup() == f"signal {signal.SIGTERM}"
    stops.uninstall()


def test_disabled_gives_an_early_signal_its_previous_course():
    got: list[int] = []
    signal.signal(signal.SIGUSR1, lambda signum, frame: got.append(signum))
    signals.install_early()
    signal.raise_signal(signal.SIGUSR1)
    assert got == []  # recorded by the early flag
    stops = StopConditions(enabled=False, end_margin_s=0, requeue=False)
    assert stops.flag is None and signals._early is None
    assert got == [signal.SIGUSR1]  # the handler before the flag, then the signal again


def test_ctrl_c_during_the_setup_then_a_second_one_aborts(capfd):
    stops = StopConditions(enabled=True, end_margin_s=0, requeue=True)
    signal.raise_signal(signal.SIGINT)
    assert stops.local_request() and stops.why_stopped_in_setup() == "Ctrl-C"
    assert "during the setup: stopping before the first step" in capfd.readouterr().err
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)
    stops.uninstall()


def test_ctrl_c_in_training_says_it_saves(capfd):
    stops = StopConditions(enabled=True, end_margin_s=0, requeue=True)
    stops.training_started()
    signal.raise_signal(signal.SIGINT)
    assert "saving a checkpoint at the end of this step" in capfd.readouterr().err
    stops.uninstall()


def test_requeue_only_for_a_preemption_on_rank_0(monkeypatch):
    asked: list[bool] = []
    monkeypatch.setattr(signals, "request_slurm_requeue", lambda log: asked.append(True) or True)
    stops = StopConditions(enabled=True, end_margin_s=0, requeue=True)
    signal.raise_signal(signal.SIGUSR1)
    stops.requeue_if_preempted(is_main=False, log=print)
    assert asked == []
    stops.requeue_if_preempted(is_main=True, log=print)
    assert asked == [True]
    stops.flag.interrupted = True  # type: ignore[union-attr]  # a Ctrl-C: someone asked to stop
    stops.requeue_if_preempted(is_main=True, log=print)
    assert asked == [True]
    stops.uninstall()
    no_requeue = StopConditions(enabled=True, end_margin_s=0, requeue=False)
    no_requeue.requeue_if_preempted(is_main=True, log=print)
    assert asked == [True]
    no_requeue.uninstall()
