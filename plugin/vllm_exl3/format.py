"""The EXL3 pack on disk: files, tensors, per-tensor bits and codebook, validation.

An EXL3 pack is a Hugging Face model directory whose quantized linears were replaced by ExLlamaV3's trellis
tensors (exl3-format.md §1). Everything here reads only safetensors *headers*: listing or validating a pack of
any size costs a few kilobytes of I/O. Tensor bytes are read on demand (`read_tensor`).

Every problem with a pack raises `Exl3FormatError`, whose message names the file, the tensor and what was
expected, so a user can tell a truncated download from a wrong converter version.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# --- exl3-format.md §1.1 / §1.7: codebook markers ------------------------------------------------------------
# A 0-dim int32 tensor `<prefix>.mcg` or `<prefix>.mul1` selects the codebook; no marker means 3INST. The stored
# value is the codebook's multiplier reinterpreted as int32; ExLlamaV3 >= 1.6 refuses any other value, so do we.
CODEBOOK_3INST = "3inst"
CODEBOOK_MCG = "mcg"
CODEBOOK_MUL1 = "mul1"
CODEBOOKS = (CODEBOOK_3INST, CODEBOOK_MCG, CODEBOOK_MUL1)
MARKER_VALUE = {CODEBOOK_MCG: 0xCBAC1FED, CODEBOOK_MUL1: 0x83DCD12D}  # as uint32

# --- §1.2: both feature dims are padded to the Hadamard block -------------------------------------------------
HADAMARD_BLOCK = 128
TILE = 16  # §1.3: 16x16 tiles

# --- §1.6 / §1.8: valid bit widths ----------------------------------------------------------------------------
INTEGER_BITS = range(1, 9)
HALF_INTEGER_BASES = (1, 2, 3)  # 1.5 / 2.5 / 3.5, mul1 only

# Tensor suffixes that belong to an EXL3 linear (the `.weight` is replaced by these).
EXL3_SUFFIXES = ("trellis", "suh", "svh", "su", "sv", "mcg", "mul1", "bias")

# safetensors dtype name -> element size in bytes
DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "F4": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}
# A header larger than this is not a real safetensors header (the reference implementation caps it at 100 MB).
MAX_HEADER_BYTES = 100 * 1024 * 1024
INDEX_FILE = "model.safetensors.index.json"
SIDECAR_FILE = "quantization_config.json"


class Exl3FormatError(ValueError):
    """A pack that does not match the EXL3 format. Names the file, the tensor and the expectation."""

    def __init__(self, file: str | os.PathLike | None, tensor: str | None, expected: str, found: str | None = None):
        self.file = str(file) if file is not None else None
        self.tensor = tensor
        self.expected = expected
        self.found = found
        where = " ".join(p for p in (self.file, f"tensor '{tensor}'" if tensor else None) if p) or "pack"
        msg = f"{where}: expected {expected}"
        if found is not None:
            msg += f", found {found}"
        super().__init__(msg)


# ------------------------------------------------------------------------------------------------------------
# safetensors headers
# ------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorRecord:
    """Where one tensor's bytes live. `offset` is absolute within `file`."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class SafetensorsFile:
    path: Path
    tensors: dict[str, TensorRecord]
    metadata: dict[str, str]
    data_start: int
    size: int


def read_safetensors_header(path: str | os.PathLike) -> SafetensorsFile:
    """Parse and validate one safetensors header without touching tensor data.

    Checks that the header is complete JSON, every tensor has a known dtype and a byte range matching its shape,
    and that the file is long enough to hold every tensor (a truncated download fails here, not mid-load).
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise Exl3FormatError(path, None, "an 8-byte safetensors header length", f"a {size}-byte file")
            header_len = int.from_bytes(prefix, "little")
            if header_len > MAX_HEADER_BYTES or header_len > size - 8:
                raise Exl3FormatError(path, None, f"a header length <= {min(MAX_HEADER_BYTES, size - 8)} bytes",
                                      f"{header_len} (truncated or not a safetensors file)")
            raw = f.read(header_len)
    except OSError as e:
        raise Exl3FormatError(path, None, "a readable safetensors file", f"{type(e).__name__}: {e}") from e
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise Exl3FormatError(path, None, "a JSON safetensors header", f"corrupt header ({e})") from e
    if not isinstance(header, dict):
        raise Exl3FormatError(path, None, "a JSON object as header", type(header).__name__)

    data_start = 8 + header_len
    data_len = size - data_start
    metadata = header.pop("__metadata__", None) or {}
    tensors: dict[str, TensorRecord] = {}
    for name, entry in header.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise Exl3FormatError(path, name, "dtype, shape and data_offsets in the header entry", repr(entry)) from e
        if dtype not in DTYPE_SIZES:
            raise Exl3FormatError(path, name, f"a safetensors dtype ({', '.join(DTYPE_SIZES)})", repr(dtype))
        if not all(isinstance(d, int) and d >= 0 for d in shape):
            raise Exl3FormatError(path, name, "a shape of non-negative integers", repr(list(shape)))
        nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
        if not (isinstance(begin, int) and isinstance(end, int)) or end - begin != nbytes or begin < 0:
            raise Exl3FormatError(path, name, f"data_offsets spanning {nbytes} bytes for {dtype}{list(shape)}",
                                  f"[{begin}, {end}]")
        if end > data_len:
            raise Exl3FormatError(path, name, f"bytes [{begin}, {end}) inside the {data_len}-byte data section",
                                  "a tensor past end-of-file (truncated file)")
        tensors[name] = TensorRecord(name, dtype, shape, path, data_start + begin, nbytes)
    return SafetensorsFile(path, tensors, metadata, data_start, size)


# ------------------------------------------------------------------------------------------------------------
# EXL3 linears
# ------------------------------------------------------------------------------------------------------------
def bits_from_trellis_dim(last_dim: int) -> float | None:
    """Per-tensor bits from the trellis' last dimension (16*b int16 words per tile); None if impossible."""
    if last_dim % TILE == 0 and last_dim // TILE in INTEGER_BITS:
        return float(last_dim // TILE)
    if last_dim % TILE == TILE // 2 and last_dim // TILE in HALF_INTEGER_BASES:
        return last_dim // TILE + 0.5
    return None


def format_bits(bits: float) -> str:
    return f"{bits:g}"


@dataclass
class Exl3Linear:
    """The stored tensors of one quantized linear, validated. Geometry is the padded (stored) one."""

    prefix: str
    trellis: TensorRecord
    suh: TensorRecord | None
    svh: TensorRecord | None
    su: TensorRecord | None  # legacy sign bitfields (pre-v0.0.2 packs)
    sv: TensorRecord | None
    marker: TensorRecord | None
    bias: TensorRecord | None
    bits: float
    codebook: str

    @property
    def in_padded(self) -> int:
        return self.trellis.shape[0] * TILE

    @property
    def out_padded(self) -> int:
        return self.trellis.shape[1] * TILE

    @property
    def records(self) -> list[TensorRecord]:
        return [r for r in (self.trellis, self.suh, self.svh, self.su, self.sv, self.marker, self.bias) if r]

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.records)

    @property
    def legacy_signs(self) -> bool:
        return self.suh is None


def _expect(cond: bool, rec: TensorRecord, expected: str, found: str) -> None:
    if not cond:
        raise Exl3FormatError(rec.file, rec.name, expected, found)


def build_linear(prefix: str, parts: dict[str, TensorRecord]) -> Exl3Linear:
    """Validate the tensors stored under one prefix and derive bits, codebook and geometry."""
    trellis = parts.get("trellis")
    any_part = next(iter(parts.values()))
    if trellis is None:
        raise Exl3FormatError(any_part.file, f"{prefix}.trellis",
                              f"a trellis tensor next to {', '.join(sorted(f'{prefix}.{k}' for k in parts))}",
                              "none (missing companion tensor)")
    _expect(trellis.dtype == "I16", trellis, "dtype I16", trellis.dtype)
    _expect(len(trellis.shape) != 2, trellis, "a linear's 3-D trellis [K/16, N/16, 16*bits]",
            f"{list(trellis.shape)}: ExLlamaV3's row codec for quantized embeddings / n-gram tables "
            "(--embed_bits, exl3-format.md §1.8), which this plugin does not serve")
    _expect(len(trellis.shape) == 3, trellis, "a 3-D shape [K/16, N/16, 16*bits]", str(list(trellis.shape)))
    kt, nt, words = trellis.shape
    _expect(kt > 0 and nt > 0, trellis, "non-empty tile dimensions", str(list(trellis.shape)))
    _expect((kt * TILE) % HADAMARD_BLOCK == 0 and (nt * TILE) % HADAMARD_BLOCK == 0, trellis,
            f"padded features that are multiples of {HADAMARD_BLOCK} (trellis dims multiples of 8)",
            str(list(trellis.shape)))
    bits = bits_from_trellis_dim(words)
    if bits is None:
        raise Exl3FormatError(trellis.file, trellis.name,
                              "a last dimension of 16*b (b = 1..8) or 16*b+8 (b = 1, 2, 3; mul1 half-integer)",
                              str(words))

    suh, svh, su, sv = (parts.get(k) for k in ("suh", "svh", "su", "sv"))
    k_pad, n_pad = kt * TILE, nt * TILE
    if suh is not None:
        _expect(suh.dtype == "F16", suh, "dtype F16", suh.dtype)
        _expect(suh.shape == (k_pad,), suh, f"shape [{k_pad}] (16 x trellis dim 0)", str(list(suh.shape)))
    elif su is not None:
        _expect(su.dtype == "I16", su, "dtype I16 (legacy sign bitfield)", su.dtype)
        _expect(su.shape == (kt,), su, f"shape [{kt}] (legacy sign bitfield)", str(list(su.shape)))
    else:
        raise Exl3FormatError(trellis.file, f"{prefix}.suh", "an input-side scale tensor (.suh or legacy .su)",
                              "none (missing companion tensor)")
    if svh is not None:
        _expect(svh.dtype == "F16", svh, "dtype F16", svh.dtype)
        _expect(svh.shape == (n_pad,), svh, f"shape [{n_pad}] (16 x trellis dim 1)", str(list(svh.shape)))
    elif sv is not None:
        _expect(sv.dtype == "I16", sv, "dtype I16 (legacy sign bitfield)", sv.dtype)
        _expect(sv.shape == (nt,), sv, f"shape [{nt}] (legacy sign bitfield)", str(list(sv.shape)))
    else:
        raise Exl3FormatError(trellis.file, f"{prefix}.svh", "an output-side scale tensor (.svh or legacy .sv)",
                              "none (missing companion tensor)")

    mcg, mul1 = parts.get("mcg"), parts.get("mul1")
    if mcg is not None and mul1 is not None:
        raise Exl3FormatError(mul1.file, mul1.name, f"at most one codebook marker for '{prefix}'",
                              "both .mcg and .mul1")
    marker = mcg or mul1
    codebook = CODEBOOK_MCG if mcg is not None else CODEBOOK_MUL1 if mul1 is not None else CODEBOOK_3INST
    if marker is not None:
        _expect(marker.dtype == "I32" and marker.shape == (), marker, "a 0-dim I32 marker",
                f"{marker.dtype}{list(marker.shape)}")
    if bits != int(bits) and codebook != CODEBOOK_MUL1:
        raise Exl3FormatError(trellis.file, trellis.name, "half-integer bits only with the mul1 codebook",
                              f"{format_bits(bits)} bits with {codebook}")

    bias = parts.get("bias")
    if bias is not None:
        _expect(bias.dtype in ("F16", "BF16", "F32"), bias, "a float dtype", bias.dtype)
        _expect(len(bias.shape) == 1 and 0 < bias.shape[0] <= n_pad, bias, f"shape [N <= {n_pad}]",
                str(list(bias.shape)))
    return Exl3Linear(prefix, trellis, suh, svh, su, sv, marker, bias, bits, codebook)


def split_suffix(name: str) -> tuple[str, str]:
    prefix, _, suffix = name.rpartition(".")
    return prefix, suffix


def group_exl3_tensors(tensors: dict[str, TensorRecord]) -> dict[str, dict[str, TensorRecord]]:
    """EXL3 component tensors grouped by module prefix (a lone `.bias` is a plain layer's, not EXL3)."""
    groups: dict[str, dict[str, TensorRecord]] = {}
    for name, rec in tensors.items():
        prefix, suffix = split_suffix(name)
        if suffix in EXL3_SUFFIXES:
            groups.setdefault(prefix, {})[suffix] = rec
    return {p: parts for p, parts in sorted(groups.items()) if not set(parts) <= {"bias"}}


def marker_problem(linear: Exl3Linear) -> Exl3FormatError | None:
    """Check a codebook marker's stored value (4 bytes of I/O); None when fine or absent."""
    if linear.marker is None:
        return None
    value = int.from_bytes(read_bytes(linear.marker), "little", signed=False)
    expected = MARKER_VALUE[linear.codebook]
    if value == expected:
        return None
    return Exl3FormatError(linear.marker.file, linear.marker.name,
                           f"the locked {linear.codebook} marker value 0x{expected:08X}",
                           f"unknown marker value 0x{value:08X}")


# ------------------------------------------------------------------------------------------------------------
# The pack
# ------------------------------------------------------------------------------------------------------------
_EXPERT_RE = re.compile(r"\.experts\.(\d+)\.")


def tensor_group(name: str) -> str:
    """experts | head | dense (other EXL3 linears) for an EXL3 prefix."""
    if _EXPERT_RE.search(name + "."):
        return "experts"
    if name == "lm_head" or name.endswith(".lm_head"):
        return "head"
    return "dense"


@dataclass
class Pack:
    """An EXL3 model directory, read header-only."""

    root: Path
    config: dict[str, Any]
    files: list[SafetensorsFile]
    tensors: dict[str, TensorRecord]
    sidecar: dict[str, Any] | None = None
    index_problems: list[Exl3FormatError] = field(default_factory=list)
    _linears: dict[str, Exl3Linear] | None = field(default=None, repr=False)

    # -- opening --------------------------------------------------------------------------------------------
    @classmethod
    def open(cls, root: str | os.PathLike) -> "Pack":
        root = Path(root)
        if not root.is_dir():
            raise Exl3FormatError(root, None, "a pack directory",
                                  "a file (give the folder that holds config.json and the *.safetensors)"
                                  if root.exists() else "no such file or directory")
        config = _read_json(root / "config.json")
        sidecar_path = root / SIDECAR_FILE
        sidecar = _read_json(sidecar_path) if sidecar_path.exists() else None

        index_path = root / INDEX_FILE
        index_problems: list[Exl3FormatError] = []
        if index_path.exists():
            index = _read_json(index_path)
            weight_map = index.get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise Exl3FormatError(index_path, None, "a non-empty 'weight_map' object", repr(weight_map)[:80])
            names = sorted(set(weight_map.values()))
            for fname in names:
                if not (root / fname).is_file():
                    missing = next(t for t, f in weight_map.items() if f == fname)
                    raise Exl3FormatError(index_path, missing, f"shard file '{fname}' named by the index to exist",
                                          "missing file")
            on_disk = {p.name for p in root.glob("*.safetensors")}
            for extra in sorted(on_disk - set(names)):
                # vLLM filters shards through the index: tensors in an unlisted file are silently never loaded.
                index_problems.append(Exl3FormatError(
                    root / extra, None, f"every *.safetensors file to be named in {INDEX_FILE}",
                    "a file the index omits (vLLM would silently skip its tensors)"))
            paths = [root / n for n in names]
        else:
            weight_map = None
            paths = sorted(root.glob("*.safetensors"))
            if not paths:
                raise Exl3FormatError(root, None, "at least one *.safetensors file", "none")

        files = [read_safetensors_header(p) for p in paths]
        tensors: dict[str, TensorRecord] = {}
        for f in files:
            for name, rec in f.tensors.items():
                if name in tensors:
                    raise Exl3FormatError(f.path, name, "each tensor in exactly one file",
                                          f"a duplicate also in {tensors[name].file.name}")
                tensors[name] = rec
        if weight_map is not None:
            for name, fname in weight_map.items():
                rec = tensors.get(name)
                if rec is None or rec.file.name != fname:
                    raise Exl3FormatError(root / fname, name, f"the tensor that {INDEX_FILE} places in this file",
                                          "not there" if rec is None else f"it is in {rec.file.name}")
        return cls(root, config, files, tensors, sidecar, index_problems)

    # -- configuration --------------------------------------------------------------------------------------
    @property
    def quantization_config(self) -> dict[str, Any]:
        qc = self.config.get("quantization_config")
        if qc is None and self.sidecar is not None:
            qc = self.sidecar
        return dict(qc or {})

    @property
    def text_config(self) -> dict[str, Any]:
        """Model dims (multimodal configs nest them under text_config)."""
        return self.config.get("text_config") or self.config

    @property
    def architecture(self) -> str:
        archs = self.config.get("architectures") or []
        return archs[0] if archs else self.config.get("model_type", "unknown")

    # -- tensors --------------------------------------------------------------------------------------------
    def linears(self) -> dict[str, Exl3Linear]:
        """All EXL3 linears by module prefix, validated. Raises on the first malformed one."""
        if self._linears is None:
            self._linears = {p: build_linear(p, parts) for p, parts in group_exl3_tensors(self.tensors).items()}
        return self._linears

    def unquantized(self) -> dict[str, TensorRecord]:
        owned = {r.name for lin in self.linears().values() for r in lin.records}
        return {n: r for n, r in self.tensors.items() if n not in owned}

    def check_markers(self) -> None:
        """Read every codebook marker (4 bytes each) and check its value."""
        for lin in self.linears().values():
            problem = marker_problem(lin)
            if problem:
                raise problem

    def logical_features(self, linear: Exl3Linear) -> tuple[int, int]:
        """Best guess of a linear's unpadded (in, out) features from the model config.

        The pack stores only padded geometry. A padded dim whose value is not itself a model dimension is
        mapped back to the unique config dimension that pads to it; otherwise the padded value stands.
        """
        dims = self._config_dims()

        def resolve(padded: int) -> int:
            if padded in dims:
                return padded
            cands = {d for d in dims if -(-d // HADAMARD_BLOCK) * HADAMARD_BLOCK == padded}
            return cands.pop() if len(cands) == 1 else padded

        return resolve(linear.in_padded), resolve(linear.out_padded)

    def _config_dims(self) -> set[int]:
        tc = self.text_config
        dims = {tc.get(k) for k in ("hidden_size", "intermediate_size", "moe_intermediate_size",
                                    "shared_expert_intermediate_size", "vocab_size", "q_lora_rank",
                                    "kv_lora_rank")}
        head_dim = tc.get("head_dim") or (tc.get("hidden_size", 0) // max(tc.get("num_attention_heads", 1), 1))
        for k in ("num_attention_heads", "num_key_value_heads"):
            if tc.get(k):
                dims.add(tc[k] * head_dim)
        return {d for d in dims if isinstance(d, int) and d > 0}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError as e:
        raise Exl3FormatError(path, None, "this file in the pack", "missing file") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise Exl3FormatError(path, None, "valid JSON", str(e)) from e
    if not isinstance(data, dict):
        raise Exl3FormatError(path, None, "a JSON object", type(data).__name__)
    return data


# ------------------------------------------------------------------------------------------------------------
# Reading tensor bytes
# ------------------------------------------------------------------------------------------------------------
def read_bytes(rec: TensorRecord) -> bytes:
    """Read one tensor's bytes with pread; a short read is a format error naming file and offset."""
    fd = os.open(rec.file, os.O_RDONLY)
    try:
        data = os.pread(fd, rec.nbytes, rec.offset)
    finally:
        os.close(fd)
    if len(data) != rec.nbytes:
        raise Exl3FormatError(rec.file, rec.name, f"{rec.nbytes} bytes at offset {rec.offset}",
                              f"{len(data)} (file shrank or is truncated)")
    return data


def read_tensor(rec: TensorRecord):
    """A torch tensor (CPU, owning its memory) with the record's dtype and shape."""
    import torch

    dtype = TORCH_DTYPES[rec.dtype]
    buf = bytearray(read_bytes(rec))
    if not buf:
        return torch.empty(rec.shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype).reshape(rec.shape)


class _TorchDtypes(dict):
    """safetensors dtype name -> torch dtype, resolved on first use so this module imports without torch."""

    def __missing__(self, key: str):
        import torch

        table = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
                 "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
                 "BOOL": torch.bool, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
                 "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
        if key not in table:
            raise KeyError(f"safetensors dtype {key} has no torch equivalent")
        self.update(table)
        return table[key]


TORCH_DTYPES = _TorchDtypes()


@dataclass
class Exl3Weights:
    """One linear's tensors in memory (legacy sign bitfields already expanded to suh/svh)."""

    trellis: Any  # int16 [K/16, N/16, 16*bits]
    suh: Any  # fp16 [K]
    svh: Any  # fp16 [N]
    codebook: str
    bits: float
    bias: Any = None

    @property
    def in_padded(self) -> int:
        return self.trellis.shape[0] * TILE

    @property
    def out_padded(self) -> int:
        return self.trellis.shape[1] * TILE


def unpack_signs(words):
    """Legacy `.su`/`.sv` (§1.1): bit i of int16 word w set means element 16*w+i is -1, else +1."""
    import torch

    bits = (words.to(torch.int32).unsqueeze(-1) >> torch.arange(TILE, dtype=torch.int32)) & 1
    return (1 - 2 * bits).reshape(-1).to(torch.float16)


def load_weights(linear: Exl3Linear) -> Exl3Weights:
    suh = read_tensor(linear.suh) if linear.suh else unpack_signs(read_tensor(linear.su))
    svh = read_tensor(linear.svh) if linear.svh else unpack_signs(read_tensor(linear.sv))
    bias = read_tensor(linear.bias) if linear.bias else None
    return Exl3Weights(read_tensor(linear.trellis), suh, svh, linear.codebook, linear.bits, bias)


def verify_pack(root: str | os.PathLike) -> tuple["Pack | None", list[Exl3FormatError]]:
    """Full structural validation: every file, every tensor. Collects every problem instead of stopping."""
    try:
        pack = Pack.open(root)
    except Exl3FormatError as e:
        return None, [e]
    problems = list(pack.index_problems)
    qc = pack.quantization_config
    if str(qc.get("quant_method", "")).lower() != "exl3":
        problems.append(Exl3FormatError(pack.root / "config.json", None,
                                        "quantization_config.quant_method 'exl3'", repr(qc.get("quant_method"))))
    linears = {}
    for prefix, parts in group_exl3_tensors(pack.tensors).items():
        try:
            linears[prefix] = build_linear(prefix, parts)
        except Exl3FormatError as e:
            problems.append(e)
    if not linears and not problems:
        problems.append(Exl3FormatError(pack.root, None, "at least one EXL3 linear (a .trellis tensor)", "none"))
    problems += [p for p in map(marker_problem, linears.values()) if p]
    if not problems:
        pack._linears = linears
    return pack, problems
