"""vLLM's options read by vLLM's own parser in a child process (appliance/vllm_options.py and its other end,
integration/vllm_cli.py): the answer's shape, errors named by where they came from, and no vLLM at all."""

from __future__ import annotations

import os

import pytest

from vllm_exl3.appliance import vllm_options
from vllm_exl3.appliance.vllm_options import VllmOptionsError, read_options
from vllm_exl3.integration import vllm_cli


def test_the_two_ends_agree_on_the_command():
    assert vllm_options.PARSE_COMMAND == vllm_cli.PARSE_COMMAND
    assert vllm_options.PARSER_MODULE == vllm_cli.__name__


def test_options_are_read_as_vllm_reads_them():
    options = read_options("/model", ["--host", "127.0.0.1", "--max-num-seqs", "8", "--ho", "0.0.0.0", "-tp", "1",
                                      "--max_model_len=4k"],
                           {"mine": ["--ho", "0.0.0.0", "-tp", "1", "--max_model_len=4k"]})
    assert options.value("host") == "0.0.0.0"  # the prefix wins over the full name before it, as in vLLM
    assert options.value("max_model_len") == 4000 and options.value("max_num_seqs") == 8
    assert options.set_by("mine") == {"host": "0.0.0.0", "tensor_parallel_size": 1, "max_model_len": 4000}
    assert options.flag("tensor_parallel_size") == "--tensor-parallel-size"


def test_a_refused_option_names_its_source_and_vllms_reason():
    with pytest.raises(VllmOptionsError, match="^vLLM refuses the options: extra: unrecognized arguments: --nope$"):
        read_options("/model", ["--nope"], {"extra": ["--nope"]})


def test_without_vllm_it_says_so(tmp_path):
    """A Python where `import vllm` fails (here a package that raises on import, ahead of the real one)."""
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("raise ImportError('no vLLM in this Python')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    with pytest.raises(VllmOptionsError, match="vLLM is not importable in .*no vLLM in this Python.*scripts/bootstrap"):
        read_options("/model", [], env=env)
