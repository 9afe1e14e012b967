"""Helpers to launch sync worker processes (separate jobs, no shared torchrun world) on a free port."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

WORKER = Path(__file__).with_name("_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(role: str, *, rank: int, world_size: int, port: int, out: Path, timeout: float, **extra) -> subprocess.Popen:
    cfg = {"role": role, "rank": rank, "world_size": world_size, "port": port, "out": str(out), "timeout": timeout}
    cfg.update(extra)
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1", HF_HUB_OFFLINE="1")
    return subprocess.Popen(
        [sys.executable, str(WORKER), json.dumps(cfg)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env
    )


def result(out: Path) -> dict:
    return json.loads(Path(out).read_text())


def run_ranks(fns, *, timeout: float = 20.0) -> list:
    """Run ``fns[r](group)`` for every rank r in a thread of this process, each rank building its own sync group
    with init_sync_group; returns per-rank results (or the exception a rank raised)."""
    from rlblocks.sync import init_sync_group

    port = free_port()
    out: list = [None] * len(fns)

    def body(r):
        try:
            g = init_sync_group(master_addr="127.0.0.1", master_port=port, world_size=len(fns), rank=r, timeout=timeout)
            out[r] = fns[r](g)
        except Exception as e:
            out[r] = e

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout * 4)
        assert not t.is_alive(), "a rank hung"
    return out
