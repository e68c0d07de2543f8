"""`vllm-exl3` command line: the subcommands' table, parsing, and the one way every failure is reported.

A subcommand lives in the module named after it (packs.py: inspect, verify, pack, dequant; appliance.py: launch,
preflight, metrics; serve.py, info.py, bench.py, load_bench.py): `setup(parser)` adds its options and returns its
handler, whose docstring is its help. A new subcommand is one function there and one row in COMMANDS.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import traceback
from pathlib import Path

from ..base.version import __version__
from ..format.errors import Exl3FormatError
from . import appliance, bench, info, load_bench, packs, serve
from .common import UsageError, err_console, lit
from .userfiles import environment_error, os_error

# name -> setup(parser) -> handler, in the order `vllm-exl3 --help` lists them.
COMMANDS = {
    "inspect": packs.inspect, "verify": packs.verify, "pack": packs.pack, "dequant": packs.dequant,
    "launch": appliance.launch, "preflight": appliance.preflight, "serve": serve.serve, "metrics": appliance.metrics,
    "info": info.info, "bench": bench.bench, "load-bench": load_bench.load_bench,
}
# Commands whose extra arguments, after `--`, go to vLLM.
_TAKES_VLLM_ARGS = {"serve", "launch", "preflight"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-exl3", description="EXL3 packs on vLLM: inspect, verify, serve.")
    parser.add_argument("--version", action="version", version=f"vllm-exl3 {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, setup in COMMANDS.items():
        sp = sub.add_parser(name, help=(setup.__doc__ or "").strip().splitlines()[0],
                            description=(setup.__doc__ or "").strip())
        sp.set_defaults(handler=setup(sp), parser=sp)
    return parser


def parse(argv: list[str]) -> argparse.Namespace:
    """Our options anywhere on the line; everything after the first `--` is vLLM's (serve, launch, preflight).
    An unknown option is reported by the subcommand that was given it, with that subcommand's usage."""
    ours, sep, vllm_args = (argv[:argv.index("--")], ["--"], argv[argv.index("--") + 1:]) if "--" in argv \
        else (argv, [], [])
    parser = build_parser()
    args, unknown = parser.parse_known_args(ours)
    sp: argparse.ArgumentParser = args.parser
    if unknown:
        hint = ""
        if args.command in _TAKES_VLLM_ARGS and any(u.startswith("-") for u in unknown):
            hint = f"; vLLM's own options go after `--`: vllm-exl3 {args.command} ... -- {' '.join(unknown)}"
        sp.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    if sep and args.command not in _TAKES_VLLM_ARGS:
        sp.error(f"unexpected `-- {' '.join(vllm_args)}`: {args.command} passes nothing to vLLM")
    args.vllm_args = vllm_args
    return args


def _write_trace() -> Path | None:
    """The current exception's full traceback in a file (for a bug report); None if no file could be written."""
    try:
        fd, name = tempfile.mkstemp(prefix="vllm-exl3-error-", suffix=".txt")
        with os.fdopen(fd, "w") as f:
            f.write(f"vllm-exl3 {__version__}: {' '.join(sys.argv)}\n\n{traceback.format_exc()}")
        return Path(name)
    except OSError:
        return None


class _NamedOutput:
    """sys.stdout while a command runs: a write the system refuses (`> /dev/full`, a full disk) is reported as
    the standard output's, which the system's error (about an open file) does not say."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        return self._refused(self._stream.write, text)

    def flush(self) -> None:
        self._refused(self._stream.flush)

    @staticmethod
    def _refused(call, *args):
        try:
            return call(*args)
        except BrokenPipeError:
            raise
        except OSError as e:
            _quiet_stdout()  # the rest would fail again when the interpreter exits
            raise os_error(e, "the standard output", "write") from e

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _quiet_stdout() -> None:
    """After a broken pipe (`vllm-exl3 inspect --json | head`): discard the rest instead of failing at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else list(argv))
    stdout, sys.stdout = sys.stdout, _NamedOutput(sys.stdout)
    try:
        code = args.handler(args)
        sys.stdout.flush()  # a closed pipe or a full disk shows here, handled below, not at interpreter exit
        return code
    except Exl3FormatError as e:
        err_console.print(f"[red]error:[/] {lit(e)}", highlight=False, soft_wrap=True)
        return 1
    except UsageError as e:
        err_console.print(f"[red]error:[/] {lit(e)}", highlight=False, soft_wrap=True)
        return e.code
    except BrokenPipeError:
        _quiet_stdout()
        return 141  # what a shell reports for a command stopped by SIGPIPE
    except KeyboardInterrupt:
        return 130
    except OSError as e:
        if not environment_error(e):
            return _internal_error(e)
        err_console.print(f"[red]error:[/] {lit(os_error(e))}", highlight=False, soft_wrap=True)
        return 1
    except Exception as e:
        return _internal_error(e)
    finally:
        sys.stdout = stdout


def _internal_error(e: Exception) -> int:
    """Anything but the user's input or environment is a bug: one line here, the whole trace in a file."""
    trace = _write_trace()
    err_console.print(f"[red]internal error:[/] {type(e).__name__}: {lit(e)}", highlight=False, soft_wrap=True)
    err_console.print(f"the full trace is in {trace}; please include it in a bug report" if trace else
                      "(the trace could not be written to the temp folder)", highlight=False, soft_wrap=True)
    return 70  # EX_SOFTWARE


if __name__ == "__main__":
    sys.exit(main())
