"""`Throughput` (gpn_scale/train/progress.py): each step's tokens/s and MFU, and the means
the end-of-run summary prints, which leave the first step (the kernels' build) out when the
process trained others, also after a resume. (The line formats themselves:
test_train_output_lines.py.)"""

from __future__ import annotations

import re
import time

import pytest

from gpn_scale.train.progress import Throughput

TOKENS = 1200


def _meter(step0: int = 0, total: int = 10, peak: float | None = 9e4, world: int = 2):
    return Throughput(step0, total, TOKENS, flops_per_token=6.0, peak_flops=peak, world_size=world)


def _means(summary: str) -> tuple[str, str]:
    m = re.search(r"mean (\S+) tok/s \| mean MFU (\S+)$", summary)
    assert m, summary
    return m[1], m[2]


def test_tokens_per_second_and_mfu_of_a_step():
    meter = _meter()
    tps, mfu = meter.add(1, dt=0.5)
    assert tps == 2400.0
    assert mfu == pytest.approx(6.0 * 2400.0 / (9e4 * 2))  # the peak of every rank
    assert _meter(peak=None).add(1, dt=0.5) == (2400.0, None)  # no known peak: no MFU


def test_the_summary_leaves_the_first_step_out():
    meter = _meter()
    meter.add(1, dt=10.0)  # the first step builds the kernels: 120 tok/s, left out
    meter.add(2, dt=1.0)
    meter.add(3, dt=0.5)
    assert _means(meter.summary(3)) == ("1,800", "6.0%")  # (1200 + 2400) / 2; 6 * 1800 / 1.8e5
    assert meter.summary(3).startswith("summary: 3 step(s) in ")
    assert meter.steps(3) == 3


def test_a_resumed_run_leaves_its_own_first_step_out():
    meter = _meter(step0=40, total=50)
    meter.add(41, dt=10.0)
    meter.add(42, dt=1.0)
    assert _means(meter.summary(42)) == ("1,200", "4.0%")
    assert meter.steps(42) == 2


def test_a_run_of_one_step_keeps_it():
    meter = _meter(step0=9, total=10)
    meter.add(10, dt=2.0)
    assert _means(meter.summary(10)) == ("600", "2.0%")
    alone = _meter(total=10)  # stopped (preempted) after its first step of many: no mean
    alone.add(1, dt=2.0)
    assert _means(alone.summary(1)) == ("n/a", "n/a")


def test_without_a_peak_the_summary_says_mfu_n_a():
    meter = _meter(peak=None)
    for step in (1, 2):
        meter.add(step, dt=1.0)
    assert _means(meter.summary(2)) == ("1,200", "n/a")


def test_seconds_per_step_over_this_process_steps():
    meter = _meter(step0=100, total=200)
    meter.t_start = time.perf_counter() - 30.0  # 30 s since this process started stepping
    assert meter.s_per_step(103) == pytest.approx(10.0, rel=0.01)
