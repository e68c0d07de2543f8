"""What kernels/ raises at the user: a setting whose value the kernels cannot honour here. Each error names the
setting, the value and why (`KernelSettingError`), so the message alone says what to change. Torch-free.

Other RuntimeErrors in kernels/ are internal invariants (a backend used without the preparation the interface
requires, a library that lacks what its backend was written against): bugs or broken installs, not a setting."""

from __future__ import annotations


class KernelSettingError(RuntimeError):
    """A VLLM_EXL3_* kernel setting that parses but cannot be honoured: `setting`=`value`, because `reason`."""

    def __init__(self, setting: str, value: str, reason: str):
        self.setting, self.value, self.reason = setting, value, reason
        super().__init__(f"{setting}={value}: {reason}")


class BackendUnavailableError(KernelSettingError):
    """VLLM_EXL3_KERNEL names a backend that cannot run here (not built, not installed, no suitable device)."""


class FallbackRefusedError(KernelSettingError):
    """VLLM_EXL3_KERNEL_STRICT=1 and the backend VLLM_EXL3_KERNEL names cannot serve a layer type."""


class ParityError(KernelSettingError):
    """VLLM_EXL3_PARITY=strict and a backend disagrees with the torch reference (kernels/parity.py)."""
