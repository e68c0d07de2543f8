"""Parallel loader: byte-identical to `safetensors` on real and generated packs, bounded read-ahead, and one real
broken file (or injected fault) per failure mode, each named by file and offset.

Over 400 lines on purpose: one contract (what loader/reader.py delivers, and how it fails) checked case by case
with shared packs and fault injectors (tests/support/fs_faults.py); split, the cases would repeat the set-up."""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
from pathlib import Path

import pytest
import torch
import vllm_exl3.loader.reader as L
import vllm_exl3.loader.progress as progress
from support.fixtures import FIXTURES
from safetensors.torch import load_file
from vllm_exl3.loader import load_bench as loadbench
from vllm_exl3.format.errors import Exl3FormatError
from vllm_exl3.format.headers import read_safetensors_header
from vllm_exl3.format.pack import Pack
from vllm_exl3.format.units import MIB
from vllm_exl3.loader.options import ReaderOptions
from vllm_exl3.loader.progress import last_load_stats
from vllm_exl3.loader.reader import PackReadError, read_tensors
from vllm_exl3.loader.plan import plan_reads
from vllm_exl3.dev.synthetic import linear_tensors, random_weights, write_pack

REPO = Path(__file__).resolve().parents[2]
FIXTURE_FILES = sorted(FIXTURES.rglob("*.safetensors")) + sorted((REPO / "plugin/vllm_exl3/demo").rglob("*.safetensors"))
# tiny chunks and ring so that the fixtures' tensors span chunks, share chunks and exceed the ring
TINY = ReaderOptions(workers=3, chunk_bytes=8192, ring_bytes=16384)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1)


def assert_identical(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(ref)
    for name, expected in ref.items():
        tensor = got[name]
        assert (tensor.dtype, tuple(tensor.shape)) == (expected.dtype, tuple(expected.shape)), name
        assert torch.equal(as_bytes(tensor), as_bytes(expected)), name


@pytest.mark.parametrize("path", FIXTURE_FILES, ids=lambda p: str(p.relative_to(REPO)))
@pytest.mark.parametrize("options", [ReaderOptions(), TINY], ids=["default", "tiny-chunks"])
def test_fixture_files_byte_identical_to_safetensors(path, options):
    assert_identical(dict(read_tensors([path], options)), load_file(path))


def generated_pack(root: Path, shards: int = 3) -> Path:
    """Real EXL3 linears plus every dtype, a 0-dim and an empty tensor, and tensors larger than a TINY chunk and
    larger than a TINY ring (16 KiB): the 40 KiB int64 and the 64x64 fp32 (16 KiB + header)."""
    tensors = linear_tensors("model.layers.0.mlp.down_proj", random_weights(256, 128, 3, "mcg", seed=1))
    tensors.update(linear_tensors("model.layers.0.mlp.experts.3.up_proj", random_weights(128, 256, 4, "mul1")))
    g = torch.Generator().manual_seed(0)
    tensors.update({
        "big.int64": torch.randint(-2**62, 2**62, (5, 1024), dtype=torch.int64, generator=g),
        "big.fp32": torch.randn(64, 65, generator=g),
        "embed.bf16": torch.randn(40, 24, generator=g).bfloat16(),
        "scale.f16": torch.randn(7, generator=g).half(),
        "mask.bool": torch.rand(13, generator=g) > 0.5,
        "codes.u8": torch.randint(0, 255, (33,), dtype=torch.uint8, generator=g),
        "codes.i8": torch.randint(-128, 127, (3, 3), dtype=torch.int8, generator=g),
        "scalar.f64": torch.tensor(3.25, dtype=torch.float64),
        "empty.f32": torch.empty(0, 4),
    })
    return write_pack(root, tensors, shards=shards)


def reference(pack: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(pack.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("options", [ReaderOptions(workers=1), ReaderOptions(workers=8), TINY,
                                     ReaderOptions(workers=2, chunk_bytes=4096, ring_bytes=4096, direct_io=False)],
                         ids=["1-worker", "8-workers", "tiny", "buffered-4k"])
def test_generated_multi_file_pack_byte_identical(tmp_path, options):
    pack = generated_pack(tmp_path / "pack")
    files = Pack.open(pack).files
    assert len(files) == 3
    assert max(r.nbytes for f in files for r in f.tensors.values()) > options.ring_bytes or options.ring_bytes > MIB
    assert_identical(dict(read_tensors(files, options)), reference(pack))
    stats = last_load_stats()
    assert stats.bytes == sum(t.nbytes for t in reference(pack).values())
    assert (stats.workers, stats.files, stats.tensors) == (options.workers, 3, len(reference(pack)))
    assert 0 <= stats.idle_seconds < stats.seconds


def test_order_is_file_then_offset(tmp_path):
    files = Pack.open(generated_pack(tmp_path / "pack")).files
    order = [name for name, _ in read_tensors(files, TINY)]
    expected = [r.name for f in files for r in sorted(f.tensors.values(), key=lambda r: (r.offset, r.name))]
    assert order == expected


def test_keep_skips_tensors_unread(tmp_path):
    files = Pack.open(generated_pack(tmp_path / "pack")).files
    keep = lambda name: not name.startswith("big.")
    plan = plan_reads(files, TINY.chunk_bytes, keep)
    got = dict(read_tensors(files, TINY, keep=keep))
    ref = {k: v for k, v in reference(tmp_path / "pack").items() if keep(k)}
    assert_identical(got, ref)
    assert sum(c.needed for c in plan.chunks) < sum(r.nbytes for f in files for r in f.tensors.values())


def test_read_ahead_is_bounded_by_the_ring(tmp_path):
    """However slowly the consumer goes, ring-sized destinations not yet handed out stay within the ring, plus at
    most one tensor larger than the ring; and reading goes on past such a tensor while it is held (draining the
    pipeline around it idled the disk)."""
    g = torch.Generator().manual_seed(0)
    sizes = {"a.small": 700, "b.large": 12000, "c.small": 900, "d.large": 10000, "e.small": 800, "f.small": 1000}
    tensors = {name: torch.randn(n, generator=g) for name, n in sizes.items()}  # fp32: 4 bytes each
    files = Pack.open(write_pack(tmp_path / "pack", tensors)).files
    options = ReaderOptions(workers=4, chunk_bytes=4096, ring_bytes=8192)
    plan = plan_reads(files, options.chunk_bytes)
    assert [t.name for t in plan.tensors] == sorted(sizes)  # file order, as the test needs it
    peaks = {"ring": 0, "oversized": 0}
    admitted_beside_oversized = []

    class Watched(L.ParallelRead):
        def _allocate(self, nbytes, *phase):
            if nbytes > options.ring_bytes:
                assert not self._oversized  # never two larger than the ring at once
                peaks["oversized"] = max(peaks["oversized"], nbytes)
            else:
                peaks["ring"] = max(peaks["ring"], self._outstanding + nbytes)
                if self._oversized:
                    admitted_beside_oversized.append(self.plan.tensors[self._admitted].name)
            return super()._allocate(nbytes, *phase)

    got = {}
    for name, tensor in Watched(plan, options):
        threading.Event().wait(0.02)  # a slow consumer: the workers run ahead as far as the ring allows
        got[name] = tensor
    assert_identical(got, tensors)
    assert 0 < peaks["ring"] <= options.ring_bytes
    assert peaks["oversized"] == 4 * 12000
    assert {"c.small", "e.small"} & set(admitted_beside_oversized)


def test_host_buffers_are_recycled_only_when_released(tmp_path):
    """A consumer that drops each tensor gets recycled memory; one that keeps them never sees them overwritten."""
    experts = {f"model.layers.0.mlp.experts.{e}.up_proj.trellis": torch.randint(-9, 9, (64, 64), dtype=torch.int16)
               for e in range(32)}
    pack = write_pack(tmp_path / "pack", experts)
    options = ReaderOptions(workers=2, chunk_bytes=8192, ring_bytes=32768)
    addresses = {t.data_ptr() for _, t in read_tensors([pack / "model.safetensors"], options)}
    assert len(addresses) < len(experts)  # same-size destinations came back from the pool
    kept = dict(read_tensors([pack / "model.safetensors"], options))
    assert len({t.data_ptr() for t in kept.values()}) == len(experts)
    assert_identical(kept, experts)


# ------------------------------------------------------------------------------------------------------------
# failures: each with a real broken file or a fault at the read seam; messages name file and offset
# ------------------------------------------------------------------------------------------------------------
def test_truncated_file_fails_before_any_tensor(tmp_path, monkeypatch):
    pack = generated_pack(tmp_path / "pack")
    shard = sorted(pack.glob("*.safetensors"))[1]
    os.truncate(shard, shard.stat().st_size - 100)
    reads = []
    monkeypatch.setattr(L, "read_into", lambda *a: reads.append(a))  # no tensor byte may be read
    with pytest.raises(Exl3FormatError) as err:
        list(read_tensors(sorted(pack.glob("*.safetensors")), TINY))
    assert str(shard) in str(err.value) and "past end-of-file" in str(err.value)
    assert "bytes [" in str(err.value)  # the offsets of the tensor that does not fit
    assert not reads


def test_index_naming_a_missing_shard_fails(tmp_path):
    pack = generated_pack(tmp_path / "pack")
    missing = sorted(pack.glob("*.safetensors"))[2]
    missing.unlink()
    with pytest.raises(Exl3FormatError) as err:
        Pack.open(pack)
    assert "model.safetensors.index.json" in str(err.value) and missing.name in str(err.value)


def test_file_truncated_after_its_header_was_read(tmp_path):
    """The file shrinks between header validation and the read: a short read, named by file and offset."""
    pack = generated_pack(tmp_path / "pack", shards=1)
    path = pack / "model.safetensors"
    header = read_safetensors_header(path)
    victim = max(header.tensors.values(), key=lambda r: r.nbytes)
    os.truncate(path, victim.offset + 1000)
    yielded = []
    with pytest.raises(PackReadError) as err:
        for name, _ in read_tensors([header], TINY):
            yielded.append(name)
    e = err.value
    assert e.file == str(path) and victim.offset <= e.offset < victim.offset + victim.nbytes
    assert f"offset {e.offset}" in str(e) and f"end of file: the file is now {victim.offset + 1000} bytes" in str(e)
    assert e.tensor == victim.name
    assert victim.name not in yielded
    assert not [t for t in threading.enumerate() if t.name.startswith("exl3-loader")]


def test_io_error_mid_read_aborts_the_load(tmp_path, monkeypatch):
    pack = generated_pack(tmp_path / "pack")
    files = Pack.open(pack).files
    plan = plan_reads(files, TINY.chunk_bytes)
    bad = plan.chunks[len(plan.chunks) // 2]
    bad_path = plan.files[bad.file]
    real = L.read_into
    bad_fd = {}

    def faulty(fd, buffer, offset):
        if offset == bad.offset and os.path.samefile(f"/proc/self/fd/{fd}", bad_path):
            bad_fd["hit"] = True
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, buffer, offset)

    monkeypatch.setattr(L, "read_into", faulty)
    yielded = []
    with pytest.raises(PackReadError) as err:
        for name, _ in read_tensors(files, TINY):
            yielded.append(name)
    e = err.value
    assert bad_fd["hit"] and e.file == str(bad_path) and e.offset == bad.offset
    assert "Input/output error" in str(e) and f"offset {bad.offset}" in str(e)
    first_bad = plan.tensors[bad.pieces[0].tensor].name
    assert first_bad not in yielded  # nothing from the failed read was handed out
    assert not [t for t in threading.enumerate() if t.name.startswith("exl3-loader")]


@pytest.mark.parametrize("refused_at", ["open", "read"])
def test_o_direct_refused_falls_back_to_buffered(tmp_path, monkeypatch, refused_at):
    """Filesystems that refuse O_DIRECT (EINVAL at open, or only at the first read) are read through the page
    cache instead, with the same bytes."""
    import fcntl

    pack = generated_pack(tmp_path / "pack")
    real_open, real_read = os.open, L.read_into

    def open_without_direct(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    def read_without_direct(fd, buffer, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_read(fd, buffer, offset)

    if refused_at == "open":
        monkeypatch.setattr(L.os, "open", open_without_direct)
    else:
        monkeypatch.setattr(L, "read_into", read_without_direct)
    assert_identical(dict(read_tensors(Pack.open(pack).files, TINY)), reference(pack))
    assert last_load_stats().direct_io is False


def test_o_direct_fallback_keeps_the_refused_descriptor_for_workers_holding_it(tmp_path):
    """A worker that took the O_DIRECT descriptor just before another worker's fallback reads from it after: it must
    still be open (closed, the read failed with EBADF in a CI run; reused by another open, it would read another
    file's bytes), and it is closed with the file."""
    from vllm_exl3.loader.files import OpenFile

    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(8192))
    f = OpenFile(path, direct_io=True)
    old_fd, direct = f.handle
    if not direct:
        f.close()
        pytest.skip("this filesystem refuses O_DIRECT at open: no read-time fallback to exercise")
    f.fall_back_to_buffered(old_fd)
    new_fd, direct = f.handle
    assert not direct and new_fd != old_fd
    assert os.fstat(old_fd).st_ino == os.fstat(new_fd).st_ino  # still open, still this file
    f.fall_back_to_buffered(old_fd)  # the late worker's own fallback changes nothing
    assert f.handle == (new_fd, False)
    assert os.pread(new_fd, 16, 0) == path.read_bytes()[:16]
    f.close()
    for fd in (old_fd, new_fd):
        with pytest.raises(OSError) as e:
            os.fstat(fd)
        assert e.value.errno == errno.EBADF


# ------------------------------------------------------------------------------------------------------------
# options, progress
# ------------------------------------------------------------------------------------------------------------
def test_options_precedence_and_validation():
    env = {"VLLM_EXL3_LOAD_WORKERS": "4", "VLLM_EXL3_LOAD_CHUNK_MIB": "8", "VLLM_EXL3_LOAD_DIRECT_IO": "0"}
    o = ReaderOptions.from_config({"workers": 16}, environ=env)
    assert (o.workers, o.chunk_bytes, o.direct_io, o.ring_bytes) == (16, 8 * MIB, False, ReaderOptions.ring_bytes)
    assert ReaderOptions.from_config({"chunk_mib": 2048}, environ={}).ring_bytes == 2048 * MIB
    with pytest.raises(ValueError, match="unknown loader option"):
        ReaderOptions.from_config({"threads": 4}, environ={})
    with pytest.raises(ValueError, match="VLLM_EXL3_LOAD_WORKERS"):
        ReaderOptions.from_config({}, environ={"VLLM_EXL3_LOAD_WORKERS": "many"})
    with pytest.raises(ValueError, match="workers"):
        ReaderOptions.from_config({"workers": 0}, environ={})
    with pytest.raises(ValueError, match="multiple of 4096"):
        ReaderOptions(chunk_bytes=1000)


def test_progress_log_line_without_a_terminal(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.0)
    files = Pack.open(generated_pack(tmp_path / "pack")).files
    with caplog.at_level(logging.INFO, logger="vllm_exl3.loader"):
        reporter = L.ProgressReporter(plan_reads(files, TINY.chunk_bytes).nbytes, bar=False)
        list(read_tensors(files, TINY, progress=reporter))
    lines = [r.getMessage() for r in caplog.records]
    assert any("GB/s, ETA" in line and "%" in line for line in lines)
    assert any(line.startswith("loaded ") and "3 workers" in line for line in lines)
    assert json.dumps(last_load_stats().to_json())  # the metrics issue reads this record


def test_expert_parallel_filter_skips_other_ranks_experts():
    pytest.importorskip("vllm")
    from vllm_exl3.integration.model_loader import _expert_filter

    keep = _expert_filter({0, 1})
    assert keep("model.layers.0.mlp.experts.1.down_proj.trellis")
    assert not keep("model.layers.0.mlp.experts.5.down_proj.trellis")
    assert not keep("model.layers.0.mlp.experts.5.down_proj.weight")
    assert keep("model.layers.0.mlp.experts.5.down_proj.suh")  # tiny, and some backends want every expert's
    assert keep("model.layers.0.self_attn.q_proj.trellis")
    assert _expert_filter(None) is None


def test_load_bench_command_json(tmp_path):
    """`vllm-exl3 load-bench PACK --workers 1,2 --json` as a user runs it."""
    import subprocess
    import sys

    pack = generated_pack(tmp_path / "pack")
    r = subprocess.run([sys.executable, "-m", "vllm_exl3.cli", "load-bench", str(pack), "--workers", "1,2", "--json",
                        "--chunk-mib", "1", "--repeats", "3"], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["bytes"] == sum(t.nbytes for t in reference(pack).values())
    assert result["raw_gbps"] > 0 and set(result["loader_gbps"]) == {"1", "2"}
    assert all(v > 0 for v in result["loader_gbps"].values())
    # raw reads and the reader interleaved in pairs; the ratio is the median of the pairs' ratios
    raw = result["raw_method"]
    assert raw in ("raw_sequential", "raw_sequential_fadvise", "raw_direct_1")
    assert result["raw_gbps"] == result[f"{raw}_gbps"] == max(result[f"{m}_gbps"] for m in loadbench.RAW_METHODS)
    for w in ("1", "2"):
        pairs = result["pairs"][w]
        assert len(pairs) == 3 and all(p["loader"] > 0 and p[raw] > 0 and p["loader_idle_s"] >= 0 for p in pairs)
        ratios = sorted(p["loader"] / p[raw] for p in pairs)
        assert result["loader_vs_raw"][w] == pytest.approx(ratios[1], abs=1e-3)
        assert result["loader_gbps"][w] == sorted(p["loader"] for p in pairs)[1]


# ------------------------------------------------------------------------------------------------------------
# host destinations read in place (no bounce copy): alignment phases, heads and tails, failures mid-read
# ------------------------------------------------------------------------------------------------------------
def write_raw_safetensors(path: Path, entries: list[tuple[str, torch.Tensor, int]], data_phase: int = 0) -> Path:
    """A safetensors file laid out by hand: each `(name, tensor, gap)` starts `gap` bytes after the previous one's
    end, and the header is padded with spaces so that the data starts at `data_phase` modulo 4096: tests choose
    every tensor's file offset modulo 4096
    (writers such as safetensors' own keep offsets aligned; other files need not). A positive gap is filled by a U8
    tensor `<name>.gap` (the format allows no holes); a negative one overlaps the previous tensor (aliases, which
    the reader refuses)."""
    header, blobs, pos = {}, [], 0
    for name, tensor, gap in entries:
        if gap > 0:
            header[f"{name}.gap"] = {"dtype": "U8", "shape": [gap], "data_offsets": [pos, pos + gap]}
        pos += gap
        data = as_bytes(tensor.contiguous()).numpy().tobytes()
        dtype = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int16: "I16",
                 torch.uint8: "U8", torch.int64: "I64"}[tensor.dtype]
        header[name] = {"dtype": dtype, "shape": list(tensor.shape), "data_offsets": [pos, pos + len(data)]}
        blobs.append((pos, data))
        pos += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * ((data_phase - 8 - len(raw)) % 4096)
    body = bytearray(max((p + len(d) for p, d in blobs), default=0))
    for p, d in blobs:
        body[p:p + len(d)] = d
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(body))
    return path


def file_reference(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of `path` by plain seek-and-read (safetensors' own reader refuses gaps and aliases)."""
    out = {}
    with open(path, "rb") as f:
        for rec in read_safetensors_header(path).tensors.values():
            f.seek(rec.offset)
            data = bytearray(f.read(rec.nbytes))
            out[rec.name] = torch.frombuffer(data, dtype=torch.uint8).view(L.TORCH_DTYPES[rec.dtype]).reshape(rec.shape)
    return out


def phase_tensors(seed: int = 0) -> list[tuple[str, torch.Tensor, int]]:
    """Tensors whose file offsets fall on many phases modulo 4096, with heads and tails sharing blocks with their
    neighbours, tensors spanning chunks, exact block multiples, a tensor inside one block, and gaps."""
    g = torch.Generator().manual_seed(seed)
    u8 = lambda n: torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)  # noqa: E731
    return [
        ("a.u8", u8(3 * 4096 + 17), 0),  # starts mid-block (after the header), ends mid-block
        ("b.u8", u8(4096), 0),  # exactly one block long, on no block boundary
        ("c.f32", torch.randn(5000, generator=g), 3),  # element-aligned offset after a 3-byte gap
        ("d.bf16", torch.randn(9001, generator=g).bfloat16(), 0),
        ("e.u8", u8(100), 0),  # inside one block: no aligned middle, through the slot
        ("f.u8", u8(8 * 4096), 4096 - 5),  # spans several chunks of the small-chunk options below
        ("g.i16", torch.randint(-9, 9, (12345,), dtype=torch.int16, generator=g), 1),  # odd offset: not in place
        ("h.u8", u8(2 * 4096 + 1), 0),
        ("i.f16", torch.randn(4097, generator=g).half(), 0),
        ("j.u8", u8(20000), 7),
    ]


@pytest.mark.parametrize("data_phase", [0, 1, 8, 2050, 4095])
@pytest.mark.parametrize("options", [ReaderOptions(workers=1, chunk_bytes=8192, ring_bytes=65536),
                                     ReaderOptions(workers=3, chunk_bytes=16384, ring_bytes=16384),
                                     ReaderOptions(workers=2, chunk_bytes=MIB),
                                     ReaderOptions(workers=3, chunk_bytes=8192, ring_bytes=16384, direct_io=False)],
                         ids=["1w-8k", "3w-16k", "2w-1m", "3w-8k-buffered"])
def test_inplace_reads_every_alignment_phase(tmp_path, monkeypatch, options, data_phase):
    """Every tensor at least one byte large may be read in place: their aligned blocks go straight into the
    destination (O_DIRECT must accept the scatter read: it stays on), heads, tails and small tensors through the
    slot; the bytes are the file's."""
    monkeypatch.setattr(L, "INPLACE_MIN_BYTES", 1)
    entries = phase_tensors()
    path = write_raw_safetensors(tmp_path / "phases.safetensors", entries, data_phase)
    header = read_safetensors_header(path)
    offsets = {name: header.tensors[name].offset for name, _, _ in entries}
    assert len({o % 4096 for o in offsets.values()}) == len(entries)  # all phases differ
    got = {}
    for name, tensor in read_tensors([path], options):
        if name not in offsets:  # a gap filler
            continue
        if offsets[name] % tensor.element_size() == 0:  # in place: the address has the file offset's phase
            assert (tensor.data_ptr() - offsets[name]) % 4096 == 0, name
        else:  # an offset a wider dtype cannot be viewed at: an ordinary (aligned) destination, through the slot
            assert tensor.data_ptr() % tensor.element_size() == 0, name
        got[name] = tensor.clone()
    assert_identical(got, {n: t for n, t in file_reference(path).items() if n in offsets})
    assert_identical(got, {name: t for name, t, _ in entries})
    stats = last_load_stats()
    assert stats.direct_io is options.direct_io
    assert 0 < stats.inplace_bytes < stats.bytes


def test_inplace_threshold_keeps_small_tensors_in_the_slot(tmp_path):
    """At the default threshold the fixture-sized tensors are copied from the slot and large ones read in place."""
    g = torch.Generator().manual_seed(1)
    big = torch.randn(L.INPLACE_MIN_BYTES // 4 + 1000, generator=g)
    small = torch.randn(100, generator=g)
    path = write_raw_safetensors(tmp_path / "m.safetensors", [("big", big, 0), ("small", small, 0)], data_phase=8)
    got = {n: t.clone() for n, t in read_tensors([path], ReaderOptions(workers=2, chunk_bytes=64 * 1024))}
    assert_identical(got, {"big": big, "small": small})
    inplace = last_load_stats().inplace_bytes
    assert big.nbytes - 2 * 4096 < inplace <= big.nbytes  # all of big but its head and tail blocks


def test_overlapping_tensors_are_refused_before_reading(tmp_path):
    """Two tensors sharing bytes (aliases): the loader never hands them out; the header check names both."""
    g = torch.Generator().manual_seed(2)
    a = torch.randint(0, 256, (5 * 4096,), dtype=torch.uint8, generator=g)
    b = torch.randint(0, 256, (3 * 4096,), dtype=torch.uint8, generator=g)
    path = write_raw_safetensors(tmp_path / "alias.safetensors", [("a", a, 0), ("b", b, -4096 - 10)])
    with pytest.raises(Exl3FormatError, match="overlapping 'a'") as err:
        list(read_tensors([path], ReaderOptions(workers=2, chunk_bytes=MIB)))
    assert err.value.file == str(path) and err.value.tensor == "b"


@pytest.mark.parametrize("direct_io", [True, False], ids=["o-direct", "buffered"])
def test_inplace_short_reads_resume_at_the_right_byte(tmp_path, monkeypatch, direct_io):
    """The kernel may return less than asked (a scatter read stops mid-iovec): the next read resumes in the right
    segment at the right byte."""
    monkeypatch.setattr(L, "INPLACE_MIN_BYTES", 1)
    path = write_raw_safetensors(tmp_path / "p.safetensors", phase_tensors(3), data_phase=124)
    real = L.read_into
    cap = 3 * 4096 if direct_io else 5000  # O_DIRECT returns whole blocks except at end of file
    calls = []

    def short(fd, buffers, offset):
        views, left = [], cap
        for b in buffers:
            m = memoryview(b).cast("B")
            if left:
                views.append(m[:left])
                left -= len(views[-1])
        calls.append(offset)
        return real(fd, views, offset)

    monkeypatch.setattr(L, "read_into", short)
    got = {n: t.clone() for n, t in read_tensors([path], ReaderOptions(workers=2, chunk_bytes=65536,
                                                                       direct_io=direct_io))}
    assert_identical(got, file_reference(path))
    assert len(calls) > len(plan_reads([read_safetensors_header(path)], 65536).chunks)  # chunks took several
    assert last_load_stats().direct_io is direct_io and last_load_stats().inplace_bytes > 0


@pytest.mark.parametrize("direct_io", [True, False], ids=["o-direct", "buffered"])
def test_inplace_file_truncated_mid_tensor(tmp_path, monkeypatch, direct_io):
    """The file shrinks inside a tensor's in-place middle after the header was read: a short read names file,
    offset and tensor; neither it nor anything after it is handed out."""
    monkeypatch.setattr(L, "INPLACE_MIN_BYTES", 1)
    path = write_raw_safetensors(tmp_path / "p.safetensors", phase_tensors(4), data_phase=77)
    header = read_safetensors_header(path)
    victim = header.tensors["f.u8"]
    cut = victim.offset + 5 * 4096 + 300  # inside its aligned middle, in the chunk after its first
    os.truncate(path, cut)
    yielded = []
    with pytest.raises(PackReadError) as err:
        for name, _ in read_tensors([header], ReaderOptions(workers=1, chunk_bytes=16384, ring_bytes=65536,
                                                            direct_io=direct_io)):
            yielded.append(name)
    e = err.value
    assert (e.file, e.offset, e.tensor) == (str(path), cut, "f.u8")  # O_DIRECT too: a partial block at the end
    assert f"end of file: the file is now {cut} bytes" in str(e)
    assert "f.u8" not in yielded and not {"g.i16", "h.u8", "i.f16", "j.u8"} & set(yielded)
    assert not [t for t in threading.enumerate() if t.name.startswith("exl3-loader")]


def test_inplace_io_error_mid_tensor(tmp_path, monkeypatch):
    """EIO on a read whose bytes go straight into a destination: the load stops, naming file and offset, and the
    partly written tensor is never handed out."""
    monkeypatch.setattr(L, "INPLACE_MIN_BYTES", 1)
    path = write_raw_safetensors(tmp_path / "p.safetensors", phase_tensors(5), data_phase=900)
    victim = read_safetensors_header(path).tensors["f.u8"]
    bad_offset = victim.offset // 4096 * 4096 + 16384  # its second chunk (a tensor larger than a chunk)
    real = L.read_into

    def faulty(fd, buffers, offset):
        if offset == bad_offset:
            assert len(buffers) > 0
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, buffers, offset)

    monkeypatch.setattr(L, "read_into", faulty)
    yielded = []
    with pytest.raises(PackReadError) as err:
        for name, _ in read_tensors([path], ReaderOptions(workers=2, chunk_bytes=16384, ring_bytes=65536)):
            yielded.append(name)
    e = err.value
    assert (e.file, e.offset, e.tensor) == (str(path), bad_offset, "f.u8") and "Input/output error" in str(e)
    assert "f.u8" not in yielded


def test_inplace_buffers_recycled_at_a_new_phase(tmp_path, monkeypatch):
    """Released in-place destinations come back for tensors of the same size at other phases: re-sliced to the new
    phase, with the new tensor's bytes; a kept tensor is never overwritten."""
    g = torch.Generator().manual_seed(6)
    n = L.INPLACE_MIN_BYTES // 2 + 3  # int16: 2n bytes, so each offset moves the phase by 6
    tensors = [(f"t{i:02d}", torch.randint(-2**15, 2**15, (n,), dtype=torch.int16, generator=g), 0)
               for i in range(24)]
    path = write_raw_safetensors(tmp_path / "r.safetensors", tensors, data_phase=2)
    options = ReaderOptions(workers=2, chunk_bytes=4 * 2 * n // 4096 * 4096, ring_bytes=8 * 2 * n)
    expected = {name: t for name, t, _ in tensors}
    storages, kept = set(), {}
    for name, tensor in read_tensors([path], options):
        assert torch.equal(tensor, expected[name]), name  # checked before the memory can be reused
        storages.add(tensor.untyped_storage().data_ptr())
        if name in ("t03", "t11"):
            kept[name] = tensor  # holding it: never recycled under us
    assert len(storages) < len(tensors)  # storage came back from the pool
    assert last_load_stats().inplace_bytes > 20 * (2 * n - 2 * 4096)
    assert_identical(kept, {k: expected[k] for k in kept})


@pytest.mark.parametrize("options", [TINY, ReaderOptions(workers=2), ReaderOptions(workers=3, direct_io=False)],
                         ids=["tiny", "default-chunks", "buffered"])
def test_everything_in_place_byte_identical_to_safetensors(tmp_path, monkeypatch, options):
    """With every tensor eligible for in-place reads, the generated pack and the real fixture packs still come out
    byte-identical to safetensors'."""
    monkeypatch.setattr(L, "INPLACE_MIN_BYTES", 1)
    pack = generated_pack(tmp_path / "pack")
    assert_identical({n: t.clone() for n, t in read_tensors(Pack.open(pack).files, options)}, reference(pack))
    assert last_load_stats().inplace_bytes > 0
    for path in FIXTURE_FILES:
        assert_identical({n: t.clone() for n, t in read_tensors([path], options)}, load_file(path))


def test_large_fresh_destinations_ask_for_huge_pages(tmp_path, monkeypatch):
    """Fresh host destinations of >= 4 MiB are advised MADV_HUGEPAGE before the read writes them; bytes unchanged."""
    advised = []
    real = L.advise_huge_pages
    monkeypatch.setattr(L, "advise_huge_pages", lambda buffer: advised.append(buffer.numel()) or real(buffer))
    g = torch.Generator().manual_seed(7)
    big = torch.randn(5 * MIB // 4 + 3, generator=g)
    small = torch.randn(1000, generator=g)
    path = write_raw_safetensors(tmp_path / "h.safetensors", [("big", big, 0), ("small", small, 0)], data_phase=8)
    got = {n: t.clone() for n, t in read_tensors([path], ReaderOptions(workers=2, chunk_bytes=MIB))}
    assert_identical(got, {"big": big, "small": small})
    assert advised == [big.nbytes + 4096]  # the phased allocation, once; the small tensor is not advised


# ------------------------------------------------------------------------------------------------------------
# fail closed (issue 19): a file changed during a load, one dtype table
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["rewritten-in-place", "replaced"])
def test_file_changed_during_the_load_is_named(tmp_path, how):
    """Bytes from two versions of a file must never mix silently: a file rewritten in place (same size, new mtime)
    or replaced (new inode) while it is read fails the load, naming the file."""
    pack = generated_pack(tmp_path / "pack", shards=1)
    path = pack / "model.safetensors"
    header = read_safetensors_header(path)
    original = path.read_bytes()
    with pytest.raises(PackReadError) as err:
        for i, _ in enumerate(read_tensors([header], TINY)):
            if i == 0:
                if how == "replaced":
                    (pack / "new").write_bytes(original)
                    os.replace(pack / "new", path)
                else:
                    with open(path, "r+b") as f:
                        f.write(original)
                    st = os.stat(path)
                    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert err.value.file == str(path) and "rewritten or replaced during the load" in str(err.value)
    assert not [t for t in threading.enumerate() if t.name.startswith("exl3-loader")]


def test_f4_and_f8_e8m0_share_one_table_with_the_planner(tmp_path):
    """F4 is half a byte per element (an odd last dim cannot be stored); F8_E8M0 is accepted by the header check
    and loads: verify and the planner read the same dtype table."""
    from vllm_exl3.format.headers import DTYPES
    from vllm_exl3.format.tensors import TORCH_DTYPES

    data = bytes(range(24))
    header = {"e8": {"dtype": "F8_E8M0", "shape": [2, 4], "data_offsets": [0, 8]},
              "f4": {"dtype": "F4", "shape": [4, 8], "data_offsets": [8, 24]}}
    raw = json.dumps(header).encode()
    path = tmp_path / "x.safetensors"
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    sf = read_safetensors_header(path)
    assert sf.tensors["f4"].nbytes == 16 and sf.tensors["f4"].storage_shape == (4, 4)
    got = dict(read_tensors([sf], TINY))
    assert got["e8"].dtype == torch.float8_e8m0fnu and got["e8"].shape == (2, 4)
    assert got["f4"].dtype == torch.float4_e2m1fn_x2 and got["f4"].view(torch.uint8).flatten().tolist() == list(data[8:])
    assert set(TORCH_DTYPES[d] for d in DTYPES)  # every dtype of the table resolves in this torch
    header["f4"]["shape"] = [4, 7]
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    with pytest.raises(Exl3FormatError, match="packs F4 into whole bytes") as err:
        read_safetensors_header(path)
    assert err.value.tensor == "f4"
