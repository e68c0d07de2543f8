"""Build hook for the optional CUDA extension `vllm_exl3.kernels._C`; everything else is in pyproject.toml.

A plain `pip install .` (or `-e .`) builds no extension and needs no CUDA toolkit: the plugin then runs on its torch
backend. The kernels are built only when asked:

    VLLM_EXL3_BUILD_CUDA=1 TORCH_CUDA_ARCH_LIST="9.0a;12.1a" pip install --no-build-isolation .

TORCH_CUDA_ARCH_LIST (default "9.0a;12.1a": H100/H200 and DGX Spark) lists the targets; each becomes one
`-gencode` with machine code (SASS) for exactly that architecture, "+PTX" adds PTX as well. `tools/check-cubins`
verifies a built library.
"""

from __future__ import annotations

import os
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent
CSRC = ROOT / "csrc"
DEFAULT_ARCHS = "9.0a;12.1a"
# torch 2.14's headers refuse anything older (`#error C++20 or later compatible compiler is required to use ATen`),
# and every torch the supported vLLM versions pin (2.12-2.14) accepts it; tests/kernels/csrc/test_torch_headers.py
# compiles the torch-facing files against the newest one.
CXX_STD = "-std=c++20"
# csrc/bindings.cpp defines Py_LIMITED_API (3.10): one `_C.abi3.so` serves every Python the package supports.
LIMITED_API_TAG = "cp310"


def gencode_flags(arch_list: str) -> tuple[list[str], str]:
    """'9.0a;12.1a+PTX' -> nvcc -gencode flags and a readable "sm_90a sm_121a+PTX" summary."""
    flags, names = [], []
    for item in arch_list.replace(",", ";").replace(" ", ";").split(";"):
        item = item.strip()
        if not item:
            continue
        ptx = item.endswith("+PTX")
        arch = item.removesuffix("+PTX").replace(".", "")  # "12.1a" -> "121a"
        if not arch[:-1 if arch.endswith(("a", "f")) else None].isdigit():
            raise ValueError(f"TORCH_CUDA_ARCH_LIST entry {item!r} is not like 9.0a or 12.1a")
        flags.append(f"-gencode=arch=compute_{arch},code=sm_{arch}")
        if ptx:
            flags.append(f"-gencode=arch=compute_{arch},code=compute_{arch}")
        names.append(f"sm_{arch}" + ("+PTX" if ptx else ""))
    if not flags:
        raise ValueError("TORCH_CUDA_ARCH_LIST names no architecture")
    return flags, " ".join(names)


def extension_args(arch_list: str | None = None) -> dict:
    """Sources and flags of vllm_exl3.kernels._C (also used by bench/device_run.sh's JIT build)."""
    gencode, names = gencode_flags(arch_list or os.environ.get("TORCH_CUDA_ARCH_LIST") or DEFAULT_ARCHS)
    # A bare token (no quotes or spaces to survive the build's shell); csrc/launch.cu turns it into a string.
    archs_define = "-DVLLM_EXL3_ARCHS=" + names.replace(" ", "__").replace("+", "_")
    return {
        "sources": sorted(str(p.relative_to(ROOT)) for p in [*CSRC.glob("*.cu"), *CSRC.glob("*.cpp")]),
        "include_dirs": [str(CSRC)],
        "libraries": ["cublas"],
        "archs": names,
        "cxx": ["-O3", CXX_STD, archs_define],
        # Our own -gencode flags also keep torch from parsing the arch list (it rejects arches it does not know).
        # No --use_fast_math: the Hadamard transforms and the mul1 epilogue rely on IEEE fp32.
        "nvcc": ["-O3", CXX_STD, "-lineinfo", archs_define, *gencode],
    }


def cuda_extensions():
    if os.environ.get("VLLM_EXL3_BUILD_CUDA", "0") != "1":
        return [], {}
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    a = extension_args()
    ext = CUDAExtension(name="vllm_exl3.kernels._C", sources=a["sources"], include_dirs=a["include_dirs"],
                        libraries=a["libraries"], extra_compile_args={"cxx": a["cxx"], "nvcc": a["nvcc"]},
                        py_limited_api=True)
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


if __name__ == "__main__":  # setuptools runs this file as __main__; importing it (device_run.sh) only reads flags
    ext_modules, cmdclass = cuda_extensions()
    options = {"bdist_wheel": {"py_limited_api": LIMITED_API_TAG}} if ext_modules else {}
    setup(ext_modules=ext_modules, cmdclass=cmdclass, options=options)
