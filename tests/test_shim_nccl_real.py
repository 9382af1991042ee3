"""The shim against the real libnccl.so.2 and nccl.h of the nvidia-nccl wheel (no GPU needed).

Needs the wheel installed (`pip install nvidia-nccl-cu13==2.30.7`, in the `test` extra).
Extra headers, e.g. a newer release's nccl.h, can be checked too: FTRUN_NCCL_HEADERS=a.h:b.h,
or FTRUN_TEST_DOWNLOAD_NCCL=2.32.3 to fetch that wheel with pip (about 300 MB) and check its
header and library.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import ftrun.shim as shim
from tests.shim_helpers import CFLAGS, CSRC, HERE, Build, Proc, build_all, have_cc, wait_until

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux-only"),
    pytest.mark.skipif(not have_cc(), reason="needs a C compiler (cc)"),
    pytest.mark.timeout(300),
]


def _wheel_nccl() -> Path | None:
    try:
        import nvidia.nccl  # type: ignore[import-not-found]
    except ImportError:
        return None
    for base in map(Path, nvidia.nccl.__path__):
        if (base / "lib" / "libnccl.so.2").is_file() and (base / "include" / "nccl.h").is_file():
            return base
    return None


NCCL = _wheel_nccl()


@pytest.fixture(scope="module")
def nccl_wheel() -> Path:
    """The nvidia-nccl-cu13 wheel's directory. The wheel is a test dependency (pyproject's
    ``test`` extra, which scripts/test.sh installs): without it the tests that need it fail,
    naming the install, rather than skip."""
    if NCCL is None:
        pytest.fail("nvidia-nccl-cu13 is not installed: pip install -e '.[test]'")
    return NCCL


needs_wheel = pytest.mark.usefixtures("nccl_wheel")

# Exported pnccl functions deliberately not interposed, and why. A release that adds an
# exported function not listed here nor in the shim's table fails test_table_covers_exports.
NOT_INTERPOSED = {
    # no communicator involved
    "MemAlloc": "no communicator", "MemFree": "no communicator",
    "ResetDebugInit": "no communicator", "SetEncryption": "no communicator (2.32)",
    "ParamBind": "no communicator", "ParamDumpAll": "no communicator",
    "ParamGet": "no communicator", "ParamGetAllParameterKeys": "no communicator",
    "ParamGetI8": "no communicator", "ParamGetI16": "no communicator",
    "ParamGetI32": "no communicator", "ParamGetI64": "no communicator",
    "ParamGetU8": "no communicator", "ParamGetU16": "no communicator",
    "ParamGetU32": "no communicator", "ParamGetU64": "no communicator",
    "ParamGetStr": "no communicator", "ParamGetParameter": "no communicator",
    "LLA2ACalcSlots": "no communicator", "LLA2ACreateRequirement": "no communicator",
    # device-API host helpers on windows/teams: setup-time calls made while the communicator
    # is live; several return structs by value whose layout the shim does not declare, and the
    # address-keyed registry passes the real handle through, so they keep working unwrapped
    "GetLsaDevicePointer": "window, not communicator",
    "GetLsaMultimemDevicePointer": "window, not communicator",
    "GetMultimemDevicePointer": "window, not communicator",
    "GetPeerDevicePointer": "window, not communicator",
    "GetCftDeviceLeInfo": "window, not communicator (2.32)",
    "GetMultimemDeviceLeInfo": "window, not communicator (2.32)",
    "GetPeerDeviceLeInfo": "window, not communicator (2.32)",
    "TeamWorld": "returns ncclTeam_t by value", "TeamLsa": "returns ncclTeam_t by value",
    "TeamRail": "returns ncclTeam_t by value", "TeamCft": "returns ncclTeam_t by value",
    "TeamCftMultimem": "returns ncclTeam_t by value",
    "TeamRankToWorld": "takes ncclTeam_t by value", "TeamRankToLsa": "takes ncclTeam_t by value",
    "GinBarrierCreateRequirement": "takes ncclTeam_t by value",
    "LsaBarrierCreateRequirement": "takes ncclTeam_t by value",
    "GinOutboxCreateRequirement": "device-API requirement builder",
    "GinInboxA2ACreateRequirement": "device-API requirement builder",
}  # fmt: skip

TABLE = {name[len("nccl") :] for name in shim.FUNCTION_NAMES}


def _extra_nccl_dirs(tmp_root: Path) -> list[Path]:
    """Other releases to check: FTRUN_TEST_DOWNLOAD_NCCL=<version> fetches the cu13 wheel."""
    version = os.environ.get("FTRUN_TEST_DOWNLOAD_NCCL")
    if not version:
        return []
    dest = tmp_root / f"nccl-{version}"
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest),
                    f"nvidia-nccl-cu13=={version}"], check=True)  # fmt: skip
    (wheel,) = dest.glob("*.whl")
    with zipfile.ZipFile(wheel) as zf:
        for member in ("nvidia/nccl/include/nccl.h", "nvidia/nccl/lib/libnccl.so.2"):
            zf.extract(member, dest)
    return [dest / "nvidia" / "nccl"]


@pytest.fixture(scope="module")
def nccl_dirs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    dirs = [NCCL] if NCCL is not None else []
    dirs += _extra_nccl_dirs(tmp_path_factory.mktemp("nccl-dl"))
    if not dirs:
        pytest.fail("no real NCCL: nvidia-nccl-cu13 is not installed (pip install -e '.[test]')")
    return dirs


def _headers(dirs: list[Path]) -> list[Path]:
    extra = [Path(p) for p in os.environ.get("FTRUN_NCCL_HEADERS", "").split(":") if p]
    return [d / "include" / "nccl.h" for d in dirs] + extra


def _prototypes(header: Path) -> dict[str, str]:
    """{name: parameter list} of every ncclX function prototype in nccl.h (not pnccl)."""
    text = re.sub(r"/\*.*?\*/", " ", header.read_text(), flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    out = {}
    proto = r"\b(?:ncclResult_t|const\s+char\s*\*|void)\s+(nccl\w+)\s*\(([^;{]*?)\)\s*;"
    for m in re.finditer(proto, text):
        out[m.group(1)] = " ".join(m.group(2).split())
    return out


# ---- coverage -------------------------------------------------------------------------------
@needs_wheel
def test_table_covers_header(nccl_dirs: list[Path]) -> None:
    """Every nccl.h function that takes or creates a communicator is in the shim's table."""
    for header in _headers(nccl_dirs):
        protos = _prototypes(header)
        assert len(protos) > 40, header
        comm_fns = {n[len("nccl") :] for n, params in protos.items() if "ncclComm_t" in params}
        missing = sorted(comm_fns - TABLE)
        assert not missing, f"{header}: communicator functions not interposed: {missing}"


@needs_wheel
@pytest.mark.skipif(shutil.which("nm") is None, reason="needs nm (binutils)")
def test_table_covers_exports(nccl_dirs: list[Path]) -> None:
    """Every function the library exports is interposed or listed in NOT_INTERPOSED."""
    for d in nccl_dirs:
        out = subprocess.run(["nm", "-D", "--defined-only", str(d / "lib" / "libnccl.so.2")],
                             capture_output=True, text=True, check=True).stdout  # fmt: skip
        exported = {m.group(1) for m in re.finditer(r" T pnccl(\w+)$", out, flags=re.M)}
        assert len(exported) > 50
        unknown = sorted(exported - TABLE - set(NOT_INTERPOSED))
        assert not unknown, f"{d}: new NCCL functions, decide whether to interpose: {unknown}"
        # and each ncclX is a weak alias of pnccl (the shape the shim relies on)
        weak = {m.group(1) for m in re.finditer(r" W nccl(\w+)$", out, flags=re.M)}
        assert TABLE & exported <= weak


# ---- ABI: the shim's own declarations against the real header --------------------------------
STUB_CUDA = """
#ifndef STUB_CUDA_RUNTIME_H
#define STUB_CUDA_RUNTIME_H
#include <stddef.h>
typedef struct CUstream_st* cudaStream_t;
typedef struct CUevent_st* cudaEvent_t;
#endif
"""

ABI_PROBE = r"""
#include <stddef.h>
#include <stdio.h>
#include HEADER
int main(void) {
  printf("results %d %d %d %d %d %d %d %d %d\n", ncclSuccess, ncclUnhandledCudaError,
         ncclSystemError, ncclInternalError, ncclInvalidArgument, ncclInvalidUsage,
         ncclRemoteError, ncclInProgress, ncclTimeout);
  printf("sizes %zu %zu %zu %zu %zu\n", sizeof(ncclUniqueId), sizeof(ncclResult_t),
         sizeof(ncclComm_t), sizeof(ncclRedOp_t), sizeof(ncclDataType_t));
  printf("config %zu %zu %zu %zu %u\n", CFG_OFF(size), CFG_OFF(magic), CFG_OFF(version),
         CFG_OFF(blocking), (unsigned)API_MAGIC);
  return 0;
}
"""


def _run_probe(tmp: Path, name: str, header: str, cfg_type: str, magic: str,
               include: list[Path]) -> str:  # fmt: skip
    src = tmp / f"{name}.c"
    src.write_text(f'#define HEADER "{header}"\n'
                   f"#define CFG_OFF(f) offsetof({cfg_type}, f)\n#define API_MAGIC {magic}\n"
                   + ABI_PROBE)  # fmt: skip
    exe = tmp / name
    subprocess.run(["cc", *[f"-I{i}" for i in include], "-o", str(exe), str(src)], check=True)
    return subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout


@needs_wheel
def test_shim_types_match_real_header(nccl_dirs: list[Path], tmp_path: Path) -> None:
    (tmp_path / "cuda_runtime.h").write_text(STUB_CUDA)
    (tmp_path / "cuda_fp16.h").write_text("/* stub */\n")
    ours = _run_probe(tmp_path, "ours", "ftshim_nccl_types.h", "ftshim_nccl_config_head",
                      "FTSHIM_NCCL_API_MAGIC", [CSRC])  # fmt: skip
    for header in _headers(nccl_dirs):
        theirs = _run_probe(tmp_path, "theirs", "nccl.h", "ncclConfig_t", "NCCL_API_MAGIC",
                            [tmp_path, header.parent])  # fmt: skip
        assert theirs == ours, f"{header}:\n{theirs}\nvs the shim's:\n{ours}"
    assert "config 0 8 12 16 3405692655" in ours  # blocking at offset 16, magic 0xcafebeef


@needs_wheel
def test_table_prototypes_match_real_header(nccl_dirs: list[Path], tmp_path: Path) -> None:
    """Compile the table's parameter lists against the real declarations: any difference in a
    parameter type is an incompatible-pointer error."""
    (tmp_path / "cuda_runtime.h").write_text(STUB_CUDA)
    (tmp_path / "cuda_fp16.h").write_text("/* stub */\n")
    for header in _headers(nccl_dirs):
        present = {n[len("nccl") :] for n in _prototypes(header)}
        lines = [f'#include "{header}"', f'#include "{CSRC / "ftshim_table.h"}"']
        for kind in ("PASS", "GSTART", "GEND", "INIT", "INIT_ALL", "DERIVE", "COLL", "P2P", "OP",
                     "QUERY", "COUNT", "URANK", "CUDEV", "ASYNC", "CLEANUP", "FINALIZE",
                     "RELEASE"):  # fmt: skip
            lines.append(f"#define RET_{kind} ncclResult_t")
        lines += ["#define RET_PASS_STR const char*", "#define RET_LASTERR const char*"]
        for name in TABLE:
            body = "x" if name in present else ""
            lines.append(f"#define IF_{name}(x) {body}")
        lines.append("#define X(kind, name, since, params, args, c, a1, a2) "
                     "IF_##name(RET_##kind (*chk_##name) params = nccl##name;)")  # fmt: skip
        lines.append("FTSHIM_NCCL_TABLE(X)")
        lines.append("int main(void) { return 0; }")
        src = tmp_path / "protos.c"
        src.write_text("\n".join(lines) + "\n")
        proc = subprocess.run(["cc", "-std=gnu11", "-Werror", "-Wall", f"-I{tmp_path}",
                               f"-I{CSRC}", "-c", "-o", str(tmp_path / "protos.o"), str(src)],
                              capture_output=True, text=True)  # fmt: skip
        assert proc.returncode == 0, f"{header}:\n{proc.stderr[-4000:]}"
        checked = len(TABLE & present)
        print(f"\n{header}: {checked} table prototypes identical to the real ones")
        assert checked >= 45


# ---- forwarding under RTLD_LOCAL with the real library --------------------------------------
@pytest.fixture(scope="module")
def real_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[Build, Path]:
    assert NCCL is not None
    root = tmp_path_factory.mktemp("shim-real")
    build = build_all(root, False)
    lib = root / "libreal_user.so"
    libdir = NCCL / "lib"
    subprocess.run(["cc", *CFLAGS, "-shared", f"-I{CSRC}", "-o", str(lib),
                    str(HERE / "real_user.c"), f"-L{libdir}", "-l:libnccl.so.2",
                    f"-Wl,-rpath,{libdir}"], check=True)  # fmt: skip
    return build, lib


@needs_wheel
def test_forwarding_to_real_nccl_loaded_rtld_local(real_build: tuple[Build, Path],
                                                   tmp_path: Path) -> None:  # fmt: skip
    build, user = real_build
    base = {k: v for k, v in os.environ.items() if not k.startswith("FTRUN_SHIM")}
    base.pop("LD_PRELOAD", None)
    direct = Proc([str(build.worker), str(user), "x"], base)
    try:
        expected = direct.finish()[1]
    finally:
        direct.kill()
    assert expected.startswith("REAL 0 230"), expected  # 2.30+ / newer
    with shim.ShimControl(label="real", library=build.shim) as ctl:
        env = ctl.worker_env(base)
        env["LD_DEBUG"] = "bindings"  # the dynamic linker says who answers each call
        env["LD_DEBUG_OUTPUT"] = str(tmp_path / "bindings")
        p = Proc([str(build.worker), str(user), "x"], env, stdin=True)
        ctl.bind(p.pid)
        try:
            p.expect("ERRSTR")
            # the shim found the RTLD_LOCAL library by soname (its thread probes once loaded)
            wait_until(lambda: shim.read_page(ctl.path).nccl_version, 5, "NCCL version probe")
            status = ctl.status()
            p.send("\n")
            rc, out, err = p.finish()
        finally:
            p.kill()
        out = "\n".join(p.lines) + "\n"
        assert rc == 0, err[-3000:]
        assert out.splitlines()[0].split()[:3] == expected.splitlines()[0].split()[:3]
        assert out.splitlines()[1] == expected.splitlines()[1]  # same error string
        (log,) = tmp_path.glob("bindings.*")
        bindings = log.read_text()
        for fn in ("ncclGetVersion", "ncclGetUniqueId", "ncclGetErrorString"):
            assert re.search(rf"libreal_user\.so .*to .*libftrun_shim\.so.*`{fn}'", bindings), fn
        version = int(expected.split()[2])
        assert status["state"] == "active"
        assert status["nccl_version"] == shim._version_str(version)
        assert ("revoke" in status["caps"]) == (version >= 22807)
