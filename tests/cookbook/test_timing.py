"""The async loop's weight update on a real TorchEngine, and the rollout rank's time accounting around it.

With partial rollout an update keeps the requests in the engine (``update_weights`` freezes, loads, re-prefills):
no request is aborted and re-submitted (a round trip whose cost grows with the requests in flight), every
generation is one engine call whose tokens carry both versions, and the tokens the engine re-prefills are counted.
Without partial rollout the requests come back aborted and restart from the prompt.
"""

from __future__ import annotations

import asyncio

import grpo_async
import pytest
import torch
from plumbing import RolloutClock, RolloutTimes, StepLaps, TimedEngine, rollout_columns

from rlblocks.rollout import GenerationRequest, SamplingParams
from rlblocks.rollout.engines import TorchEngine

pytestmark = pytest.mark.filterwarnings("error:rlblocks:DeprecationWarning")

N, BUDGET = 6, 40  # requests in flight across the update, tokens each


def _rollout(engine, partial: bool) -> grpo_async.Rollout:
    cfg = grpo_async.Config(prompts_per_step=2, max_staleness=1, partial_rollout=partial, group_size=N)
    return grpo_async.Rollout(cfg, 1, n_train=1, sample_group=None, sync_group=None, tokenizer=None, engine=engine,
                              max_model_len=64, task=None, reward=None)


async def _update_mid_flight(path: str, partial: bool):
    engine = TorchEngine.from_pretrained(path, device="cpu", max_model_len=64)
    r = _rollout(engine, partial)
    sp = SamplingParams(temperature=1.0, max_new_tokens=BUDGET, stop_token_ids=())
    tasks = [asyncio.create_task(r._one(GenerationRequest(f"g/{k}", [1, 2, 3, 4 + k], sp))) for k in range(N)]
    # wait for tokens, not for time: every request has decoded some and none has finished
    while not all(3 <= (engine.num_output_tokens(f"g/{k}") or 0) for k in range(N)):
        await asyncio.sleep(0.001)
    tensors = [(n, t.detach().clone()) for n, t in engine.model.state_dict().items()]
    await r.load(tensors, 1)
    gens = await asyncio.gather(*tasks)
    r.outbox.put(r.clock.report(r.rank, 2))  # the interval after the update: the re-prefill ran in it
    await engine.aclose()
    return r, gens


def test_partial_rollout_update_keeps_requests_in_the_engine(tiny_hf_dir):
    r, gens = asyncio.run(_update_mid_flight(tiny_hf_dir, partial=True))
    for g in gens:
        assert g.num_submissions == 1 and g.finish_reason == "length" and len(g.output_ids) == BUDGET
        assert g.output_versions[0] == 0 and g.output_versions[-1] == 1  # spans the update, each token's own version
        assert g.output_versions == sorted(g.output_versions)
    assert r.counters["resubmissions"] == 0
    before, after = r.outbox.get_nowait(), r.outbox.get_nowait()  # the intervals ending at versions 1 and 2
    assert isinstance(before, RolloutTimes) and (before.version, after.version) == (1, 2)
    assert before.seconds["weight_load"] > 0 and before.counts["decode_forwards"] >= 2
    assert before.counts["reprefill_tokens"] == 0 and before.seconds["reprefill"] == 0
    # after it, the engine re-prefilled prompt + tokens so far of every request it kept: N·4 prompt tokens plus at
    # least 3 generated tokens each, less than the budget
    assert N * (4 + 3) <= after.counts["reprefill_tokens"] < N * (4 + BUDGET)
    assert after.counts["reprefill_tokens"] <= after.counts["prefill_tokens"]
    assert after.seconds["reprefill"] > 0 and after.seconds["prefill"] == 0  # nothing else was prefilled


def test_restart_without_partial_rollout_aborts_and_discards(tiny_hf_dir):
    r, gens = asyncio.run(_update_mid_flight(tiny_hf_dir, partial=False))
    for g in gens:  # restarted from the prompt under the new weights: one version, the full budget
        assert set(g.output_versions) == {1} and len(g.output_ids) == BUDGET
    assert r.counters["tokens_discarded"] >= 3 * N
    r.outbox.get_nowait()
    after = r.outbox.get_nowait()
    assert after.counts["reprefill_tokens"] == N * 4  # each restarted from its prompt alone


class _Fake:
    """An engine whose generate returns what it is told (an abort first, then a finish) — no model, no hooks."""

    def __init__(self) -> None:
        self.calls = 0
        self.hidden = "engine attribute"

    async def generate(self, request):
        from rlblocks.rollout import Generation

        self.calls += 1
        reason = "abort" if self.calls == 1 else "length"
        return Generation(request.request_id, request.prompt_ids, [7], [-0.5], [0], finish_reason=reason)


def test_timed_engine_counts_resubmissions_as_reprefill_and_partitions_time():
    clock = RolloutClock(None)
    fake = _Fake()
    timed = TimedEngine(fake, clock)
    assert timed.hidden == "engine attribute"
    sp = SamplingParams(max_new_tokens=4)

    async def go():
        await timed.generate(GenerationRequest("a", [1, 2, 3], sp))  # aborted
        await timed.generate(GenerationRequest("a", [1, 2, 3, 7], sp))  # its resume: 4 tokens re-sent
        await timed.generate(GenerationRequest("b", [1, 2], sp))  # a new request

    asyncio.run(go())
    clock.load_started()
    clock.load_ended(reprefill_tokens=5)  # kept across the update: re-prefilled in the next interval
    rep = clock.report(rank=1, version=3)
    assert rep.counts["reprefill_tokens"] == 4
    assert clock.report(rank=1, version=4).counts["reprefill_tokens"] == 5
    assert sum(rep.seconds.values()) == pytest.approx(rep.interval_s, rel=1e-9, abs=1e-9)
    assert rep.seconds["decode"] == rep.seconds["prefill"] == 0.0  # no model: no forwards timed
    cols = rollout_columns([rep, RolloutTimes(2, 3, 2.0, dict.fromkeys(rep.seconds, 0.5), {"decode_tokens": 30,
                                                                                         "decode_forwards": 3,
                                                                                         "decode_batch_max": 12})],
                           ranks=2)
    assert cols["rollout_seconds"] == pytest.approx((rep.interval_s + 2.0) / 2)
    assert cols["rollout_idle_seconds"] == pytest.approx((rep.seconds["idle"] + 0.5) / 2)
    assert cols["decode_batch_mean"] == 10 and cols["decode_batch_max"] == 12 and cols["reprefill_tokens"] == 4
    assert all(v is None for v in rollout_columns([], ranks=1).values())


def test_forward_hooks_split_decode_from_prefill():
    """A model called the way the engine calls it: one prefill of 3 rows × 5 tokens, then two one-token steps."""
    lin = torch.nn.Embedding(10, 4)

    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.e = lin

        def forward(self, input_ids=None, **kw):
            return self.e(input_ids)

    eng = type("E", (), {})()
    eng.model = M()
    clock = RolloutClock(eng)
    clock.submitted(5, resume=True)
    eng.model(input_ids=torch.zeros(3, 5, dtype=torch.long))
    eng.model(input_ids=torch.zeros(3, 1, dtype=torch.long))
    eng.model(input_ids=torch.zeros(2, 1, dtype=torch.long))
    clock.returned()
    rep = clock.report(1, 1)
    assert rep.counts["prefill_tokens"] == 15 and rep.counts["decode_tokens"] == 5
    assert rep.counts["decode_forwards"] == 2 and rep.counts["decode_batch_max"] == 3
    # 5 of the 15 prefilled tokens were re-sent by a resume: a third of the prefill time is re-prefill
    assert rep.seconds["reprefill"] == pytest.approx(rep.seconds["prefill"] / 2)


def test_step_laps_attribute_every_instant_to_one_part(monkeypatch):
    # a fake clock: the gaps between the loop's statements (here 0.5 s before "sync") land in the next lap, so the
    # parts add up to the step exactly; a part that runs twice adds up
    ticks = iter([10.0, 11.0, 13.0, 13.5, 14.0, 17.0])
    monkeypatch.setattr("plumbing.timing.time.perf_counter", lambda: next(ticks))
    laps = StepLaps()
    assert laps.lap("wait") == 1.0
    assert laps.lap("train") == 2.0
    laps.lap("sync")
    laps.lap("sync")
    assert laps.lap("eval") == 3.0
    assert dict(laps.seconds) == {"wait": 1.0, "train": 2.0, "sync": 1.0, "eval": 3.0}
    assert laps.step_seconds == 7.0 == sum(laps.seconds.values())
