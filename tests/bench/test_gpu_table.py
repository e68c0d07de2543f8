"""bench/gpu/table.py: the serving table of a harness run, built from run.py's serve rows and the bench's saved runs
(written here in their real formats by hand: two servers, one that did not boot)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _phase(concurrency: int, ms: float, tok_s: float) -> dict:
    return {"side": "A", "concurrency": concurrency, "wall_s": 1.0, "requests": [],
            "server": {"ms_per_step": ms, "tokens_per_s": tok_s}}


def _write(results: Path, label: str, phases: list[dict] | None, gz: bool = False, **row) -> None:
    """run.py's row, and the bench's saved run (gzipped as committed under bench/results/, or as run.py leaves it)."""
    (results / f"serve-{label}.json").write_text(json.dumps({"label": label, **row}))
    if phases is not None:
        (results / f"bench-{label}").mkdir()
        run = json.dumps({"sides": {"A": {}}, "phases": phases, "partial": False, "error": None}).encode()
        name = "results.json.gz" if gz else "results.json"
        (results / f"bench-{label}" / name).write_bytes(gzip.compress(run) if gz else run)


def test_rows_are_set_against_the_base_and_a_server_that_did_not_boot_says_why(tmp_path):
    prefill = {"side": "A", "prefill_length": 2048, "wall_s": 1.0, "requests": [],
               "server": {"prefill_tokens_per_s": 20000.0}}
    qwen, glm = {"shape": "qwen3-30b-a3b", "layers": 48}, {"shape": "glm-4.5-air", "layers": 20}
    _write(tmp_path, "ours", [_phase(1, 6.0, 160.0), _phase(8, 9.0, 880.0), {**prefill, "server": {
        "prefill_tokens_per_s": 15000.0}}], boot_s=150.2, idle_servers_beside=["base"], pack=qwen)
    _write(tmp_path, "base", [_phase(1, 5.0, 190.0), _phase(8, 6.0, 1300.0), prefill], boot_s=140.0, pack=qwen,
           gz=True)
    _write(tmp_path, "other-shape", [_phase(1, 4.0, 250.0)], boot_s=90.0, pack=glm)  # no base of its shape
    late = "not healthy: still booting when its wait ended, 312 s after its start"  # run.py's Server.unhealthy()
    _write(tmp_path, "late", None, ok=False, error=late)
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu" / "table.py"), str(tmp_path), "--base", "base"],
                         capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    assert lines[0].startswith("| server | base | boot s | c1 ms/step (× base) | c8 ms/step (× base) |")
    ours = next(ln for ln in lines if ln.startswith("| ours |"))
    assert ours == "| ours | base | 150 | 6.00 (1.20) | 9.00 (1.50) | 160 | 880 | 15,000 (0.75) |"
    other = next(ln for ln in lines if ln.startswith("| other-shape |"))
    assert other.startswith("| other-shape | – | 90 | 4.00 (–) | – (–) | 250 |")
    assert "- `ours` was measured with base idle beside it" in lines
    assert f"- `late`: {late}" in lines


def test_a_folder_without_rows_is_one_clear_error(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu" / "table.py"), str(tmp_path)],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "no serve-*.json rows" in r.stderr and "Traceback" not in r.stderr


def test_profiled_servers_get_a_table_of_device_time_by_class(tmp_path):
    """stepprofile's windows (profile-LABEL.json) become one column per server and concurrency; a class one window
    lacks is "–", and the busy total, the overlapping sum and the profiled step close the table."""
    qwen = {"shape": "qwen3-30b-a3b", "layers": 48}
    _write(tmp_path, "ours", [_phase(1, 4.3, 230.0)], boot_s=130.0, pack=qwen)

    def window(c, classes, busy, inclusive, ms):
        return {"concurrency": c, "by_class_us_per_step": classes, "us_per_step": busy,
                "inclusive_us_per_step": inclusive, "server_ms_per_step": ms}

    (tmp_path / "profile-ours.json").write_text(json.dumps({"label": "ours", "windows": [
        window(1, {"exl3 moe gemm": 900.0, "attention": 500.0}, 1400.0, 1900.0, 1.5),
        window(8, {"exl3 moe gemm": 3400.0}, 3400.0, 3700.0, 3.5)]}))
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu" / "table.py"), str(tmp_path)],
                         capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    assert "| class | ours c1 | ours c8 |" in lines
    assert lines[lines.index("| class | ours c1 | ours c8 |") + 2:][:5] == [
        "| exl3 moe gemm | 900 | 3,400 |", "| attention | 500 | – |", "| **device busy** | 1,400 | 3,400 |",
        "| kernels' durations summed (overlapping) | 1,900 | 3,700 |",
        "| the server's step under the profiler | 1,500 | 3,500 |"]


def test_a_profile_from_before_exclusive_counting_is_marked(tmp_path):
    """Windows written before stepprofile counted exclusive time carry only `us_per_step`, the overlapping sum: it
    goes to that row, the busy row says "–", and the column is marked."""
    _write(tmp_path, "ours", [_phase(1, 4.3, 230.0)], boot_s=130.0, pack={"shape": "q", "layers": 48})
    (tmp_path / "profile-ours.json").write_text(json.dumps({"label": "ours", "windows": [
        {"concurrency": 1, "by_class_us_per_step": {"exl3 moe gemm": 1179.0}, "us_per_step": 5804.0,
         "server_ms_per_step": 4.93}]}))
    lines = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu" / "table.py"), str(tmp_path)],
                           capture_output=True, text=True, check=True).stdout.splitlines()
    assert "| class | ours c1 † |" in lines
    assert "| **device busy** | – |" in lines and "| kernels' durations summed (overlapping) | 5,804 |" in lines
    assert any(ln.startswith("† profiled before kernels were counted exclusive") for ln in lines)


def test_steps_at_two_to_five_sequences_read_as_verify_steps_with_their_break_even_acceptance(tmp_path):
    """A server measured at 1, 2 and 4 sequences: k = 1 and 3 get the step over the 1-sequence step and the acceptance
    rate at which k free drafts pay for it ((1 - a^(k+1)) / (1 - a) = ratio); k = 2 was not measured; a step at
    k + 1 sequences that costs k + 1 plain steps never pays."""
    qwen = {"shape": "qwen3-30b-a3b", "layers": 48}
    _write(tmp_path, "ours", [_phase(1, 4.0, 250.0), _phase(2, 4.4, 450.0), _phase(4, 16.0, 250.0),
                              _phase(8, 8.0, 1000.0)], boot_s=100.0, pack=qwen)
    _write(tmp_path, "only-batch-1", [_phase(1, 5.0, 200.0)], boot_s=100.0, pack=qwen)
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu" / "table.py"), str(tmp_path)],
                         capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    assert "| server | c1 ms/step | k = 1 | k = 3 |" in lines
    # k = 1: 1 + a = 1.1 -> a = 0.10; k = 3: 16 / 4 = 4 = k + 1 -> never
    assert "| ours | 4.00 | 1.100 (0.10) | 4.000 (never) |" in lines
    assert not any(ln.startswith("| only-batch-1 | 5.00 |") for ln in lines)


def test_the_graph_a_step_ran_is_named_from_the_servers_log():
    """graph_rows: the sizes the server logged it captured (the eighteenth run's default list: 3 sequences ran the
    4-row graph, 5 the 8-row one); without a log, the --compilation-config it was given; with neither, unknown."""
    sys.path.insert(0, str(ROOT / "bench" / "gpu"))
    import table

    r = table.load_rows(ROOT / "bench" / "results" / "s18-h100" / "serve")["exl3-4b-native"]
    assert r["graphs"][:5] == [1, 2, 4, 8, 16] and r["graphs"][-1] == 128
    assert [table.graph_rows(r, n) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, 16]
    assert [table.graph_rows(r, n) for n in r["graphs"]] == r["graphs"]
    given = json.dumps({"cudagraph_capture_sizes": [1, 2, 3, 5]})
    exact = {"graphs": None, "row": {"argv": ["--compilation-config", given]}}
    assert [table.graph_rows(exact, n) for n in (3, 4, 5, 6)] == [3, 5, 5, None]
    assert table.graph_rows({"graphs": None, "row": {"argv": ["--max-num-seqs", "64"]}}, 3) is None
