"""Where the built native libraries are: the shim and the NCCL test doubles.

``setup.py`` compiles ``csrc/`` into ``ftrun/_native`` (the source tree's, for an editable
install). Both the ABI mirror (:mod:`ftrun.shim.abi`) and the control side
(:mod:`ftrun.shim.control`) locate the library through this module, so neither imports the
other for it.
"""

from __future__ import annotations

from pathlib import Path


# ---- errors ---------------------------------------------------------------------------------
class ShimError(RuntimeError):
    """The shim or its control page is not usable."""


class ShimNotBuiltError(ShimError):
    """The native library was not built (package installed without its build step)."""


# ---- locating the built library -------------------------------------------------------------
_NATIVE = Path(__file__).resolve().parent.parent / "_native"  # ftrun/_native


def shim_library_path() -> Path:
    """Path of the built ``libftrun_shim.so``."""
    path = _NATIVE / "libftrun_shim.so"
    if not path.is_file():
        raise ShimNotBuiltError(
            f"the ftrun NCCL shim is not built ({path} is missing): reinstall with "
            "`pip install -e .` or `pip install .` (needs a C compiler: apt-get install gcc)"
        )
    return path


def fake_nccl_dir(revoke: bool = True) -> Path:
    """Directory holding the shipped NCCL test double ``libnccl.so.2`` (new: has revoke)."""
    path = _NATIVE / "fake_nccl" / ("new" if revoke else "old")
    if not (path / "libnccl.so.2").is_file():
        raise ShimNotBuiltError(
            f"the NCCL test double is not built ({path}): reinstall with `pip install -e .`"
        )
    return path
