"""Build hook: compiles the native NCCL shim (csrc/) into ftrun/_native/.

Everything declarative lives in pyproject.toml; this file only exists because a plain C
shared library (not a Python extension) has to be built at install time.

Outputs (inside the package, so they ship in the wheel):
  ftrun/_native/libftrun_shim.so              the shim (LD_PRELOAD into workers)
  ftrun/_native/fake_nccl/new/libnccl.so.2    NCCL test double, "2.32.3" (has ncclCommRevoke)
  ftrun/_native/fake_nccl/old/libnccl.so.2    NCCL test double, "2.26.2" (no revoke)
The test doubles are used by ``ftrun.shim.self_test`` (doctor's abort round trip).
With ``pip install -e .`` they are written to the source tree's ftrun/_native/ (git-ignored).
No CUDA toolkit is needed: the shim declares the few NCCL types it uses itself.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"
CFLAGS = ["-O2", "-g", "-std=gnu11", "-Wall", "-Wextra", "-fPIC", "-fvisibility=hidden"]


def _compiler() -> list[str]:
    cc = shlex.split(os.environ.get("CC", "cc"))
    if not cc or shutil.which(cc[0]) is None:
        raise SystemExit(
            "ftrun: building the NCCL shim needs a C compiler, and none was found "
            f"({cc[0] if cc else 'cc'!r}): install gcc (e.g. `apt-get install gcc`) or set CC."
        )
    return cc


def build_native(out: Path) -> None:
    """Compile the shim and the NCCL test doubles into `out` (ftrun/_native)."""
    cc = _compiler()
    out.mkdir(parents=True, exist_ok=True)
    jobs = [
        (out / "libftrun_shim.so", [CSRC / "ftshim.c"], ["-ldl", "-lpthread"], []),
        (out / "fake_nccl" / "new" / "libnccl.so.2", [CSRC / "fake_nccl" / "fake_nccl.c"],
         ["-lpthread", "-Wl,-soname,libnccl.so.2"], []),
        (out / "fake_nccl" / "old" / "libnccl.so.2", [CSRC / "fake_nccl" / "fake_nccl.c"],
         ["-lpthread", "-Wl,-soname,libnccl.so.2"], ["-DFAKE_OLD"]),
    ]
    for target, sources, libs, defines in jobs:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".tmp")
        cmd = [*cc, *CFLAGS, *defines, "-shared", "-o", str(tmp), *map(str, sources), *libs]
        try:
            subprocess.run(cmd, check=True)
        except subprocess.CalledProcessError as exc:
            raise SystemExit(f"ftrun: compiling {target.name} failed: {shlex.join(cmd)}") from exc
        os.replace(tmp, target)  # atomic: a running worker never sees a half-written library


class BuildPyWithShim(build_py):
    """build_py that also compiles csrc/ (into the source tree for editable installs)."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            build_native(ROOT / "ftrun" / "_native")
        else:
            build_native(Path(self.build_lib) / "ftrun" / "_native")


class NativeDistribution(Distribution):
    """The wheel carries a native library: tag it for the platform, not as pure Python."""

    def has_ext_modules(self) -> bool:
        return True


setup(cmdclass={"build_py": BuildPyWithShim}, distclass=NativeDistribution)
