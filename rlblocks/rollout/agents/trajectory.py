"""One token sequence per episode: token-in-token-out multi-turn trajectories and their training tensors.

Why token-in-token-out: re-tokenising a chat history does not give back the ids the engine sampled (BPE merges
across a turn boundary, templates that trim or strip earlier reasoning), so the trainer's log-probs stop lining up
with the engine's (the recurring bug reported in SkyRL, prime-rl, slime, verl and TRL). A :class:`Trajectory`
therefore keeps the engine's own ids for model turns and tokenises only what the environment adds.

Per token a trajectory stores:

- ``token_ids``: the id;
- ``roles``: ``"prompt"`` (the initial context), ``"model"`` (sampled by the engine) or ``"env"`` (added by the
  environment, a tool or the chat template between turns);
- ``turn_ids``: the turn index. Turn 0 is the prompt and the first model response; environment tokens that follow
  model turn ``t`` open turn ``t + 1`` and the next model response belongs to it as well;
- ``logprobs``: the engine's processed log-prob for model tokens (0.0 elsewhere);
- ``versions``: the weight version that sampled each model token (-1 elsewhere).

``loss_mask`` is true on model tokens only (and, when a generation carries its own mask, e.g.
``resumable_generate(..., mask_stale=True)``, only where that mask is true).

Chat templates are applied as a DELTA (:meth:`Trajectory.append_messages`, :meth:`Trajectory.extend_to_text`),
without ever re-tokenising a model turn: the whole conversation is rendered with the chat template and, when the
rendering starts with the text the trajectory's ids decode to, only the rest (new messages, the template's glue,
the generation prompt) is tokenised and appended after the engine's ids, kept only if it decodes back exactly.
Otherwise (a template that rewrites history) the rendering is tokenised whole and must start with exactly the
trajectory's ids; failing that, a :class:`PrefixMismatchError` names the first differing position, or, with
``on_mismatch="branch"``, a new *branch* starts (the finished segment is kept in ``branches`` and counted in
``prefix_mismatches``; every segment is its own row in :func:`to_tensors`). The rules in full:
``docs/rollout/agents.md`` (Token-faithful chat deltas).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from jaxtyping import Int
from torch import Tensor

from rlblocks._checks import check_int, check_int_list, check_real_list
from rlblocks.errors import ArgumentError, PrefixMismatchError

from ..batch import RolloutBatch, own_loss_mask, padded_rows, per_row
from ..types import Generation

__all__ = [
    "ROLES",
    "Trajectory",
    "render_chat",
    "render_chat_text",
    "to_tensors",
    "trajectory_rows",
]

ROLES = ("prompt", "model", "env")
OnMismatch = Literal["raise", "branch"]


def _ids(name: str, value: object) -> list[int]:
    if isinstance(value, Tensor):
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ArgumentError(f"{name}: expected a sequence of int token ids, got {type(value).__name__}")
    return check_int_list(name, value, minimum=0)


def _dicts(name: str, value: object) -> list[dict]:
    """Chat messages (or tool schemas): a sequence of mappings, copied."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise ArgumentError(f"{name}: expected a list of dicts, got {type(value).__name__}")
    for i, m in enumerate(value):
        if not isinstance(m, Mapping):
            raise ArgumentError(f"{name}[{i}]: expected a dict, got {type(m).__name__}")
    return [dict(m) for m in value]


def render_chat_text(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    **template_kwargs: Any,
) -> str:
    """``messages`` rendered to text with ``tokenizer``'s chat template (Hugging Face ``apply_chat_template`` with
    ``tokenize=False``; ``tools`` and ``template_kwargs`` are passed to it)."""
    if not hasattr(tokenizer, "apply_chat_template"):
        raise ArgumentError(f"tokenizer: expected a Hugging Face tokenizer with a chat template, got "
                            f"{type(tokenizer).__name__}")
    return tokenizer.apply_chat_template(
        _dicts("messages", messages),
        tools=None if tools is None else _dicts("tools", tools),
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        **template_kwargs,
    )


def render_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    **template_kwargs: Any,
) -> list[int]:
    """Token ids of ``messages`` rendered with ``tokenizer``'s chat template (:func:`render_chat_text`).

    The text is encoded with ``add_special_tokens=False``: templates write their own BOS (``{{ bos_token }}``), so
    the tokenizer must not add a second one.
    """
    text = render_chat_text(tokenizer, messages, tools=tools, add_generation_prompt=add_generation_prompt,
                            **template_kwargs)
    return list(tokenizer.encode(text, add_special_tokens=False))


def _decode(tokenizer: Any, ids: list[int]) -> str:
    """The exact text of ``ids`` (special tokens written out, no clean-up of spaces)."""
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


class Trajectory:
    """The token sequence of one episode (see the module docstring for the per-token fields and conventions).

    Args:
        prompt_ids: the initial context (at least one token); its tokens have role ``"prompt"`` and turn 0.
        messages: the chat messages ``prompt_ids`` was rendered from (kept for :meth:`append_messages`).
        tools: the tool schemas given to the chat template (kept for :meth:`append_messages`).
        session_id: an identifier carried along.
        group_id: an identifier carried along (the prompt group for advantages).

    ``reward`` (float or None) and ``info`` (dict) are free for the caller; :func:`to_tensors` uses ``reward`` as
    the row reward when every trajectory has one.
    """

    def __init__(
        self,
        prompt_ids: Sequence[int] | Tensor,
        *,
        messages: Sequence[Mapping[str, Any]] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        session_id: str | None = None,
        group_id: int | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        _turn: int = 0,
    ) -> None:
        ids = _ids("prompt_ids", prompt_ids)
        if not ids:
            raise ArgumentError("prompt_ids: expected at least one token, got an empty sequence")
        if group_id is not None:
            group_id = check_int("group_id", group_id)
        if session_id is not None and not isinstance(session_id, str):
            raise ArgumentError(f"session_id: expected None or a str, got {type(session_id).__name__}")
        n = len(ids)
        self.token_ids: list[int] = ids
        self.roles: list[str] = ["prompt"] * n
        self.turn_ids: list[int] = [_turn] * n
        self.logprobs: list[float] = [0.0] * n
        self.versions: list[int] = [-1] * n
        self._trainable: list[bool] = [False] * n
        self.prompt_len = n
        self.messages: list[dict] = _dicts("messages", messages) if messages is not None else []
        self.tools = None if tools is None else _dicts("tools", tools)
        self.template_kwargs = dict(template_kwargs or {})
        self.session_id = session_id
        self.group_id = group_id
        self.reward: float | None = None
        self.info: dict[str, Any] = {}
        self.branches: list[Trajectory] = []
        self.prefix_mismatches = 0
        self._turn = _turn  # turn of the last appended token
        self._in_model = False  # whether the current turn already has model tokens

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_messages(
        cls,
        tokenizer: Any,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        session_id: str | None = None,
        group_id: int | None = None,
        **template_kwargs: Any,
    ) -> Trajectory:
        """A trajectory whose prompt is ``messages`` rendered with the chat template and a generation prompt."""
        ids = render_chat(tokenizer, messages, tools=tools, add_generation_prompt=True, **template_kwargs)
        return cls(ids, messages=messages, tools=tools, session_id=session_id, group_id=group_id,
                   template_kwargs=template_kwargs)

    # ------------------------------------------------------------------ reading
    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (f"Trajectory(tokens={len(self)}, prompt={self.prompt_len}, model={self.num_model_tokens}, "
                f"env={self.num_env_tokens}, turns={self.num_turns}, branches={len(self.branches)}, "
                f"session_id={self.session_id!r})")

    @property
    def loss_mask(self) -> list[bool]:
        """True on model tokens whose generation did not mask them; False on prompt and environment tokens."""
        return [r == "model" and t for r, t in zip(self.roles, self._trainable)]

    @property
    def num_model_tokens(self) -> int:
        return sum(r == "model" for r in self.roles)

    @property
    def num_env_tokens(self) -> int:
        return sum(r == "env" for r in self.roles)

    @property
    def num_turns(self) -> int:
        """Model turns of this segment and of its branches (a turn with no model token is not counted)."""
        own = len({t for r, t in zip(self.roles, self.turn_ids) if r == "model"})
        return own + sum(b.num_turns for b in self.branches)

    @property
    def turn(self) -> int:
        """The turn of the last appended token."""
        return self._turn

    def segments(self) -> list[Trajectory]:
        """Earlier branches (oldest first) then this segment: one training row each."""
        return [*self.branches, self]

    def version_spans(self) -> list[tuple[int, int, int]]:
        """Runs of equal version among this segment's model tokens, as ``(version, start, end)`` over positions in
        ``token_ids`` (``end`` exclusive). A non-model token ends a run, so each model turn has at least one span;
        a turn interrupted by a weight update has one span per version."""
        spans: list[tuple[int, int, int]] = []
        prev_model = False
        for i, (r, v) in enumerate(zip(self.roles, self.versions)):
            if r != "model":
                prev_model = False
                continue
            if prev_model and spans[-1][0] == v:
                spans[-1] = (v, spans[-1][1], i + 1)
            else:
                spans.append((v, i, i + 1))
            prev_model = True
        return spans

    def model_versions(self) -> list[int]:
        """Versions of every model token of every segment (branches first), in order."""
        return [v for s in self.segments() for r, v in zip(s.roles, s.versions) if r == "model"]

    @property
    def oldest_version(self) -> int | None:
        """The smallest version of any model token (all segments), ``None`` without model tokens: the staleness
        key of the episode (e.g. for ``StalenessQueue.put(traj, traj.oldest_version)``)."""
        vs = self.model_versions()
        return min(vs) if vs else None

    def staleness(self, *, current_version: int) -> int:
        """The largest version gap ``current_version − version`` over every model token (all segments); 0 when
        there is no model token. Negative gaps (tokens newer than ``current_version``) are reported as they are."""
        current_version = check_int("current_version", current_version)
        vs = self.model_versions()
        return max(current_version - v for v in vs) if vs else 0

    # ------------------------------------------------------------------ appending
    def append_generation(self, generation: Generation, *, message: Mapping[str, Any] | None = None) -> None:
        """Append the output of ``generation`` as model tokens of the current turn.

        ``generation.prompt_ids`` must equal ``token_ids`` exactly (the engine saw this trajectory, nothing else):
        a :class:`PrefixMismatchError` otherwise. Logprobs and versions are kept per token; a generation with its
        own ``loss_mask`` (one bool per output token) masks those tokens. ``message`` (the assistant message the
        output decodes to) is recorded in ``messages`` for the next :meth:`append_messages`.
        """
        if not isinstance(generation, Generation):
            raise ArgumentError(f"generation: expected a Generation, got {type(generation).__name__}")
        self._check_extends(list(generation.prompt_ids), exact=True, what="generation.prompt_ids")
        n = len(generation.output_ids)
        own = own_loss_mask("generation", generation)
        trainable = own if own is not None else [True] * n
        self._in_model = True  # model tokens continue the current turn (its context came before them)
        self.token_ids += [int(t) for t in generation.output_ids]
        self.roles += ["model"] * n
        self.turn_ids += [self._turn] * n
        self.logprobs += [float(x) for x in generation.output_logprobs]
        self.versions += [int(v) for v in generation.output_versions]
        self._trainable += trainable
        if message is not None:
            self.messages.append(dict(message))

    def append_env(self, token_ids: Sequence[int] | Tensor, *, messages: Sequence[Mapping[str, Any]] = ()) -> None:
        """Append environment tokens (never trained on). Tokens that follow model tokens open the next turn.
        ``messages`` are recorded in ``messages``."""
        ids = _ids("token_ids", token_ids)
        if self._in_model and ids:  # environment tokens after a model response open the next turn
            self._turn += 1
            self._in_model = False
        n = len(ids)
        self.token_ids += ids
        self.roles += ["env"] * n
        self.turn_ids += [self._turn] * n
        self.logprobs += [0.0] * n
        self.versions += [-1] * n
        self._trainable += [False] * n
        self.messages += _dicts("messages", messages)

    def extend_to(
        self,
        token_ids: Sequence[int] | Tensor,
        *,
        on_mismatch: OnMismatch = "raise",
        messages: Sequence[Mapping[str, Any]] | None = None,
        tokenizer: Any = None,
    ) -> list[int]:
        """Make the trajectory equal ``token_ids``, which must start with the trajectory's tokens exactly.

        The new suffix is appended as environment tokens and returned. If ``token_ids`` does not extend the
        trajectory: ``on_mismatch="raise"`` raises :class:`PrefixMismatchError` naming the first differing position
        (``tokenizer``, when given, decodes the context into the message); ``"branch"`` counts the mismatch, keeps
        the current segment in ``branches`` and starts a new one whose prompt is ``token_ids`` (then the whole of
        ``token_ids`` is returned). ``messages``: the full conversation ``token_ids`` renders (replaces
        ``messages``).
        """
        if on_mismatch not in ("raise", "branch"):
            raise ArgumentError(f"on_mismatch: expected 'raise' or 'branch', got {on_mismatch!r}")
        ids = _ids("token_ids", token_ids)
        try:
            self._check_extends(ids, exact=False, what="token_ids", tokenizer=tokenizer)
        except PrefixMismatchError:
            if on_mismatch == "raise":
                raise
            self.prefix_mismatches += 1
            self.branch(ids, messages=messages)
            return list(ids)
        delta = ids[len(self.token_ids):]
        self.append_env(delta)
        if messages is not None:
            self.messages = _dicts("messages", messages)
        return delta

    def text_delta(self, tokenizer: Any, text: str) -> list[int] | None:
        """The ids that extend the trajectory to the rendering ``text`` without re-tokenising its tokens, or None.

        ``text`` must start with the text the trajectory's ids decode to (special tokens written out); the rest is
        tokenised on its own: after the trajectory's last token when that is an added token (so that a tokenizer
        which treats the start of a text specially, e.g. a SentencePiece dummy prefix, tokenises the rest as it
        would inside the full rendering), else alone. A candidate is returned only if the trajectory's ids followed
        by it decode to exactly ``text``. None when ``text`` does not extend the trajectory's text or no candidate
        decodes back to it (then only a token-level prefix check can extend the trajectory). Nothing is changed.
        """
        if not isinstance(text, str):
            raise ArgumentError(f"text: expected the rendered conversation as a str, got {type(text).__name__}")
        mine = self.token_ids
        current = _decode(tokenizer, mine)
        if not text.startswith(current):
            return None
        rest = text[len(current):]
        if not rest:
            return []
        candidates: list[list[int]] = []
        last = mine[-1]
        added = tokenizer.get_added_vocab() if callable(getattr(tokenizer, "get_added_vocab", None)) else {}
        piece = tokenizer.convert_ids_to_tokens(last) if added else None
        if piece is not None and added.get(piece) == last:
            anchored = list(tokenizer.encode(piece + rest, add_special_tokens=False))
            if anchored[:1] == [last]:
                candidates.append(anchored[1:])
        alone = list(tokenizer.encode(rest, add_special_tokens=False))
        if alone not in candidates:
            candidates.append(alone)
        for ids in candidates:
            if _decode(tokenizer, mine + ids) == text:
                return ids
        return None

    def extend_to_text(
        self,
        tokenizer: Any,
        text: str,
        *,
        on_mismatch: OnMismatch = "raise",
        messages: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """Make the trajectory the rendering ``text`` of the conversation ``messages`` (which replaces
        ``messages``), keeping its ids: the :meth:`text_delta` is appended as environment tokens when there is one,
        else ``text`` is tokenised whole and must extend the trajectory's ids exactly (:meth:`extend_to`, with
        ``on_mismatch``). Returns the appended ids (the whole new prompt after a branch)."""
        if on_mismatch not in ("raise", "branch"):
            raise ArgumentError(f"on_mismatch: expected 'raise' or 'branch', got {on_mismatch!r}")
        delta = self.text_delta(tokenizer, text)
        if delta is None:
            return self.extend_to(list(tokenizer.encode(text, add_special_tokens=False)), on_mismatch=on_mismatch,
                                  messages=messages, tokenizer=tokenizer)
        self.append_env(delta)
        if messages is not None:
            self.messages = _dicts("messages", messages)
        return delta

    def append_messages(
        self,
        tokenizer: Any,
        messages: Sequence[Mapping[str, Any]],
        *,
        on_mismatch: OnMismatch = "raise",
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Append ``messages`` (tool results, user turns) after the trajectory without re-tokenising it: render
        ``self.messages + messages`` with the chat template (and ``tools``) and append only what the new messages,
        the template's glue and the generation prompt add (:meth:`extend_to_text`; see the module docstring, and
        :meth:`extend_to` for ``on_mismatch``). Returns the appended ids."""
        full = [*self.messages, *_dicts("messages", messages)]
        text = render_chat_text(tokenizer, full, tools=self.tools, add_generation_prompt=add_generation_prompt,
                                **self.template_kwargs)
        return self.extend_to_text(tokenizer, text, on_mismatch=on_mismatch, messages=full)

    def branch(
        self, prompt_ids: Sequence[int] | Tensor, *, messages: Sequence[Mapping[str, Any]] | None = None
    ) -> None:
        """Close the current segment (kept, unchanged, in ``branches``) and continue with a new segment whose
        prompt is ``prompt_ids`` (role ``"prompt"``, not trained). Turn numbering continues across branches."""
        ids = _ids("prompt_ids", prompt_ids)
        if not ids:
            raise ArgumentError("prompt_ids: expected at least one token, got an empty sequence")
        closed = Trajectory.__new__(Trajectory)
        closed.__dict__.update(self.__dict__)
        closed.branches = []
        closed.prefix_mismatches = 0
        branches = [*self.branches, closed]
        next_turn = self._turn + 1 if self._in_model else self._turn  # the new prompt carries the next turn
        mismatches = self.prefix_mismatches
        msgs = messages if messages is not None else self.messages
        self.__init__(ids, messages=msgs, tools=self.tools, session_id=self.session_id, group_id=self.group_id,
                      template_kwargs=self.template_kwargs, _turn=next_turn)
        self.reward, self.info = closed.reward, closed.info
        self.branches = branches
        self.prefix_mismatches = mismatches

    # ------------------------------------------------------------------ checks
    def _check_extends(self, ids: list[int], *, exact: bool, what: str, tokenizer: Any = None) -> None:
        mine = self.token_ids
        n = len(mine)
        limit = min(n, len(ids))
        pos = next((i for i in range(limit) if mine[i] != ids[i]), None)
        if pos is None:
            if len(ids) < n:
                pos = len(ids)
            elif exact and len(ids) > n:
                pos = n
            else:
                return
        expected = mine[pos] if pos < n else None
        got = ids[pos] if pos < len(ids) else None
        role = self.roles[pos] if pos < n else None
        turn = self.turn_ids[pos] if pos < n else None
        where = (f"trajectory token {expected} (role {role}, turn {turn})" if expected is not None
                 else "end of trajectory")
        context = ""
        if tokenizer is not None:
            lo = max(0, pos - 16)
            try:
                context = (f"; trajectory text there: {tokenizer.decode(mine[lo:pos + 8])!r}, "
                           f"rendered: {tokenizer.decode(ids[lo:pos + 8])!r}")
            except Exception as e:  # decoding is only for the message; never hide the mismatch itself
                context = f"; (could not decode the context: {type(e).__name__})"
        raise PrefixMismatchError(
            f"{what}: expected the {n} tokens of the trajectory as an exact prefix, but they differ at position "
            f"{pos}: {where} vs {'id ' + str(got) if got is not None else 'end of ' + what} "
            f"(the chat template rewrote history or the tokenizer re-merged tokens{context})",
            position=pos, expected=expected, got=got, role=role, turn=turn,
        )


def trajectory_rows(trajectories: Sequence[Trajectory]) -> Int[Tensor, " B"]:
    """For each row of :func:`to_tensors` (one per segment), the index of its trajectory in ``trajectories``.

    Use it to compute per-episode quantities once and broadcast them to the rows, e.g.
    ``grpo_advantages(rewards, group_ids)[trajectory_rows(trajs)]`` with one reward per trajectory (a branched
    episode must not count twice in its group's statistics).
    """
    _check_trajectories(trajectories)
    return torch.tensor([i for i, t in enumerate(trajectories) for _ in t.segments()], dtype=torch.long)


def _check_trajectories(trajectories: object) -> None:
    if isinstance(trajectories, Trajectory) or not isinstance(trajectories, Sequence) or len(trajectories) == 0:
        raise ArgumentError(f"trajectories: expected a non-empty sequence of Trajectory, got {trajectories!r:.80}")
    for i, t in enumerate(trajectories):
        if not isinstance(t, Trajectory):
            raise ArgumentError(f"trajectories[{i}]: expected a Trajectory, got {type(t).__name__}")


def _own(attr: str, values: list, *, kind: str, none: list | None) -> list | None:
    """The trajectories' own ``group_id`` / ``reward``: ``none`` when no trajectory has one, the checked values when
    all have one. A mix is refused: the trajectories without one would have been merged into group 0 (or the
    batch would have lost every reward), silently."""
    missing = [i for i, v in enumerate(values) if v is None]
    if len(missing) == len(values):
        return none
    if missing:
        raise ArgumentError(f"trajectories[{missing[0]}].{attr}: expected every trajectory to have a {attr} (or pass "
                            f"{attr}s=...), got {len(missing)} of {len(values)} without one")
    return check_int_list(f"trajectories[*].{attr}", values) if kind == "int" else \
        check_real_list(f"trajectories[*].{attr}", values)


def to_tensors(
    trajectories: Sequence[Trajectory],
    *,
    pad_id: int,
    group_ids: Sequence[int] | Tensor | None = None,
    rewards: Sequence[float] | Tensor | None = None,
    device: torch.device | str | None = None,
) -> RolloutBatch:
    """Right-padded training tensors for ``trajectories``: the :class:`~rlblocks.rollout.batch.RolloutBatch` layout
    that rlblocks.losses and rlblocks.kernels take directly, with ``turn_ids`` filled.

    One row per segment (a trajectory without branches is one row; see :func:`trajectory_rows`). Row ``b``:

    - ``input_ids[b] = token_ids`` of the segment; ``prompt_lens[b]`` = its leading prompt length ``P_b``;
    - response-aligned ``[B, T]`` tensors cover everything after the prompt (model AND environment tokens):
      ``response_mask`` is true there; ``loss_mask`` only on model tokens (and where their generation's own mask
      allowed); ``rollout_logp`` is the engine's fp32 log-prob on model tokens and exactly 0 elsewhere;
      ``versions`` the model tokens' versions and -1 elsewhere; ``turn_ids`` the turn of every response token
      (-1 on padding).
    - ``group_ids`` (one per trajectory, repeated over its segments; default: the trajectories' ``group_id``,
      or 0 when none has one) and ``rewards`` (one per trajectory; default: their ``reward``, or no rewards when
      none has one).

    Raises :class:`~rlblocks.errors.ArgumentError` for an empty list, a non-``Trajectory`` entry, a ``pad_id``
    that is not an int >= 0, per-trajectory lists of the wrong length or type, or trajectories of which only some
    have a ``group_id`` (or a ``reward``). Nothing is dropped.
    """
    _check_trajectories(trajectories)
    pad_id = check_int("pad_id", pad_id, minimum=0, what="an int token id >= 0")
    n = len(trajectories)
    gids = per_row("group_ids", group_ids, n, kind="int", unit="trajectory")
    if gids is None:
        gids = _own("group_id", [t.group_id for t in trajectories], kind="int", none=[0] * n)
    rews = per_row("rewards", rewards, n, kind="real", unit="trajectory")
    if rews is None:
        rews = _own("reward", [t.reward for t in trajectories], kind="real", none=None)

    rows = [(i, s) for i, t in enumerate(trajectories) for s in t.segments()]
    p = [s.prompt_len for _, s in rows]
    fields = padded_rows([(s.token_ids, p_, s.loss_mask[p_:], s.logprobs[p_:], s.versions[p_:])
                          for (_, s), p_ in zip(rows, p)], pad_id)
    turn_ids = torch.full(fields["versions"].shape, -1, dtype=torch.long)
    for r, ((_, s), p_) in enumerate(zip(rows, p)):
        turn_ids[r, : len(s) - p_] = torch.tensor(s.turn_ids[p_:], dtype=torch.long)
    batch = RolloutBatch(
        **fields,
        group_ids=torch.tensor([gids[i] for i, _ in rows], dtype=torch.long),
        rewards=None if rews is None else torch.tensor([rews[i] for i, _ in rows], dtype=torch.float32),
        turn_ids=turn_ids,
    )
    return batch if device is None else batch.to(device)
