"""The discrete-event simulator: hand-computed batch-barrier times, η = 0 equals the synchronous loop, conservation
of samples, the staleness bound, the closed-form decode sums, and the sizing CLI."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from rlblocks.errors import ArgumentError
from rlblocks.sched import sim
from rlblocks.sched.sim import (
    DecodeCost,
    Hardware,
    Lengths,
    PrefillCost,
    Schedule,
    SyncCost,
    TrainCost,
    Workload,
    cpu_like,
    gpu_like,
    simulate,
)

DECODE = DecodeCost(overhead_s=0.01, weights_s=0.0025, compute_per_seq_s=0.001, compute_per_token_s=1e-4)
PREFILL = PrefillCost(overhead_s=0.02, per_token_s=5e-4)
TRAIN = TrainCost(overhead_s=0.1, per_token_s=1e-3)


def hand_hw(**kw) -> Hardware:
    base = dict(name="hand", decode=DECODE, prefill=PREFILL, train=TRAIN, sync=SyncCost(latency_s=0.05),
                sync_colocated=SyncCost(latency_s=0.03), weight_bytes=0.0, kv_capacity_tokens=10_000, max_batch=64)
    base.update(kw)
    return Hardware(**base)


def step_cost(b: int, ctx: int) -> float:
    """The decode-step formula written out here: overhead + max(memory, compute)."""
    return 0.01 + max(0.0025, 0.001 * b + 1e-4 * ctx)


def test_decode_run_matches_step_by_step_sum():
    rng = random.Random(0)
    for _ in range(300):
        d = DecodeCost(overhead_s=rng.random() * 1e-3, host_per_seq_s=rng.random() * 1e-5,
                       weights_s=rng.random() * 1e-2, kv_per_token_s=rng.random() * 1e-7,
                       compute_per_seq_s=rng.random() * 1e-4, compute_per_token_s=rng.random() * 1e-7)
        b, c0, k = rng.randint(1, 300), rng.randint(0, 200_000), rng.randint(0, 400)
        total, comp = d.run_s(b, c0, k)
        ref = sum(d.step_s(b, c0 + j * b) for j in range(k))
        ref_comp = sum(d.compute_per_seq_s * b + d.compute_per_token_s * (c0 + j * b) for j in range(k)
                       if d.compute_per_seq_s * b + d.compute_per_token_s * (c0 + j * b)
                       > d.weights_s + d.kv_per_token_s * (c0 + j * b))
        assert total == pytest.approx(ref, rel=1e-9, abs=1e-12)
        assert comp == pytest.approx(ref_comp, rel=1e-9, abs=1e-12)


def test_sync_disaggregated_is_exactly_the_batch_barrier_time():
    """Two groups of one sample, lengths 3 and 5, prompts of 2 tokens, one engine: the step waits for the longest."""
    work = Workload(lengths=Lengths.cycle([3, 5]), prompt_lengths=Lengths.fixed(2), batch_groups=2, group_size=1)
    res = simulate(hand_hw(), work, Schedule(mode="sync-disaggregated", steps=2, warmup_steps=0),
                   rollout_devices=1, train_devices=1)
    prefill = 0.02 + 5e-4 * (2 + 2)  # both prompts together; it samples token 1 of each
    # decode: both run (contexts 3 + 3, growing by 2 per step) until the short one has 3 tokens, then the long one
    gen = prefill + step_cost(2, 6) + step_cost(2, 8) + step_cost(1, 5) + step_cost(1, 6)
    train = 0.1 + 1e-3 * ((2 + 3) + (2 + 5))  # packed prompt + response tokens
    step = gen + train + 0.05
    assert res.step_end_s[0] == pytest.approx(step, rel=1e-12)
    # step 2 draws groups 2 and 3: the cycle gives them lengths 3 and 5 again
    assert res.step_end_s[1] == pytest.approx(2 * step, rel=1e-12)
    assert res.trained_tokens == 2 * (3 + 5)
    assert res.staleness_histogram == {0: 16}
    assert res.utilisation["train_busy"] == pytest.approx(2 * train / (2 * step))


def test_sync_colocated_uses_every_device_for_both_phases():
    """Colocated on 2 devices: one engine per device (one group each), then training on both devices."""
    work = Workload(lengths=Lengths.cycle([3, 5]), prompt_lengths=Lengths.fixed(2), batch_groups=2, group_size=1)
    res = simulate(hand_hw(), work, Schedule(mode="sync-colocated", steps=1, warmup_steps=0),
                   rollout_devices=1, train_devices=1)
    one = 0.02 + 5e-4 * 2
    gen = max(one + step_cost(1, 3) + step_cost(1, 4),
              one + step_cost(1, 3) + step_cost(1, 4) + step_cost(1, 5) + step_cost(1, 6))
    train = 0.1 + 1e-3 * 12 / 2  # the variable part is shared by 2 devices
    assert res.step_end_s == [pytest.approx(gen + train + 0.03, rel=1e-12)]


def test_shared_host_contention_slows_only_concurrent_work():
    """With host_contention c, work done while n devices are busy takes 1 + c·(n − 1) times longer (real time)."""
    work = Workload(lengths=Lengths.cycle([3, 5]), prompt_lengths=Lengths.fixed(2), batch_groups=2, group_size=1)
    c = 0.5
    one = 0.02 + 5e-4 * 2
    short = one + step_cost(1, 3) + step_cost(1, 4)
    long = short + step_cost(1, 5) + step_cost(1, 6)
    train = 0.1 + 1e-3 * 12 / 2
    colo = simulate(hand_hw(host_contention=c), work, Schedule(mode="sync-colocated", steps=1, warmup_steps=0),
                    rollout_devices=1, train_devices=1)
    # both engines busy until the short one ends, then one; training and the push keep both devices busy
    assert colo.step_end_s == [pytest.approx((1 + c) * short + (long - short) + (1 + c) * (train + 0.03), rel=1e-12)]
    # one device busy at a time: nothing changes
    plain = simulate(hand_hw(), work, Schedule(mode="sync-disaggregated", steps=2, warmup_steps=0),
                     rollout_devices=1, train_devices=1)
    shared = simulate(hand_hw(host_contention=c), work, Schedule(mode="sync-disaggregated", steps=2, warmup_steps=0),
                      rollout_devices=1, train_devices=1)
    assert shared.step_end_s == plain.step_end_s
    # overlapping rollout and training (async) pays for the overlap
    w = lognormal_work()
    fast = simulate(hand_hw(), w, Schedule(mode="async", max_staleness=1, steps=4), rollout_devices=1, train_devices=1)
    slow = simulate(hand_hw(host_contention=c), w, Schedule(mode="async", max_staleness=1, steps=4),
                    rollout_devices=1, train_devices=1)
    assert fast.wall_s < slow.wall_s < (1 + c) * fast.wall_s
    assert slow.utilisation["rollout_busy"] <= 1.0 and slow.utilisation["train_busy"] <= 1.0


def lognormal_work(**kw) -> Workload:
    base = dict(lengths=Lengths.lognormal(40, 400, maximum=600), prompt_lengths=Lengths.lognormal(20, 60, maximum=80),
                batch_groups=12, group_size=4, seed=3)
    base.update(kw)
    return Workload(**base)


@pytest.mark.parametrize("partial", [True, False])
def test_eta_zero_gives_the_synchronous_result(partial):
    """Admission with η = 0 lets one batch in per version, so the async loop must reproduce the synchronous
    disaggregated loop event for event — here with 3 engines, long-tailed lengths and a KV cache small enough to
    preempt."""
    hw = hand_hw(kv_capacity_tokens=700, max_batch=16)
    work = lognormal_work(lengths=Lengths.lognormal(40, 400, maximum=500))
    sync = simulate(hw, work, Schedule(mode="sync-disaggregated", steps=5), rollout_devices=3, train_devices=2)
    asyn = simulate(hw, work, Schedule(mode="async", max_staleness=0, steps=5, partial_rollout=partial),
                    rollout_devices=3, train_devices=2)
    assert sync.preemptions > 0  # the KV limit was exercised
    assert asyn.step_end_s == sync.step_end_s
    assert asyn.trained_tokens == sync.trained_tokens
    assert asyn.staleness_histogram == sync.staleness_histogram == {0: sync.trained_tokens}
    assert asyn.samples == sync.samples and asyn.samples["dropped"] == 0
    # and a real bound of 1 is faster on the same workload
    one = simulate(hw, work, Schedule(mode="async", max_staleness=1, steps=5), rollout_devices=3, train_devices=2)
    assert one.wall_s < sync.wall_s


CASES = [
    ("sync-disaggregated", dict(dynamic_sampling=True, over_sampling=1.5), dict(zero_variance_p=0.5)),
    ("sync-disaggregated", dict(dynamic_sampling=True, over_sampling=2.0, partial_rollout=False),
     dict(zero_variance_p=0.4)),
    ("sync-colocated", dict(dynamic_sampling=True, over_sampling=2.0, max_rounds=1), dict(zero_variance_p=0.7)),
    ("async", dict(max_staleness=1), {}),
    ("async", dict(max_staleness=1, partial_rollout=False), {}),
    ("async", dict(max_staleness=2, dynamic_sampling=True, max_rounds=2), dict(zero_variance_p=0.5)),
]


@pytest.mark.parametrize(("mode", "sched_kw", "work_kw"), CASES)
def test_conservation_generated_equals_trained_plus_dropped_plus_left(mode, sched_kw, work_kw):
    """Every finished sample is trained, dropped (with a reason) or still somewhere (queue, buffer, in flight).
    The counters are checked against a census of the simulator's samples taken here."""
    hw = hand_hw(kv_capacity_tokens=3_000, max_batch=16)
    work = lognormal_work(**work_kw)
    s = sim._Sim(hw, work, Schedule(mode=mode, steps=6, **sched_kw), 2, 2)
    s.run()
    res = s.result()
    finished = [smp for g in s.groups for smp in g.samples if smp.finished_once]
    census = {"trained": 0, "dropped": 0, "left": 0}
    for smp in finished:
        state = smp.group.state
        census["trained" if state == "trained" else "dropped" if state == "dropped" else "left"] += 1
    assert res.samples["generated"] == len(finished)
    assert {k: res.samples[k] for k in census} == census
    assert res.samples["generated"] == res.samples["trained"] + res.samples["dropped"] + res.samples["left"]
    assert sum(res.dropped_by_reason.values()) == res.samples["dropped"]
    assert res.samples["trained"] <= 6 * work.batch_groups * work.group_size
    # the real blocks' own invariants held over the run
    q = res.queue
    assert q["put"] == q["returned"] + q["stale"] + q["queued"]
    if res.controller is not None:
        c = res.controller
        assert c["submitted"] == c["accepted"] + c["rejected"] + c["running"]
    if res.buffer is not None:
        b = res.buffer
        assert b["samples_added"] == b["samples_popped"] + b["samples_dropped"] + b["samples_held"]
    if sched_kw.get("dynamic_sampling"):
        assert res.dropped_by_reason.get("filtered", 0) > 0
    if mode == "async":  # trained tokens are never older than η
        assert max(res.staleness_histogram) <= sched_kw["max_staleness"]
        assert res.samples["trained"] == 6 * work.batch_groups * work.group_size


def test_stale_drops_beyond_the_slack_do_not_stall_the_loop():
    """Long tails with partial rollout at η = 1: more groups are found stale at consumption than the (η + 1)·B
    slots ahead of training. Each drop gives its admission slot back (StalenessController.on_discard), so the loop
    keeps going; had the slots stayed used, admission would have stopped for good and the run stalled."""
    work = lognormal_work()
    res = simulate(hand_hw(kv_capacity_tokens=50_000), work, Schedule(mode="async", max_staleness=1, steps=20),
                   rollout_devices=1, train_devices=1)
    stale_groups = res.controller["rejected"]
    assert stale_groups * work.group_size == res.dropped_by_reason["stale"]
    assert stale_groups > 2 * work.batch_groups
    assert res.steps == 20 and res.samples["trained"] == 20 * work.batch_groups * work.group_size


def test_partial_rollout_resumes_and_restart_discards():
    """A weight update interrupts long samples: with partial rollout their tokens are kept (re-prefilled), without
    it they are discarded and regenerated, which costs decode work."""
    hw = hand_hw(kv_capacity_tokens=50_000, max_batch=64)
    work = lognormal_work(batch_groups=8)
    keep = simulate(hw, work, Schedule(mode="async", max_staleness=2, steps=6), rollout_devices=1, train_devices=1)
    restart = simulate(hw, work, Schedule(mode="async", max_staleness=2, steps=6, partial_rollout=False),
                       rollout_devices=1, train_devices=1)
    assert keep.tokens["discarded"] == 0 and restart.tokens["discarded"] > 0
    assert restart.tokens["decoded"] > keep.tokens["decoded"] - keep.tokens["discarded"]
    assert len(keep.staleness_histogram) > 1  # resumed samples mix versions


def test_gpu_like_is_memory_bound_then_compute_bound_and_cpu_like_is_not():
    hw = gpu_like("7b")
    d = hw.decode
    per_seq = [d.step_s(b, 0) / b for b in (1, 8, 64, 512, 2048)]
    assert per_seq[0] / per_seq[2] > 30  # memory-bound: a bigger batch is nearly free per sequence ...
    assert per_seq[3] / per_seq[4] < 1.2  # ... until compute dominates
    crossover = (d.weights_s - 0) / d.compute_per_seq_s
    assert 50 < crossover < 500
    c = cpu_like().decode
    assert c.step_s(128, 0) / c.step_s(1, 0) > 2  # a CPU pays for every sequence
    assert hw.kv_capacity_tokens > 100_000


def test_deterministic_and_refuses_bad_input():
    hw, work = cpu_like(), lognormal_work()
    a = simulate(hw, work, Schedule(mode="async", max_staleness=1, steps=3), rollout_devices=1, train_devices=1)
    b = simulate(hw, work, Schedule(mode="async", max_staleness=1, steps=3), rollout_devices=1, train_devices=1)
    assert a.step_end_s == b.step_end_s
    with pytest.raises(ValueError, match="mode"):
        Schedule(mode="fast")
    with pytest.raises(ValueError, match="p99"):
        Lengths.lognormal(100, 10, maximum=1000)
    with pytest.raises(ValueError, match="train_devices"):
        simulate(hw, work, Schedule(), rollout_devices=1, train_devices=0)
    with pytest.raises(ValueError, match="KV capacity"):
        simulate(hand_hw(kv_capacity_tokens=100), work, Schedule(), rollout_devices=1, train_devices=1)
    with pytest.raises(ValueError, match="warmup_steps"):
        Schedule(steps=2, warmup_steps=2)


def test_hardware_round_trips_through_json():
    import json

    hw = gpu_like("1.5b", devices_per_engine=2)
    assert Hardware.from_dict(json.loads(json.dumps(hw.to_dict()))) == hw


def test_sizing_cli_help_and_a_small_run(tmp_path, capsys):
    """``python -m rlblocks.sched.sim`` is :func:`sim.main` (run in-process here: a subprocess would pay the torch
    import twice)."""
    with pytest.raises(SystemExit) as e:
        sim.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--devices" in out and "best η and split" in out
    sim.main(["--hardware", "cpu", "--devices", "4", "--batch", "8", "--group-size", "2", "--median", "20",
              "--p99", "200", "--max-len", "300", "--prompt-len", "8", "--steps", "4", "--warmup", "1",
              "--etas", "0,1", "--json", str(tmp_path / "rows.json")])
    out = capsys.readouterr().out
    assert "best: η=" in out and (tmp_path / "rows.json").exists()
    with pytest.raises(SystemExit):
        sim.main(["--median", "-5"])  # bad input is an argparse error naming the argument, not a traceback
    assert "median" in capsys.readouterr().err


def test_prefill_pays_one_forward_per_distinct_length():
    """``per_length_s`` once per distinct context length (an engine that batches equal lengths only), written out."""
    p = PrefillCost(overhead_s=0.5, per_token_s=0.01, per_token_sq_s=1e-4, per_length_s=0.2)
    contexts = [3, 3, 5, 9, 9, 9]
    assert p.seconds(contexts) == pytest.approx(0.5 + 0.2 * 3 + 0.01 * 38 + 1e-4 * (9 + 9 + 25 + 81 * 3))
    assert PrefillCost(per_length_s=0.2).seconds([]) == 0.0


def test_padded_prefill_pays_rows_times_longest_per_forward():
    """``padded=True``: sorted by length, cut at the token budget, each forward charged rows × its longest (written
    out by hand); identical keys are computed once."""
    p = PrefillCost(overhead_s=0.5, per_token_s=0.01, per_token_sq_s=1e-4, padded=True, token_budget=20)
    contexts = [3, 9, 3, 5, 9, 9]
    # 3,3,5 -> 3 rows × 5 = 15 ≤ 20; a fourth row of 9 would make 36: new forward; 9,9 = 18; 9,9,9 = 27: new forward
    assert p.forwards(contexts) == [(3, 5), (2, 9), (1, 9)]
    assert p.seconds(contexts) == pytest.approx(3 * 0.5 + 0.01 * (15 + 18 + 9) + 1e-4 * (3 * 25 + 2 * 81 + 81))
    assert replace(p, token_budget=0).forwards(contexts) == [(6, 9)]  # no budget: one forward
    # the samples of one group before their first token share a key: one row for the three
    assert p.seconds([7, 7, 7, 12], keys=["g", "g", "g", "s"]) == pytest.approx(
        p.seconds([7, 12]))
    assert p.seconds([7, 7, 7, 12], keys=["g", "g", "g", "s"]) < p.seconds([7, 7, 7, 12])
    assert p.seconds([]) == 0.0


def test_padded_prefill_forwards_are_the_engines():
    """The cost model's forwards are the ones ``TorchEngine`` cuts its newcomers into (a second implementation:
    the engine's own chunking), for random lengths at the engine's budget."""
    from types import SimpleNamespace

    from rlblocks.rollout.engines.torch_compute import PREFILL_TOKEN_BUDGET, _Compute

    p = PrefillCost(padded=True, token_budget=PREFILL_TOKEN_BUDGET)
    rng = random.Random(3)
    for _ in range(50):
        lengths = [rng.randint(1, 900) for _ in range(rng.randint(1, 300))]
        chunks = _Compute._prefill_chunks([SimpleNamespace(tokens=[0] * n) for n in lengths])
        assert p.forwards(lengths) == [(len(c), max(len(s.tokens) for s in c)) for c in chunks]


def test_padded_prefill_bad_input_names_the_field():
    with pytest.raises(ArgumentError, match="per_length_s"):
        PrefillCost(per_length_s=0.1, padded=True)
    with pytest.raises(ArgumentError, match="token_budget"):
        PrefillCost(padded=True, token_budget=-1)
    with pytest.raises(ArgumentError, match="keys: expected one per context"):
        PrefillCost(padded=True).seconds([3, 4], keys=["a"])


def test_padded_prefill_computes_a_groups_prompt_once():
    """A synchronous run of 4 groups × 4 samples against 16 groups × 1, same lengths: with a padded prefill (the
    engine computes identical prompts once) the first costs 4 prompt rows where the second costs 16."""
    pre = PrefillCost(overhead_s=0.0, per_token_s=0.05, padded=True)
    hw = hand_hw(prefill=pre)
    sched = Schedule(mode="sync-disaggregated", steps=2, warmup_steps=0)
    runs = {k: simulate(hw, Workload(lengths=Lengths.fixed(3), prompt_lengths=Lengths.fixed(40), batch_groups=16 // k,
                                     group_size=k), sched, rollout_devices=1, train_devices=1) for k in (1, 4)}
    assert runs[4].samples["generated"] == runs[1].samples["generated"]
    assert runs[4].tokens["prefilled"] == runs[1].tokens["prefilled"]  # the same prompt tokens, logically
    # per step the prefill is one padded forward: 4 rows × 40 tokens vs 16 rows × 40 (the rest is equal)
    assert runs[1].wall_s - runs[4].wall_s == pytest.approx(2 * 0.05 * 40 * (16 - 4))


def test_reprefill_per_length_cost_is_paid_at_every_update():
    """Samples of different lengths in flight across the weight updates: each update's re-prefill pays one
    per-length cost per distinct context, so the run takes longer."""
    work = Workload(lengths=Lengths.cycle([40, 41]), prompt_lengths=Lengths.fixed(2), batch_groups=1, group_size=2)
    sched = Schedule(mode="async", max_staleness=4, steps=6, warmup_steps=0)
    base = simulate(hand_hw(), work, sched, rollout_devices=1, train_devices=1)
    slow = simulate(hand_hw(prefill=replace(PREFILL, per_length_s=0.3)), work, sched, rollout_devices=1,
                    train_devices=1)
    prompts = 2 * base.samples["generated"]  # every sample's first prefill: its 2 prompt tokens
    assert base.tokens["prefilled"] > prompts and slow.tokens["prefilled"] > 2 * slow.samples["generated"]
    assert slow.wall_s > base.wall_s
