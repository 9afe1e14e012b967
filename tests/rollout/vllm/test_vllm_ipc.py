"""``VLLMEngine.update_weights_from_ipc``: the colocated CUDA IPC weight path.

On CPU the contract is checked against a stand-in for ``AsyncLLM`` that records the calls the engine makes and
decodes what would reach vLLM's worker with vLLM's own ``IPCWeightTransferUpdateInfo`` (the worker-side parser), so
a field the worker does not accept fails here. The handles themselves are opaque to the engine: it forwards them.
The end-to-end load from real CUDA IPC handles runs only where a GPU is present.
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import pickle
from types import SimpleNamespace

import pytest
import torch

from rlblocks.errors import ArgumentError, WeightUpdateError

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")

SHAPES = {
    "model.embed_tokens.weight": [8, 4],
    "model.layers.0.self_attn.q_proj.weight": [4, 4],
    "model.layers.0.self_attn.k_proj.weight": [4, 4],
    "model.layers.0.self_attn.v_proj.weight": [4, 4],
    "lm_head.weight": [8, 4],
}


class FakeLLM:
    """The slice of ``AsyncLLM`` that the weight paths use; every call is appended to ``calls``."""

    def __init__(self, backend: str | None = "ipc", fail_update: bool = False) -> None:
        self.model_config = SimpleNamespace(
            logprobs_mode="processed_logprobs", max_model_len=64, architectures=["LlamaForCausalLM"], model="fake"
        )
        self.vllm_config = SimpleNamespace(
            scheduler_config=SimpleNamespace(enable_chunked_prefill=False),
            lora_config=None,
            weight_transfer_config=None if backend is None else SimpleNamespace(backend=backend),
        )
        self.calls: list[str] = []
        self.received: list[object] = []
        self.fail_update = fail_update

    async def pause_generation(self, mode: str, clear_cache: bool) -> None:
        assert mode == "keep" and not clear_cache
        self.calls.append("pause")

    async def resume_generation(self) -> None:
        self.calls.append("resume")

    async def reset_prefix_cache(self, reset_running_requests: bool) -> None:
        assert reset_running_requests
        self.calls.append("reset")

    async def update_weight_version(self, v: str) -> None:
        self.calls.append(f"version {v}")

    async def init_weight_transfer_engine(self, request) -> None:
        self.calls.append(f"init {request.init_info}")

    async def start_weight_update(self) -> None:
        self.calls.append("start")

    async def update_weights(self, request) -> None:
        from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferUpdateInfo

        info = dict(request.update_info)
        handles = pickle.loads(base64.b64decode(info.pop("ipc_handles_pickled")))
        # the worker's own parser: field names, equal lengths, one handle per tensor
        self.received.append(IPCWeightTransferUpdateInfo(**info, ipc_handles=handles))
        self.calls.append("update")
        if self.fail_update:
            raise RuntimeError("worker failed to map a handle")

    async def finish_weight_update(self) -> None:
        self.calls.append("finish")

    async def collective_rpc(self, method: str, args: tuple = ()) -> list:
        assert method == "rlblocks_refresh_tied" and not args  # the only worker call of the IPC path
        self.calls.append("refresh tied")
        return [[["lm_head"], []]]


def _engine(llm: FakeLLM):
    from rlblocks.rollout.engines.vllm_engine import VLLMEngine

    return VLLMEngine(llm, version=0, expected_weights=SHAPES)


def _info(names=tuple(SHAPES), dtype="bfloat16"):
    # stand-ins for reduce_tensor args: the engine forwards them untouched, keyed by GPU uuid
    return {
        "names": list(names),
        "dtype_names": [dtype] * len(names),
        "shapes": [SHAPES[n] for n in names],
        "ipc_handles": [{"GPU-0000": ("handle", i, n)} for i, n in enumerate(names)],
    }


def test_ipc_update_runs_vllms_transfer_sequence_and_commits():
    llm = FakeLLM()
    eng = _engine(llm)
    asyncio.run(eng.update_weights_from_ipc(_info(), version=1))
    assert llm.calls == ["pause", "init {'packed': False}", "start", "update", "finish", "refresh tied", "reset",
                         "version 1", "resume"]
    got = llm.received[0]
    assert got.names == list(SHAPES) and got.dtype_names == ["bfloat16"] * 5
    assert got.shapes == list(SHAPES.values())
    assert got.ipc_handles == [{"GPU-0000": ("handle", i, n)} for i, n in enumerate(SHAPES)]
    assert eng.version == 1
    # the transfer engine is initialised once; later updates go straight to start/update/finish
    llm.calls.clear()
    asyncio.run(eng.update_weights_from_ipc(_info(), version=2))
    assert llm.calls == ["pause", "start", "update", "finish", "refresh tied", "reset", "version 2", "resume"]
    assert eng.version == 2


def test_ipc_partial_update_must_send_whole_fused_modules():
    llm = FakeLLM()
    eng = _engine(llm)
    with pytest.raises(WeightUpdateError, match="fused"):
        asyncio.run(eng.update_weights_from_ipc(_info(["model.layers.0.self_attn.q_proj.weight"]), version=1,
                                                partial=True))
    assert llm.calls == [] and eng.version == 0
    qkv = [n for n in SHAPES if "_proj" in n]
    asyncio.run(eng.update_weights_from_ipc(_info(qkv), version=1, partial=True))
    assert llm.received[0].names == qkv and eng.version == 1


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda i: i.update(names=["nope.weight", *i["names"][1:]]), WeightUpdateError, "nope"),
        (lambda i: i.update(shapes=[[9, 9], *i["shapes"][1:]]), WeightUpdateError, "shape"),
        (lambda i: i.update(names=i["names"][:-1], dtype_names=i["dtype_names"][:-1], shapes=i["shapes"][:-1],
                            ipc_handles=i["ipc_handles"][:-1]), WeightUpdateError, "lm_head"),
        (lambda i: i.update(ipc_handles=i["ipc_handles"][:-1]), ArgumentError, "equal lengths"),
        (lambda i: i.update(dtype_names=["bf16"] * 5), ArgumentError, "bf16"),
        (lambda i: i.pop("ipc_handles"), ArgumentError, "missing keys"),
        (lambda i: i.update(ipc_handles=[{}] * 5), ArgumentError, "ipc_handles"),
    ],
)
def test_ipc_bad_update_is_refused_before_anything_is_mapped(change, error, match):
    llm = FakeLLM()
    eng = _engine(llm)
    info = _info()
    change(info)
    with pytest.raises(error, match=match):
        asyncio.run(eng.update_weights_from_ipc(info, version=1))
    assert llm.calls == [] and eng.version == 0


def test_ipc_refuses_a_stale_version_and_an_engine_without_the_ipc_backend():
    llm = FakeLLM()
    eng = _engine(llm)
    asyncio.run(eng.update_weights_from_ipc(_info(), version=3))
    llm.calls.clear()
    with pytest.raises(WeightUpdateError, match="older"):
        asyncio.run(eng.update_weights_from_ipc(_info(), version=2))
    assert llm.calls == [] and eng.version == 3
    for backend in (None, "nccl"):
        other = FakeLLM(backend=backend)
        with pytest.raises(ArgumentError, match="backend"):
            asyncio.run(_engine(other).update_weights_from_ipc(_info(), version=1))
        assert other.calls == []


def test_ipc_failed_transfer_keeps_the_old_version_and_resumes():
    llm = FakeLLM(fail_update=True)
    eng = _engine(llm)
    with pytest.raises(RuntimeError, match="map a handle"):
        asyncio.run(eng.update_weights_from_ipc(_info(), version=1))
    assert eng.version == 0 and llm.calls[-1] == "resume" and "version 1" not in llm.calls
    assert not eng.is_paused


def test_from_pretrained_lets_the_ipc_workers_unpickle_handles(monkeypatch, tmp_path):
    """With ``backend="ipc"`` the engine processes get VLLM_ALLOW_INSECURE_SERIALIZATION=1 while they start (and
    the caller's environment is restored); with another backend they do not."""
    import os

    import vllm.v1.engine.async_llm as async_llm

    from rlblocks.rollout.engines.vllm_engine import VLLMEngine

    seen = []

    def fake_start(args):
        seen.append(os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION"))
        return FakeLLM()

    monkeypatch.setattr(async_llm.AsyncLLM, "from_engine_args", staticmethod(fake_start))
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    VLLMEngine.from_pretrained(tmp_path, weight_transfer_config={"backend": "ipc"}, expected_weights=SHAPES)
    VLLMEngine.from_pretrained(tmp_path, weight_transfer_config={"backend": "nccl"}, expected_weights=SHAPES)
    assert seen == ["1", None]
    assert "VLLM_ALLOW_INSECURE_SERIALIZATION" not in os.environ


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_ipc_update_loads_the_trainers_weights(vllm_model_dir, run, other_model):
    """End to end on a GPU: the trainer's weights handed over by CUDA IPC give the engine the trainer's greedy
    log-probs (fp32 model, reference = the HF model with those weights)."""
    from rlblocks.rollout import GenerationRequest, SamplingParams
    from rlblocks.rollout.engines.vllm_engine import VLLMEngine
    from rlblocks.sync import HandoffSender

    async def go():
        eng = VLLMEngine.from_pretrained(vllm_model_dir, dtype="float32", enforce_eager=True, max_model_len=64,
                                         gpu_memory_utilization=0.2, weight_transfer_config={"backend": "ipc"})
        sender = HandoffSender(device="cuda")
        state = {k: v.cuda() for k, v in other_model.state_dict().items()}
        msg = sender.prepare(state, version=1)
        try:
            await eng.update_weights_from_ipc(sender.vllm_ipc_update_info(msg), version=1)
        finally:
            sender.release(msg)
            sender.close()
        prompt = [1, 5, 9, 13]
        out = await eng.generate(GenerationRequest("r", prompt, SamplingParams(max_tokens=6, temperature=0.0)))
        await eng.aclose()
        return prompt, out

    prompt, out = run(go(), timeout=600)
    ids = torch.tensor([prompt + list(out.output_ids)])
    with torch.no_grad():
        logits = other_model(ids).logits[0, len(prompt) - 1 : -1].double()
    ref = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt):, None])[:, 0]
    assert out.output_versions == [1] * len(out.output_ids)
    torch.testing.assert_close(torch.tensor(out.output_logprobs, dtype=torch.float64), ref, atol=2e-3, rtol=0)


# ---------------------------------------------------------------- routed experts (MoE routing replay, R3)
def _finished(routed):
    from rlblocks.rollout import GenerationRequest

    tok = SimpleNamespace(logprob=-0.5)
    comp = SimpleNamespace(finish_reason="length", token_ids=[7, 8], logprobs=[{7: tok}, {8: tok}],
                           weight_versions=[SimpleNamespace(version="default", start=0, end=2)], routed_experts=routed)
    from rlblocks.rollout.engines.vllm_engine import _InFlight

    return _InFlight(request=GenerationRequest("r", [1, 2, 3])), comp


@pytest.mark.parametrize("dtype, num_experts, want", [("uint8", 8, torch.uint8), ("int32", 200, torch.uint8),
                                                      ("int64", 300, torch.uint16), ("uint16", 60000, torch.uint16)])
def test_routed_experts_reach_the_generation_compactly(dtype, num_experts, want):
    """vLLM's per-request record [positions, layers, top_k] becomes Generation.routed_experts, ids unchanged, in
    the compact dtype rlblocks.rollout.routing uses (uint8 below 256 experts)."""
    import numpy as np

    rng = np.random.default_rng(0)
    record = rng.integers(0, num_experts, size=(4, 3, 2)).astype(dtype)
    record[0, 0, 0] = num_experts - 1
    eng = _engine(FakeLLM())
    gen = eng._to_generation(*_finished(record))
    assert gen.routed_experts.dtype == want and gen.routed_experts.shape == (4, 3, 2)
    assert torch.equal(gen.routed_experts.long(), torch.as_tensor(record.astype("int64")))
    assert eng._to_generation(*_finished(None)).routed_experts is None


@pytest.mark.parametrize("record", [[[1, 2]], [[[-1]]], [[[70000]]], [[[0.5]]]])
def test_malformed_routed_experts_are_an_engine_error(record):
    import numpy as np

    from rlblocks.errors import EngineError

    with pytest.raises(EngineError, match="routed"):
        _engine(FakeLLM())._to_generation(*_finished(np.asarray(record)))


def test_routed_experts_on_cpu_are_refused_at_start(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("the refusal is for engines without CUDA")
    from rlblocks.rollout.engines.vllm_engine import VLLMEngine

    with pytest.raises(ArgumentError, match="record_routing"):
        VLLMEngine.from_pretrained(tmp_path, enable_return_routed_experts=True)
