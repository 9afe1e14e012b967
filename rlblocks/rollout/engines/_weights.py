"""The one weight-update check shared by every engine (TorchEngine, VLLMEngine, SGLangEngine).

Rule (the ``update_weights(named_tensors, *, version, partial=False, allow_rollback=False)`` contract)
-----------------------------------------------------------------------------------------------------
An update is refused with :class:`~rlblocks.errors.WeightUpdateError` before any weight, cache or version changes
when it:

- is empty (no tensor at all: an update of nothing must not move the version);
- contains an item that is not a ``(name, torch.Tensor)`` pair, an unknown name, or a name given twice;
- has a tensor of the wrong shape, or of a dtype that cannot be loaded: a floating-point weight needs a
  floating-point tensor (any float dtype; it is cast to the weight's dtype when loaded), any other weight needs
  exactly its own dtype;
- has a non-finite value (NaN or +-inf) in a floating-point tensor: a trainer that diverged must not poison the
  rollout policy silently;
- covers only some of the model's weights while ``partial=False`` (the default): a forgotten tensor would leave the
  engine serving a mix of two policies under one version. Buffers (e.g. rotary frequencies, which trainers do not
  stream) are accepted but never required; parameters are;
- names two aliases of one tied tensor (``state_dict()`` lists ``lm_head.weight`` and ``model.embed_tokens.weight``
  when the embeddings are tied) with *different* values. Identical values are fine: ``state_dict()`` of a tied model
  is a valid complete update, and either alias alone covers the tensor;
- has ``version < engine.version`` while ``allow_rollback=False``.

``version == engine.version`` re-loads the weights of the current version (the caller must only re-use a version
number for the same weights); a ``version`` that is not a genuine integer is an
:class:`~rlblocks.errors.ArgumentError`. Every refusal message has one shape (:func:`refuse`):
``<Engine>.update_weights refused: <detail>; nothing was loaded (weights and version unchanged)``.
The rule with its reasons: ``docs/rollout/engines.md`` (Weight updates).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from rlblocks._checks import check_bool, check_version
from rlblocks.errors import ArgumentError, WeightUpdateError

__all__ = ["WeightLayout", "WeightSpec", "check_tensors", "check_update_version", "refuse"]

_UNCHANGED = "nothing was loaded (weights and version unchanged)"


def refuse(engine: str, detail: str) -> WeightUpdateError:
    """The one refusal message: ``"<engine>.update_weights refused: <detail>; nothing was loaded (...)"``."""
    return WeightUpdateError(f"{engine}.update_weights refused: {detail}; {_UNCHANGED}")


def check_update_version(engine: str, version: object, current: int, *, allow_rollback: object) -> int:
    """``version`` of an update to an engine at version ``current`` (see the module docstring for the rule): a
    weight version by :func:`rlblocks._checks.check_version`, not older than ``current`` unless
    ``allow_rollback``."""
    version = check_version("version", version)
    allow_rollback = check_bool("allow_rollback", allow_rollback)
    if version < current and not allow_rollback:
        raise refuse(
            engine,
            f"version {version} is older than the engine's version {current} (versions only move forward; pass "
            "allow_rollback=True to go back on purpose)",
        )
    return version


@dataclass(frozen=True)
class WeightSpec:
    """One weight the engine accepts: its shape, its dtype (``None``: any floating dtype) and whether a complete
    (``partial=False``) update must cover it."""

    shape: tuple[int, ...]
    dtype: torch.dtype | None = None
    required: bool = True


class WeightLayout:
    """The weights an engine accepts and the rule that checks an update against them.

    Args:
        specs: ``{name: WeightSpec}`` for every name an update may use (aliases of a tied tensor included).
        aliases: ``{alias: canonical name}`` for names that share one tensor (tied weights). The canonical name is the
            one the engine loads; an alias counts as the canonical tensor for completeness.
    """

    def __init__(self, specs: Mapping[str, WeightSpec], *, aliases: Mapping[str, str] | None = None) -> None:
        self.specs = dict(specs)
        self.aliases = dict(aliases or {})
        for alias, canonical in self.aliases.items():
            if alias not in self.specs or canonical not in self.specs:
                raise ArgumentError(f"aliases: {alias!r} -> {canonical!r} names a weight that is not in specs")
        self.required = sorted({self.canonical(n) for n, spec in self.specs.items() if spec.required})

    @classmethod
    def from_module(cls, module: torch.nn.Module, *, non_persistent_buffers: bool = True) -> WeightLayout:
        """The layout of ``module``: every ``state_dict()`` name (plus the non-persistent buffers if asked);
        parameters are required, buffers optional; names sharing one tensor (tied weights) are aliases of the first
        such name."""
        specs: dict[str, WeightSpec] = {}
        aliases: dict[str, str] = {}
        first: dict[int, str] = {}
        params = {id(p) for p in module.parameters()}
        entries = list(module.state_dict(keep_vars=True).items())
        if non_persistent_buffers:
            names = {n for n, _ in entries}
            entries += [(n, b) for n, b in module.named_buffers() if n not in names]
        for name, t in entries:
            specs[name] = WeightSpec(tuple(t.shape), t.dtype, required=id(t) in params)
            key = id(t)
            if key in first:
                aliases[name] = first[key]
            else:
                first[key] = name
        return cls(specs, aliases=aliases)

    @classmethod
    def from_shapes(
        cls, shapes: Mapping[str, Sequence[int]], *, aliases: Mapping[str, str] | None = None
    ) -> WeightLayout:
        """A layout known only by names and shapes (floating-point weights, all required)."""
        return cls({n: WeightSpec(tuple(int(d) for d in s)) for n, s in shapes.items()}, aliases=aliases)

    def canonical(self, name: str) -> str:
        return self.aliases.get(name, name)

    def validate(
        self, named_tensors: Iterable[tuple[str, Tensor]], *, engine: str, partial: bool = False
    ) -> list[tuple[str, Tensor]]:
        """Check an update (module docstring rule) and return it as ``[(canonical name, tensor)]``, one entry per
        tensor of the model (aliases folded into their canonical name), in the order given.

        Values are checked only for tensors that have them (meta tensors describe a transfer still to come: their
        names, shapes and dtypes are checked, not their values). Raises :class:`WeightUpdateError`.
        """
        check_bool("partial", partial)
        out: dict[str, tuple[str, Tensor]] = {}  # canonical -> (name given, tensor)
        seen: set[str] = set()
        for i, item in enumerate(named_tensors):
            if not (isinstance(item, tuple | list) and len(item) == 2 and isinstance(item[0], str)):
                raise refuse(engine, f"named_tensors[{i}]: expected a (name, torch.Tensor) pair, got {_kind(item)}")
            name, t = item
            spec = self.specs.get(name)
            if spec is None:
                sample = ", ".join(repr(n) for n in list(self.specs)[:3])
                raise refuse(engine, f"{name!r}: the model has no weight of this name (its names: {sample}, ...)")
            if not isinstance(t, Tensor):
                raise refuse(engine, f"{name!r}: expected a torch.Tensor, got {type(t).__name__}")
            if name in seen:
                raise refuse(engine, f"{name!r} is given more than once")
            seen.add(name)
            if tuple(t.shape) != spec.shape:
                raise refuse(engine, f"{name!r}: expected shape {list(spec.shape)}, got {list(t.shape)}")
            floating = spec.dtype is None or spec.dtype.is_floating_point
            if floating and not t.is_floating_point():
                want = "a floating-point dtype" + ("" if spec.dtype is None else f" (loaded as {spec.dtype})")
                raise refuse(engine, f"{name!r}: expected {want}, got {t.dtype}")
            if not floating and t.dtype != spec.dtype:
                raise refuse(engine, f"{name!r}: expected dtype {spec.dtype}, got {t.dtype}")
            if t.is_floating_point() and not t.is_meta:
                _check_finite(engine, name, t)
            key = self.canonical(name)
            if key in out:
                other, t0 = out[key]
                if not (t.is_meta or t0.is_meta) and not torch.equal(t0, t.to(t0.device)):
                    raise refuse(
                        engine,
                        f"{other!r} and {name!r} are one tied tensor in the model, but the update gives them different "
                        "values",
                    )
                continue
            out[key] = (name, t)
        if not out:
            raise refuse(engine, "the update is empty (no tensor); the version does not move without weights")
        if not partial:
            missing = [n for n in self.required if n not in out]
            if missing:
                shown = ", ".join(repr(n) for n in missing[:5]) + (", ..." if len(missing) > 5 else "")
                raise refuse(
                    engine,
                    f"a partial update covers {len(self.required) - len(missing)} of the model's "
                    f"{len(self.required)} weights, missing {shown} (pass partial=True to update only some weights)",
                )
        return [(key, t) for key, (_, t) in out.items()]


def dequantize_fp8(items: list, layout: WeightLayout, *, engine: str) -> list:
    """An update in the block-FP8 wire format of :mod:`rlblocks.sync.fp8` (``name`` as ``float8_e4m3fn`` plus
    ``name + "_scale_inv"``, 128 x 128 blocks) dequantised for an engine that computes in its own dtypes: each pair
    becomes one tensor of the weight's dtype in ``layout`` (``float32(q) * scale`` rounded once), so the engine
    computes with exactly the weights an FP8 engine holds. Anything else passes through untouched. A float8 tensor
    without its scales, or scales without their weight, is refused (:func:`refuse`) like any other bad update."""
    from rlblocks.sync.fp8 import FP8_DTYPE, SCALE_SUFFIX, dequantize_named

    specs = layout.specs
    if not any(
        isinstance(it, tuple | list) and len(it) == 2 and isinstance(it[0], str) and isinstance(it[1], Tensor)
        and (it[1].dtype == FP8_DTYPE or (it[0].endswith(SCALE_SUFFIX) and it[0] not in specs))
        for it in items
    ):
        return items
    own = {n: s.dtype or torch.float32 for n, s in specs.items()}
    try:
        return dequantize_named(items, dtype=own, own=own)
    except ArgumentError as e:
        raise refuse(engine, str(e)) from None


def check_tensors(named_tensors: Iterable[tuple[str, Tensor]], *, engine: str) -> list[tuple[str, Tensor]]:
    """The part of the rule that needs no layout (an engine that cannot see the model's weights, such as a client
    of a remote server given no ``expected_weights``): pairs, tensors, duplicates, finite values, not empty. Names,
    shapes and completeness are then the server's to check."""
    out: list[tuple[str, Tensor]] = []
    seen: set[str] = set()
    for i, item in enumerate(named_tensors):
        if not (isinstance(item, tuple | list) and len(item) == 2 and isinstance(item[0], str)):
            raise refuse(engine, f"named_tensors[{i}]: expected a (name, torch.Tensor) pair, got {_kind(item)}")
        name, t = item
        if not isinstance(t, Tensor):
            raise refuse(engine, f"{name!r}: expected a torch.Tensor, got {type(t).__name__}")
        if name in seen:
            raise refuse(engine, f"{name!r} is given more than once")
        seen.add(name)
        if t.is_floating_point() and not t.is_meta:
            _check_finite(engine, name, t)
        out.append((name, t))
    if not out:
        raise refuse(engine, "the update is empty (no tensor); the version does not move without weights")
    return out


def _check_finite(engine: str, name: str, t: Tensor) -> None:
    """Refuse a tensor with a NaN or an infinity.

    Fast path: one sum (fp32 accumulation at least, no temporary of the tensor's size, one host sync). A NaN or an
    infinity anywhere makes the sum non-finite, so a finite sum proves the tensor finite. A non-finite sum can also
    come from finite values whose sum overflows; only then are the values checked one by one (exact)."""
    acc = torch.float64 if t.dtype == torch.float64 else torch.float32
    if bool(torch.isfinite(t.sum(dtype=acc))):
        return
    # torch has no isfinite for the float8 dtypes: read them as float32 (exact), only on this slow path
    values = t.float() if t.element_size() == 1 else t
    bad = int((~torch.isfinite(values)).sum())
    if bad:
        raise refuse(engine, f"{name!r}: {bad} of {t.numel()} values are not finite (NaN or inf)")


def _kind(item: object) -> str:
    if isinstance(item, tuple | list):
        return f"a {type(item).__name__} of {len(item)} items"
    return type(item).__name__
