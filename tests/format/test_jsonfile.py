"""format/jsonfile.py: the package's one atomic JSON writer."""

from __future__ import annotations

import json

import pytest

from vllm_exl3.format.jsonfile import write_json


def test_replaces_the_document_and_leaves_no_temp_file(tmp_path):
    path = tmp_path / "sub" / "state.json"
    write_json(path, {"a": 1}, make_parent=True)
    write_json(path, {"a": 2}, indent=1)
    assert json.loads(path.read_text()) == {"a": 2}
    assert [p.name for p in path.parent.iterdir()] == ["state.json"]


def test_a_failed_write_keeps_the_old_document_and_no_temp_file(tmp_path):
    path = tmp_path / "state.json"
    write_json(path, {"a": 1})
    with pytest.raises(TypeError):
        write_json(path, {"a": object()})  # not serializable: nothing is replaced
    assert json.loads(path.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]
