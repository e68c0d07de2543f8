"""CI without a GPU: every csrc/*.cu compiles for sm_90a and sm_121a and the objects hold SASS for both; the kernels'
lane decoder, compiled for the host, is bit-exact with the Python reference; tools/check-cubins behaves.

Skips when nvcc/cuobjdump are missing, unless VLLM_EXL3_REQUIRE_TOOLS=1 (CI sets it). cuobjdump comes from the
CUDA toolkit or `pip install nvidia-cuda-cuobjdump` (the `test` extra).
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from vllm_exl3.format import reference as R
from vllm_exl3.format import constants as C
from vllm_exl3.format.constants import CODEBOOKS

ROOT = Path(__file__).resolve().parents[3]
CSRC = ROOT / "csrc"
CHECK_CUBINS = ROOT / "tools" / "check-cubins"
ARCHS = ("sm_90a", "sm_121a")
sys.path.insert(0, str(ROOT))
import setup as build_setup  # noqa: E402  (setup.py: the flags the extension is built with)

NVCC_FLAGS = [build_setup.CXX_STD, "-O3", f"-I{CSRC}"]


def _tool(name: str) -> str | None:
    if found := shutil.which(name):
        return found
    for root in filter(None, (os.environ.get("CUDA_HOME"), "/usr/local/cuda")):
        if (p := Path(root) / "bin" / name).is_file():
            return str(p)
    try:
        import nvidia

        for base in map(Path, nvidia.__path__):
            for p in sorted(base.glob(f"*/bin/{name}")):
                return str(p)
    except ImportError:
        pass
    return None


def _require(name: str) -> str:
    path = _tool(name)
    if path is None:
        if os.environ.get("VLLM_EXL3_REQUIRE_TOOLS") == "1":
            pytest.fail(f"{name} not found (VLLM_EXL3_REQUIRE_TOOLS=1)")
        pytest.skip(f"{name} not found")
    return path


@pytest.fixture(scope="module")
def objects(tmp_path_factory) -> dict[str, Path]:
    """Every csrc/*.cu compiled to an object with SASS for both targets (in parallel: this is the slow part)."""
    nvcc = _require("nvcc")
    out = tmp_path_factory.mktemp("cu")
    gencode = [f"-gencode=arch=compute_{a[3:]},code={a}" for a in ARCHS]

    def compile_one(src: Path) -> tuple[str, Path]:
        obj = out / (src.stem + ".o")
        r = subprocess.run([nvcc, *NVCC_FLAGS, *gencode, "-c", str(src), "-o", str(obj)], capture_output=True,
                           text=True)
        assert r.returncode == 0, f"nvcc failed on {src.name}:\n{r.stderr[-4000:]}"
        return src.name, obj

    sources = sorted(CSRC.glob("*.cu"))
    assert sources, "no CUDA sources"
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        return dict(pool.map(compile_one, sources))


def test_every_kernel_file_builds_sass_for_hopper_and_spark(objects):
    cuobjdump = _require("cuobjdump")
    for name, obj in objects.items():
        listing = subprocess.run([cuobjdump, "--list-elf", str(obj)], capture_output=True, text=True, check=True).stdout
        for arch in ARCHS:
            assert f".{arch}.cubin" in listing, f"{name}: no {arch} SASS in\n{listing}"


def test_check_cubins_script(objects):
    _require("cuobjdump")
    obj = str(next(iter(objects.values())))
    env = dict(os.environ, PATH=os.pathsep.join(filter(None, [str(Path(_tool("cuobjdump")).parent),
                                                                os.environ.get("PATH")])))
    ok = subprocess.run([sys.executable, str(CHECK_CUBINS), obj, "sm_121a", "sm_90a"], capture_output=True, text=True,
                        env=env)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    missing = subprocess.run([sys.executable, str(CHECK_CUBINS), obj, "sm_100a"], capture_output=True, text=True,
                             env=env)
    assert missing.returncode == 1 and "sm_121a" in missing.stdout and "sm_90a" in missing.stdout, missing.stdout
    usage = subprocess.run([sys.executable, str(CHECK_CUBINS), obj, "121a"], capture_output=True, text=True, env=env)
    assert usage.returncode == 2


@pytest.fixture(scope="module")
def decode_host(tmp_path_factory) -> Path:
    """tests/kernels/csrc/decode_host.cpp: the kernels' decode header compiled for the CPU."""
    nvcc = _require("nvcc")
    exe = tmp_path_factory.mktemp("host") / "decode_host"
    r = subprocess.run([nvcc, *NVCC_FLAGS, "-x", "c++", str(ROOT / "tests" / "kernels" / "csrc" / "decode_host.cpp"), "-o",
                        str(exe)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    return exe


def test_kernel_constants_match_the_python_table(tmp_path):
    """csrc's format constants (exl3_decode.cuh, the codebook indices of exl3_kernels.h) are format/constants.py's
    CSRC_DECODE_CONSTANTS, and the decoder's per-codebook multiplier/addend are the ones that table names."""
    nvcc = _require("nvcc")
    exe = tmp_path / "constants_host"
    r = subprocess.run([nvcc, *NVCC_FLAGS, "-x", "c++", str(ROOT / "tests" / "kernels" / "csrc" / "constants_host.cpp"),
                        "-o", str(exe)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    lines = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.splitlines()
    got = {name: float(value) if "." in value else int(value) for name, value in (ln.rsplit(" ", 1) for ln in lines)}
    for name, value in C.CSRC_DECODE_CONSTANTS.items():
        assert got.pop(name) == value, name
    mul = {C.CODEBOOK_3INST: C.INST3_MUL, C.CODEBOOK_MCG: C.MARKER_VALUE[C.CODEBOOK_MCG],
           C.CODEBOOK_MUL1: C.MARKER_VALUE[C.CODEBOOK_MUL1]}
    add = {C.CODEBOOK_3INST: C.INST3_ADD, C.CODEBOOK_MCG: 0, C.CODEBOOK_MUL1: 0}
    for i, cb in enumerate(CODEBOOKS):
        assert got.pop(f"codebook_mul({i})") == mul[cb] and got.pop(f"codebook_add({i})") == add[cb], cb
    assert not got, f"printed but not in the table: {sorted(got)}"


MB = 1 << 20
PLANNER_CASES = [  # (arch major, L2 bytes, rows, W' bytes, active columns, skinny fits, panel fits) -> path, asked
    # H200, W' larger than L2: skinny <= 16, panel <= 64, original basis from a quarter of the columns
    ((9, 50 * MB, 1, 117 * MB, 14336, 1, 1), ("SKINNY", "s")),
    ((9, 50 * MB, 16, 117 * MB, 14336, 1, 1), ("SKINNY", "s")),
    ((9, 50 * MB, 17, 117 * MB, 14336, 1, 1), ("PANEL", "p")),
    ((9, 50 * MB, 64, 117 * MB, 14336, 1, 1), ("PANEL", "p")),
    ((9, 50 * MB, 65, 117 * MB, 14336, 1, 1), ("RECONSTRUCT", "-")),
    ((9, 50 * MB, 3584, 117 * MB, 14336, 1, 1), ("RECON_ORIGINAL", "-")),
    # W' in L2: 8 / 16
    ((9, 50 * MB, 8, 32 * MB, 4096, 1, 1), ("SKINNY", "s")),
    ((9, 50 * MB, 9, 32 * MB, 4096, 1, 1), ("PANEL", "p")),
    ((9, 50 * MB, 17, 32 * MB, 4096, 1, 1), ("RECONSTRUCT", "-")),
    ((9, 50 * MB, 1024, 32 * MB, 4096, 1, 1), ("RECON_ORIGINAL", "-")),
    # sm_12x: no L2 rule, 16 / 256
    ((12, 24 * MB, 8, 8 * MB, 4096, 1, 1), ("SKINNY", "s")),
    ((12, 24 * MB, 256, 8 * MB, 4096, 1, 1), ("PANEL", "p")),
    ((12, 24 * MB, 257, 8 * MB, 4096, 1, 1), ("RECONSTRUCT", "-")),
    # a kernel that cannot run on the device is skipped
    ((9, 50 * MB, 4, 117 * MB, 14336, 0, 1), ("PANEL", "sp")),
    ((9, 50 * MB, 4, 117 * MB, 14336, 0, 0), ("RECONSTRUCT", "sp")),
]


def host_planner(tmp_path, harness: str, source: str):
    """tests/kernels/csrc/`harness` linked with csrc/`source` for the host: a function of cases (one stdin line
    each) and environment overrides (every other VLLM_EXL3_ variable unset) to the output lines' fields."""
    nvcc = _require("nvcc")
    exe = tmp_path / Path(harness).stem
    r = subprocess.run([nvcc, *NVCC_FLAGS, "-x", "c++", str(ROOT / "tests" / "kernels" / "csrc" / harness),
                        "-x", "c++", str(CSRC / source), "-o", str(exe)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]

    def run(cases, **env):
        stdin = "".join(" ".join(map(str, c)) + "\n" for c in cases)
        environ = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_EXL3_")} | env
        out = subprocess.run([str(exe)], input=stdin, capture_output=True, text=True, check=True, env=environ).stdout
        return [ln.split() for ln in out.splitlines()]

    return run


def test_planner_picks_the_documented_paths(tmp_path):
    """csrc/planner.cpp compiled for the host: `auto`'s choice per architecture, layer size and row count, the
    per-device fit asked only for a kernel the rows would take, and the environment overrides."""
    from vllm_exl3.kernels.backends.native import NativePath

    host = host_planner(tmp_path, "planner_host.cpp", "planner.cpp")

    def run(cases, **env):
        return [(NativePath(int(p)).name, asked) for p, asked in host(cases, **env)]

    assert run([c for c, _ in PLANNER_CASES]) == [e for _, e in PLANNER_CASES]
    overridden = run([(9, 50 * MB, 40, 117 * MB, 14336, 1, 1), (9, 50 * MB, 100, 117 * MB, 14336, 1, 1),
                      (9, 50 * MB, 5000, 117 * MB, 14336, 1, 1)],
                     VLLM_EXL3_SKINNY_MAX_ROWS="50", VLLM_EXL3_PANEL_MAX_ROWS="100", VLLM_EXL3_ORIGINAL_MIN_ROWS="9999")
    assert overridden == [("SKINNY", "s"), ("PANEL", "p"), ("RECONSTRUCT", "-")]


# (tokens, top-k, experts, hidden, intermediate, SMs) -> (rows per chunk, splits13 x splits2). The H100 rows are the
# split pairs its sweep measured fastest or within 5 % of it (bench/notes/serving-run-17.md "Seventeenth run").
MOE_PLAN_CASES = [
    *(((t, 8, 128, 2048, 768, 132), (8, s)) for t, s in  # Qwen3-30B-A3B
      [(1, "4x2"), (2, "4x2"), (3, "4x2"), (4, "3x2"), (5, "2x1"), (6, "2x1"), (8, "1x1"), (16, "1x1"), (32, "1x1")]),
    *(((t, 8, 128, 4096, 1408, 132), (8, s)) for t, s in [(1, "4x3"), (2, "3x2"), (3, "2x1"), (4, "1x1")]),  # GLM-4.5-Air
    ((33, 8, 128, 2048, 768, 132), (8, "1x1")),  # past 256 routed pairs: no split slots
    ((1, 8, 128, 512, 256, 132), (8, "1x1")),  # K of 4 and 2 128-blocks: no split gets 3
    ((1, 8, 128, 2048, 768, 48), (8, "4x2")),  # a GB10's 48 SMs (not measured there)
    ((4, 8, 128, 2048, 768, 48), (8, "1x1")),
    ((600, 8, 128, 2048, 768, 132), (64, "1x1")),
]


def test_moe_planner_splits_and_workspace(tmp_path):
    """csrc/moe_planner.cpp compiled for the host: the MoE op's split choice at decode sizes, and every chunk plan's
    workspace, with the most splits a bench may force (VLLM_EXL3_MOE_SPLITS13/2), within what moe_reserve_bytes
    reserves for the call."""
    host = host_planner(tmp_path, "moe_planner_host.cpp", "moe_planner.cpp")

    def run(cases, **env):
        return [tuple(map(int, fields)) for fields in host(cases, **env)]

    def splits(plans):
        return [(rows, f"{s13}x{s2}") for rows, _, s13, s2, *_ in plans]

    assert splits(run([c for c, _ in MOE_PLAN_CASES])) == [e for _, e in MOE_PLAN_CASES]
    # a bench's forced splits: clamped to 4 and to the K range's 128-blocks, none past 256 pairs
    forced = run([(3, 8, 128, 2048, 768, 132), (1, 8, 128, 512, 256, 132), (33, 8, 128, 2048, 768, 132)],
                 VLLM_EXL3_MOE_SPLITS13="3", VLLM_EXL3_MOE_SPLITS2="9")
    assert splits(forced) == [(8, "3x4"), (8, "3x2"), (8, "1x1")]
    sweep = [(t, k, e, h, i, sms) for t in (*range(1, 41), 100, 257, 1024, 3000) for k in (1, 2, 4, 8)
             for e, h, i in ((8, 256, 384), (128, 2048, 768), (128, 4096, 1408), (512, 2048, 512), (256, 7168, 2048))
             for sms in (48, 132)]
    for case, (rows, bound, s13, s2, planned, forced, reserved) in zip(sweep, run(sweep)):
        assert rows in (8, 16, 64) and bound >= 1 and 1 <= s13 <= 4 and 1 <= s2 <= 4, case
        assert planned <= reserved and forced <= reserved, case


WIDTHS = [(cb, bits2) for cb in CODEBOOKS for bits2 in (2, 4, 6, 8, 10, 12, 14, 16)] + [
    ("mul1", 3), ("mul1", 5), ("mul1", 7)]


@pytest.mark.parametrize("codebook,bits2", WIDTHS, ids=[f"{c}-{b / 2:g}b" for c, b in WIDTHS])
def test_lane_decoder_matches_reference(decode_host, codebook, bits2):
    """Every lane's 8 states (§1.4/§1.5 windows) and codewords (§2) against reference.trellis_states / the LUT."""
    tiles = 16
    g = torch.Generator().manual_seed(1000 + bits2 * 3 + CODEBOOKS.index(codebook))
    trellis = torch.randint(-(2**15), 2**15, (1, tiles, 8 * bits2), dtype=torch.int16, generator=g)
    inp = struct.pack("3i", bits2, CODEBOOKS.index(codebook), tiles) + trellis.numpy().tobytes()
    out = subprocess.run([str(decode_host)], input=inp, capture_output=True, check=True).stdout
    got = np.frombuffer(out, dtype=np.uint32).reshape(tiles, 32, 8, 2)

    positions = [R.tile_position(t) for t in range(256)]
    rows = torch.tensor([p[0] for p in positions]).view(32, 8)
    cols = torch.tensor([p[1] for p in positions]).view(32, 8)
    ref_states = R.trellis_states(trellis)[0][:, rows, cols]  # [tiles, lane, j]
    states = torch.from_numpy(got[..., 0].astype(np.int64))
    assert torch.equal(states, ref_states), f"{int((states != ref_states).sum())} states differ"

    cw = got[..., 1]
    lut = R.codebook_lut(codebook).float()[ref_states]
    if codebook == "mul1":  # fp16(1024 + bytesum) in the low half, 0 above; the value is one affine step away
        assert (cw >> 16 == 0).all()
        v = (torch.from_numpy((cw & 0xFFFF).astype(np.int64)) - 0x6400 + R.MUL1_BYTE_SUM_BASE).float()
        value = (v * R.MUL1_INV_SCALE + R.MUL1_BIAS).half().float()
    else:  # two fp16 halves whose sum, rounded once, is the value
        lo = torch.from_numpy((cw & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float32))
        hi = torch.from_numpy((cw >> 16).astype(np.uint16).view(np.float16).astype(np.float32))
        value = (lo + hi).half().float()
    assert torch.equal(value, lut)


def test_fast_division_matches_integer_division(tmp_path):
    """exl3::FastDiv (skinny kernel bookkeeping) equals n / d and n % d for n < 2^31, divisors 1 .. 2^31 - 1."""
    nvcc = _require("nvcc")
    exe = tmp_path / "fast_div_host"
    r = subprocess.run([nvcc, *NVCC_FLAGS, "-x", "c++", str(ROOT / "tests" / "kernels" / "csrc" / "fast_div_host.cpp"), "-o",
                        str(exe)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    out = subprocess.run([str(exe)], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("ok "), out.stdout + out.stderr
    assert int(out.stdout.split()[1]) > 10_000_000


def test_stream_k_bookkeeping_matches_integer_forms(tmp_path):
    """The skinny kernel's division-free block ranges and group-to-block mapping equal the host's exact forms."""
    nvcc = _require("nvcc")
    exe = tmp_path / "stream_k_host"
    r = subprocess.run([nvcc, *NVCC_FLAGS, str(ROOT / "tests" / "kernels" / "csrc" / "stream_k_host.cu"), "-o", str(exe)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    out = subprocess.run([str(exe)], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("ok "), out.stdout + out.stderr
    assert int(out.stdout.split()[1]) > 100_000
