"""``--preload``'s value: what ``auto`` (the default) chooses, and what the user may say."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftrun.config import AUTO_PRELOAD, ConfigError, parse_preload


@pytest.mark.parametrize("source, preloads", [
    ("import torch\n", True),
    ("import os\nfrom torch.distributed import init_process_group\n", True),
    ("def main():\n    import torch.nn as nn\n", True),  # an import inside a function
    ("import os\nprint('no torch here')\n", False),
    ("import torchvision\n", False),  # another package whose name starts with torch
    ("# import torch\nx = 'import torch'\n", False),  # a comment, a string
])
def test_auto_preloads_what_a_torch_job_imports_only_for_a_script_that_imports_torch(
        tmp_path: Path, source: str, preloads: bool) -> None:
    script = tmp_path / "train.py"
    script.write_text(source)
    for text in ("auto", "", " AUTO "):
        assert parse_preload(text, str(script)) == (AUTO_PRELOAD if preloads else (), True)


def test_auto_for_a_module_or_an_unreadable_script_assumes_torch(tmp_path: Path) -> None:
    assert parse_preload("auto", "pkg.train", module=True) == (AUTO_PRELOAD, True)
    assert parse_preload("auto", str(tmp_path / "missing.py")) == (AUTO_PRELOAD, True)


def test_none_and_explicit_lists_are_the_users_choice(tmp_path: Path) -> None:
    assert parse_preload("none", "x.py") == ((), False)
    assert parse_preload("torch, numpy.linalg", "x.py") == (("torch", "numpy.linalg"), False)
    with pytest.raises(ConfigError, match="'not a module' is not a module name"):
        parse_preload("torch,not a module", "x.py")
