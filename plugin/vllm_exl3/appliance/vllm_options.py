"""A `vllm serve` command's options as vLLM itself will read them: for the launcher, preflight and `vllm-exl3 serve`.

Every check of a user's vLLM options (the bind address, the topology a role owns, the values the memory plan
checks, an option vLLM would refuse) reads them from here. vLLM's parser accepts prefixes (`--ho 0.0.0.0` is
`--host`), short forms (`-tp 2`), `_` for `-` and `--config FILE`; only vLLM's parser reads them all the way vLLM
does, and the appliance must not import vLLM, so a child process does the parsing
(`python -m vllm_exl3.integration.vllm_cli parse-serve-args`, integration/vllm_cli.py).

The request names the model, the command's options and named groups of them (the preset's flags, the user's
extra arguments); the answer gives the effective value of every option (vLLM's `dest` names: `host`,
`max_model_len`, ...), what each group sets on its own, and each option's long flag for messages. The child
imports vLLM's argument machinery (torch included): a few seconds, once per launch, before a boot of minutes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

PARSER_MODULE = "vllm_exl3.integration.vllm_cli"
PARSE_COMMAND = "parse-serve-args"  # integration/vllm_cli.py answers it
PARSE_TIMEOUT_S = 300.0  # importing vLLM's argument machinery on a busy 2-core box takes ~10 s


class VllmOptionsError(ValueError):
    """The options cannot be served (vLLM refuses them), or cannot be read here (no vLLM); the message says which."""


@dataclass(frozen=True)
class VllmOptions:
    effective: Mapping[str, Any]  # dest -> the value vLLM will use for the whole command
    given: Mapping[str, Mapping[str, Any]]  # group -> {dest: value} that group sets by itself
    flags: Mapping[str, str]  # dest -> its long flag, e.g. max_model_len -> --max-model-len
    # vLLM's ModelConfig built from the options and the pack's config (integration/vllm_cli.py _model_check):
    # {"problem", "length_only", "max_model_len", "pack"}; None when the model is not a local pack
    model: Mapping[str, Any] | None = None

    def value(self, dest: str) -> Any:
        return self.effective.get(dest)

    def set_by(self, *groups: str) -> dict[str, Any]:
        """What these groups set, the later group winning (the order vLLM reads them in)."""
        out: dict[str, Any] = {}
        for g in groups:
            out.update(self.given.get(g, {}))
        return out

    def flag(self, dest: str) -> str:
        return self.flags.get(dest) or "--" + dest.replace("_", "-")

    @property
    def eagle3_target(self) -> bool | None:
        """Whether vLLM's class for the model supports EAGLE-3 (integration/vllm_cli.py _eagle3_target); None when
        the speculative config does not ask for `eagle3` or the class is not known."""
        return (self.model or {}).get("eagle3_target")

    def model_refusal(self, length_final: bool = True) -> str | None:
        """Why vLLM would refuse these options against the model's config, in its first minute of booting; None
        when it would not. length_final=False: the --max-model-len read here is not the one vLLM will get (the
        launcher's plan replaces a preset's), so a problem with the length alone is not one."""
        if (self.model or {}).get("pack"):
            return self.model["pack"]
        problem = (self.model or {}).get("problem")
        if not problem:
            return None
        if not self.model.get("length_only"):
            return f"vLLM refuses the model with these options: {problem}"
        if not length_final:
            return None
        limit = self.model.get("max_model_len")
        return (f"{self.flag('max_model_len')} {self.value('max_model_len')} is above the model's maximum context"
                + (f", {limit} tokens" if limit else "") + ", which vLLM derives from the pack's config.json and "
                "tokenizer_config.json and refuses to exceed: lower it, or leave it out to get the maximum "
                f"(vLLM: {problem.split('. ')[0]})")


def read_options(model: str, command: Sequence[str], groups: Mapping[str, Sequence[str]] | None = None,
                 env: Mapping[str, str] | None = None, python: str = sys.executable,
                 timeout: float = PARSE_TIMEOUT_S) -> VllmOptions:
    """Parse `vllm serve MODEL COMMAND...` with vLLM's parser in `python`. VllmOptionsError names what is wrong:
    "<group>: <vLLM's reason>" for an option vLLM refuses, or why vLLM could not be asked."""
    request = json.dumps({"model": model, "command": list(command),
                          "groups": {k: list(v) for k, v in (groups or {}).items()}})
    argv = [python, "-m", PARSER_MODULE, PARSE_COMMAND]
    try:
        done = subprocess.run(argv, input=request, capture_output=True, text=True, timeout=timeout,
                              env=None if env is None else dict(env))
    except subprocess.TimeoutExpired:
        raise VllmOptionsError(f"vLLM's option parser ({python}) gave no answer within {timeout:.0f} s") from None
    except OSError as e:
        raise VllmOptionsError(f"cannot run {python} to read vLLM's options: {e.strerror or e}") from None
    try:
        answer = json.loads(done.stdout)
    except ValueError:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise VllmOptionsError(f"vLLM's option parser failed (exit {done.returncode}): {last}") from None
    if "unavailable" in answer:
        raise VllmOptionsError(f"cannot read vLLM's options: vLLM is not importable in {python} "
                               f"({answer['unavailable']}). Run this where vLLM is installed: the appliance image, "
                               "or a virtualenv made by scripts/bootstrap") from None
    if "error" in answer:
        raise VllmOptionsError(f"vLLM refuses the options: {answer['error']}")
    return VllmOptions(answer["effective"], answer["given"], answer["flags"], answer.get("model"))
