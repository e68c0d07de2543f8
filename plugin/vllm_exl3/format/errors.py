"""The format's errors: `Exl3FormatError`, every problem with a pack's files, naming the file, the tensor and what
was expected; `Exl3ConfigError`, a `quantization_config` that contradicts itself or the pack."""

from __future__ import annotations

import os


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


class Exl3ConfigError(ValueError):
    """A `quantization_config` that contradicts itself or the pack it describes."""
