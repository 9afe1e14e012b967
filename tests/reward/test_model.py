"""RewardModel: scores against a manual float64 forward of each unpadded sequence, any padding side, any pad id."""

import asyncio
import copy

import pytest
import torch

pytest.importorskip("transformers")

from rlblocks.errors import ArgumentError
from rlblocks.reward import RewardModel, Sample

PROMPTS = ["what is 2+3? ", "7*6=", "abc", "x", "1+1=", "say yes: "]
RESPONSES = ["5", "42.", "def ghi jkl", "y z", "2", "yes yes yes yes"]


@pytest.fixture(scope="module")
def rm(tiny_rm_dir):
    return RewardModel.from_pretrained(tiny_rm_dir, batch_size=4)


def manual(model, ids, *, head=None):
    """The reference: float64 copy, one unpadded sequence at a time, head on the last token's hidden state."""
    m64 = copy.deepcopy(model).double()
    h64 = copy.deepcopy(head).double() if head is not None else m64.score
    with torch.no_grad():
        out = []
        for row in ids:
            h = m64.base_model(input_ids=torch.tensor([row])).last_hidden_state[0, -1]
            out.append(h64(h)[0])
        return torch.stack(out)


def test_scores_match_a_manual_forward(rm):
    scores = rm.score(PROMPTS, RESPONSES)
    ids = [rm.tokenizer(p + r)["input_ids"] for p, r in zip(PROMPTS, RESPONSES)]
    assert len({len(i) for i in ids}) > 3  # lengths differ, so batches really are padded
    ref = manual(rm.model, ids)
    assert scores.dtype == torch.float32 and scores.shape == (len(PROMPTS),)
    torch.testing.assert_close(scores.double(), ref, atol=1e-5, rtol=1e-5)
    assert ref.std() > 0.1  # rewards differ: the comparison is not between constants
    with torch.no_grad():  # HF's own pooling agrees on unpadded rows (no pad token in them)
        hf = torch.stack([rm.model(input_ids=torch.tensor([i])).logits[0, 0] for i in ids])
    torch.testing.assert_close(scores, hf, atol=1e-5, rtol=1e-5)


def test_from_pretrained_in_bfloat16(tiny_rm_dir, rm):
    half = RewardModel.from_pretrained(tiny_rm_dir, dtype=torch.bfloat16)
    assert next(half.model.parameters()).dtype == torch.bfloat16
    s = half.score(PROMPTS, RESPONSES)
    assert s.dtype == torch.float32
    full = rm.score(PROMPTS, RESPONSES)
    torch.testing.assert_close(s, full, atol=0.05 * full.abs().max().item(), rtol=0.05)


def test_left_and_right_padding_give_the_same_scores(rm):
    left = RewardModel(rm.model, rm.tokenizer, padding_side="left", batch_size=6)
    torch.testing.assert_close(left.score(PROMPTS, RESPONSES), rm.score(PROMPTS, RESPONSES), atol=1e-5, rtol=1e-5)
    rows, _ = rm.encode(PROMPTS, RESPONSES)
    L = max(map(len, rows)) + 2
    ids_r = torch.full((len(rows), L), 7)
    ids_l = torch.full((len(rows), L), 9)  # the pad id is irrelevant: the mask marks padding
    mask_r = torch.zeros(len(rows), L, dtype=torch.bool)
    mask_l = torch.zeros(len(rows), L, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids_r[i, : len(r)] = torch.tensor(r)
        mask_r[i, : len(r)] = True
        ids_l[i, L - len(r) :] = torch.tensor(r)
        mask_l[i, L - len(r) :] = True
    torch.testing.assert_close(rm.score_ids(ids_r, mask_r), rm.score_ids(ids_l, mask_l.long()), atol=1e-5, rtol=1e-5)


def test_pad_token_equal_to_eos_is_handled(tiny_rm_dir):
    rm = RewardModel.from_pretrained(tiny_rm_dir, append_eos=True)
    eos = rm.tokenizer.eos_token_id
    rm.tokenizer.pad_token = rm.tokenizer.eos_token  # a common setting: pad with EOS
    rm.model.config.pad_token_id = eos
    rows, _ = rm.encode(PROMPTS, RESPONSES)
    assert all(r[-1] == eos for r in rows)
    ref = manual(rm.model, rows)
    torch.testing.assert_close(rm.score(PROMPTS, RESPONSES).double(), ref, atol=1e-5, rtol=1e-5)
    # HF's pooling (rightmost token that is not the pad id) reads the token BEFORE the final EOS: wrong here
    L = max(map(len, rows))
    ids = torch.tensor([r + [eos] * (L - len(r)) for r in rows])
    with torch.no_grad():
        hf = rm.model(input_ids=ids, attention_mask=(torch.arange(L) < torch.tensor([len(r) for r in rows])[:, None])
                      .long()).logits[:, 0]
    assert (hf.double() - ref).abs().max() > 1e-3


def test_causal_lm_with_a_scalar_head(tiny_hf_dir):
    from transformers import AutoTokenizer, LlamaForCausalLM

    lm = LlamaForCausalLM.from_pretrained(tiny_hf_dir).eval()
    tok = AutoTokenizer.from_pretrained(tiny_hf_dir)
    torch.manual_seed(1)
    head = torch.nn.Linear(lm.config.hidden_size, 1)
    rm = RewardModel(lm, tok, head=head, batch_size=3, padding_side="left")
    ids = [tok(p + r)["input_ids"] for p, r in zip(PROMPTS, RESPONSES)]
    torch.testing.assert_close(rm.score(PROMPTS, RESPONSES).double(), manual(lm, ids, head=head), atol=1e-5,
                               rtol=1e-5)


def test_absolute_positions_follow_the_mask_with_left_padding():
    from transformers import GPT2Config, GPT2ForSequenceClassification

    torch.manual_seed(3)
    cfg = GPT2Config(vocab_size=50, n_embd=32, n_layer=2, n_head=2, n_positions=64, num_labels=1, pad_token_id=0)
    gpt = GPT2ForSequenceClassification(cfg).eval()
    rm = RewardModel(gpt)
    rows = [[5, 7, 9, 3], [11, 3], [8, 8, 8, 8, 8, 3]]
    L = 7
    ids = torch.zeros(3, L, dtype=torch.long)
    mask = torch.zeros(3, L, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, L - len(r) :] = torch.tensor(r)
        mask[i, L - len(r) :] = 1
    ref = manual(gpt, rows)
    torch.testing.assert_close(rm.score_ids(ids, mask).double(), ref, atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # positions counted from the row start (no position_ids) would shift these rows
        h = gpt.base_model(input_ids=ids, attention_mask=mask).last_hidden_state[:, -1]
    assert (gpt.score(h)[:, 0].double() - ref).abs().max() > 1e-3


def test_encoder_classifier_is_called_whole_with_right_padding():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(2)
    cfg = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, num_labels=1, max_position_embeddings=64)
    bert = BertForSequenceClassification(cfg).eval()
    rm = RewardModel(bert)
    assert rm.pooling == "model"
    rows = [[2, 5, 7, 9, 3], [2, 11, 3], [2, 8, 8, 8, 8, 8, 3]]
    L = 8
    ids = torch.zeros(3, L, dtype=torch.long)
    mask = torch.zeros(3, L, dtype=torch.long)
    for i, r in enumerate(rows):  # LEFT padded: BERT's absolute positions need the tokens moved to the left
        ids[i, L - len(r) :] = torch.tensor(r)
        mask[i, L - len(r) :] = 1
    with torch.no_grad():
        ref = torch.stack([bert(input_ids=torch.tensor([r])).logits[0, 0] for r in rows])
    torch.testing.assert_close(rm.score_ids(ids, mask), ref, atol=1e-5, rtol=1e-5)


def test_truncation_keeps_the_end(rm):
    short = RewardModel(rm.model, rm.tokenizer, max_length=4)
    rows, cut = short.encode(PROMPTS, RESPONSES)
    full, _ = rm.encode(PROMPTS, RESPONSES)
    assert rows == [f[-4:] for f in full] and cut == [len(f) > 4 for f in full]
    torch.testing.assert_close(short.score(PROMPTS, RESPONSES).double(), manual(rm.model, rows), atol=1e-5,
                               rtol=1e-5)
    r = asyncio.run(short(Sample(RESPONSES[0], prompt=PROMPTS[0])))
    assert r.details["truncated"] and r.details["num_tokens"] == 4


def test_async_calls_are_gathered_into_batches(rm):
    async def main():
        return await asyncio.gather(*(rm(Sample(r, prompt=p)) for p, r in zip(PROMPTS * 2, RESPONSES * 2)))

    results = asyncio.run(main())
    expect = rm.score(PROMPTS * 2, RESPONSES * 2)
    torch.testing.assert_close(torch.tensor([r.score for r in results]), expect, atol=1e-5, rtol=1e-5)
    sizes = [r.details["batch_rows"] for r in results]
    assert max(sizes) == rm.batch_size and sum(1 / s for s in sizes) == pytest.approx(3)  # batches of 4, 4, 4


def test_chat_template(rm):
    tok = copy.deepcopy(rm.tokenizer)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }};{% endfor %}"
    chat = RewardModel(rm.model, tok, chat=True)
    rows, _ = chat.encode(["1+1="], ["2"])
    assert rows == [tok("1+1=;2;", add_special_tokens=False)["input_ids"]]
    torch.testing.assert_close(chat.score(["1+1="], ["2"]).double(), manual(rm.model, rows), atol=1e-5, rtol=1e-5)


def test_gradient_for_training_the_reward_model(rm):
    model = copy.deepcopy(rm.model)
    train = RewardModel(model, rm.tokenizer)
    rows, _ = train.encode(PROMPTS[:3], RESPONSES[:3])
    ids, mask = train._batch(rows)
    train.score_ids(ids, mask, grad=True).sum().backward()
    # d(sum of rewards)/d(score.weight) = sum of the last valid hidden states
    with torch.no_grad():
        h = torch.stack([model.base_model(input_ids=torch.tensor([r])).last_hidden_state[0, -1] for r in rows])
    torch.testing.assert_close(model.score.weight.grad[0], h.sum(0), atol=1e-5, rtol=1e-5)
    assert rm.score_ids(ids, mask).grad_fn is None  # the default keeps no graph


def test_bad_inputs(rm):
    ids = torch.ones(2, 4, dtype=torch.long)
    with pytest.raises(ArgumentError, match="contiguous"):
        rm.score_ids(ids, torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]]))
    with pytest.raises(ArgumentError, match="contiguous"):
        rm.score_ids(ids, torch.tensor([[0, 0, 0, 0], [1, 1, 1, 1]]))
    with pytest.raises(ArgumentError, match="attention_mask"):
        rm.score_ids(ids, torch.ones(2, 3))
    with pytest.raises(ArgumentError, match="input_ids"):
        rm.score_ids(ids.float(), torch.ones(2, 4))
    with pytest.raises(ArgumentError, match="tokenizer"):
        RewardModel(rm.model).score(["a"], ["b"])
    with pytest.raises(ArgumentError, match="prompts"):
        rm.score(["a", "b"], ["c"])
    two = RewardModel(rm.model, rm.tokenizer, head=torch.nn.Linear(rm.model.config.hidden_size, 2))
    with pytest.raises(ArgumentError, match="one reward per row"):
        two.score(["a"], ["b"])
    r = asyncio.run(two(Sample("b", prompt="a")))  # the async call turns it into an error result
    assert not r.ok and "one reward per row" in r.error


@pytest.mark.gpu
def test_on_cuda_matches_cpu(rm):
    gpu = RewardModel(copy.deepcopy(rm.model), rm.tokenizer, device="cuda", batch_size=4, padding_side="left")
    torch.testing.assert_close(gpu.score(PROMPTS, RESPONSES), rm.score(PROMPTS, RESPONSES), atol=1e-4, rtol=1e-4)
    bf16 = RewardModel(copy.deepcopy(rm.model).to(torch.bfloat16), rm.tokenizer, device="cuda")
    s = bf16.score(PROMPTS, RESPONSES)
    assert s.dtype == torch.float32
    torch.testing.assert_close(s, rm.score(PROMPTS, RESPONSES), atol=0.1, rtol=0.05)
