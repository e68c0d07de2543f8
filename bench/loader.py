"""Cold-cache load throughput on a generated EXL3 MoE pack: raw reads, `safetensors`, our loader at 1..16 workers.

Targets (issue 6): the loader reaches >= 90% of the raw-read rate, and >= 3x its own single-worker rate where the
device has the parallelism. The pack is shaped like Qwen3-30B-A3B at 4 bits (128 experts of 2048x768 trellis
linears, a bf16 embedding of 151936x2048) with as many layers as `--size-gb` asks for, written as several shards
with an index. Every measurement starts from a cold page cache (see plugin/vllm_exl3/loader/load_bench.py) and
ends with every tensor copied to a destination on the target device (the GPU when there is one), as vLLM's weight
loaders do.
Before timing, the loader's tensors are checked byte-identical to `safetensors`' on that device.

Writes bench/results/<machine>-loader.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
from vllm_exl3.loader import load_bench as loadbench
from vllm_exl3.format.constants import TILE
from vllm_exl3.format.tensors import Exl3Weights
from vllm_exl3.format.units import GB
from vllm_exl3.loader.options import ReaderOptions
from vllm_exl3.loader.reader import read_tensors
from vllm_exl3.dev.synthetic import linear_tensors, random_weights, write_pack

HIDDEN, MOE_INTERMEDIATE, EXPERTS, VOCAB, BITS = 2048, 768, 128, 151936, 4
SHARD_TARGET_BYTES = 2 * 10**9
DEFAULT_WORKERS = ReaderOptions().workers


# ---------------------------------------------------------------------------------------------------------------
# The pack
# ---------------------------------------------------------------------------------------------------------------
def layer_tensors(layer: int) -> dict[str, torch.Tensor]:
    """One MoE layer: 128 experts x gate/up/down EXL3 linears (4 bits, mcg), attention, router, norms."""
    g = torch.Generator().manual_seed(layer)
    out = {}
    words = int(BITS * TILE)
    # one random draw per layer, split per expert: a pack of several GB generates in seconds
    trellis = torch.randint(-2**15, 2**15, (EXPERTS, 3, HIDDEN // TILE, MOE_INTERMEDIATE // TILE, words),
                            dtype=torch.int16, generator=g)
    template = random_weights(HIDDEN, MOE_INTERMEDIATE, BITS, "mcg", seed=layer)
    for e in range(EXPERTS):
        for p, name in enumerate(("gate_proj", "up_proj", "down_proj")):
            t = trellis[e, p].clone()
            if name == "down_proj":  # [K/16, N/16, words] with K and N swapped
                t = t.reshape(MOE_INTERMEDIATE // TILE, HIDDEN // TILE, words)
            suh, svh = (template.suh, template.svh) if name != "down_proj" else (template.svh, template.suh)
            w = Exl3Weights(t, suh.clone(), svh.clone(), "mcg", BITS)
            out.update(linear_tensors(f"model.layers.{layer}.mlp.experts.{e}.{name}", w))
    for name, (k, n) in (("q_proj", (HIDDEN, 4096)), ("k_proj", (HIDDEN, 512)), ("v_proj", (HIDDEN, 512)),
                         ("o_proj", (4096, HIDDEN))):
        out.update(linear_tensors(f"model.layers.{layer}.self_attn.{name}", random_weights(k, n, BITS, "mcg")))
    out[f"model.layers.{layer}.mlp.gate.weight"] = torch.randn(EXPERTS, HIDDEN, generator=g).bfloat16()
    for norm in ("input_layernorm", "post_attention_layernorm"):
        out[f"model.layers.{layer}.{norm}.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
    return out


def generate_pack(root: Path, size_gb: float) -> Path:
    embed = torch.randn(VOCAB, HIDDEN).bfloat16()
    per_layer = sum(t.nbytes for t in layer_tensors(0).values())
    layers = max(1, math.ceil((size_gb * GB - 2 * embed.nbytes) / per_layer))
    tensors = {"model.embed_tokens.weight": embed, "lm_head.weight": torch.randn(VOCAB, HIDDEN).bfloat16(),
               "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16)}
    for layer in range(layers):
        tensors.update(layer_tensors(layer))
    total = sum(t.nbytes for t in tensors.values())
    config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": HIDDEN,
              "moe_intermediate_size": MOE_INTERMEDIATE, "num_experts": EXPERTS, "num_hidden_layers": layers,
              "vocab_size": VOCAB}
    write_pack(root, tensors, config, shards=max(2, math.ceil(total / SHARD_TARGET_BYTES)))
    for path in root.glob("*.safetensors"):  # dirty pages cannot be dropped: make them clean
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    return root


# ---------------------------------------------------------------------------------------------------------------
# The machine
# ---------------------------------------------------------------------------------------------------------------
def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def describe_machine(data_dir: Path) -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in (_read("/proc/cpuinfo") or "").splitlines()
                if line.startswith("model name")), platform.processor() or platform.machine())
    mem = next((int(line.split()[1]) * 1024 for line in (_read("/proc/meminfo") or "").splitlines()
                if line.startswith("MemTotal")), None)
    # the block device and filesystem holding the pack
    st = os.stat(data_dir)
    dev = os.path.realpath(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    # a partition's queue settings live on its parent disk; overlay/tmpfs have no block device at all
    disk_dir = dev if os.path.exists(f"{dev}/queue") else os.path.dirname(dev)
    if not os.path.exists(f"{disk_dir}/queue"):
        disk_dir = ""
    disk = {"name": os.path.basename(disk_dir), "model": _read(f"{disk_dir}/device/model"),
            "rotational": _read(f"{disk_dir}/queue/rotational"),
            "logical_block_size": _read(f"{disk_dir}/queue/logical_block_size"),
            "max_sectors_kb": _read(f"{disk_dir}/queue/max_sectors_kb"),
            "read_ahead_kb": _read(f"{disk_dir}/queue/read_ahead_kb"),
            "nr_requests": _read(f"{disk_dir}/queue/nr_requests")} if disk_dir else None
    mounts = [line.split() for line in (_read("/proc/mounts") or "").splitlines()]
    real = os.path.realpath(data_dir)
    fs = max((m for m in mounts if len(m) > 2 and (real == m[1] or real.startswith(m[1].rstrip("/") + "/"))),
             key=lambda m: len(m[1]), default=None)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_bytes": mem, "kernel": platform.release(),
            "load_average_at_start": os.getloadavg(),
            "arch": platform.machine(), "gpu": gpu, "torch": torch.__version__, "python": platform.python_version(),
            "disk": disk, "filesystem": {"type": fs[2], "mount": fs[1], "device": fs[0]} if fs else None}


# ---------------------------------------------------------------------------------------------------------------
def verify(files, device: torch.device) -> int:
    """Every tensor the loader hands out on `device` equals safetensors' bytes; returns the tensor count."""
    from safetensors.torch import load_file

    count = 0
    for f in files:
        ref = load_file(str(f.path))
        for name, tensor in read_tensors([f], ReaderOptions(), device=device):
            a, b = ref.pop(name), tensor.cpu()
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert a.reshape(-1).view(torch.uint8).equal(b.reshape(-1).view(torch.uint8)), name
            count += 1
        assert not ref, f"{f.path}: the loader skipped {sorted(ref)[:3]}"
    return count


def summarize(samples: dict[str, list[float]], pairs: dict[str, list[dict]], workers: list[int],
              modes: list[str]) -> dict:
    """Medians per method, the median of per-pair loader/raw ratios, and the targets: best loader vs raw reads
    (paired, and as before from medians), vs one worker, vs safetensors."""
    gbps = {name: round(statistics.median(v), 3) if v else None for name, v in samples.items()}
    loader = {mode: {str(w): gbps[f"loader_{mode}_{w}"] for w in workers} for mode in modes}
    out = {"raw_sequential_gbps": gbps["raw_sequential"], "raw_sequential_fadvise_gbps": gbps["raw_sequential_fadvise"],
           "raw_direct_gbps": {"1": gbps["raw_direct_1"], str(max(workers)): gbps["raw_parallel_direct"]},
           "safetensors_gbps": gbps["safetensors"], "loader_gbps": loader}
    every = [p for per in pairs.values() for p in per]
    raw = loadbench.raw_method(every) if every else None
    if raw:
        out["raw_method"] = raw  # the pairs' reference: the faster single-stream raw read of this run
        out["loader_vs_raw"] = {mode: {str(w): (round(loadbench.pair_ratio(pairs[f"loader_{mode}_{w}"], raw), 3)
                                                if pairs[f"loader_{mode}_{w}"] else None) for w in workers}
                                for mode in modes}
    measured = [(m, w, v) for m, per in loader.items() for w, v in per.items() if v is not None]
    raws = [v for v in (gbps["raw_sequential"], gbps["raw_sequential_fadvise"], gbps["raw_parallel_direct"])
            if v is not None]
    if measured and raws:
        mode, w, best = max(measured, key=lambda x: x[2])
        one = loader[mode][str(min(workers))]
        best_pairs = pairs[f"loader_{mode}_{w}"]
        ratios = [p["loader"] / p[raw] for p in best_pairs]
        out["summary"] = {
            "best_loader": f"{mode}, {w} workers", "best_loader_gbps": best,
            "raw_gbps": max(raws),  # the best of dd-style sequential (plain, hinted) and parallel O_DIRECT reads
            "device_parallelism": (round(gbps["raw_parallel_direct"] / gbps["raw_direct_1"], 3)
                                   if gbps["raw_parallel_direct"] and gbps["raw_direct_1"] else None),
            "best_vs_raw": round(best / max(raws), 3),
            # the steadier figure: median over back-to-back pairs of best loader / the run's faster 1-stream read
            "best_vs_raw_paired": round(statistics.median(ratios), 3),
            "best_vs_raw_paired_range": [round(min(ratios), 3), round(max(ratios), 3)],
            "best_pairs": len(ratios),
            "best_loader_idle_s": statistics.median(p["loader_idle_s"] for p in best_pairs),
            # what users get: the default worker count (the best above is picked from noisy medians)
            "default_workers": DEFAULT_WORKERS,
            "default_vs_raw_paired": out["loader_vs_raw"].get("direct", {}).get(str(DEFAULT_WORKERS)),
            "best_vs_one_worker": round(best / one, 3) if one else None,
            "best_vs_safetensors": round(best / gbps["safetensors"], 3) if gbps["safetensors"] else None,
        }
    return out


def print_summary(result: dict) -> None:
    s = result.get("summary")
    if not s:
        print("no loader measurement finished")
        return
    raw = result["raw_method"]
    print(f"best loader: {s['best_loader']}, {s['best_loader_gbps']:.2f} GB/s (median); disk idle during its loads "
          f"{s['best_loader_idle_s']:.2f} s")
    print(f"vs raw ({raw}): {s['best_vs_raw_paired']:.0%} median of {s['best_pairs']} pairs (range "
          f"{s['best_vs_raw_paired_range'][0]:.0%}-{s['best_vs_raw_paired_range'][1]:.0%}); from medians vs the "
          f"best raw read incl. {max(result['raw_direct_gbps'], key=int)} O_DIRECT threads: {s['best_vs_raw']:.0%}")
    if s["default_vs_raw_paired"] is not None:
        print(f"default ({s['default_workers']} O_DIRECT workers) vs raw: {s['default_vs_raw_paired']:.0%} "
              "median of pairs")
    print(f"vs one worker: {s['best_vs_one_worker']}x; device parallelism (raw O_DIRECT N/1 threads): "
          f"{s['device_parallelism']}x; vs safetensors: {s['best_vs_safetensors']}x")
    for mode, per in result["loader_vs_raw"].items():
        print(f"  {mode}: " + ", ".join(f"{w} workers {result['loader_gbps'][mode][w]} GB/s = {r:.0%}"
                                        for w, r in per.items() if r is not None))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=6.0, help="pack size to generate (10^9 bytes)")
    ap.add_argument("--dir", type=Path, default=Path(".loader-bench"), help="where the pack is written")
    ap.add_argument("--pack", type=Path, help="measure this existing pack instead of generating one")
    ap.add_argument("--workers", default="1,2,4,8,16")
    ap.add_argument("--modes", default="direct,buffered", help="loader I/O modes: direct (O_DIRECT), buffered")
    ap.add_argument("--repeats", type=int, default=3, help="measurements per method (median reported)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="stop starting measurements after this many seconds (results so far are written)")
    ap.add_argument("--machine", default=None, help="machine name for the result file (default: from the CPU/GPU)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--keep", action="store_true", help="keep the generated pack")
    args = ap.parse_args()
    started = time.monotonic()

    device = loadbench.default_device()
    workers = [int(w) for w in args.workers.split(",")]
    modes = args.modes.split(",")
    generated = args.pack is None
    root = args.pack or generate_pack(args.dir, args.size_gb)
    print(f"pack ready after {time.monotonic() - started:.0f} s", flush=True)
    try:
        files = loadbench.pack_files(root)
        paths = [f.path for f in files]
        nbytes = sum(r.nbytes for f in files for r in f.tensors.values())
        print(f"pack {root}: {len(files)} files, {nbytes / GB:.2f} GB of tensors; device {device}", flush=True)
        verified = verify(files, device)
        print(f"byte-identical to safetensors on {device}: {verified} tensors "
              f"({time.monotonic() - started:.0f} s)", flush=True)

        # unpaired: the device's own parallelism (O_DIRECT reads with the most workers), and vLLM's default path.
        # Each loader run is paired with raw reads right before it (after it on odd rounds): see loadbench.
        single = [("raw_parallel_direct", lambda: loadbench.raw_parallel_direct(paths, max(workers))),
                  ("safetensors", lambda: loadbench.safetensors_default(files, device))]
        paired = [(f"loader_{mode}_{w}", ReaderOptions(workers=w, direct_io=mode == "direct"))
                  for mode in modes for w in workers]
        machine = describe_machine(Path(root))
        name = args.machine or re.sub(r"[^a-z0-9]+", "-", (machine["gpu"] or machine["cpu"]).lower()).strip("-")
        out = args.out or Path(__file__).parent / "results" / f"{name}-loader.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        samples: dict[str, list[float]] = {n: [] for n in (*loadbench.RAW_METHODS, *(n for n, _ in single),
                                                            *(n for n, _ in paired))}
        pairs: dict[str, list[dict]] = {n: [] for n, _ in paired}
        skipped = 0

        def write(complete: bool) -> dict:
            result = {
                "date": datetime.date.today().isoformat(), "complete": complete, "skipped_for_time": skipped,
                "machine": machine, "load_average_at_end": os.getloadavg(),
                "pack": {"bytes": nbytes, "files": len(files), "tensors": sum(len(f.tensors) for f in files),
                         "largest_tensor_bytes": max(r.nbytes for f in files for r in f.tensors.values()),
                         "generated": generated},
                "device": str(device),
                "options": {"chunk_bytes": ReaderOptions().chunk_bytes, "ring_bytes": ReaderOptions().ring_bytes},
                "repeats": args.repeats, "verified_byte_identical_tensors": verified,
                **summarize(samples, pairs, workers, modes), "samples_gbps": samples, "pairs": pairs}
            out.write_text(json.dumps(result, indent=2) + "\n")
            return result

        def over_budget() -> bool:
            return bool(args.budget_s) and time.monotonic() - started > args.budget_s

        for r in range(args.repeats):
            for label, run in single:
                if over_budget():
                    skipped += 1
                    continue
                m = run()
                samples[label].append(round(m.gbps, 3))
                print(f"[{r + 1}/{args.repeats}] {label:22s} {m.bytes / GB:6.2f} GB in {m.seconds:6.2f} s "
                      f"= {m.gbps:6.2f} GB/s", flush=True)
            for label, opts in paired:
                if over_budget():
                    skipped += 1
                    continue
                pair = loadbench.paired_reader(files, opts, device, loader_first=r % 2 == 1)
                pairs[label].append(pair)
                for method in loadbench.RAW_METHODS:
                    samples[method].append(pair[method])
                samples[label].append(pair["loader"])
                print(f"[{r + 1}/{args.repeats}] {label:22s} {pair['loader']:6.2f} GB/s (disk idle "
                      f"{pair['loader_idle_s']:.2f} s); raw dd {pair['raw_sequential']:.2f}, hinted "
                      f"{pair['raw_sequential_fadvise']:.2f}, O_DIRECT {pair['raw_direct_1']:.2f}", flush=True)
            write(complete=False)
        result = write(complete=skipped == 0)
        print_summary(result)
        print(f"-> {out} ({time.monotonic() - started:.0f} s)")
    finally:
        if generated and not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
