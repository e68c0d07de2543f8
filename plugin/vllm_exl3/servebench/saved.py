"""Saved runs (`results.json`): read one back to render it again, or to stand in for one side of a head-to-head.
On one Spark the two kernel profiles cannot serve at once (they share the port and the GPU), so side A is measured,
the profile switched, and side B measured against A's saved run with A's exact workload."""

from __future__ import annotations

import json
from pathlib import Path

from .workload import Prompt, Workload

REQUIRED = ("sides", "phases", "workload", "partial")


class SavedRunError(ValueError):
    """The file is not a saved run this command can use (the message names the file and what is wrong)."""


def dumps(run: dict) -> str:
    """The saved form: indented, but one line per request (its chunk timings would otherwise take a line each)."""
    marker = "@request@{}@"
    phases = [{**p, "requests": [marker.format(i) for i in range(len(p["requests"]))]} for p in run["phases"]]
    text = json.dumps({**run, "phases": phases}, indent=1)
    for p in run["phases"]:
        for i, r in enumerate(p["requests"]):
            text = text.replace(json.dumps(marker.format(i)), json.dumps(r), 1)
    return text + "\n"


def load_run(path: str | Path) -> dict:
    try:
        run = json.loads(Path(path).read_text())
    except OSError as e:
        raise SavedRunError(f"{path}: cannot read it: {e.strerror}") from e
    except ValueError as e:
        raise SavedRunError(f"{path}: not JSON ({e})") from e
    missing = [k for k in REQUIRED if not isinstance(run, dict) or k not in run]
    if missing:
        raise SavedRunError(f"{path}: not a saved run of `vllm-exl3 bench` (results.json): it has no "
                            f"{', '.join(missing)}")
    return run


def workload_of(run: dict, path: str | Path) -> Workload:
    """The saved run's workload, prompts included (the other side then sends exactly the same requests)."""
    w = dict(run["workload"])
    try:
        prompts = [Prompt(**p) for p in w.pop("prompts")]
        prefill = [Prompt(**p) for p in w.pop("prefill_prompts", [])]
        return Workload(**w, prompts=prompts, prefill_prompts=prefill)
    except (TypeError, KeyError) as e:
        raise SavedRunError(f"{path}: its workload is not one this version reads ({e})") from e


def common_workload(runs: dict[str, dict]) -> Workload:
    """The workload of saved runs (path -> run), which must all have measured the same one."""
    loaded = [workload_of(run, path) for path, run in runs.items()]
    if any(w.to_json() != loaded[0].to_json() for w in loaded[1:]):
        raise SavedRunError(f"{' and '.join(runs)} were measured with different workloads; a head-to-head "
                            "compares the same requests")
    return loaded[0]


def one_side(run: dict, path: str | Path) -> tuple[dict, list[dict]]:
    """The single side of a complete one-endpoint run, and its phases."""
    if run["partial"]:
        raise SavedRunError(f"{path}: a partial run ({run.get('error')}); measure that side again")
    if len(run["sides"]) != 1:
        raise SavedRunError(f"{path}: a head-to-head run of {len(run['sides'])} sides; a side stands in for one "
                            "endpoint: give a one-endpoint run (vllm-exl3 bench --a URL)")
    ((name, side),) = run["sides"].items()
    return side, [p for p in run["phases"] if p["side"] == name]


def merge(report: dict, name: str, run: dict, path: str | Path, label: str | None) -> None:
    """Put a saved one-endpoint run into `report` as side `name` (its phases renamed), marked as saved."""
    side, phases = one_side(run, path)
    own = side["label"] if side["label"] != side["name"] else name  # a default label is the old side's name
    report["sides"][name] = {**side, "name": name, "label": label or own,
                             "saved_from": str(path), "measured": run.get("started")}
    report["phases"] += [{**p, "side": name} for p in phases]
    report["sides"] = dict(sorted(report["sides"].items()))
