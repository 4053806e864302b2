"""Build of kvcache._native: one pybind11 module, CPU twin always, CUDA kernels when nvcc works.

KVCACHE_BUILD_CUDA=auto (default) builds the kernels when nvcc runs, 1 insists (and fails
loudly without nvcc), 0 skips them. KVCACHE_CUDA_ARCHS sets the targets (default "90",
plus PTX of the highest so newer GPUs JIT it), e.g. "80;90". CUDA's home is asked of nvcc
itself (``nvcc -v --dryrun`` prints TOP=...), because the nvcc on PATH may be a wrapper.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent.resolve()
CSRC = ROOT / "csrc"


def _log(msg: str) -> None:
    print(f"[kvcache build] {msg}", file=sys.stderr, flush=True)


def _find_nvcc() -> str | None:
    explicit = os.environ.get("NVCC")
    if explicit:
        return explicit
    return shutil.which("nvcc")


def _cuda_home(nvcc: str) -> Path:
    out = subprocess.run(
        [nvcc, "-v", "--dryrun", "-x", "cu", os.devnull],
        capture_output=True,
        text=True,
        check=False,
    )
    text = out.stdout + out.stderr
    match = re.search(r"^#\$ TOP=(.+)$", text, re.MULTILINE)
    if not match:
        raise RuntimeError(f"could not ask {nvcc} for CUDA's home; output was:\n{text}")
    return Path(match.group(1).strip()).resolve()


def _cuda_mode() -> str:
    mode = os.environ.get("KVCACHE_BUILD_CUDA", "auto").strip().lower()
    if mode not in {"auto", "1", "0"}:
        raise RuntimeError(f"KVCACHE_BUILD_CUDA must be auto, 1 or 0, not {mode!r}")
    return mode


def _gencode_flags() -> list[str]:
    archs = [a.strip() for a in os.environ.get("KVCACHE_CUDA_ARCHS", "90").split(";") if a.strip()]
    flags: list[str] = []
    for arch in archs:
        flags += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
    flags += ["-gencode", f"arch=compute_{archs[-1]},code=compute_{archs[-1]}"]
    return flags


class BuildNative(build_ext):
    """Compiles the .cu file with nvcc into an object the pybind module links."""

    def build_extensions(self) -> None:
        mode = _cuda_mode()
        nvcc = _find_nvcc() if mode != "0" else None
        use_cuda = False
        if mode == "1" and nvcc is None:
            raise RuntimeError("KVCACHE_BUILD_CUDA=1 but nvcc was not found on PATH (or $NVCC)")
        if nvcc is not None:
            try:
                home = _cuda_home(nvcc)
                use_cuda = True
            except (OSError, RuntimeError) as err:
                if mode == "1":
                    raise
                _log(f"nvcc unusable, building the CPU path only: {err}")
        for ext in self.extensions:
            if use_cuda:
                self._add_cuda(ext, nvcc, home)  # type: ignore[arg-type]
            else:
                ext.sources.append(str((CSRC / "kvc_cuda_stub.cpp").relative_to(ROOT)))
                _log("CUDA kernels not built (CPU twin only)")
        super().build_extensions()

    def _add_cuda(self, ext: Pybind11Extension, nvcc: str, home: Path) -> None:
        build_dir = Path(self.build_temp).resolve()
        build_dir.mkdir(parents=True, exist_ok=True)
        obj = build_dir / "kvc_cuda.o"
        cmd = [
            nvcc,
            "-c",
            str(CSRC / "kvc_cuda.cu"),
            "-o",
            str(obj),
            "-O3",
            "-std=c++17",
            "--compiler-options",
            "-fPIC",
            "-I",
            str(CSRC),
            *_gencode_flags(),
        ]
        _log(f"CUDA home {home}; " + " ".join(cmd))
        subprocess.run(cmd, check=True)
        lib_dirs = [home / "lib64", home / "lib", home / "targets" / "x86_64-linux" / "lib"]
        ext.extra_objects.append(str(obj))
        ext.library_dirs += [str(d) for d in lib_dirs if d.exists()]
        # Static cudart: the module imports on machines without the toolkit or a driver.
        ext.libraries += ["cudart_static", "dl", "rt", "pthread"]
        ext.define_macros.append(("KVCACHE_WITH_CUDA", "1"))


ext_modules = [
    Pybind11Extension(
        "kvcache._native",
        sources=[
            str(p.relative_to(ROOT))
            for p in (
                CSRC / "kvc_cpu.cpp",
                CSRC / "kvc_keys.cpp",
                CSRC / "kvc_lowered.cpp",
                CSRC / "bindings_pybind.cpp",
            )
        ],
        include_dirs=[str(CSRC)],
        # headers and the layout table: an edit to them must rebuild the module
        depends=[str(p.relative_to(ROOT)) for p in [*sorted(CSRC.glob("*.h")), CSRC / "layouts.def"]],
        extra_compile_args=["-O3", "-fopenmp"],
        extra_link_args=["-fopenmp"],
        cxx_std=17,
    )
]

setup(ext_modules=ext_modules, cmdclass={"build_ext": BuildNative})
