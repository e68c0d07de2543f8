"""`vllm-exl3 serve` refuses what needs no vLLM before it asks vLLM's option parser (which imports vLLM: 10-30 s of
silence on a busy machine), in process: the parser is replaced by one that records it was asked."""

from __future__ import annotations

import socket

import pytest

from vllm_exl3.appliance.vllm_options import VllmOptionsError
from vllm_exl3.cli import serve

from support.mutants import run_cli
from support.servers import free_port


@pytest.fixture
def parser_asked(monkeypatch):
    asked = []

    def recording_parser(*args, **kwargs):
        asked.append(args)
        raise VllmOptionsError("vLLM's parser was asked")

    monkeypatch.setattr(serve, "read_options", recording_parser)
    return asked


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize("extra", [[], ["--", "--max-model-len", "256", "--max-num-seqs", "4"]])
def test_a_busy_port_is_refused_before_vllms_parser(parser_asked, busy_port, extra):
    """It waited 20 s in silence for the parser (22.4 s measured on the 2-core CI box, 1.3 s now)."""
    code, err = run_cli("serve", "--demo", "--once", "--port", str(busy_port), *extra)
    assert code == 1 and f"cannot serve on 127.0.0.1:{busy_port}: Address already in use" in err, err
    assert not parser_asked


def test_an_open_bind_without_a_key_is_refused_before_vllms_parser(parser_asked, monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_EXL3_ALLOW_OPEN_API", raising=False)
    code, err = run_cli("serve", "--demo", "--once", "--host", "0.0.0.0", "--port", str(free_port()))
    assert code == 2 and "the API would listen on every interface with no key" in err, err
    assert not parser_asked


@pytest.mark.parametrize("value,says", [("bogus", "VLLM_EXL3_KERNEL"), ("exllamav3", "exllamav3: ")])
def test_a_kernel_setting_the_plugin_would_refuse_is_refused_before_the_boot(parser_asked, monkeypatch, value, says):
    """preflight's check (appliance/preflight.py check_kernel), so serve no longer boots vLLM for minutes to end
    in the plugin's traceback."""
    monkeypatch.setenv("VLLM_EXL3_KERNEL", value)
    from vllm_exl3.appliance.preflight import check_kernel

    check = check_kernel({"VLLM_EXL3_KERNEL": value})
    if check is None or check.ok:
        pytest.skip(f"{value} is usable here")
    code, err = run_cli("serve", "--demo", "--once", "--port", str(free_port()))
    assert code == 2 and f"refusing to serve: kernel backend: {check.detail}" in err.replace("\n", " "), err
    assert says in err and "Traceback" not in err and not parser_asked


@pytest.mark.parametrize("extra", [["--", "--po", "8001"], ["--", "--port=8001"], ["--", "--config", "x.yaml"],
                                   ["--", "--ho", "::1"], ["--", "-O3"]])
def test_options_that_may_move_the_bind_leave_the_bind_to_vllms_parser(parser_asked, busy_port, extra):
    """An early refusal of the default port would be wrong when the user's options choose another one (in any
    spelling vLLM's parser reads): then the parsed bind is what is checked."""
    code, err = run_cli("serve", "--demo", "--once", "--port", str(busy_port), *extra)
    assert code == 2 and "vLLM's parser was asked" in err, err
    assert len(parser_asked) == 1


def test_the_curl_line_carries_the_key_when_one_is_set():
    with_key = serve.curl_line("http://127.0.0.1:8000", "m", keyed=True)
    assert '-H "Authorization: Bearer $VLLM_API_KEY"' in with_key  # the shell fills it in; the key is not printed
    assert "Authorization" not in serve.curl_line("http://127.0.0.1:8000", "m", keyed=False)
