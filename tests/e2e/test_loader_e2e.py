"""vLLM (CPU build) end to end: `--load-format exl3_parallel` serves the same greedy tokens and prompt logprobs as
vLLM's default loader, and a broken checkpoint is refused with the file and offset named.

All five engines start at once (one subprocess each, engine core in-process): ~80 s on a 2-core CI box."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.fixtures import FIXTURES
from support.servers import cpu_env

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]
vllm = pytest.importorskip("vllm")

HERE = Path(__file__).parent
DEMO_PACK = HERE.parents[1] / "plugin" / "vllm_exl3" / "demo" / "qwen3moe-tiny-exl3"
LOADER_OPTIONS = {"workers": 3, "chunk_mib": 1}  # several chunks per shard, several workers


def tiny_moe_model(root: Path) -> Path:
    """A random Qwen3-MoE written by transformers in 6 shards with an index; tokenizer from an EXL3 fixture."""
    import torch
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=2048, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(
        root, max_shard_size="300KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURES / "qwen3moe-a-exl3-mcg-b3" / name, root / name)
    return root


def start(model: Path, load_format: str, extra: dict | None = None) -> subprocess.Popen:
    env = cpu_env(VLLM_ENABLE_V1_MULTIPROCESSING="0")  # engine core in-process: one process less to boot
    return subprocess.Popen([sys.executable, str(HERE.parent / "support" / "vllm_generate.py"), str(model), load_format,
                             json.dumps(extra or {})], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def finish(proc: subprocess.Popen) -> tuple[int, str, list | None]:
    out, _ = proc.communicate(timeout=360)
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    return proc.returncode, out, json.loads(lines[-1][len("RESULT "):]) if lines else None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    model = tiny_moe_model(root / "model")
    broken = root / "broken"
    shutil.copytree(model, broken)
    victim = sorted(broken.glob("*.safetensors"))[2]
    os.truncate(victim, victim.stat().st_size - 64)
    procs = {"default": start(model, "auto"), "ours": start(model, "exl3_parallel", LOADER_OPTIONS),
             "broken": start(broken, "exl3_parallel", LOADER_OPTIONS),
             "exl3_default": start(DEMO_PACK, "auto"), "exl3_ours": start(DEMO_PACK, "exl3_parallel", LOADER_OPTIONS)}
    results = {name: finish(proc) for name, proc in procs.items()}
    results["victim"] = victim
    return results


@pytest.mark.parametrize("model", ["", "exl3_"], ids=["unquantized", "exl3-demo-pack"])
def test_same_greedy_tokens_and_prompt_logprobs_as_default_loader(runs, model):
    (rc_default, log_default, default), (rc_ours, log_ours, ours) = runs[f"{model}default"], runs[f"{model}ours"]
    assert rc_default == 0 and default, log_default[-3000:]
    assert rc_ours == 0 and ours, log_ours[-3000:]
    assert ours == default  # exact: same bytes in the parameters give the same numbers
    receipt = [line for line in log_ours.splitlines() if "loaded" in line and "with 3 workers" in line]
    assert receipt, "the exl3_parallel reader did not run"


def test_truncated_checkpoint_is_not_served(runs):
    rc, log, result = runs["broken"]
    assert rc != 0 and result is None
    assert str(runs["victim"]) in log and "past end-of-file" in log
