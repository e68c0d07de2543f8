"""`--load-format exl3_parallel`: vLLM's default safetensors loading with the parallel reader (loader/reader.py)
under it.

Everything except reading stays vLLM's DefaultModelLoader: downloading, choosing shards through the index, the
multimodal and unused-shard filters, the expert-parallel filter, weight tracking. What changes is how the chosen
files are read, and where tensors arrive: on the GPU when the model is on one (staged through pinned buffers),
else in host memory.

Options (`--model-loader-extra-config` JSON keys, else `VLLM_EXL3_LOAD_*` environment variables, see
loader/options.py's OPTION_KEYS): `workers`, `chunk_mib`, `ring_mib`, `direct_io`, `drop_page_cache`.
DefaultModelLoader's own keys (`enable_weights_track`, ...) pass through to it.

Tensor parallelism: every rank reads each tensor whole and vLLM's weight loaders narrow it to the rank's slice
(EXL3 layers do the same in theirs), so N ranks on one host read the checkpoint N times. Under expert parallelism,
other ranks' experts are skipped before they are read: vLLM's EP weight filter, extended to EXL3 `.trellis`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from pathlib import Path

import torch
from torch import nn
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from . import compat
from ..format.headers import SafetensorsFile, read_safetensors_header
from ..loader.options import OPTION_KEYS, ReaderOptions
from ..loader.progress import ProgressReporter
from ..loader.reader import ParallelRead
from ..loader.plan import plan_reads

LOAD_FORMAT = "exl3_parallel"
# Per-expert tensors holding nearly all expert bytes; vLLM's own EP filter knows only `.weight`/`.weight_packed`.
EXL3_EXPERT_PAYLOAD_SUFFIX = ".trellis"


class ParallelSafetensorsLoader(DefaultModelLoader):
    """DefaultModelLoader whose safetensors reads go through `loader.ParallelRead`."""

    def __init__(self, load_config):
        extra = dict(load_config.model_loader_extra_config or {})
        self.options = ReaderOptions.from_config({k: extra.pop(k) for k in list(extra) if k in OPTION_KEYS})
        self.use_progress_bar = load_config.use_tqdm_on_load
        super().__init__(compat.safetensors_load_config(load_config, extra))
        self._device = torch.device("cpu")

    def load_weights(self, model: nn.Module, model_config) -> None:
        self._device = _staging_device(model)
        super().load_weights(model, model_config)

    def _get_weights_iterator(self, source) -> Generator[tuple[str, torch.Tensor], None, None]:
        folder, files, use_safetensors, index_file = self._prepare_weights(
            source.model_or_path, source.subfolder, source.revision, source.fall_back_to_pt,
            source.allow_patterns_overrides)
        if not use_safetensors:
            raise ValueError(f"--load-format {LOAD_FORMAT} reads safetensors checkpoints; "
                             f"{source.model_or_path} has none")
        files = compat.filter_weight_files(self, source, folder, files, index_file)
        plan = plan_reads(_headers(files), self.options.chunk_bytes,
                          _expert_filter(self.local_expert_ids))
        progress = ProgressReporter(plan.nbytes) if self.use_progress_bar and _is_first_rank() else None
        if self.counter_before_loading_weights == 0.0:
            self.counter_before_loading_weights = time.perf_counter()
        reader = ParallelRead(plan, self.options, self._device, progress)
        return ((source.prefix + name, tensor) for name, tensor in reader)


def _headers(files: list[str]) -> list[SafetensorsFile]:
    """Validated headers, in name order. (A shard named by the index but missing already fails in vLLM's own
    index filter, 0.31+; a truncated one fails here, before any tensor is read.)"""
    return [read_safetensors_header(p) for p in sorted(files, key=lambda f: Path(f).name)]


def _expert_filter(local_expert_ids: set[int] | None) -> Callable[[str], bool] | None:
    if local_expert_ids is None:
        return None
    from vllm.model_executor.model_loader.ep_weight_filter import parse_expert_id, should_skip_weight

    def keep(name: str) -> bool:
        if name.endswith(EXL3_EXPERT_PAYLOAD_SUFFIX):
            expert = parse_expert_id(name)
            return expert is None or expert in local_expert_ids
        return not should_skip_weight(name, local_expert_ids)

    return keep


def _staging_device(model: nn.Module) -> torch.device:
    """Where tensors go: the model's GPU when it has one (so vLLM's copies are device-to-device), else the host."""
    for param in model.parameters():
        if param.device.type == "cuda":
            return param.device
    return torch.device("cpu")


def _is_first_rank() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


_registered = False


def register_loader() -> None:
    """Make `--load-format exl3_parallel` known to this process (idempotent; vLLM calls plugins in every process)."""
    global _registered
    if _registered:
        return
    register_model_loader(LOAD_FORMAT)(ParallelSafetensorsLoader)
    _registered = True
