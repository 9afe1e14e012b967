"""Synchronous verifiers for the process-pool tests: module level, so a worker process can import them by name."""

import os
import signal
import time

from rlblocks.reward import RewardResult


def behave(sample):
    """Do what ``sample.metadata["mode"]`` says; the score of a normal call is ``metadata["i"]``."""
    mode, i = sample.metadata["mode"], sample.metadata["i"]
    if mode == "ok":
        time.sleep(sample.metadata.get("sleep", 0.0))
        return float(i)
    if mode == "result":
        return RewardResult(float(i), {"half": i / 2}, details={"pid": os.getpid()})
    if mode == "hang":
        while True:  # busy, in the interpreter: only killing the process stops it
            pass
    if mode == "raise":
        raise ValueError(f"bad sample {i}")
    if mode == "crash":
        os._exit(3)
    if mode == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    if mode == "error_result":
        return RewardResult.failure(f"verifier says no to {i}")
    if mode == "invalid":
        return "not a reward"
    if mode == "print":
        print("noise on stdout must not break the protocol")
        return float(i)
    if mode == "memory":
        return len(bytearray(1 << 32))
    raise AssertionError(mode)


def loaded(names):
    """Which of ``names`` are imported in this (worker) process."""
    import sys

    return [n for n in names if n in sys.modules]


def first_attempt_dies(sample):
    """The first call of a sample (no ``metadata["marker"]`` file yet) writes its pid there and then dies as
    ``metadata["how"]`` says: ``"killed"`` waits to be killed by the test, ``"hang"`` blocks until the pool's
    timeout kills its worker, ``"crash"`` exits at once. A later call (in a fresh worker) scores ``metadata["i"]``."""
    marker = sample.metadata["marker"]
    if not os.path.exists(marker):
        tmp = f"{marker}.{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(str(os.getpid()))
        os.replace(tmp, marker)  # the test sees a whole pid or nothing
        how = sample.metadata["how"]
        if how == "crash":
            os._exit(7)
        while True:  # "killed" or "hang": only killing the process ends this call
            time.sleep(3600)
    return float(sample.metadata["i"])


def where(_sample=None):
    """The ``rlblocks`` package directory this worker imported, and the head of its ``sys.path``."""
    import sys

    import rlblocks

    return os.path.dirname(os.path.abspath(rlblocks.__file__)), sys.path[:2]
