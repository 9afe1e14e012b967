"""Prefix trees against brute force: which slots attend to which, the node of every (sequence, position), the
token budget split (no response token lost or duplicated), and bad input."""

from __future__ import annotations

import random

import pytest
import torch

from rlblocks.errors import ArgumentError
from rlblocks.rollout import build_batch
from rlblocks.sched import build_prefix_tree, response_prefix_tree


def _random_sequences(rng: random.Random, n: int, vocab: int = 3, max_len: int = 9) -> list[list[int]]:
    """Sequences over a tiny vocabulary (many shared prefixes), some forking off others, some empty."""
    seqs: list[list[int]] = []
    for _ in range(n):
        if seqs and rng.random() < 0.6:
            base = rng.choice(seqs)
            cut = rng.randint(0, len(base))
            seq = base[:cut] + [rng.randrange(vocab) for _ in range(rng.randint(0, 4))]
        else:
            seq = [rng.randrange(vocab) for _ in range(rng.randint(0, max_len))]
        seqs.append(seq[:max_len])
    return seqs


def _brute_mask(tree, seqs) -> torch.Tensor:
    """allowed[f, g]: flat slot f attends to flat slot g iff some sequence has g at a position <= that of f;
    plus every slot to itself (padding sees only itself)."""
    total = tree.num_rows * tree.row_len
    allowed = torch.eye(total, dtype=torch.bool)
    for s, seq in enumerate(seqs):
        slots = tree.index[s, : len(seq)].tolist()
        for p, f in enumerate(slots):
            for g in slots[: p + 1]:
                allowed[f, g] = True
    return allowed


def _flat_mask(tree) -> torch.Tensor:
    """The tree's own ancestor mask as a ``[R·N, R·N]`` block-diagonal matrix (rows never see each other)."""
    n, r = tree.row_len, tree.num_rows
    dense = tree.ancestor_mask()[:, 0]
    out = torch.zeros(r * n, r * n, dtype=torch.bool)
    for i in range(r):
        out[i * n : (i + 1) * n, i * n : (i + 1) * n] = dense[i]
    return out


def _check_layout(tree, seqs) -> None:
    flat_ids, flat_pos = tree.input_ids.reshape(-1), tree.position_ids.reshape(-1)
    used: set[int] = set()
    for s, seq in enumerate(seqs):
        idx = tree.index[s]
        assert (idx[len(seq) :] == -1).all()
        slots = idx[: len(seq)]
        assert (slots >= 0).all()
        assert flat_ids[slots].tolist() == seq  # each position's node holds its token ...
        assert flat_pos[slots].tolist() == list(range(len(seq)))  # ... at its depth (RoPE position)
        assert (slots // tree.row_len == tree.row_of[s]).all()  # a sequence lies whole in one row
        used.update(slots.tolist())
    # every real node belongs to some sequence; rows hold exactly row_tokens real nodes, padding after them
    assert len(used) == tree.num_nodes
    for r in range(tree.num_rows):
        n = int(tree.row_tokens[r])
        assert all(r * tree.row_len + j in used for j in range(n))
    assert tree.lengths.tolist() == [len(q) for q in seqs]
    assert sorted(i for m in tree.members for i in m) == list(range(len(seqs)))


@pytest.mark.parametrize("seed", range(12))
def test_random_trees_against_brute_force(seed):
    rng = random.Random(seed)
    seqs = _random_sequences(rng, rng.randint(1, 14))
    if not any(seqs):
        seqs[0] = [1]
    tree = build_prefix_tree(seqs)
    _check_layout(tree, seqs)
    assert torch.equal(_flat_mask(tree), _brute_mask(tree, seqs))
    # no budget: every distinct non-empty prefix is one node (nothing forwarded twice)
    distinct = {tuple(q[: p + 1]) for q in seqs for p in range(len(q))}
    assert tree.num_nodes == len(distinct)
    # the compressed edges: every ancestor pair in exactly one triangle or rectangle
    cover = torch.zeros(tree.num_rows, tree.row_len, tree.row_len, dtype=torch.int64)
    end = tree.subtree_end
    for r, a, b in tree.edges.tolist():
        cover[r, a:b, a:b] += torch.tril(torch.ones(b - a, b - a, dtype=torch.int64))
        cover[r, b : int(end[r, b - 1]), a:b] += 1
    real = torch.arange(tree.row_len)[None, :] < tree.row_tokens[:, None]
    want = tree.ancestor_mask()[:, 0] & real[:, :, None] & real[:, None, :]
    assert torch.equal(cover, want.long())


@pytest.mark.parametrize("seed", range(8))
def test_budget_split_is_exact(seed):
    rng = random.Random(100 + seed)
    seqs = _random_sequences(rng, rng.randint(2, 16))
    longest = max(len(q) for q in seqs) or 1
    seqs[0] = seqs[0] or [2]
    longest = max(longest, len(seqs[0]))
    for budget in sorted({longest, longest + 3, 2 * longest}):
        tree = build_prefix_tree(seqs, max_tokens=budget)
        _check_layout(tree, seqs)
        assert torch.equal(_flat_mask(tree), _brute_mask(tree, seqs))
        assert int(tree.row_tokens.max()) <= budget
        # never more nodes than one row per sequence
        assert tree.num_nodes <= sum(len(q) for q in seqs)


def test_multiple_of_pads_rows_and_padding_sees_itself():
    tree = build_prefix_tree([[1, 2, 3], [1, 2, 4], [5]], multiple_of=8, pad_id=7)
    assert tree.row_len == 8 and tree.num_nodes == 5
    n = int(tree.row_tokens[0])
    assert (tree.input_ids[0, n:] == 7).all()
    mask = tree.ancestor_mask()[0, 0]
    for j in range(n, 8):
        assert mask[j].nonzero().flatten().tolist() == [j]
        assert not mask[:n, j].any()


def test_share_false_is_plain_packing():
    seqs = [[1, 2, 3], [1, 2, 4], [1, 2]]
    tree = build_prefix_tree(seqs, share=False)
    assert tree.num_nodes == 8
    _check_layout(tree, seqs)
    assert torch.equal(_flat_mask(tree), _brute_mask(tree, seqs))


def _rollout(rows):
    """A RolloutBatch from (prompt, response) lists, through build_batch."""
    from rlblocks.rollout import Generation

    gens = [Generation(request_id=str(i), prompt_ids=list(p), output_ids=list(r), output_logprobs=[-0.5] * len(r),
                       output_versions=[0] * len(r), finish_reason="stop") for i, (p, r) in enumerate(rows)]
    return build_batch(gens, pad_id=0)


def test_response_positions_each_have_one_logit_slot():
    prompt = [9, 8, 7, 6]
    rows = [(prompt, [1, 2, 3]), (prompt, [1, 2, 5, 5]), (prompt, []), (prompt, [1, 2, 3]), ([4, 4], [6]),
            (prompt[:2], [3, 3, 3, 3, 3])]
    batch = _rollout(rows)
    for budget in (None, 9, 12):
        tree = build_prefix_tree(batch, max_tokens=budget)
        li = tree.logit_index
        assert li.shape == batch.response_mask.shape
        assert torch.equal(li >= 0, batch.response_mask)
        flat_ids, flat_pos = tree.input_ids.reshape(-1), tree.position_ids.reshape(-1)
        for b, (p, r) in enumerate(rows):
            for t in range(len(r)):
                slot = int(li[b, t])
                # the slot holds the token before response token t, at its sequence position
                assert int(flat_pos[slot]) == len(p) + t - 1
                assert int(flat_ids[slot]) == (p + r)[len(p) + t - 1]
        # identical rows share their slots; the empty row enters as nothing
        assert torch.equal(li[0], li[3])
        assert tree.lengths[2] == 0
        assert tree.num_nodes < int(batch.response_mask.sum() + torch.tensor([len(p) for p, _ in rows]).sum())


def test_bad_input():
    with pytest.raises(ArgumentError, match=r"max_tokens.*longest sequence"):
        build_prefix_tree([[1, 2, 3], [1]], max_tokens=2)
    with pytest.raises(ArgumentError, match="sequences: expected a non-empty"):
        build_prefix_tree([])
    with pytest.raises(ArgumentError, match=r"sequences\[1\]\[0\]: expected a token id >= 0"):
        build_prefix_tree([[1], [-1]])
    with pytest.raises(ArgumentError, match=r"sequences\[0\]: expected a 1-D integer tensor"):
        build_prefix_tree([torch.tensor([1.0, 2.0])])
    with pytest.raises(ArgumentError, match=r"sequences\[0\]\[1\]"):
        build_prefix_tree([[1, 2.5]])
    with pytest.raises(ArgumentError, match="multiple_of"):
        build_prefix_tree([[1]], multiple_of=0)
    with pytest.raises(ArgumentError, match="share"):
        build_prefix_tree([[1]], share="yes")
    ids = torch.tensor([[1, 2, 3, 4]])
    with pytest.raises(ArgumentError, match=r"prompt_lens: expected an integer tensor of shape \[1\]"):
        response_prefix_tree(ids, torch.tensor([1, 2]), torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(ArgumentError, match=r"response_mask: expected shape \[1, T\]"):
        response_prefix_tree(ids, torch.tensor([2]), torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(ArgumentError, match="past input_ids' length"):
        response_prefix_tree(ids, torch.tensor([2]), torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ArgumentError, match="prompt_lens: expected values >= 1"):
        response_prefix_tree(ids, torch.tensor([0]), torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(ArgumentError, match="max_tokens: expected >= the longest row"):
        response_prefix_tree(ids, torch.tensor([2]), torch.ones(1, 2, dtype=torch.bool), max_tokens=2)
    with pytest.raises(ArgumentError, match="input_ids: expected an integer tensor"):
        response_prefix_tree(ids.float(), torch.tensor([2]), torch.ones(1, 2, dtype=torch.bool))
