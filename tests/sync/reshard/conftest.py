"""Fixtures for the resharding tests: multi-process launcher and TEST-ONLY megatron-core CPU patches.

The patches below make megatron-core 0.16.1 build and run ``GPTModel`` on CPU under gloo. They exist only for
tests (applied inside the worker processes); the library never patches megatron.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
WORKERS = HERE / "_workers.py"


def apply_megatron_cpu_patches() -> None:
    """TEST-ONLY: let megatron-core run on CPU.

    1. ``torch.cuda.current_device`` returns ``"cpu"`` (RoPE and the global memory buffer ask for it).
    2. ``get_cuda_rng_tracker().fork()`` becomes a no-op context (attention dropout forks a CUDA RNG).
    3. The causal attention mask is passed explicitly by the caller (see ``causal_mask``), since the CPU softmax path
       does not build one.
    """
    import torch

    torch.cuda.current_device = lambda: "cpu"
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.fork = lambda *args, **kwargs: contextlib.nullcontext()


def causal_mask(seq_len: int):
    """Megatron convention: True marks a masked-out (future) position; shape [1, 1, s, s]."""
    import torch

    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)[None, None]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_workers(task: str, world_size: int = 2, timeout: float = 240.0) -> None:
    """Start ``world_size`` processes running ``_workers.py <task>``; fail the test with every failing rank's output."""
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore")
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKERS), task, str(rank), str(world_size), str(port)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=str(HERE), text=True,
        )
        for rank in range(world_size)
    ]
    outputs, failed = [], []
    try:
        for rank, p in enumerate(procs):
            try:
                out, _ = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
                out += f"\n[rank {rank} killed after {timeout} s]"
            outputs.append(out)
            if p.returncode != 0:
                failed.append(rank)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if failed:
        report = "\n".join(f"----- rank {r} (rc {procs[r].returncode}) -----\n{outputs[r][-6000:]}" for r in failed)
        pytest.fail(f"worker task {task!r} failed on rank(s) {failed}:\n{report}", pytrace=False)


@pytest.fixture
def run_workers():
    """``run_workers(task, world_size=2)`` runs ``tests/sync/reshard/_workers.py`` on that many gloo ranks."""
    return _run_workers
