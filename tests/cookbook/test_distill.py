"""On-policy distillation in the cookbook (``cookbook/distill.py``, ``grpo_sync.py --distill-from``): teacher
log-probs against a float64 reference, the update of each mode against an independent float64 gradient, the
teacher's loading rules, and a short run in which the student's KL to the teacher falls."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import distill
import grpo_sync
import pytest
import torch
import toy
from plumbing import PolicyLogprobs, batch_tensors, parse_flags

from rlblocks.checkpoint import save_checkpoint
from rlblocks.errors import ArgumentError

# a deprecated rlblocks name (the library's DeprecationWarnings all start with "rlblocks:") fails the test
pytestmark = pytest.mark.filterwarnings("error:rlblocks:DeprecationWarning")


@pytest.fixture(scope="module")
def tok():
    return toy.build_tokenizer()


def fresh_model(tok, seed: int) -> torch.nn.Module:
    """The demo's architecture with random weights (a different ``seed`` gives a different model)."""
    return toy.build_tiny_model(tok, seed=seed).eval()


def save_model(tok, model, path: Path) -> str:
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def sample_batch(tok, seed: int = 0, n_groups: int = 3, k: int = 4) -> dict[str, torch.Tensor]:
    """Cookbook batch tensors for random "responses" (1..6 random tokens after an addition prompt)."""
    g = torch.Generator().manual_seed(seed)
    groups = []
    for i in range(n_groups):
        a, b = (int(x) for x in torch.randint(0, 100, (2,), generator=g))
        samples = []
        for _ in range(k):
            n = int(torch.randint(1, 7, (1,), generator=g))
            out = torch.randint(4, len(tok), (n,), generator=g).tolist()
            samples.append({"output_ids": out, "output_logprobs": [-1.0] * n, "output_versions": [0] * n,
                            "finish_reason": "length", "reward": float(torch.rand((), generator=g) < 0.5)})
        groups.append({"uid": f"g{i}", "pair": (a, b), "prompt_ids": toy.encode_prompt(tok, a, b),
                       "samples": samples, "version": 0, "rank": 0})
    return batch_tensors(groups, tok.pad_token_id, torch.device("cpu"))


def logits64(model, bt) -> torch.Tensor:
    """Float64 next-token logits ``[B, L-1, V]`` of ``model`` (a float64 copy of it unless it is float64 already:
    the independent reference)."""
    m64 = model if next(model.parameters()).dtype == torch.float64 else copy.deepcopy(model).double()
    return m64(input_ids=bt["input_ids"], attention_mask=bt["attention_mask"]).logits[:, :-1]


def cfg_of(**kw) -> SimpleNamespace:
    base = dict(loss="ppo", eps_low=None, eps_high=None, rollout_weight_cap=None, ppo_epochs=1, mini_batches=1,
                agg="token-mean", grad_clip=1e9, seed=0, temperature=1.0, distill_mode="sampled",
                distill_reward_weight=0.0, distill_discount=0.0)
    return SimpleNamespace(**{**base, **kw})


# ------------------------------------------------------------------------------------------------ teacher log-probs
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_teacher_logprobs_match_float64_reference(tok, temperature):
    teacher, bt = fresh_model(tok, 1), sample_batch(tok)
    got = distill.teacher_logprobs(teacher, bt, temperature)
    ref = (logits64(teacher, bt) / temperature).log_softmax(-1)
    ref = torch.where(bt["mask"], ref.gather(-1, bt["labels"].clamp(min=0)[..., None])[..., 0], 0.0)
    assert got.dtype == torch.float32 and got.shape == bt["labels"].shape and not got.requires_grad
    torch.testing.assert_close(got.double(), ref, rtol=0, atol=2e-5)
    assert (got[~bt["mask"]] == 0).all()


# ------------------------------------------------------------------------------------------------ the update
def reverse_kl64(student, teacher, bt, temperature=1.0) -> torch.Tensor:
    """Token-mean over the sampled positions of Σ_v p_s (log p_s − log p_t), from float64 logits."""
    ls = (logits64(student, bt) / temperature).log_softmax(-1)
    lt = (logits64(teacher, bt) / temperature).log_softmax(-1).detach()
    kl = (ls.exp() * (ls - lt)).sum(-1)
    return torch.where(bt["mask"], kl, 0.0).sum() / bt["mask"].sum()


def sgd_delta(student, run) -> list[torch.Tensor]:
    before = [p.detach().clone() for p in student.parameters()]
    run()
    return [p.detach() - b for p, b in zip(student.parameters(), before)]


def test_dense_step_is_minus_lr_times_the_float64_reverse_kl_gradient(tok):
    # a small step, so that the KL's first-order decrease is what the last line sees
    student, teacher, bt, lr = fresh_model(tok, 1), fresh_model(tok, 2), sample_batch(tok), 0.05
    student.train()
    s64 = copy.deepcopy(student).double()
    kl0 = reverse_kl64(s64, teacher, bt, 0.8)
    grads = torch.autograd.grad(kl0, list(s64.parameters()))
    policy = PolicyLogprobs(student, 0.8)
    cfg = cfg_of(distill_mode="dense", temperature=0.8)
    m = {}
    delta = sgd_delta(student, lambda: m.update(distill.distill_step(
        cfg, policy, torch.optim.SGD(policy.parameters(), lr=lr), bt, teacher)))
    for d, g in zip(delta, grads):
        torch.testing.assert_close(d.double(), -lr * g, rtol=1e-3, atol=1e-6)
    assert m["distill_kl_dense"] == pytest.approx(float(kl0.detach()), rel=1e-4)
    # the student moved toward the teacher
    assert float(reverse_kl64(student, teacher, bt, 0.8).detach()) < float(kl0.detach())


@pytest.mark.parametrize("discount", [0.0, 0.9])
def test_sampled_step_follows_the_teacher_minus_student_advantage(tok, discount):
    """On-policy (rollout_logp = the student's own log-probs): the update is −lr·∇ of
    −mean_t A_t·log π(y_t) with A_t = Σ_{k≥t} γ^{k−t} (log π_teacher(y_k) − log π_student(y_k)), in float64;
    to first order it raises the log-prob of the tokens the teacher prefers (Σ A_t Δlog π_t > 0)."""
    student, teacher, bt, lr = fresh_model(tok, 1), fresh_model(tok, 2), sample_batch(tok), 0.5
    mask = bt["mask"]
    ls0 = torch.where(mask, logits64(student, bt).log_softmax(-1).gather(-1, bt["labels"].clamp(min=0)[..., None])
                      [..., 0], 0.0)
    lt = torch.where(mask, logits64(teacher, bt).log_softmax(-1).gather(-1, bt["labels"].clamp(min=0)[..., None])
                     [..., 0], 0.0).detach()
    bt["rollout_logp"] = ls0.detach().float()
    adv = (lt - ls0).detach()
    if discount:  # per row, every position one step, masked positions contribute 0
        acc = torch.zeros(adv.shape[0], dtype=torch.float64)
        out = torch.zeros_like(adv)
        for t in range(adv.shape[1] - 1, -1, -1):
            acc = adv[:, t] + discount * acc
            out[:, t] = torch.where(mask[:, t], acc, 0.0)
        adv = out
    s64 = copy.deepcopy(student).double().train()
    lp = torch.where(mask, s64(input_ids=bt["input_ids"], attention_mask=bt["attention_mask"]).logits[:, :-1]
                     .log_softmax(-1).gather(-1, bt["labels"].clamp(min=0)[..., None])[..., 0], 0.0)
    grads = torch.autograd.grad(-(adv * lp).sum() / mask.sum(), list(s64.parameters()))
    student.train()
    policy = PolicyLogprobs(student)
    delta = sgd_delta(student, lambda: distill.distill_step(
        cfg_of(distill_discount=discount), policy, torch.optim.SGD(policy.parameters(), lr=lr), bt, teacher))
    for d, g in zip(delta, grads):
        torch.testing.assert_close(d.double(), -lr * g, rtol=1e-3, atol=1e-6)
    # direction: a small step along the update raises Σ_t A_t log π(y_t) (first-order: the gradient is followed)
    ls1 = torch.where(mask, logits64(student, bt).log_softmax(-1).gather(-1, bt["labels"].clamp(min=0)[..., None])
                      [..., 0], 0.0)
    assert float((adv * (ls1 - ls0)).sum().detach()) > 0


@pytest.mark.parametrize("mode", ["sampled", "dense"])
def test_reward_weight_adds_the_grpo_advantage(tok, mode):
    """--distill-reward-weight w: sampled, the advantage is A_distill + w·A_GRPO; dense, the loss is KL + w·GRPO
    loss. With a teacher equal to the student, A_distill = 0 and the KL's gradient is 0 (its minimum), so the
    step is w × the plain GRPO step."""
    student, bt, lr = fresh_model(tok, 1).train(), sample_batch(tok), 0.5
    teacher = copy.deepcopy(student).eval().requires_grad_(False)
    with torch.no_grad():
        bt["rollout_logp"] = distill.teacher_logprobs(student, bt)
    d_mix = sgd_delta(student, lambda: distill.distill_step(
        cfg_of(distill_reward_weight=2.0, distill_mode=mode), PolicyLogprobs(student),
        torch.optim.SGD(student.parameters(), lr=lr), bt, teacher))
    student2 = copy.deepcopy(teacher).train().requires_grad_(True)
    g_cfg = SimpleNamespace(**vars(cfg_of()), correction="none", correction_cap=None, kl_coef=0.0)
    d_grpo = sgd_delta(student2, lambda: grpo_sync.grpo_step(
        g_cfg, PolicyLogprobs(student2), torch.optim.SGD(student2.parameters(), lr=lr), bt))
    assert sum(float(d.abs().sum()) for d in d_grpo) > 0
    for a, b in zip(d_mix, d_grpo):
        torch.testing.assert_close(a, 2.0 * b, rtol=1e-3, atol=1e-6)


def test_dense_epochs_and_mini_batches_match_float64_sgd(tok):
    """2 epochs × 2 mini-batches in dense mode: the loops' documented shuffle (seed·1 000 003 + step), each update
    SGD on the float64 token-mean reverse KL of its mini-batch's rows."""
    student, teacher, bt, lr, step = fresh_model(tok, 1).train(), fresh_model(tok, 2), sample_batch(tok), 0.05, 4
    cfg = cfg_of(distill_mode="dense", ppo_epochs=2, mini_batches=2, seed=3)
    s64 = copy.deepcopy(student).double()
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    for _ in range(cfg.ppo_epochs):
        for rows in torch.randperm(bt["mask"].shape[0], generator=gen).tensor_split(cfg.mini_batches):
            mb = {k: v[rows] for k, v in bt.items()}
            grads = torch.autograd.grad(reverse_kl64(s64, teacher, mb), list(s64.parameters()))
            with torch.no_grad():
                for p, g in zip(s64.parameters(), grads):
                    p -= lr * g
    m = distill.distill_step(cfg, PolicyLogprobs(student), torch.optim.SGD(student.parameters(), lr=lr), bt,
                             teacher, step=step)
    assert m["ppo_updates"] == 4
    for p, q in zip(student.parameters(), s64.parameters()):
        torch.testing.assert_close(p.detach().double(), q.detach(), rtol=1e-3, atol=1e-6)


# ------------------------------------------------------------------------------------------------ the teacher's file
def test_load_teacher_from_an_hf_dir_and_from_a_run_ckpt(tok, tmp_path):
    student_dir = save_model(tok, fresh_model(tok, 1), tmp_path / "student")
    teacher = fresh_model(tok, 2)
    hf_dir = save_model(tok, teacher, tmp_path / "teacher")
    run = tmp_path / "run"
    run.mkdir()  # what every loop's run checkpoint holds: {"model": state_dict, "optim": ..., "step": ...}
    save_checkpoint(run / "ckpt.pt", {"model": teacher.state_dict(), "step": 3, "counters": {"samples": 1}})
    plain = tmp_path / "plain.pt"  # a plain torch.save file of the same shape
    torch.save({"model": teacher.state_dict(), "step": 3}, plain)
    bt = sample_batch(tok)
    want = distill.teacher_logprobs(teacher, bt)
    for path in (hf_dir, str(run), str(run / "ckpt.pt"), str(plain)):
        t = distill.load_teacher(path, student_dir, torch.device("cpu"))
        assert not t.training and not any(p.requires_grad for p in t.parameters())
        torch.testing.assert_close(distill.teacher_logprobs(t, bt), want, rtol=0, atol=1e-6)
    data = (run / "ckpt.pt").read_bytes()
    (run / "ckpt.pt").write_bytes(data[: len(data) - 100])  # torn: refused, never half-loaded
    with pytest.raises(ArgumentError, match=r"--distill-from: .*torn checkpoint"):
        distill.load_teacher(str(run), student_dir, torch.device("cpu"))


def test_load_teacher_refuses_what_cannot_be_a_teacher(tok, tmp_path):
    student_dir = save_model(tok, fresh_model(tok, 1), tmp_path / "student")
    with pytest.raises(ArgumentError, match=r"--distill-from.*not found"):
        distill.load_teacher(str(tmp_path / "nope"), student_dir, torch.device("cpu"))
    torch.save({"model": {"actor.w": torch.zeros(2)}}, tmp_path / "bad.pt")
    with pytest.raises(ArgumentError, match=r"--distill-from.*architecture"):
        distill.load_teacher(str(tmp_path / "bad.pt"), student_dir, torch.device("cpu"))
    other = toy.build_tiny_model(tok)
    other.resize_token_embeddings(len(tok) + 8)
    other_dir = save_model(tok, other, tmp_path / "other_vocab")
    with pytest.raises(ArgumentError, match="vocabulary"):
        distill.load_teacher(other_dir, student_dir, torch.device("cpu"))
    with pytest.raises(ArgumentError, match="--distill-mode dense"):
        distill.load_teacher(student_dir, student_dir, torch.device("cpu"), world=2, mode="dense")


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--distill-mode", "dense"], "--distill-mode"),  # no teacher: nothing to distill
        (["--distill-reward-weight", "1"], "--distill-reward-weight"),
        (["--distill-from", "t", "--distill-mode", "dense", "--distill-discount", "0.9"], "--distill-discount"),
        (["--distill-from", "t", "--distill-discount", "1.5"], "--distill-discount"),
        (["--distill-from", "t", "--distill-reward-weight", "-1"], "--distill-reward-weight"),
        (["--distill-from", "t", "--correction", "tis"], "--correction"),
        (["--distill-from", "t", "--kl-coef", "0.1"], "--kl-coef"),
    ],
)
def test_distill_flags_that_would_be_ignored_are_refused(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        parse_flags(grpo_sync.Config, argv, check=grpo_sync.check_flags)
    assert e.value.code == 2 and flag in capsys.readouterr().err


def test_make_demo_distill_flags_parse():
    """The Makefile's demo-distill recipe passes flags grpo_sync.py accepts (the teacher path aside, which the
    recipe makes with make demo-toy)."""
    text = (Path(__file__).resolve().parents[2] / "Makefile").read_text().replace("\\\n", " ")
    recipe = text[text.index("\ndemo-distill:"):]
    line = next(ln for ln in recipe.splitlines() if "grpo_sync.py" in ln)
    argv = line.split("grpo_sync.py", 1)[1].split()
    cfg = parse_flags(grpo_sync.Config, argv, check=grpo_sync.check_flags)
    assert (cfg.distill_from, cfg.distill_mode, cfg.steps, cfg.time_limit) == ("runs/demo/ckpt.pt", "dense", 350, 0)


def test_distill_flags_reach_the_config():
    cfg = parse_flags(grpo_sync.Config, ["--distill-from", "runs/demo", "--distill-reward-weight", "0.5",
                                         "--distill-discount", "0.9"], check=grpo_sync.check_flags)
    assert (cfg.distill_from, cfg.distill_mode, cfg.distill_reward_weight, cfg.distill_discount) == (
        "runs/demo", "sampled", 0.5, 0.9)
    assert parse_flags(grpo_sync.Config, [], check=grpo_sync.check_flags).distill_from == ""


# ------------------------------------------------------------------------------------------------ a short run
# ~7 s a run under load (the demo model is the cookbook tests' shared session fixture), so not marked slow
@pytest.mark.parametrize(("mode", "key"), [("dense", "distill_kl_dense"), ("sampled", "distill_kl_k1")])
def test_short_distillation_run_lowers_the_students_kl_to_the_teacher(demo_model_dir, tok, tmp_path, mode, key):
    """``grpo_sync.py --distill-from``: a student made by perturbing the warm-started demo model (Gaussian noise of
    half each tensor's std on every weight) is distilled back toward it; the reverse KL to the teacher on the
    student's own samples (exact in dense mode, the k1 estimate in sampled mode), averaged over the last 4 of 24
    steps, is under 70 % of its average over the first 4 (measured: ~35-45 %)."""
    from transformers import AutoModelForCausalLM

    student = AutoModelForCausalLM.from_pretrained(demo_model_dir)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in student.parameters():
            p.add_(0.5 * p.std() * torch.randn(p.shape, generator=g))
    student_dir = save_model(tok, student, tmp_path / "student")
    grpo_sync.main(["--model", student_dir, "--distill-from", demo_model_dir, "--distill-mode", mode,
                    "--runs-dir", str(tmp_path), "--name", "d", "--steps", "24", "--time-limit", "0",
                    "--prompts-per-step", "8", "--group-size", "4", "--lr", "3e-4", "--eval-every", "100",
                    "--quiet"])
    rows = [json.loads(line) for line in (tmp_path / "d" / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((tmp_path / "d" / "summary.json").read_text())
    assert len(rows) == 24 and summary["teacher_accuracy"] is not None
    kl = [r[key] for r in rows]
    first, last = sum(kl[:4]) / 4, sum(kl[-4:]) / 4
    assert first > 0.2 and last < 0.7 * first, kl
