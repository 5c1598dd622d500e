"""core.config.read_yaml: every config file reads the same with and without OmegaConf (a bare
CUDA image has PyYAML only: the device check and its kernel prebuild read the model YAMLs
there), and bad files are one line either way."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gpn_scale.core.config import ConfigError, read_yaml
from gpn_scale.models.gpn import load_model_config

CONFIGS = sorted((Path(__file__).parents[2] / "configs").rglob("*.yaml"))


def _without_omegaconf(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "omegaconf" or m.startswith("omegaconf.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "omegaconf", None)  # import omegaconf -> ImportError


def test_every_shipped_config_reads_the_same_without_omegaconf(monkeypatch):
    assert len(CONFIGS) > 20
    want = {path: read_yaml(path) for path in CONFIGS}
    models = {name: load_model_config(name) for name in ("gpn_m_130m", "gpn_m_130m_2l", "tiny")}
    _without_omegaconf(monkeypatch)
    for path, value in want.items():
        assert read_yaml(path) == value, path
    for name, cfg in models.items():
        assert load_model_config(name) == cfg


def test_floats_read_as_omegaconf_reads_them(tmp_path, monkeypatch):
    """YAML 1.1 (PyYAML) reads 1e-5 as a string; OmegaConf, and so the fallback, as a float."""
    path = tmp_path / "m.yaml"
    path.write_text("a: 1e-5\nb: 3.0e+2\nc: .5\nd: 10\ne: '1e-5'\nf: .inf\n")
    want = read_yaml(path)
    _without_omegaconf(monkeypatch)
    got = read_yaml(path)
    assert got == want == {"a": 1e-5, "b": 300.0, "c": 0.5, "d": 10, "e": "1e-5", "f": float("inf")}


def test_bad_files_are_one_line_without_omegaconf(tmp_path, monkeypatch):
    interpolated = tmp_path / "i.yaml"
    interpolated.write_text("a: 1\nb: ${a}\n")
    broken = tmp_path / "b.yaml"
    broken.write_text("a: [1, 2\n")
    with pytest.raises(ConfigError) as with_omegaconf:
        read_yaml(broken, what="model config")
    _without_omegaconf(monkeypatch)
    with pytest.raises(ConfigError, match=r"uses \$\{...\} interpolation, which needs omegaconf"):
        read_yaml(interpolated, what="model config")
    assert read_yaml(interpolated, resolve=False) == {"a": 1, "b": "${a}"}
    with pytest.raises(ConfigError) as without:
        read_yaml(broken, what="model config")
    head = str(with_omegaconf.value).split(": YAML syntax error")[0]  # the file and line
    assert str(without.value).startswith(f"{head}: YAML syntax error in the model config: ")
    assert "\n" not in str(without.value) and "line 2" in str(without.value)
    with pytest.raises(ConfigError, match="cannot read the model config"):
        read_yaml(tmp_path / "missing.yaml", what="model config")
