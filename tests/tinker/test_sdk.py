"""The official tinker SDK (ServiceClient, TrainingClient, SamplingClient, RestClient) against the running server,
checked against float64 references computed outside the server."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from tinker_testlib import MODEL, RL_MODEL, merged_reference, ref_logprobs

from rlblocks.tinker.losses import check_loss_config

TIMEOUT = 120


def _types():
    from tinker import types

    return types


def datum(tokens, **inputs):
    types = _types()
    return types.Datum(model_input=types.ModelInput.from_ints(list(tokens[:-1])),
                       loss_fn_inputs={"target_tokens": list(tokens[1:]), **inputs})


SEQS = [[1, 40, 41, 42, 43, 44, 45, 2], [1, 50, 51, 52, 2], [1, 60, 61, 62, 63, 64, 65, 66, 67, 2]]


def _train_client(service_client, seed=0, rank=8, **kw):
    return service_client.create_lora_training_client(base_model=MODEL, rank=rank, seed=seed, **kw).result(TIMEOUT)


def _adapter_dir(server, path: str) -> Path:
    run, kind, name = path[len("tinker://"):].split("/")
    return Path(server.service.store.root) / run / kind / name


def test_capabilities_info_and_healthz(server, service_client, tinker_model_dir):
    import httpx
    import tinker

    rest = tinker.RestClient(base_url=server.base_url)
    caps = rest.get_server_capabilities().result(TIMEOUT)
    assert [m.model_name for m in caps.supported_models] == [MODEL, RL_MODEL]
    assert caps.supported_models[0].max_context_length == 512
    assert httpx.get(f"{server.base_url}/api/v1/healthz").json() == {"status": "ok"}
    tc = _train_client(service_client, rank=4, train_unembed=False)
    info = tc.get_info()
    assert info.model_name == MODEL and info.lora_rank == 4 and info.is_lora
    from transformers import AutoTokenizer

    # tokenizer_id is the model's own directory, so get_tokenizer() needs no hub
    assert tc.get_tokenizer().get_vocab() == AutoTokenizer.from_pretrained(tinker_model_dir).get_vocab()


def test_forward_logprobs_equal_float64_reference_after_training(server, service_client, ref_model):
    types = _types()
    tc = _train_client(service_client, seed=1)
    data = [datum(s, weights=[1.0] * (len(s) - 1)) for s in SEQS]
    fresh = tc.forward(data, "cross_entropy").result(TIMEOUT)
    for s, out in zip(SEQS, fresh.loss_fn_outputs):  # B = 0: the adapter starts as the identity
        torch.testing.assert_close(out["logprobs"].to_torch().double(), ref_logprobs(ref_model, s[:-1], s[1:]),
                                   rtol=0, atol=2e-5)
    for _ in range(3):
        fb = tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=5e-3)).result(TIMEOUT)
        fb.result(TIMEOUT)
    path = tc.save_state("after3").result(TIMEOUT).path
    trained = tc.forward(data, "cross_entropy").result(TIMEOUT)
    ref = merged_reference(ref_model, _adapter_dir(server, path))
    moved = 0.0
    for s, out, before in zip(SEQS, trained.loss_fn_outputs, fresh.loss_fn_outputs):
        got = out["logprobs"].to_torch().double()
        torch.testing.assert_close(got, ref_logprobs(ref, s[:-1], s[1:]), rtol=0, atol=5e-5)
        moved = max(moved, (got - before["logprobs"].to_torch().double()).abs().max().item())
    assert moved > 0.05  # the adapter really moved the policy (else the comparison above proves little)


def test_cross_entropy_steps_lower_the_loss_and_report_the_sum(service_client):
    types = _types()
    tc = _train_client(service_client, seed=2)
    data = [datum(s, weights=[1.0] * (len(s) - 1)) for s in SEQS]
    losses = []
    for _ in range(5):
        fb = tc.forward_backward(data, "cross_entropy")
        op = tc.optim_step(types.AdamParams(learning_rate=1e-2))
        r = fb.result(TIMEOUT)
        op.result(TIMEOUT)
        total = -sum(o["logprobs"].to_torch().double().sum().item() for o in r.loss_fn_outputs)
        assert r.metrics["loss:sum"] == pytest.approx(total, rel=1e-5)  # a sum over every token, weights 1
        losses.append(r.metrics["loss:sum"])
    assert losses[-1] < 0.8 * losses[0], losses


LOSS_CASES = [("cross_entropy", None), ("importance_sampling", None), ("ppo", None),
              ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}), ("cispo", None),
              ("dro", {"beta": 0.2}), ("gspo", None)]


def _rl_reference(loss_fn, cfg, lp, q, a, w, m):
    r = torch.exp(lp - q)
    if loss_fn == "cross_entropy":
        return (-lp * w).sum()
    if loss_fn == "importance_sampling":
        return -(r * a).sum()
    lo, hi = cfg.get("clip_low_threshold"), cfg.get("clip_high_threshold")
    if loss_fn == "ppo":
        return -torch.min(r * a, r.clamp(lo, hi) * a).sum()
    if loss_fn == "cispo":
        return -(r.clamp(lo, hi) * lp * a).sum()
    if loss_fn == "dro":
        return -(lp * a - 0.5 * cfg["beta"] * (lp - q) ** 2).sum()
    s = torch.exp((lp - q)[m != 0].mean())
    return -torch.min(s * a, s.clamp(lo, hi) * a).sum()


@pytest.mark.parametrize("loss_fn,config", LOSS_CASES)
def test_every_loss_through_the_service_matches_float64(service_client, ref_model, loss_fn, config):
    """``loss:sum`` of a forward_backward equals Tinker's formula on float64 reference log-probs."""
    tc = _train_client(service_client, seed=3)
    g = torch.Generator().manual_seed(7)
    data, parts = [], []
    for s in SEQS:
        n = len(s) - 1
        lp = ref_logprobs(ref_model, s[:-1], s[1:])
        q = (lp + 0.4 * torch.randn(n, generator=g, dtype=torch.float64)).float().double()
        m = torch.ones(n, dtype=torch.float64)
        m[0] = 0.0
        a = (torch.randn(n, generator=g, dtype=torch.float64) * m).float().double()
        w = torch.rand(n, generator=g, dtype=torch.float64).float().double()
        if loss_fn == "cross_entropy":
            inputs = {"weights": w.float()}
        else:
            inputs = {"logprobs": q.float(), "advantages": a.float()}
            if loss_fn == "gspo":
                inputs["sequence_ratio_mask"] = m.float()
        data.append(datum(s, **inputs))
        parts.append((lp, q, a, w, m))
    cfg = check_loss_config(loss_fn, config)
    out = tc.forward_backward(data, loss_fn, config).result(TIMEOUT)
    ref = sum(_rl_reference(loss_fn, cfg, *p).item() for p in parts)
    assert out.metrics["loss:sum"] == pytest.approx(ref, rel=1e-4, abs=1e-4)


def test_accumulation_and_order_match_one_big_batch(service_client):
    """forward_backward calls before an optim_step add their gradients: fb(A); fb(B); step == fb(A + B); step."""
    types = _types()
    a, b = _train_client(service_client, seed=5), _train_client(service_client, seed=5)
    data = [datum(s, weights=[1.0] * (len(s) - 1)) for s in SEQS]
    adam = types.AdamParams(learning_rate=1e-2)
    futs = [a.forward_backward(data[:1], "cross_entropy"), a.forward_backward(data[1:], "cross_entropy"),
            a.optim_step(adam)]  # submitted without waiting: they run in submission order
    fb_all = b.forward_backward(data, "cross_entropy")
    b.optim_step(adam).result(TIMEOUT)
    r1, r2 = futs[0].result(TIMEOUT), futs[1].result(TIMEOUT)
    assert futs[2].result(TIMEOUT).metrics["grad_norm"] > 0
    assert r1.metrics["loss:sum"] + r2.metrics["loss:sum"] == pytest.approx(fb_all.result(TIMEOUT).metrics["loss:sum"],
                                                                            rel=1e-6)
    la = a.forward(data, "cross_entropy").result(TIMEOUT).loss_fn_outputs
    lb = b.forward(data, "cross_entropy").result(TIMEOUT).loss_fn_outputs
    before = fb_all.result(TIMEOUT).loss_fn_outputs
    for x, y, z in zip(la, lb, before):
        torch.testing.assert_close(x["logprobs"].to_torch(), y["logprobs"].to_torch(), rtol=0, atol=1e-5)
        assert (x["logprobs"].to_torch() - z["logprobs"].to_torch()).abs().max() > 1e-3  # the step moved them


def test_forward_backward_custom_equals_the_builtin_loss(service_client):
    """A client-side custom loss (sent as a linear surrogate) trains exactly like the built-in cross_entropy."""
    types = _types()
    builtin, custom = _train_client(service_client, seed=6), _train_client(service_client, seed=6)
    data = [datum(s, weights=[1.0] * (len(s) - 1)) for s in SEQS]
    adam = types.AdamParams(learning_rate=1e-2)

    def nll(batch, logprobs):
        loss = sum(-lp.sum() for lp in logprobs)
        return loss, {"nll:sum": loss.item()}

    fb_c = custom.forward_backward_custom(data, nll)
    custom.optim_step(adam).result(TIMEOUT)
    fb_b = builtin.forward_backward(data, "cross_entropy")
    builtin.optim_step(adam).result(TIMEOUT)
    rc, rb = fb_c.result(TIMEOUT), fb_b.result(TIMEOUT)
    assert rc.metrics["loss:sum"] == pytest.approx(rb.metrics["loss:sum"], rel=1e-6)
    assert rc.metrics["nll:sum"] == pytest.approx(rb.metrics["loss:sum"], rel=1e-6)
    oc = custom.forward(data, "cross_entropy").result(TIMEOUT).loss_fn_outputs
    ob = builtin.forward(data, "cross_entropy").result(TIMEOUT).loss_fn_outputs
    for x, y in zip(oc, ob):
        torch.testing.assert_close(x["logprobs"].to_torch(), y["logprobs"].to_torch(), rtol=0, atol=1e-5)


def test_sampled_logprobs_equal_teacher_forced_logprobs_of_the_published_weights(server, service_client, ref_model):
    types = _types()
    tc = _train_client(service_client, seed=8)
    data = [datum(s, weights=[1.0] * (len(s) - 1)) for s in SEQS]
    for _ in range(2):
        tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-2))
    sampler = tc.save_weights_and_get_sampling_client().result(TIMEOUT)
    path = tc.save_weights_for_sampler("published").result(TIMEOUT).path
    ref = merged_reference(ref_model, _adapter_dir(server, path))
    prompt = [1, 40, 41, 42]
    res = sampler.sample(types.ModelInput.from_ints(prompt), 6, types.SamplingParams(max_tokens=8, seed=11),
                         include_prompt_logprobs=True).result(TIMEOUT)
    assert len(res.sequences) == 6 and len({s.sequence_id for s in res.sequences}) == 6
    for s in res.sequences:
        toks = prompt + s.tokens
        want = ref_logprobs(ref, toks[:-1], toks[1:])[len(prompt) - 1:]
        torch.testing.assert_close(torch.tensor(s.logprobs, dtype=torch.float64), want, rtol=0, atol=5e-5)
        assert s.stop_reason == ("stop" if s.tokens[-1] == 2 else "length")
    assert res.prompt_logprobs[0] is None
    torch.testing.assert_close(torch.tensor(res.prompt_logprobs[1:], dtype=torch.float64),
                               ref_logprobs(ref, prompt[:-1], prompt[1:]), rtol=0, atol=5e-5)
    # the same seed gives the same samples; a sampling client from the named path samples the same weights
    again = sampler.sample(types.ModelInput.from_ints(prompt), 6, types.SamplingParams(max_tokens=8, seed=11))
    assert [s.tokens for s in again.result(TIMEOUT).sequences] == [s.tokens for s in res.sequences]
    named = service_client.create_sampling_client(model_path=path).result(TIMEOUT)
    greedy = named.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=6, temperature=0.0))
    toks = list(prompt)
    for _ in range(6):
        nxt = int(ref(input_ids=torch.tensor([toks])).logits[0, -1].argmax())
        toks.append(nxt)
        if nxt == 2:
            break
    assert greedy.result(TIMEOUT).sequences[0].tokens == toks[len(prompt):]


def test_sampling_parameters(service_client, ref_model, tinker_model_dir):
    from transformers import AutoTokenizer

    types = _types()
    base = service_client.create_sampling_client(base_model=MODEL).result(TIMEOUT)
    prompt = types.ModelInput.from_ints([1, 40, 41])
    # stop token ids: the output ends at (and includes) the first stop token
    long = base.sample(prompt, 8, types.SamplingParams(max_tokens=24, seed=3)).result(TIMEOUT)
    pick = next(s.tokens[3] for s in long.sequences if len(s.tokens) > 4)
    stopped = base.sample(prompt, 8, types.SamplingParams(max_tokens=24, seed=3, stop=[pick])).result(TIMEOUT)
    for s_long, s_stop in zip(long.sequences, stopped.sequences):
        if pick in s_long.tokens:
            assert s_stop.tokens == s_long.tokens[: s_long.tokens.index(pick) + 1] and s_stop.stop_reason == "stop"
    # a stop string ends the output at the token that completes it
    tok = AutoTokenizer.from_pretrained(tinker_model_dir)
    text = tok.decode(long.sequences[0].tokens)
    needle = text[2:4]
    cut = base.sample(prompt, 8, types.SamplingParams(max_tokens=24, seed=3, stop=[needle])).result(TIMEOUT)
    got = cut.sequences[0]
    assert needle in tok.decode(got.tokens) and needle not in tok.decode(got.tokens[:-1])
    assert got.stop_reason == "stop" and got.tokens == long.sequences[0].tokens[: len(got.tokens)]
    # max_tokens, top-k prompt logprobs and top-k sample logprobs
    res = base.sample(prompt, 2, types.SamplingParams(max_tokens=3, temperature=0.7), topk_prompt_logprobs=3,
                      topk_sample_logprobs=2).result(TIMEOUT)
    assert all(len(s.tokens) <= 3 for s in res.sequences)
    lsm = torch.log_softmax(ref_model(input_ids=torch.tensor([[1, 40, 41]])).logits[0].double(), -1)
    top = res.topk_prompt_logprobs
    assert top[0] is None and len(top) == 3
    vals, ids = lsm[1].topk(3)
    assert [t for t, _ in top[2]] == ids.tolist()
    assert [v for _, v in top[2]] == pytest.approx(vals.tolist(), abs=5e-5)
    for s in res.sequences:
        assert len(s.topk_logprobs) == len(s.tokens) and all(len(r) == 2 for r in s.topk_logprobs)
    lp = base.compute_logprobs(types.ModelInput.from_ints([1, 40, 41, 42])).result(TIMEOUT)
    torch.testing.assert_close(torch.tensor(lp[1:], dtype=torch.float64),
                               ref_logprobs(ref_model, [1, 40, 41], [40, 41, 42]), rtol=0, atol=5e-5)
    assert math.isfinite(lp[1])


def test_rest_checkpoints_runs_and_samplers(server, service_client):
    import tinker

    tc = _train_client(service_client, seed=9, rank=4)
    state = tc.save_state("s1").result(TIMEOUT).path
    sampler_path = tc.save_weights_for_sampler("w1").result(TIMEOUT).path
    rest = tinker.RestClient(base_url=server.base_url)
    cps = rest.list_checkpoints(tc.model_id).result(TIMEOUT).checkpoints
    assert {(c.checkpoint_id, c.checkpoint_type, c.tinker_path) for c in cps} == {
        ("weights/s1", "training", state), ("sampler_weights/w1", "sampler", sampler_path)}
    run = rest.get_training_run_by_tinker_path(state).result(TIMEOUT)
    assert run.base_model == MODEL and run.lora_rank == 4 and run.last_checkpoint.tinker_path == state
    info = rest.get_weights_info_by_tinker_path(state).result(TIMEOUT)
    assert info.base_model == MODEL and info.lora_rank == 4 and info.train_unembed
    rest.delete_checkpoint_from_tinker_path(sampler_path).result(TIMEOUT)
    assert [c.checkpoint_id for c in rest.list_checkpoints(tc.model_id).result(TIMEOUT).checkpoints] == ["weights/s1"]
    assert tc.model_id in [r.training_run_id for r in rest.list_training_runs(limit=100).result(TIMEOUT).training_runs]
    sampler = tc.save_weights_and_get_sampling_client().result(TIMEOUT)
    assert rest.get_sampler(sampler._sampling_session_id).result(TIMEOUT).base_model == MODEL
    overwrite = tc.save_state("s1", overwrite=True).result(TIMEOUT)
    assert overwrite.path == state


def test_every_adapter_on_a_shared_base_trains_the_layers_it_asked_for(server, service_client):
    """Adapters are added to one peft model; each gets exactly the linear layers of its own LoraConfig."""
    training = server.service.hosts[MODEL].training
    clients = [_train_client(service_client, seed=i, rank=r, train_mlp=mlp, train_attn=attn, train_unembed=head)
               for i, (r, mlp, attn, head) in enumerate([(4, True, True, True), (2, False, True, False),
                                                         (8, True, False, True), (4, True, True, True)])]
    for tc, (mlp, attn, head) in zip(clients, [(True, True, True), (False, True, False), (True, False, True),
                                               (True, True, True)]):
        names = {k.split(".lora_")[0] for k in training._adapters[tc.model_id].params}
        assert any(".mlp." in n for n in names) == mlp
        assert any(".self_attn." in n for n in names) == attn
        assert any(n.endswith("lm_head") for n in names) == head
        assert not any("base_layer" in n or ".lora_" in n for n in names)
        assert len(names) == (6 if mlp else 0) + (8 if attn else 0) + (1 if head else 0)


def test_a_checkpoint_saved_again_under_its_name_samples_its_new_weights(service_client):
    types = _types()
    tc = _train_client(service_client, seed=10)
    path = tc.save_weights_for_sampler("again").result(TIMEOUT).path
    sampler = service_client.create_sampling_client(model_path=path).result(TIMEOUT)
    prompt, params = types.ModelInput.from_ints([1, 40, 41]), types.SamplingParams(max_tokens=6, seed=1)
    sampler.sample(prompt, 1, params).result(TIMEOUT)  # the engine now holds the first save
    data = [datum(s, weights=[1.0] * (len(s) - 1)) for s in SEQS]
    for _ in range(2):
        tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=2e-2))
    assert tc.save_weights_for_sampler("again").result(TIMEOUT).path == path
    (seq,) = sampler.sample(prompt, 1, params).result(TIMEOUT).sequences
    toks = [1, 40, 41, *seq.tokens]
    now = tc.forward([datum(toks, weights=[1.0] * (len(toks) - 1))], "cross_entropy").result(TIMEOUT)
    torch.testing.assert_close(torch.tensor(seq.logprobs), now.loss_fn_outputs[0]["logprobs"].to_torch()[2:],
                               rtol=0, atol=1e-4)
