"""save -> restart the server (``python -m rlblocks.tinker``, a new process) -> load is bit-exact: weights and Adam
moments, shown by identical log-probs and an identical next step, and by byte-equal re-saved tensors."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from tinker_testlib import MODEL

TIMEOUT = 180


class CliServer:
    """``python -m rlblocks.tinker`` in a subprocess; ready once it prints the line with its URL."""

    def __init__(self, model_dir: str, state_dir: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rlblocks.tinker", "--model", f"{MODEL}={model_dir}", "--port", "0",
             "--state-dir", str(state_dir)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in self.proc.stdout], daemon=True).start()
        seen = []
        while True:
            try:
                line = lines.get(timeout=TIMEOUT)
            except queue.Empty:
                self.stop()
                pytest.fail(f"the server printed no URL within {TIMEOUT} s: {seen}")
            seen.append(line)
            if line.startswith("rlblocks.tinker: serving"):
                self.base_url = line.split(" at ")[1].split()[0]
                return

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def _types():
    from tinker import types

    return types


def datum(tokens):
    types = _types()
    return types.Datum(model_input=types.ModelInput.from_ints(list(tokens[:-1])),
                       loss_fn_inputs={"target_tokens": list(tokens[1:]), "weights": [1.0] * (len(tokens) - 1)})


DATA = [datum([1, 40, 41, 42, 43, 2]), datum([1, 50, 51, 52, 53, 54, 2])]


def _logprobs(tc):
    return [o["logprobs"].to_torch() for o in tc.forward(DATA, "cross_entropy").result(TIMEOUT).loss_fn_outputs]


def _step(tc):
    types = _types()
    fb = tc.forward_backward(DATA, "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=5.0)).result(TIMEOUT)
    return fb.result(TIMEOUT).metrics["loss:sum"]


def _files(state: Path, path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    run, kind, name = path[len("tinker://"):].split("/")
    d = state / "runs" / run / kind / name
    return {**load_file(str(d / "adapter_model.safetensors")),
            **{f"opt/{k}": v for k, v in load_file(str(d / "optimizer.safetensors")).items()}}


def test_save_restart_load_is_bit_exact(tinker_model_dir, tinker_env, tmp_path):
    import tinker

    state = tmp_path / "state"
    first = CliServer(tinker_model_dir, state)
    try:
        sc = tinker.ServiceClient(base_url=first.base_url)
        tc = sc.create_lora_training_client(base_model=MODEL, rank=8, seed=4).result(TIMEOUT)
        for _ in range(3):
            _step(tc)
        path = tc.save_state("roundtrip").result(TIMEOUT).path
        saved_logprobs = _logprobs(tc)
        next_loss = _step(tc)  # what the step after the checkpoint gives, with the moments it had
        after_next = _logprobs(tc)
        run_id = tc.model_id
        sc.close("success").result(TIMEOUT)
    finally:
        first.stop()

    second = CliServer(tinker_model_dir, state)
    try:
        sc = tinker.ServiceClient(base_url=second.base_url)
        rest = tinker.RestClient(base_url=second.base_url)
        listed = rest.list_checkpoints(run_id).result(TIMEOUT).checkpoints
        assert [c.tinker_path for c in listed] == [path]  # the restarted server lists earlier checkpoints
        assert rest.get_training_run(run_id).result(TIMEOUT).lora_rank == 8
        loaded = sc.create_training_client_from_state_with_optimizer(path).result(TIMEOUT)
        for a, b in zip(_logprobs(loaded), saved_logprobs):
            assert torch.equal(a, b)  # the weights, bit for bit
        resaved = loaded.save_state("resaved").result(TIMEOUT).path
        want, got = _files(state, path), _files(state, resaved)
        assert sorted(want) == sorted(got) and any(k.endswith("exp_avg_sq") for k in want)
        for k in want:
            assert torch.equal(want[k], got[k]), k  # weights, both Adam moments and the step count
        assert _step(loaded) == next_loss
        for a, b in zip(_logprobs(loaded), after_next):
            assert torch.equal(a, b)  # the next step used the restored moments
        fresh = sc.create_training_client_from_state(path).result(TIMEOUT)  # weights only: new moments
        for a, b in zip(_logprobs(fresh), saved_logprobs):
            assert torch.equal(a, b)
        _step(fresh)
        assert any(not torch.equal(a, b) for a, b in zip(_logprobs(fresh), after_next))
        sc.close("success").result(TIMEOUT)
    finally:
        second.stop()
