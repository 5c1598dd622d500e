"""gpn_scale.io.outputs: where a command will write is checked first, in one line naming the
flag, and nothing is left behind by the check."""

from __future__ import annotations

import pytest

from gpn_scale.io.outputs import check_out_dir, check_out_file
from gpn_scale.io.storage import StorageError


class Refused(ValueError):
    pass


def test_out_dir(tmp_path):
    assert check_out_dir(str(tmp_path)) is True
    assert check_out_dir(str(tmp_path / "new" / "deeper")) is False
    assert sorted(tmp_path.iterdir()) == []  # the write probe leaves nothing
    assert check_out_dir("s3://bucket/prefix") is False  # left to the writer
    a_file = tmp_path / "f"
    a_file.write_text("x")
    cases = [
        (str(a_file), "exists and is a file, not a directory"),
        (str(a_file / "sub"), f"{a_file} is a file, not a directory"),
        ("/proc/sys/gpn_out", "is not writable"),  # read-only for root too
        ("/proc/gpn_out", "refuses new entries"),  # access(2) says yes for root; mkdir fails
    ]
    for path, words in cases:
        with pytest.raises(Refused) as err:
            check_out_dir(path, "--out", error=Refused)
        msg = str(err.value)
        assert "\n" not in msg and msg.startswith(f"--out {path}: ") and words in msg, msg
        assert msg.endswith("choose another --out")


def test_out_file(tmp_path):
    target = tmp_path / "sub" / "report.json"
    assert check_out_file(str(target), "--out") is False
    target.parent.mkdir()
    target.write_text("{}")
    with pytest.raises(StorageError, match=r"already exists; pass --overwrite to replace it"):
        check_out_file(str(target), "--out")
    assert check_out_file(str(target), "--out", overwrite=True) is True
    with pytest.raises(StorageError, match=r"is a directory; give a file path for --out"):
        check_out_file(str(tmp_path), "--out")
    with pytest.raises(StorageError, match=r"/proc refuses new entries"):
        check_out_file("/proc/x.json", "--out")
