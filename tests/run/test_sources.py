"""gpn_scale/run/sources.py: what each kind of checkpoint reference resolves to, what it
holds before any tensor is read, its weights, its tokenizer; one-line errors otherwise. And
that it is the one reader: no other module reads a reference's files itself."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from gpn_scale.checkpoint import CheckpointManager
from gpn_scale.core.config import ConfigError
from gpn_scale.data.metadata import DatasetMetadata, SplitInfo, write_metadata
from gpn_scale.data.tokenizer import TOKENIZER_FILE, ByteTokenizer
from gpn_scale.io.run_folder import CHECKPOINTS, FINAL_WEIGHTS, RUN_CONFIG
from gpn_scale.run import sources
from gpn_scale.run.export_format import CONFIG_FILE, EXPORT_FORMAT, WEIGHTS_FILE
from gpn_scale.testing.models import perturbed_model, tiny_config

REPO = Path(__file__).resolve().parents[2]
BYTE = {"kind": "byte", "name": "byte", "eod_token_id": 256}


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return perturbed_model(tiny_config(vocab_size=257), dtype=torch.float32, scale=0.3).eval()


def _save(run: Path, model: torch.nn.Module, step: int = 7, **meta: Any) -> str:
    """A DCP step directory under run/checkpoints, as the trainer writes one."""
    files = meta.pop("files", None)
    values = {"step": step, "tokens": step * 16, "model_config": model.config.to_dict(), **meta}
    mgr = CheckpointManager(str(run / CHECKPOINTS))
    return mgr.save(step, {"model": model.state_dict()}, meta=values, files=files)


def _byte_dataset(root: Path) -> str:
    meta = DatasetMetadata(
        vocab_size=257,
        seq_len=16,
        tokenizer=BYTE,
        eod_token_id=256,
        splits={"train": SplitInfo(1, 16, 1), "val": SplitInfo(1, 16, 1)},
        source={"description": "test"},
        seed=0,
    )
    root.mkdir(parents=True, exist_ok=True)
    write_metadata(str(root), meta)
    return str(root)


def _export(folder: Path, model: torch.nn.Module) -> Path:
    """A folder as `gpn-scale export --format safetensors` writes it (its readers' view)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, folder / WEIGHTS_FILE)
    config = {"format": EXPORT_FORMAT, "model_config": model.config.to_dict(), "tokenizer": BYTE}
    (folder / CONFIG_FILE).write_text(json.dumps(config))
    return folder


def _same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for key in a:
        torch.testing.assert_close(a[key], b[key])


# ----------------------------------------------------------------------------- resolving


def test_each_kind_of_reference_resolves_to_its_weights(tmp_path, model):
    run = tmp_path / "run"
    _save(run, model, step=3)
    step = _save(run, model, step=7)
    assert sources.resolve(step) == ("dcp", step)
    assert sources.resolve(step + "/") == ("dcp", step)
    assert sources.resolve(str(run / CHECKPOINTS)) == ("dcp", step)  # a root: its newest
    assert sources.resolve(str(run)) == ("dcp", step)  # a run folder: its checkpoints/
    final = tmp_path / "bare" / FINAL_WEIGHTS
    final.parent.mkdir()
    torch.save(model.state_dict(), final)
    assert sources.resolve(str(final)) == ("final", str(final))
    assert sources.resolve(str(final.parent)) == ("final", str(final))  # no checkpoint: the .pt
    export = _export(tmp_path / "export", model)
    assert sources.resolve(str(export)) == ("export", str(export))
    uri = "s3://bucket/run/checkpoints/step_000000007"  # named, not looked up
    assert sources.resolve(uri) == ("dcp", uri)
    assert sources.is_explicit(step) and sources.is_explicit(str(final))
    assert not sources.is_explicit(str(run))
    assert sources.root_of(step) == str(run / CHECKPOINTS)


def test_a_run_folder_looks_in_its_own_checkpoints_then_the_root_it_names(tmp_path):
    run, outside = tmp_path / "run", tmp_path / "elsewhere"
    run.mkdir()
    (run / RUN_CONFIG).write_text(f"run_dir: .\ncheckpoint:\n  root: {outside}\n")
    assert sources.checkpoint_roots(str(run)) == [
        str(run),
        str(run / CHECKPOINTS),
        str(outside),
    ]
    assert sources.checkpoint_roots("s3://b/root") == ["s3://b/root"]


@pytest.mark.parametrize(
    "ref, says",
    [
        ("", "checkpoint: empty"),
        ("{tmp}/gone.pt", "no such file; fix the path"),
        ("{tmp}/checkpoints/step_000000009", "no such step folder"),
        ("{tmp}/nowhere", "no such file or directory"),
        ("{tmp}", "no complete checkpoint (nor model_final.pt) in it"),
    ],
)
def test_a_reference_naming_nothing_is_one_line(tmp_path, ref, says):
    with pytest.raises(ConfigError) as err:
        sources.resolve(ref.format(tmp=tmp_path))
    assert says in str(err.value) and "\n" not in str(err.value)


# ----------------------------------------------------------------------------- reading


def test_a_step_directory_gives_its_meta_run_folder_and_tokenizer_file(tmp_path, model):
    uri = _save(tmp_path / "run", model, tokenizer=BYTE, run_dir="..")
    source = sources.open_source(uri)
    assert (source.kind, source.uri) == ("dcp", uri)
    assert source.meta["step"] == 7 and source.meta["tokenizer"] == BYTE
    assert source.run_dir == str(tmp_path / "run")
    assert source.serialized_tokenizer is None  # the byte tokenizer has no file
    carried = _save(tmp_path / "hf", model, step=2, files={TOKENIZER_FILE: b"{}"})
    assert sources.open_source(carried).serialized_tokenizer == "{}"


def test_every_kind_reads_the_same_weights(tmp_path, model):
    blank = perturbed_model(model.config, dtype=torch.float32, seed=5).eval()
    step = _save(tmp_path / "run", model)
    final = tmp_path / FINAL_WEIGHTS
    torch.save(model.state_dict(), final)
    export = _export(tmp_path / "export", model)
    for ref in (step, str(final), str(export)):
        source = sources.open_source(ref)
        _same_state(sources.read_weights(source, blank, None, model.config), model.state_dict())
    bare = sources.open_source(str(final))
    assert bare.meta == {} and bare.run_dir is None  # no config.yaml beside it
    assert sources.open_source(str(export)).meta["layout"] == "safetensors"


# ----------------------------------------------------------------------------- the tokenizer


def test_tokenizer_identities_compare_by_kind_serialisation_and_eod():
    hf = {"kind": "huggingface", "name": "a", "sha256": "1" * 64, "eod_token_id": 2}
    assert sources.same_tokenizer(BYTE, dict(BYTE, name="elsewhere"))
    assert not sources.same_tokenizer(BYTE, hf)
    assert sources.same_tokenizer(hf, dict(hf, name="b"))  # moved: the same file
    assert not sources.same_tokenizer(hf, dict(hf, sha256="2" * 64))
    assert not sources.same_tokenizer(hf, dict(hf, eod_token_id=3))
    assert sources.same_tokenizer(hf, {k: v for k, v in hf.items() if k != "eod_token_id"})
    assert sources.describe_tokenizer(hf) == "huggingface:a (sha256 111111111111)"
    assert sources.describe_tokenizer(BYTE) == "byte:byte"


def test_the_recorded_identity_carries_a_hugging_face_file_only(tmp_path, monkeypatch):
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models

    path = tmp_path / TOKENIZER_FILE
    Tokenizer(models.WordLevel({"a": 0, "<eod>": 1}, unk_token="a")).save(str(path))
    monkeypatch.chdir(tmp_path)  # a relative name is recorded absolute
    identity = {"kind": "huggingface", "name": TOKENIZER_FILE, "eod_token_id": 1}
    recorded, files = sources.tokenizer_record(identity)
    assert recorded["name"] == str(path) and set(files) == {TOKENIZER_FILE}
    assert files[TOKENIZER_FILE] == Tokenizer.from_file(str(path)).to_str().encode()
    assert sources.tokenizer_record(BYTE) == (BYTE, {})
    gone = {"kind": "huggingface", "name": str(tmp_path / "gone.json"), "eod_token_id": 1}
    assert sources.tokenizer_record(gone) == (gone, {})  # the identity alone


def test_the_tokenizer_is_the_recorded_one_else_the_training_data_s(tmp_path, model):
    data = _byte_dataset(tmp_path / "data")
    recorded = sources.open_source(_save(tmp_path / "a", model, tokenizer=BYTE))
    assert isinstance(sources.tokenizer_of(recorded), ByteTokenizer)
    older = sources.open_source(_save(tmp_path / "b", model, config={"data": {"remote": data}}))
    assert "tokenizer" not in older.meta
    assert isinstance(sources.tokenizer_of(older), ByteTokenizer)  # from its dataset
    assert isinstance(sources.tokenizer_of(older, "byte"), ByteTokenizer)
    unknown = sources.open_source(_save(tmp_path / "c", model))
    with pytest.raises(ConfigError, match="names no dataset; pass --tokenizer"):
        sources.tokenizer_of(unknown)


def test_an_override_must_be_the_recorded_tokenizer(tmp_path, model):
    hf = {"kind": "huggingface", "name": "x", "sha256": "1" * 64, "eod_token_id": 256}
    source = sources.open_source(_save(tmp_path / "run", model, tokenizer=hf))
    with pytest.raises(ConfigError) as err:
        sources.tokenizer_of(source, "byte")
    assert "is not the tokenizer" in str(err.value) and "\n" not in str(err.value)


def test_the_training_data_is_found_where_the_run_folder_lies_now(tmp_path, model):
    config = {"run_dir": ".", "data": {"remote": "default", "seq_len": 16}}
    here = tmp_path / "copy"
    assert sources.training_data(config, str(here)) == str(here / "data" / "default_corpus_T16")
    assert sources.training_data({"data": {"remote": "s3://b/d"}}, str(here)) == "s3://b/d"
    assert sources.training_data(None, str(here)) is None
    assert sources.training_data({"data": {}}, None) is None
    # The default corpus, deleted since: the byte tokenizer it is always built with.
    source = sources.open_source(_save(here, model, config=config, run_dir=".."))
    assert source.run_dir == str(here) and not (here / "data").exists()
    assert isinstance(sources.tokenizer_of(source), ByteTokenizer)


# ----------------------------------------------------------------------------- one reader

# What reads a reference's files, by name: used by run/sources.py alone (besides the module
# defining it, and the checkpoint package's own loads of its per-rank files).
READERS = {
    "safe_torch_load": ("gpn_scale/checkpoint/",),
    "read_export_meta": ("gpn_scale/run/export_format.py",),
    "read_export_weights": ("gpn_scale/run/export_format.py",),
    "is_export_dir": ("gpn_scale/run/export_format.py",),
    "checkpoint_run_dir": ("gpn_scale/io/run_folder.py",),
}
SOURCES = "gpn_scale/run/sources.py"


def _uses(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.ImportFrom):
            names.update(alias.name for alias in node.names)
    return names


def test_only_the_sources_module_reads_a_checkpoint_reference():
    found = []
    for path in sorted((REPO / "gpn_scale").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        for name in _uses(path) & set(READERS):
            if rel != SOURCES and not rel.startswith(READERS[name]):
                found.append(f"{rel}: {name}")
    assert not found, f"read checkpoint references through gpn_scale.run.sources: {found}"
    assert set(READERS) <= _uses(REPO / SOURCES)  # the check sees them where they are used


def test_the_tokenizer_file_name_is_spelled_once():
    """`tokenizer.json`, the file a step folder and an export carry: gpn_scale.data.tokenizer's
    TOKENIZER_FILE everywhere in the package (data_tools, which builds tokenizers, aside)."""
    spelled = [
        f"{path.relative_to(REPO)}:{node.lineno}"
        for path in sorted((REPO / "gpn_scale").rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Constant) and node.value == TOKENIZER_FILE
    ]
    assert len(spelled) == 1 and spelled[0].startswith("gpn_scale/data/tokenizer.py:"), spelled
