"""Worker processes import the parent's rlblocks, whatever directory they start in: the current directory that
``python -c`` puts first on ``sys.path`` is dropped, and a worker that found another rlblocks is refused."""

import os
import shutil
import stat
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import reward_helpers

import rlblocks
from rlblocks.errors import WorkerCrashed
from rlblocks.reward import ProcessWorkers

PACKAGE = os.path.dirname(os.path.abspath(rlblocks.__file__))


def test_a_worker_started_next_to_another_rlblocks_imports_the_parents(tmp_path, monkeypatch):
    # a directory holding a package named rlblocks that cannot be imported: a worker that looked in the current
    # directory first would fail to start (or, with a working copy, run other code than its parent)
    fake = tmp_path / "rlblocks"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('the rlblocks of the current directory was imported')\n")
    monkeypatch.chdir(tmp_path)
    with ProcessWorkers(1) as w:
        package, head = w.run(reward_helpers.where, timeout=60)
    assert os.path.realpath(package) == os.path.realpath(PACKAGE)
    assert "" not in head and str(tmp_path) not in head


def test_a_worker_that_imports_another_rlblocks_is_refused(tmp_path):
    # a complete copy of the package first on the worker's path (an interpreter wrapper puts it there): the worker
    # starts, reports where its rlblocks lives, and the parent refuses it by name
    shutil.copytree(PACKAGE, tmp_path / "copy" / "rlblocks", ignore=shutil.ignore_patterns("__pycache__"))
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH="{tmp_path / "copy"}:$PYTHONPATH" exec "{sys.executable}" "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    with ProcessWorkers(1, python=str(wrapper)) as w:
        with pytest.raises(WorkerCrashed, match=r"imported rlblocks from .*copy"):
            w.run(reward_helpers.where, timeout=60)
        assert w.stats()["crashes"] == 1 and w.stats()["alive"] == 0
