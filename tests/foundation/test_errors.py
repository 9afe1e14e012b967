"""The exception hierarchy: every exception class of the library lives in ``rlblocks.errors``, derives from
``RLBlocksError`` and from the built-in a caller would naturally catch."""

from __future__ import annotations

import ast
import builtins
import queue
import subprocess
import sys
from pathlib import Path

import pytest

import rlblocks
from rlblocks import errors

PACKAGE = Path(rlblocks.__file__).resolve().parent

EXPECTED = {  # class -> the built-in (or standard-library) exception it also is
    errors.ArgumentError: ValueError,
    errors.WeightUpdateError: ValueError,
    errors.EngineError: RuntimeError,
    errors.SGLangError: RuntimeError,  # an EngineError
    errors.SyncError: RuntimeError,
    errors.SyncMismatchError: ValueError,  # a refused update: also a WeightUpdateError
    errors.DeltaError: ValueError,  # a WeightUpdateError
    errors.QueueFull: queue.Full,
    errors.QueueClosed: RuntimeError,
    errors.InsufficientGroupsError: RuntimeError,
    errors.SimulationStalled: RuntimeError,
    errors.PrefixMismatchError: ValueError,  # an ArgumentError
    errors.GatewayError: RuntimeError,
    errors.ClientDisconnected: ConnectionError,
    errors.QueueRefused: RuntimeError,  # a GatewayError
    errors.ToolUnavailable: RuntimeError,
    errors.RequestError: ValueError,  # an ArgumentError
    errors.SessionNotFound: ValueError,  # an ArgumentError
    errors.RewardTimeout: TimeoutError,
    errors.WorkerCrashed: RuntimeError,
    errors.WorkerError: RuntimeError,
    errors.SandboxUnavailable: RuntimeError,
    errors.CheckpointError: ValueError,
    errors.NoLiveEngine: RuntimeError,  # an EngineError
    errors.EngineDied: RuntimeError,  # an EngineError
}


def test_every_error_derives_from_the_base_and_its_builtin():
    public = {getattr(errors, n) for n in errors.__all__} - {errors.RLBlocksError}
    assert public == set(EXPECTED), public ^ set(EXPECTED)
    for cls, builtin in EXPECTED.items():
        assert issubclass(cls, rlblocks.RLBlocksError) and issubclass(cls, builtin), cls
        # the built-in is a direct base or comes through another class of this module
        assert any(b is builtin or b.__module__ == errors.__name__ for b in cls.__bases__), cls
    assert issubclass(errors.SyncMismatchError, errors.SyncError)
    assert issubclass(errors.SyncMismatchError, errors.WeightUpdateError)
    assert issubclass(errors.DeltaError, errors.WeightUpdateError)
    assert issubclass(errors.SGLangError, errors.EngineError)
    assert issubclass(errors.PrefixMismatchError, errors.ArgumentError)
    assert issubclass(errors.SessionNotFound, errors.ArgumentError)
    assert issubclass(errors.RequestError, errors.ArgumentError)
    assert issubclass(errors.QueueRefused, errors.GatewayError)
    assert issubclass(errors.NoLiveEngine, errors.EngineError)
    assert rlblocks.RLBlocksError is errors.RLBlocksError


def test_the_errors_table_lists_every_class():
    """The table of exceptions in ``docs/concepts.md`` (Errors) names each class once."""
    lines = (PACKAGE.parent / "docs" / "concepts.md").read_text().splitlines()
    start = lines.index("| class | also a | raised when |") + 2  # past the header and its rule
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    names = [row.split("`")[1] for row in rows]
    assert sorted(names) == sorted(c.__name__ for c in EXPECTED)


def _module_names() -> list[str]:
    return sorted(
        "rlblocks." + ".".join(p.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")
        for p in PACKAGE.rglob("*.py")
        if p.name != "__main__.py"
    )


WALK = r"""
import importlib, inspect, json, sys
found, failed = [], []
for name in sys.argv[1:]:
    try:
        module = importlib.import_module(name)
    except Exception as e:  # reported: every module must import where its extras are installed
        failed.append(f"{name}: {type(e).__name__}: {e}")
        continue
    for _, obj in inspect.getmembers(module, inspect.isclass):
        if issubclass(obj, BaseException) and obj.__module__ == name:
            found.append(f"{name}.{obj.__qualname__}")
print(json.dumps({"found": found, "failed": failed}))
"""


# The sandbox's boot script runs as ``python -I -S -c <its text>`` inside the sandbox, where rlblocks cannot be
# imported; these two private control-flow exceptions are raised and caught inside that interpreter and never reach
# a caller (the host sees only the verdict on the status pipe).
BOOT_PRIVATE = {"rlblocks.sandbox._boot._TooBig", "rlblocks.sandbox._boot._ProgramGone"}


@pytest.mark.slow
def test_no_module_outside_errors_defines_an_exception():
    """Import every module of the package (vllm and the other optional extras are installed in the test
    environment) in a fresh process and list the exception classes each defines: only ``rlblocks.errors`` may."""
    import json

    names = _module_names()
    out = subprocess.run([sys.executable, "-c", WALK, *names], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["failed"] == []
    found = [f for f in result["found"] if f not in BOOT_PRIVATE]
    assert {f.rsplit(".", 1)[0] for f in found} <= {"rlblocks.errors"}, result["found"]
    assert len(found) == len(EXPECTED) + 1


def test_no_source_file_outside_errors_declares_an_exception_class():
    """The same from the source, which also sees classes defined inside functions: no ``class X(...)`` outside
    ``errors.py`` names a built-in exception or a class of ``rlblocks.errors`` among its bases."""
    exception_names = {n for n in dir(builtins) if isinstance(getattr(builtins, n), type)
                       and issubclass(getattr(builtins, n), BaseException)} | set(errors.__all__)
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "errors.py":
            continue
        boot = path == PACKAGE / "sandbox" / "_boot.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                bases = {b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else ""
                         for b in node.bases}
                if boot and f"rlblocks.sandbox._boot.{node.name}" in BOOT_PRIVATE:
                    continue
                if bases & exception_names or any(b.endswith(("Error", "Exception")) for b in bases):
                    offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}")
    assert offenders == []


def test_bad_input_raises_argument_error_naming_the_argument():
    import torch

    from rlblocks.losses import aggregate

    with pytest.raises(errors.ArgumentError, match="mode"):
        aggregate(torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), mode="no-such-mode")
