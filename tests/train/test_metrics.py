"""Metrics sinks: JSONL append/resume, W&B offline runs read back from their .wandb files,
resuming the same W&B run id, and secret scrubbing."""

from __future__ import annotations

import errno
import json
import math
import os
from pathlib import Path

import pytest

from gpn_scale.core.config import ConfigError
from gpn_scale.train.metrics import JsonlSink, MetricsSink, read_jsonl
from gpn_scale.train.secret_scrub import REDACTED, scrub_secrets
from gpn_scale.train.wandb_sink import WANDB_SERVICE_ENV, WandbSink, read_offline_run


def _strict_rows(path: Path) -> list[dict]:
    def refuse(token: str) -> None:
        raise AssertionError(f"non-standard JSON constant {token}")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


# -- JSONL ------------------------------------------------------------------------------------


def test_read_jsonl_live_tolerates_a_run_still_writing(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    assert read_jsonl(path, live=True) == []  # the run has not started
    with pytest.raises(FileNotFoundError):
        read_jsonl(path)
    path.write_text('{"step": 1, "train/loss": 2.5}\n{"step": 2, "tra')  # torn last line
    assert read_jsonl(path, live=True) == [{"step": 1, "train/loss": 2.5}]
    with pytest.raises(json.JSONDecodeError):
        read_jsonl(path)


def test_jsonl_appends_and_resume_truncates(tmp_path: Path) -> None:
    path = tmp_path / "run" / "metrics.jsonl"
    sink = JsonlSink(str(path))
    assert isinstance(sink, MetricsSink)
    for s in range(1, 11):
        sink.log({"loss": 1.0 / s}, step=s)
    sink.close()
    sink = JsonlSink(str(path))  # a restart without resume appends
    sink.log({"loss": 0.05}, step=11)
    sink.close()
    assert [r["step"] for r in read_jsonl(path)] == list(range(1, 12))
    with open(path, "a") as f:
        f.write('{"step": 12, "lo')  # killed mid-write

    # The job is preempted and resumes from its step-8 checkpoint: steps 9.. are redone.
    sink = JsonlSink(str(path), resume_step=8)
    for s in range(9, 13):
        sink.log({"loss": 2.0 / s, "nan": float("nan"), "inf": -math.inf}, step=s)
    sink.close()
    rows = _strict_rows(path)
    assert [r["step"] for r in rows] == list(range(1, 13))  # each step exactly once, in order
    assert rows[8]["loss"] == 2.0 / 9 and rows[7]["loss"] == 1.0 / 8
    assert rows[-1]["nan"] == "NaN" and rows[-1]["inf"] == "-Infinity"
    assert all(isinstance(r["time"], float) for r in rows)


def test_jsonl_resume_on_missing_file_and_tensor_values(tmp_path: Path) -> None:
    import torch

    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(str(path), resume_step=5)
    sink.log(
        {"loss": torch.tensor(1.5), "grad_norm": torch.tensor(2.0, dtype=torch.float64)}, step=6
    )
    sink.close()
    assert _strict_rows(path)[0]["loss"] == 1.5 and _strict_rows(path)[0]["grad_norm"] == 2.0


def test_jsonl_unwritable_path(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match=r"cannot write metrics file .*run_dir") as ei:
        JsonlSink(str(blocker / "metrics.jsonl"))
    assert "\n" not in str(ei.value)


class _FullDisk:
    """A file whose writes the disk refuses (ENOSPC), as a full run_dir does mid-run."""

    def __init__(self, real) -> None:  # type: ignore[no-untyped-def]
        self.real, self.closed = real, False

    def write(self, text: str = "") -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    flush = write

    def fileno(self) -> int:
        return self.real.fileno()

    def close(self) -> None:
        self.real.close()
        self.closed = True


def test_a_full_or_read_only_disk_under_the_metrics_file_is_one_line(tmp_path: Path) -> None:
    """Issue 36 case 3: a run_dir that filled up mid-run turned the metrics writer's OSError
    into a 26-line traceback (exit 1). It is a ConfigError (the CLI's one line, exit 2)
    naming the file, the cause and the fix."""
    path = tmp_path / "run" / "metrics.jsonl"
    sink = JsonlSink(str(path))
    sink.log({"loss": 1.0}, step=1)
    sink._file = _FullDisk(sink._file)
    for action in (lambda: sink.log({"loss": 0.5}, step=2), sink.sync):
        with pytest.raises(ConfigError) as err:
            action()
        line = str(err.value)
        assert "\n" not in line and str(path) in line, line
        assert "No space left on device" in line and "free disk space" in line, line
    with pytest.raises(ConfigError):
        sink.close()
    assert sink._file.closed  # closed all the same


def test_resume_repairs_a_torn_history_and_names_one_with_a_gap(tmp_path: Path) -> None:
    """Issue 36 case 4: after a filesystem abort metrics.jsonl was 0 bytes while checkpoints
    of steps 5 and 10 survived; the resume went on and the history silently lacked steps
    1-10. The repair names the gap in one line (a torn last line is dropped, and said)."""
    from gpn_scale.models.registry import load_model_config
    from gpn_scale.run.config import load_train_config
    from gpn_scale.train.sinks import open_sinks

    path = tmp_path / "run" / "metrics.jsonl"
    path.parent.mkdir()
    path.write_bytes(b"")  # what the abort left
    cfg = load_train_config("ci_tiny", ["logging.wandb.mode=disabled"])
    lines: list[str] = []
    sinks, _ = open_sinks(
        cfg, str(path.parent), 10, None, load_model_config("tiny")[1], 1, lines.append
    )
    sinks[0].close()
    gap = [ln for ln in lines if ln.startswith("metrics: ")]
    assert len(gap) == 1 and "steps 1-10 are missing" in gap[0] and str(path) in gap[0], lines

    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)) + '{"step": 4, "lo')
    sink = JsonlSink(str(path), resume_step=10)
    sink.close()
    assert len(sink.notes) == 2 and "dropped a torn last line" in sink.notes[0]
    assert "ends at step 3" in sink.notes[1] and "steps 4-10 are missing" in sink.notes[1]
    assert [r["step"] for r in _strict_rows(path)] == [1, 2, 3]

    # a whole history (the checkpoint's own row at step 10 included) says nothing
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 11)))
    sink = JsonlSink(str(path), resume_step=10)
    sink.close()
    assert sink.notes == []


# -- W&B offline ------------------------------------------------------------------------------


@pytest.fixture
def wandb_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Keep W&B's cache/config/data inside the test's tmp dir and away from any real account."""
    for name in ("CACHE", "CONFIG", "DATA", "ARTIFACT"):
        monkeypatch.setenv(f"WANDB_{name}_DIR", str(tmp_path / f"wandb_{name.lower()}"))
    for name in (
        "WANDB_API_KEY",
        "WANDB_MODE",
        "WANDB_RUN_ID",
        "WANDB_RESUME",
        "WANDB_PROJECT",
        "WANDB_ENTITY",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    return tmp_path / "wb"


CONFIG = {
    "model": {"d_state": 64, "d_key": 16, "n_layers": 2},
    "optim": {"lr": 3e-4},
    "data": {"eos_token": 0, "tokenizer": "gpt2", "root": "s3://bucket/data"},
    "logging": {"wandb": {"api_key": "0123456789abcdef0123456789abcdef01234567", "project": "gpn"}},
    "s3": {
        "aws_secret_access_key": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
        "endpoint": "http://user:hunter2@minio:9000",
    },
    "notes": "AKIAIOSFODNN7EXAMPLE",
}


def test_wandb_offline_logs_metrics_and_scrubbed_config(wandb_env: Path) -> None:
    sink = WandbSink(
        project="gpn-sweep",
        group="scale-1e18",
        job_type="train",
        name="d512-lr3e-4",
        config=CONFIG,
        mode="offline",
        dir=str(wandb_env),
    )
    assert isinstance(sink, MetricsSink)
    for s in range(5):
        sink.log({"train/loss": 5.0 - s, "lr": 1e-3 * (s + 1)}, step=s)
    run_id = sink.run_id
    sink.close()

    run = read_offline_run(str(wandb_env))
    assert run.run_id == run_id
    assert (run.project, run.group, run.job_type, run.name) == (
        "gpn-sweep",
        "scale-1e18",
        "train",
        "d512-lr3e-4",
    )
    assert [r["_step"] for r in run.history] == [0, 1, 2, 3, 4]
    assert [r["train/loss"] for r in run.history] == [5.0, 4.0, 3.0, 2.0, 1.0]
    assert run.history[2]["lr"] == pytest.approx(3e-3)
    assert run.summary["train/loss"] == 1.0
    assert run.config["model"] == {"d_state": 64, "d_key": 16, "n_layers": 2}
    assert run.config["data"] == {"eos_token": 0, "tokenizer": "gpt2", "root": "s3://bucket/data"}
    assert run.config["logging"]["wandb"] == {"api_key": REDACTED, "project": "gpn"}
    assert run.config["s3"]["aws_secret_access_key"] == REDACTED
    assert run.config["s3"]["endpoint"] == f"http://user:{REDACTED}@minio:9000"
    assert run.config["notes"] == REDACTED
    raw = b"".join(Path(f).read_bytes() for f in run.files)
    for secret in (
        b"0123456789abcdef0123456789abcdef01234567",
        b"wJalrXUtnFEMI",
        b"hunter2",
        b"AKIAIOSFODNN7EXAMPLE",
    ):
        assert secret not in raw  # not anywhere in what W&B wrote


def test_wandb_resume_continues_same_run(wandb_env: Path) -> None:
    first = WandbSink(
        project="p",
        group="g",
        job_type="train",
        name="n",
        config={"a": 1},
        mode="offline",
        dir=str(wandb_env),
    )
    for s in range(3):
        first.log({"loss": float(s)}, step=s)
    run_id = first.run_id
    first.close()

    # The job is preempted; the resumed job reads the id from its checkpoint meta.
    second = WandbSink(
        project="p",
        group="g",
        job_type="train",
        name="n",
        config={"a": 1},
        mode="offline",
        dir=str(wandb_env),
        resume_id=run_id,
    )
    assert second.run_id == run_id
    for s in range(3, 6):
        second.log({"loss": float(s)}, step=s)
    second.close()

    run = read_offline_run(str(wandb_env), run_id)
    assert len(run.files) == 2  # one .wandb file per process, same run id
    assert [r["_step"] for r in run.history] == list(range(6))
    assert [r["loss"] for r in run.history] == [float(s) for s in range(6)]
    assert run.summary["loss"] == 5.0
    # A different run in the same dir is not mixed in.
    other = WandbSink(
        project="p",
        group="g",
        job_type="eval",
        name="m",
        config={},
        mode="offline",
        dir=str(wandb_env),
    )
    other.log({"x": 1}, step=0)
    other.close()
    assert read_offline_run(str(wandb_env), run_id).history == run.history
    assert read_offline_run(str(wandb_env), other.run_id).history[0]["x"] == 1


def test_offline_reader_spans_many_blocks(wandb_env: Path) -> None:
    sink = WandbSink(
        project="p",
        group=None,
        job_type=None,
        name=None,
        config={"blob": "y" * 40_000},
        mode="offline",
        dir=str(wandb_env),
    )
    n = 300  # well over several 32 KiB blocks, with records split across block boundaries
    for s in range(n):
        sink.log({"loss": s / 7, "tag": f"step-{s}"}, step=s)
    sink.close()
    run = read_offline_run(str(wandb_env))
    assert sum(Path(f).stat().st_size for f in run.files) > 4 * 32 * 1024
    assert run.config["blob"] == "y" * 40_000  # a record larger than a block
    assert len(run.history) == n
    assert all(
        r["_step"] == s and r["loss"] == s / 7 and r["tag"] == f"step-{s}"
        for s, r in enumerate(run.history)
    )


def test_wandb_bad_mode_and_disabled(wandb_env: Path) -> None:
    with pytest.raises(ConfigError, match=r"mode='offlin' is not one of offline/online/disabled"):
        WandbSink(
            project="p",
            group=None,
            job_type=None,
            name=None,
            config={},
            mode="offlin",
            dir=str(wandb_env),
        )
    sink = WandbSink(
        project="p",
        group=None,
        job_type=None,
        name=None,
        config={},
        mode="disabled",
        dir=str(wandb_env),
    )
    sink.log({"loss": 1.0}, step=0)
    assert sink.run_id
    sink.close()
    with pytest.raises(FileNotFoundError, match="no W&B run files"):
        read_offline_run(str(wandb_env))


# -- scrubbing --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key,value",
    [
        ("api_key", "abc"),
        ("WANDB_API_KEY", "abc"),
        ("hf_token", "abc"),
        ("password", "abc"),
        ("db_password", "abc"),
        ("aws_secret_access_key", "abc"),
        ("AWS_ACCESS_KEY_ID", "abc"),
        ("secret", "abc"),
        ("client_secret", "abc"),
        ("token", "abc"),
        ("key", "abc"),
        ("authToken", "abc"),
        ("private_key", "abc"),
        ("credentials", {"user": "u"}),
    ],
)
def test_secret_keys_are_scrubbed(key: str, value: object) -> None:
    assert scrub_secrets({"x": {key: value}}) == {"x": {key: REDACTED}}


@pytest.mark.parametrize(
    "key,value",
    [
        ("d_key", 64),
        ("n_key_heads", 4),
        ("eos_token", 0),
        ("pad_token", "<pad>"),
        ("tokens", 10**9),
        ("max_tokens", 4096),
        ("tokenizer", "gpt2"),
        ("keep_last", 3),
        ("key_dim", 16),
        ("git_sha", "a" * 40),
        ("run_id", "0123456789abcdef0123456789abcdef01234567"),
        ("lr", 3e-4),
        ("root", "s3://bucket/x"),
    ],
)
def test_ordinary_keys_are_kept(key: str, value: object) -> None:
    assert scrub_secrets({key: value}) == {key: value}


@pytest.mark.parametrize(
    "value",
    [
        "AKIAIOSFODNN7EXAMPLE",
        "hf_" + "a" * 34,
        "ghp_" + "b" * 36,
        "sk-" + "c" * 40,
        "0123456789abcdef0123456789abcdef01234567",
        "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.sig_nature",
        "-----BEGIN RSA PRIVATE KEY-----\nMIIE...",
    ],
)
def test_credential_looking_values_are_scrubbed(value: str) -> None:
    assert scrub_secrets({"misc": [value]}) == {"misc": [REDACTED]}


def test_scrub_is_a_copy_and_handles_urls() -> None:
    cfg = {"a": {"password": "p", "url": "https://me:pa55@host/x", "plain": "https://host/x"}}
    out = scrub_secrets(cfg)
    assert out == {
        "a": {
            "password": REDACTED,
            "url": f"https://me:{REDACTED}@host/x",
            "plain": "https://host/x",
        }
    }
    assert cfg["a"]["password"] == "p"  # the input is untouched


def _closed_port() -> int:
    import socket

    with socket.socket() as s:  # bound then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_wandb_online_without_server_says_so_and_gives_up(
    wandb_env: Path, monkeypatch, capsys
) -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("WANDB_BASE_URL", url)
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef0123456789abcdef01234567")
    lines: list[str] = []
    with pytest.raises(ConfigError) as err:
        WandbSink(
            project="p",
            group=None,
            job_type=None,
            name=None,
            config={},
            mode="online",
            dir=str(wandb_env),
            init_timeout=2,
            log=lines.append,
        )
    assert len(lines) == 1 and f"connecting to {url}" in lines[0]
    assert "logging.wandb.init_timeout=2" in lines[0]
    msg = str(err.value)
    assert "\n" not in msg
    assert f"{url} not reachable within logging.wandb.init_timeout=2 s" in msg
    assert "logging.wandb.mode=offline" in msg and "WANDB_API_KEY" not in msg


def test_wandb_online_without_server_fails_train_in_one_line(
    corpus, tmp_path: Path, wandb_env: Path, monkeypatch, capsys
) -> None:
    from train_helpers import train_args

    from gpn_scale.cli import main

    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef0123456789abcdef01234567")
    rc = main(
        train_args(
            corpus, tmp_path / "run", "logging.wandb.mode=online", "logging.wandb.init_timeout=2"
        )
    )
    out = capsys.readouterr()
    assert rc == 2
    assert "W&B: connecting to" in out.out + out.err
    errors = [ln for ln in out.err.splitlines() if ln.startswith("gpn-scale: error:")]
    assert len(errors) == 1 and "logging.wandb.mode=offline" in errors[0], out.err


def test_a_wandb_that_fails_to_start_leaves_the_metrics_file_closed(tmp_path, monkeypatch):
    """open_sinks returns nothing when W&B raises, so it closes the JSONL sink it opened
    (the run's cleanup never sees it)."""
    from gpn_scale.models.registry import load_model_config
    from gpn_scale.run.config import load_train_config
    from gpn_scale.train import sinks

    opened: list[JsonlSink] = []
    real = sinks.JsonlSink

    def recording(*args, **kwargs):
        opened.append(real(*args, **kwargs))
        return opened[-1]

    def refuse(*args, **kwargs):
        raise ConfigError("logging.wandb: no server")

    monkeypatch.setattr(sinks, "JsonlSink", recording)
    monkeypatch.setattr(sinks, "_open_wandb", refuse)
    cfg = load_train_config("ci_tiny", ["logging.wandb.mode=offline"])
    with pytest.raises(ConfigError, match="no server"):
        sinks.open_sinks(cfg, str(tmp_path), None, None, load_model_config("tiny")[1], 1, print)
    assert len(opened) == 1 and opened[0]._file.closed


def test_a_dead_inherited_wandb_service_is_replaced_by_the_sinks_own(
    wandb_env: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A process started by one that used W&B inherits WANDB_SERVICE, the token of that
    process's service; once that service has ended, W&B's init fails connecting to it (seen:
    a trainer started by a test runner whose earlier W&B run had ended). The sink starts its
    own service instead, says so, and logs."""
    import wandb
    from wandb.sdk.lib.service.service_token import UnixServiceToken

    wandb.teardown()  # this process's own service (an earlier test's) would be used instead
    gone = UnixServiceToken(parent_pid=os.getppid(), path=str(tmp_path / "gone" / "socket"))
    monkeypatch.setenv(WANDB_SERVICE_ENV, gone.env_value)
    said: list[str] = []
    sink = WandbSink(
        project="p",
        group=None,
        job_type=None,
        name=None,
        config={},
        mode="offline",
        dir=str(wandb_env),
        log=said.append,
    )
    sink.log({"train/loss": 1.5}, step=1)
    sink.close()
    assert any("inherited WANDB_SERVICE does not answer" in line for line in said), said
    assert os.environ.get(WANDB_SERVICE_ENV) != gone.env_value  # its own service now
    assert [r["train/loss"] for r in read_offline_run(str(wandb_env)).history] == [1.5]
