"""The training host's prefix-shared forward_backward: datums that share a prompt give the log-probs, loss and LoRA
gradients of one forward per datum, and the shared prompt is forwarded (and its head positions scored) once."""

from __future__ import annotations

import math

import numpy as np
import torch

from rlblocks.tinker.losses import check_loss_config
from rlblocks.tinker.training import LoraSpec, TrainingHost
from rlblocks.tinker.wire import WireDatum


def _datums(seed: int = 0) -> list[WireDatum]:
    """Two GRPO-like groups (3 and 2 samples) on two prompts of different lengths, plus one lone datum: tokens =
    prompt + response[:-1], targets = the tokens shifted by one, PPO inputs on the response positions only. One
    target differs from the next token on purpose (Tinker allows any target per position)."""
    g = torch.Generator().manual_seed(seed)

    def ints(n: int) -> list[int]:
        return torch.randint(4, 100, (n,), generator=g).tolist()

    out = []
    for prompt_len, n in ((11, 3), (7, 2), (9, 1)):
        prompt = ints(prompt_len)
        for _ in range(n):
            resp = ints(int(torch.randint(2, 7, (1,), generator=g)))
            seq = prompt + resp
            tokens, targets = np.array(seq[:-1]), np.array(seq[1:])
            m = np.zeros(len(tokens), dtype=np.float32)
            m[prompt_len - 1:] = 1.0
            adv = m * float(torch.randn(1, generator=g))
            q = m * (-3.0 + 0.1 * torch.randn(len(tokens), generator=g).numpy())
            out.append(WireDatum(tokens, {"target_tokens": targets, "advantages": adv.astype(np.float32),
                                          "logprobs": q.astype(np.float32)}))
    out[1].inputs["target_tokens"][3] = 5  # a prompt position whose target is not the next token
    return out


def _run(path: str, share: bool, data: list[WireDatum]) -> tuple[np.ndarray, float, dict[str, torch.Tensor], list]:
    torch.manual_seed(0)
    host = TrainingHost("m", path, device=torch.device("cpu"), dtype=torch.float32, prefix_share=share)
    host.create("a", LoraSpec(rank=4, seed=3))
    with torch.no_grad():  # B = 0 at creation: give the adapter a value, so that its gradients reach A too
        for name, p in host._adapters["a"].params.items():
            if ".lora_B." in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    calls: list[int] = []
    body = host._peft.get_base_model().get_decoder()
    hook = body.register_forward_pre_hook(lambda _m, _a, kw: calls.append(int(kw["input_ids"].numel())),
                                          with_kwargs=True)
    runs, metrics = host.forward_backward("a", data, "ppo", check_loss_config("ppo", {}), forward_only=False)
    hook.remove()
    logp = np.concatenate([r.fields["logprobs"] for r in runs])
    grads = {k: p.grad.detach().clone() for k, p in host._adapters["a"].params.items()}
    return logp, metrics["loss:sum"], grads, calls


def test_shared_forward_backward_equals_one_forward_per_datum(tinker_model_dir):
    data = _datums()
    logp_s, loss_s, grads_s, calls_s = _run(tinker_model_dir, True, data)
    logp_u, loss_u, grads_u, calls_u = _run(tinker_model_dir, False, data)
    tokens = sum(len(d.tokens) for d in data)
    assert logp_s.shape == logp_u.shape == (tokens,)
    np.testing.assert_allclose(logp_s, logp_u, rtol=0, atol=2e-5)
    assert math.isclose(loss_s, loss_u, rel_tol=1e-5, abs_tol=1e-6)
    assert grads_s.keys() == grads_u.keys()
    for k in grads_u:
        scale = float(grads_u[k].abs().max())
        assert scale > 0, k
        torch.testing.assert_close(grads_s[k], grads_u[k], rtol=0, atol=1e-4 * scale + 1e-7, msg=k)
    # the shared forward holds each prompt once: fewer token slots than the padded batch, and fewer than the
    # datums' tokens (the two shared prompts are 11 + 7 tokens, forwarded for 5 datums)
    width = max(len(d.tokens) for d in data)
    assert calls_u == [len(data) * width]
    assert len(calls_s) == 1 and calls_s[0] < tokens


def test_float64_reference(tinker_model_dir):
    """The shared path's log-probs against float64 HF logits of each datum on its own (adapter merged)."""
    from transformers import AutoModelForCausalLM

    data = _datums(seed=1)
    host = TrainingHost("m", tinker_model_dir, device=torch.device("cpu"), dtype=torch.float32)
    host.create("a", LoraSpec(rank=4, seed=3))
    with torch.no_grad():
        for name, p in host._adapters["a"].params.items():
            if ".lora_B." in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    runs, _ = host.forward_backward("a", data, "ppo", check_loss_config("ppo", {}), forward_only=True)
    got = np.concatenate([r.fields["logprobs"] for r in runs])
    ref = AutoModelForCausalLM.from_pretrained(tinker_model_dir, dtype=torch.float64).eval()
    state = host.adapter_state("a")
    params = dict(ref.named_parameters())
    with torch.no_grad():
        for key, a in state["tensors"].items():
            if ".lora_A." not in key:
                continue
            module = key.split(".lora_A.")[0].removeprefix("base_model.model.")
            b = state["tensors"][key.replace(".lora_A.", ".lora_B.")]
            params[module + ".weight"].add_((state["config"]["lora_alpha"] / a.shape[0]) * (b.double() @ a.double()))
        want = []
        for d in data:
            logits = ref(input_ids=torch.as_tensor(np.asarray(d.tokens))[None]).logits[0]
            want.append(torch.log_softmax(logits, -1).gather(-1, torch.as_tensor(d.inputs["target_tokens"])[:, None])
                        [:, 0].numpy())
    np.testing.assert_allclose(got, np.concatenate(want), rtol=0, atol=5e-5)


def test_a_lone_datum_runs_unshared(tinker_model_dir):
    data = _datums()[-1:]
    logp_s, loss_s, _, _ = _run(tinker_model_dir, True, data)
    logp_u, loss_u, _, _ = _run(tinker_model_dir, False, data)
    np.testing.assert_array_equal(logp_s, logp_u)
    assert loss_s == loss_u
