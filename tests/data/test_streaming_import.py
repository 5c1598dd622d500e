"""gpn_scale/data/streaming_import.py: streaming without transformers and torchvision, and
nothing that tells the difference. Each case runs in a fresh interpreter (this one may have
imported either already)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path


def _python(code: str, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_streaming_without_transformers_and_nothing_differs():
    out = _python(
        """
        import sys
        from gpn_scale.data.streaming_import import import_streaming

        streaming = import_streaming()
        assert "transformers" not in sys.modules and "torchvision" not in sys.modules
        from streaming import StreamingDataLoader, StreamingDataset, MDSWriter
        from streaming.base.dataset import StreamingDataset as base_dataset
        assert StreamingDataset is base_dataset is streaming.StreamingDataset
        assert import_streaming() is streaming

        import torch
        loader = StreamingDataLoader([], batch_size=None)
        assert loader._get_batch_size({"a": [1, 2, 3]}) == 3
        assert loader._get_batch_size(torch.zeros(5, 2)) == 5
        assert "transformers" not in sys.modules  # tensor batches never ask it

        # The ready-made datasets run their own __init__ when first used.
        from streaming.text import StreamingC4
        import streaming.vision
        assert streaming.vision.StreamingCIFAR10.__module__ == "streaming.vision.cifar10"
        assert StreamingC4.__module__ == "streaming.text.c4"

        # transformers is the real one, and its batches are counted as streaming counts them.
        from transformers import BatchEncoding, BatchFeature
        import transformers.tokenization_utils_base as tub
        assert tub.BatchEncoding is BatchEncoding and tub.__file__
        batch = BatchEncoding({"input_ids": [[1, 2], [3, 4], [5, 6], [7, 8]]})
        assert loader._get_batch_size(batch) == 4
        assert loader._get_batch_size(BatchFeature({"x": [1, 2]})) == 2
        import streaming.base.dataloader as dl
        assert issubclass(BatchEncoding, dl.BatchEncoding)
        assert not isinstance(torch.zeros(1), dl.BatchEncoding)
        print("ok")
        """
    )
    assert out.strip() == "ok"


def test_with_transformers_imported_it_is_a_plain_import():
    out = _python(
        """
        import transformers.tokenization_utils_base as tub
        from gpn_scale.data.streaming_import import import_streaming

        import_streaming()
        import streaming.base.dataloader as dl
        assert dl.BatchEncoding is tub.BatchEncoding
        print("ok")
        """
    )
    assert out.strip() == "ok"


def test_a_streaming_that_imports_other_names_is_imported_plainly(tmp_path: Path):
    """A streaming whose loader imports a transformers name the stand-ins lack (another
    release): the attempt is forgotten and the package imported as it is."""
    package = tmp_path / "streaming"
    (package / "base").mkdir(parents=True)
    (package / "text").mkdir()
    (package / "__init__.py").write_text(
        "import streaming.text as text\nfrom streaming.base import Dataset\n"
    )
    (package / "text" / "__init__.py").write_text("LOADED = True\n")
    (package / "base" / "__init__.py").write_text(
        "from transformers.tokenization_utils_base import PreTrainedTokenizerBase\n"
        "class Dataset:\n    pass\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = _python(
        """
        import sys
        from gpn_scale.data.streaming_import import import_streaming

        streaming = import_streaming()
        import transformers.tokenization_utils_base as tub
        import streaming.base as base
        assert base.PreTrainedTokenizerBase is tub.PreTrainedTokenizerBase
        assert type(sys.modules["streaming.text"]).__name__ == "module"
        assert streaming.text.LOADED
        print(streaming.__file__)
        """,
        env=env,
    )
    assert out.strip() == str(package / "__init__.py")
