"""integration/binding.py acts on the parity gate's decision (kernels/parity.py decides, never reaches back into
the layers): a fallback rebinds every layer already bound to the failed (backend, layer type), each to the next
backend, and only those; a passing gate rebinds nothing. CPU only, no vLLM."""

from __future__ import annotations

import pytest
import torch

from vllm_exl3.dev.synthetic import random_weights
from vllm_exl3.integration import binding
from vllm_exl3.kernels import backend as kbackend, parity, selection
from vllm_exl3.kernels.backends.torch_ref import TorchBackend
from vllm_exl3.kernels.specs import LinearSpec

from support.backends import WrongNative


@pytest.fixture
def env(monkeypatch, tmp_path):
    kbackend.load_backends()
    monkeypatch.setenv(parity.REPORT_ENV, str(tmp_path / "parity.json"))
    monkeypatch.setenv("VLLM_EXL3_KERNEL", "auto")
    monkeypatch.setattr(selection, "_excluded", {})
    parity.reset()
    binding.reset()
    yield
    parity.reset()
    binding.reset()


class Layer:
    """What linear.py's _bind does for one shard: choose, bind, then check through binding.bind_checked."""

    def __init__(self, name: str, w, last_block: bool = False):
        self.name, self.w, self.last_block, self.bound = name, w, last_block, []
        self.spec = LinearSpec(w.codebook, w.bits, w.in_padded, w.out_padded, torch.float32, "cpu")

    def bind(self):
        b = selection.choose_linear_backend(self.spec)
        bound = b.bind_linear(self.w, 0, 0, self.w.out_padded)
        self.bound.append(b.name)
        binding.bind_checked(self.name, selection.linear_layer_type(self.spec), b, torch.float32,
                             lambda: parity.linear_error(bound, self.w.in_padded, torch.float32),
                             self.bind, self.last_block)


def test_a_fallback_rebinds_every_layer_bound_to_the_failed_backend(env, monkeypatch):
    monkeypatch.setitem(kbackend.REGISTRY, "native", WrongNative())
    w = random_weights(128, 128, 3, "mcg", seed=1)
    other = random_weights(128, 128, 4, "mcg", seed=2)  # another layer type
    # The type's first check is taken as passed (a backend wrong only on some layers), so two layers stay bound.
    parity._verified.update({("native", "linear:mcg:3b:cpu"), ("native", "linear:mcg:4b:cpu")})
    first, second, unrelated = Layer("l.0", w), Layer("l.1", w), Layer("l.2", other)
    for layer in (first, second, unrelated):
        layer.bind()
    assert first.bound == second.bound == unrelated.bound == ["native"]
    last = Layer("l.last", w, last_block=True)  # every layer of the last block is checked: this one fails
    last.bind()
    assert last.bound == ["native", "torch"]
    assert first.bound == second.bound == ["native", "torch"]  # rebound by the caller, not by the gate
    assert unrelated.bound == ["native"]  # another layer type: the fallback is not its
    assert parity.served() == {"linear:mcg:3b:cpu": "torch", "linear:mcg:4b:cpu": "native"}


def test_a_passing_gate_rebinds_nothing(env, monkeypatch):
    class Honest(TorchBackend):
        name = "native"

        def unavailable_reason(self):
            return None

    monkeypatch.setitem(kbackend.REGISTRY, "native", Honest())
    w = random_weights(128, 128, 3, "mcg", seed=1)
    layers = [Layer(f"l.{i}", w, last_block=i == 2) for i in range(3)]
    for layer in layers:
        layer.bind()
    assert [layer.bound for layer in layers] == [["native"]] * 3
    assert [c.passed for c in parity.checks()] == [True, True]  # the type's first layer and the last block's
