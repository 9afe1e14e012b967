"""A learned reward model: scores ``prompt + response`` with an HF model, batched, padding-aware, on any device.

Two kinds of model:

- an HF ``*ForSequenceClassification`` decoder with one label (Llama, Qwen2, Mistral, Gemma, GPT-2, ...: a
  ``score`` linear head on the backbone), as DeepSpeed-Chat's and OpenRLHF's reward models are;
- any HF backbone or causal LM plus your ``head`` (a module mapping a hidden state ``[.., H]`` to ``[.., 1]``):
  "a causal LM with a scalar head" (``AutoModelForCausalLM`` + ``nn.Linear(H, 1)``).

For both, the reward is the head applied to the hidden state of the LAST VALID token of each row, located from the
``attention_mask`` — never from the pad token id. HF's own pooling looks for the rightmost token that is not
``pad_token_id``, which reads the wrong position when the pad token is also the EOS token that ends the text (a
common setting) and fails without a pad token. Position ids are computed from the mask
(``position_ids = cumsum(mask) − 1``, 0 on padding), so a left-padded row gets the same positions as the
unpadded sequence (models with absolute position embeddings would otherwise shift). Left and right padding give
the same scores up to floating-point rounding; the pad id can be any token.

A model without a ``score`` head and no ``head`` given (an encoder classifier such as BERT, which pools its first
token) is called as a whole, with right padding, and its ``logits`` are used.

The reward is returned in float32 (the model may run in bf16). :meth:`RewardModel.score_ids` takes token ids (any
padding side); :meth:`RewardModel.score` takes texts; ``await rm(sample)`` is a :class:`~rlblocks.reward.RewardFn`
that gathers concurrent calls into batches of up to ``batch_size`` (waiting at most ``max_wait`` seconds for a
batch to fill) and runs the forward in a thread, so the event loop keeps going.

``transformers`` is imported only by :meth:`RewardModel.from_pretrained`.
"""

from __future__ import annotations

import asyncio
import math
import re
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Float, Int, Shaped
from torch import Tensor

from rlblocks.errors import ArgumentError
from rlblocks.reward.types import RewardResult, Sample

__all__ = ["RewardModel"]


def _shape(x: Tensor) -> str:
    return "[" + ", ".join(str(int(s)) for s in x.shape) + "]"


class _LoopBatcher:
    """Pending calls of one event loop, flushed as one batch when full or after ``max_wait``."""

    def __init__(self) -> None:
        self.pending: list[tuple[Sample, asyncio.Future]] = []
        self.timer: asyncio.TimerHandle | None = None


class RewardModel:
    """Scalar reward of ``prompt + response`` from an HF model (see the module docstring for the conventions).

    Args:
        model: an HF sequence-classification model with one label, or a backbone / causal LM when ``head`` is given.
        tokenizer: an HF tokenizer (needed for texts; :meth:`score_ids` does not use it).
        head: maps hidden states ``[.., H]`` to ``[.., 1]``; default ``model.score``.
        device: where the model runs (default: where its parameters are); the model (moved in place, as
            ``nn.Module.to`` does) and the inputs go there.
        batch_size: rows per forward.
        max_length: keep at most this many tokens per row, dropping from the LEFT (the start of the prompt): the
            reward is read at the end, which must survive. ``details["truncated"]`` says when it happened.
        append_eos: append the tokenizer's EOS id when the text does not already end with it (reward models
            trained with an EOS at the end, as OpenRLHF's, expect it).
        chat: format as a chat (``tokenizer.apply_chat_template`` with a user turn and an assistant turn)
            instead of the plain concatenation ``prompt + response``.
        padding_side: ``"right"`` or ``"left"``: the layout of the batches this object builds (the scores do not
            depend on it, up to rounding).
        max_wait: seconds the async call waits for more calls to fill a batch.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any = None,
        *,
        head: torch.nn.Module | None = None,
        device: str | torch.device | None = None,
        batch_size: int = 16,
        max_length: int | None = None,
        append_eos: bool = False,
        chat: bool = False,
        padding_side: str = "right",
        max_wait: float = 0.002,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise ArgumentError(f"model: expected a torch.nn.Module (an HF model), got {type(model).__name__}")
        if head is not None and not isinstance(head, torch.nn.Module):
            raise ArgumentError(f"head: expected None or a torch.nn.Module, got {type(head).__name__}")
        for name, v in (("batch_size", batch_size), ("max_length", max_length)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ArgumentError(f"{name}: expected an int >= 1, got {v!r}")
        if padding_side not in ("right", "left"):
            raise ArgumentError(f"padding_side: expected 'right' or 'left', got {padding_side!r}")
        if isinstance(max_wait, bool) or not isinstance(max_wait, (int, float)) or not 0 <= max_wait < 10:
            raise ArgumentError(f"max_wait: expected seconds in [0, 10), got {max_wait!r}")
        if device is not None:
            model = model.to(device)
            head = head.to(device) if head is not None else None
        self.model = model
        self.tokenizer = tokenizer
        if head is not None:
            self.backbone = getattr(model, "base_model", model)
            self.head = head
            self.pooling = "last"
        elif isinstance(getattr(model, "score", None), torch.nn.Module):
            self.backbone = model.base_model
            self.head = model.score
            self.pooling = "last"
        else:
            self.backbone = model
            self.head = None
            self.pooling = "model"
        try:
            self.device = torch.device(device) if device is not None else next(model.parameters()).device
        except StopIteration:
            raise ArgumentError("model: expected a model with parameters, got one with none") from None
        self.batch_size = batch_size
        self.max_length = max_length
        self.append_eos = bool(append_eos)
        self.chat = bool(chat)
        self.padding_side = padding_side
        self.max_wait = float(max_wait)
        self._forward_lock = threading.Lock()
        self._batchers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @classmethod
    def from_pretrained(
        cls, path: str, *, device: str | torch.device | None = None, dtype: torch.dtype | None = None, **kwargs: Any
    ) -> RewardModel:
        """Load an HF sequence-classification checkpoint and its tokenizer from ``path`` (a local directory or a
        hub name; no download happens when ``HF_HUB_OFFLINE=1``). ``kwargs`` go to the constructor."""
        import transformers
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        load: dict[str, Any] = {}
        if dtype is not None:
            # transformers >= 4.56 names it dtype; older versions silently pass an unknown keyword to the config,
            # so the old name must be used there.
            major_minor = tuple(int(x) for x in re.findall(r"\d+", transformers.__version__)[:2])
            load["dtype" if major_minor >= (4, 56) else "torch_dtype"] = dtype
        model = AutoModelForSequenceClassification.from_pretrained(path, **load)
        tokenizer = AutoTokenizer.from_pretrained(path)
        return cls(model.eval(), tokenizer, device=device, **kwargs)

    # ------------------------------------------------------------------ token ids
    def score_ids(
        self, input_ids: Int[Tensor, "B L"], attention_mask: Shaped[Tensor, "B L"], *, grad: bool = False
    ) -> Float[Tensor, " B"]:
        """Rewards ``[B]`` (float32, on the model's device) of token rows padded on either side.

        ``attention_mask`` is 1 (or True) on each row's tokens, which must be one contiguous run (left or right
        padding) of at least one token. ``grad=True`` keeps the autograd graph (for training the reward model,
        e.g. a Bradley–Terry loss ``−log σ(r_chosen − r_rejected)``); the default runs under ``torch.no_grad``.
        Validation reads the mask on the host (one sync per call).
        """
        if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.dtype.is_floating_point:
            got = _shape(input_ids) if isinstance(input_ids, Tensor) else type(input_ids).__name__
            raise ArgumentError(f"input_ids: expected an integer tensor [B, L], got {got}")
        if not isinstance(attention_mask, Tensor) or attention_mask.shape != input_ids.shape:
            got = _shape(attention_mask) if isinstance(attention_mask, Tensor) else type(attention_mask).__name__
            raise ArgumentError(f"attention_mask: expected the shape of input_ids {_shape(input_ids)}, got {got}")
        m = (attention_mask != 0).to(self.device)
        ids = input_ids.to(self.device)
        B, L = ids.shape
        if B == 0 or L == 0:
            raise ArgumentError(f"input_ids: expected at least one row and one column, got shape {_shape(input_ids)}")
        count = m.sum(-1)
        first = m.to(torch.int8).argmax(-1)
        last = (L - 1) - m.flip(-1).to(torch.int8).argmax(-1)
        bad = (count == 0) | (last - first + 1 != count)
        if bool(bad.any()):
            rows = bad.nonzero().flatten().tolist()[:8]
            raise ArgumentError(
                f"attention_mask: expected each row to hold one contiguous run of >= 1 tokens (left or right "
                f"padding), got rows {rows} that are empty or have holes"
            )
        with torch.set_grad_enabled(grad):
            if self.pooling == "model":
                ids, m = self._right_padded(ids, m, first, count)
                logits = self.model(input_ids=ids, attention_mask=m.long()).logits
                values = logits
            else:
                pos = (m.long().cumsum(-1) - 1).clamp(min=0)
                out = self.backbone(input_ids=ids, attention_mask=m.long(), position_ids=pos)
                hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
                # The head is position-wise, so applying it to the gathered last states equals gathering its output.
                values = self.head(hidden[torch.arange(B, device=hidden.device), last])
        if values.dim() != 2 or values.shape[-1] != 1:
            raise ArgumentError(
                f"model: expected one reward per row (a head with one output, num_labels=1), got output "
                f"{_shape(values)}"
            )
        return values[:, 0].float()

    @staticmethod
    def _right_padded(ids: Tensor, m: Tensor, first: Tensor, count: Tensor) -> tuple[Tensor, Tensor]:
        """Move every row's tokens to the left edge (for models that pool by position and assume right padding)."""
        L = ids.shape[1]
        src = (torch.arange(L, device=ids.device)[None, :] + first[:, None]).clamp(max=L - 1)
        new_m = torch.arange(L, device=ids.device)[None, :] < count[:, None]
        new_ids = torch.where(new_m, ids.gather(1, src), ids[:, :1].expand_as(ids))
        return new_ids, new_m

    # ------------------------------------------------------------------ texts
    def _text(self, prompt: str, response: str) -> str:
        if self.chat:
            msgs = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
            return self.tokenizer.apply_chat_template(msgs, tokenize=False)
        return prompt + response

    def encode(self, prompts: Sequence[str], responses: Sequence[str]) -> tuple[list[list[int]], list[bool]]:
        """Token ids of each ``prompt + response`` (after the template, EOS and truncation) and whether each row
        was truncated."""
        if self.tokenizer is None:
            raise ArgumentError("tokenizer: expected an HF tokenizer to score texts, got None (use score_ids)")
        if isinstance(prompts, str) or isinstance(responses, str) or len(prompts) != len(responses):
            raise ArgumentError(
                f"prompts/responses: expected two lists of str of equal length, got {type(prompts).__name__} and "
                f"{type(responses).__name__}"
            )
        for i, (p, r) in enumerate(zip(prompts, responses)):
            if not isinstance(p, str) or not isinstance(r, str):
                raise ArgumentError(f"prompts[{i}]/responses[{i}]: expected str, got {type(p).__name__}, "
                                    f"{type(r).__name__}")
        texts = [self._text(p, r) for p, r in zip(prompts, responses)]
        enc = self.tokenizer(texts, add_special_tokens=not self.chat)["input_ids"]
        eos = getattr(self.tokenizer, "eos_token_id", None)
        rows, truncated = [], []
        for ids in enc:
            ids = list(ids)
            if self.append_eos and eos is not None and (not ids or ids[-1] != eos):
                ids.append(eos)
            cut = self.max_length is not None and len(ids) > self.max_length
            rows.append(ids[-self.max_length :] if cut else ids)
            truncated.append(cut)
        for i, ids in enumerate(rows):
            if not ids:
                raise ArgumentError(f"prompts[{i}]/responses[{i}]: expected text that gives at least one token")
        return rows, truncated

    def _pad_id(self) -> int:
        for name in ("pad_token_id", "eos_token_id"):
            v = getattr(self.tokenizer, name, None)
            if v is not None:
                return int(v)
        return 0  # any id works: the mask, not the id, marks padding

    def _batch(self, rows: list[list[int]]) -> tuple[Tensor, Tensor]:
        L = max(len(r) for r in rows)
        ids = torch.full((len(rows), L), self._pad_id(), dtype=torch.long)
        mask = torch.zeros((len(rows), L), dtype=torch.long)
        for i, r in enumerate(rows):
            sl = slice(0, len(r)) if self.padding_side == "right" else slice(L - len(r), L)
            ids[i, sl] = torch.tensor(r, dtype=torch.long)
            mask[i, sl] = 1
        return ids, mask

    def score_rows(self, rows: list[list[int]]) -> Float[Tensor, " n"]:
        """Rewards ``[n]`` (float32, CPU) of token rows, in micro-batches of ``batch_size`` grouped by length."""
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))  # similar lengths together: less padding
        out = torch.empty(len(rows), dtype=torch.float32)
        with self._forward_lock:  # one forward at a time on this model, whichever thread asks
            for s in range(0, len(order), self.batch_size):
                idx = order[s : s + self.batch_size]
                ids, mask = self._batch([rows[i] for i in idx])
                out[torch.tensor(idx)] = self.score_ids(ids, mask).cpu()
        return out

    def score(self, prompts: Sequence[str], responses: Sequence[str]) -> Float[Tensor, " n"]:
        """Rewards ``[n]`` (float32, CPU) of each ``prompt + response``, in input order."""
        rows, _ = self.encode(prompts, responses)
        if not rows:
            return torch.empty(0, dtype=torch.float32)
        return self.score_rows(rows)

    # ------------------------------------------------------------------ RewardFn
    async def __call__(self, sample: Sample) -> RewardResult:
        if not isinstance(sample, Sample):
            raise ArgumentError(f"sample: expected a rlblocks.reward.Sample, got {type(sample).__name__}")
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        b = self._batchers.get(loop)
        if b is None:
            b = self._batchers[loop] = _LoopBatcher()
        fut = loop.create_future()
        b.pending.append((sample, fut))
        if len(b.pending) >= self.batch_size:
            self._flush(loop, b)
        elif b.timer is None:
            b.timer = loop.call_later(self.max_wait, self._flush, loop, b)
        try:
            score, info = await fut
        except Exception as e:
            return RewardResult.failure(f"{type(e).__name__}: {e}", seconds=time.perf_counter() - t0)
        if not math.isfinite(score):  # a NaN reward would poison its whole group's advantages
            return RewardResult.failure(f"the model gave a non-finite reward ({score})",
                                        seconds=time.perf_counter() - t0, details=info)
        return RewardResult(score, seconds=time.perf_counter() - t0, details=info)

    def _flush(self, loop: asyncio.AbstractEventLoop, b: _LoopBatcher) -> None:
        if b.timer is not None:
            b.timer.cancel()
            b.timer = None
        batch, b.pending = b.pending, []
        batch = [(s, f) for s, f in batch if not f.done()]  # a cancelled caller needs no forward
        if batch:
            loop.create_task(self._run_batch(batch))

    async def _run_batch(self, batch: list[tuple[Sample, asyncio.Future]]) -> None:
        try:
            try:
                rows, truncated = self.encode([s.prompt for s, _ in batch], [s.response for s, _ in batch])
            except ArgumentError:
                # One sample that cannot be encoded (e.g. a text that gives no token) must fail alone, not every
                # concurrent caller that happened to share its batch: encode them one by one, fail the bad ones.
                batch, rows, truncated = self._encode_each(batch)
            scores = await asyncio.to_thread(self.score_rows, rows) if rows else torch.empty(0)
        except Exception as e:
            for _, f in batch:
                if not f.done():
                    f.set_exception(e)
            return
        for (_, f), v, r, t in zip(batch, scores.tolist(), rows, truncated):
            if not f.done():
                f.set_result((v, {"num_tokens": len(r), "truncated": t, "batch_rows": len(batch)}))

    def _encode_each(self, batch: list[tuple[Sample, asyncio.Future]]) -> tuple[list, list, list]:
        """Encode samples one at a time; a sample that fails gets its error, the others are returned."""
        good, rows, truncated = [], [], []
        for s, f in batch:
            try:
                (row,), (cut,) = self.encode([s.prompt], [s.response])
            except ArgumentError as e:
                if not f.done():
                    f.set_exception(e)
                continue
            good.append((s, f))
            rows.append(row)
            truncated.append(cut)
        return good, rows, truncated
