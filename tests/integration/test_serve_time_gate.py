"""The plugin's own check inside plain `vllm serve` (`Exl3Config` as vLLM builds it: `from_config`, then
`maybe_update_config`) on the seeded pack mutants of tests/cli/test_fail_closed_packs.py: as strict as `verify`,
the finite-scale check included. tests/e2e/test_e2e_serving.py starts the real server on two of them."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

from support.mutants import CATEGORIES, Hung, deadline, make_mutant, outcome  # noqa: E402

from vllm_exl3.format.errors import Exl3FormatError  # noqa: E402
from vllm_exl3.integration.config import Exl3Config, Exl3ConfigError  # noqa: E402

SEED = "fail-closed-2"  # the same mutants as tests/cli/test_fail_closed_packs.py
VARIANTS = 6
CASES = [(c, v) for c in CATEGORIES for v in range(VARIANTS)]


def vllm_config_gate(target) -> tuple[bool, str]:
    """What vLLM does with the plugin at start: the quantization config from config.json (vLLM's own reader stops
    first on JSON Python cannot read; the plugin is then never asked), then the pack check."""
    try:
        qc = json.loads((target / "config.json").read_text()).get("quantization_config") or {}
    except (OSError, ValueError):
        qc = {"quant_method": "exl3"}
    try:
        with deadline(f"Exl3Config on {target}"):
            Exl3Config.from_config(qc).maybe_update_config(str(target))
    except (Exl3FormatError, Exl3ConfigError) as e:
        return False, str(e)
    return True, ""


@pytest.mark.parametrize("category,variant", CASES, ids=[f"{c.__name__}-{v}" for c, v in CASES])
def test_exl3_config_refuses_the_mutant(tmp_path, category, variant):
    mutant = make_mutant(SEED, category, variant, tmp_path)
    assert "serve" in mutant.expect.gates  # every category is a serve-time fault
    try:
        accepted, text = vllm_config_gate(mutant.target)
    except (Exception, Hung) as e:  # noqa: BLE001 - any escape is the finding
        accepted, text = False, f"Traceback: {type(e).__name__}: {e}"
    assert outcome(mutant.expect, accepted, text) == "refused", f"{mutant.category}-{variant}: {text}"
