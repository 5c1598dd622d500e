"""`gpn-scale eval --json`: stdout is one JSON object, log lines go to stderr."""

from __future__ import annotations

import json
import math

from train_helpers import train_args

from gpn_scale.cli import main


def test_eval_json_prints_one_object_on_stdout(corpus, tmp_path, capsys):
    args = train_args(corpus, tmp_path / "run")
    args[0] = "eval"
    assert main(args + ["--checkpoint", "none", "--json", "--batches", "1"]) == 0
    out = capsys.readouterr().out
    (line,) = out.strip().splitlines()
    got = json.loads(line)
    assert set(got) == {"eval/loss", "eval/ppl", "eval/tokens", "checkpoint", "step", "tokens"}
    assert got["checkpoint"] is None and got["step"] == 0
    assert got["eval/tokens"] == 4 * 64  # one batch of ci_tiny's 4 x 64
    assert math.isclose(got["eval/ppl"], math.exp(got["eval/loss"]), rel_tol=1e-9)
