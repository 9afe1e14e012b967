"""The argument checks of every rlblocks package, in one place: ``from rlblocks._checks import check_int, ...``.

One rule per check, one message shape for every refusal: ``"<argument>: expected <what>, got <what came>"``,
raised as :class:`rlblocks.errors.ArgumentError` (also a ``ValueError``).

- :mod:`.scalars`: one plain value (``check_int``, ``check_real``, ``check_bool``, ``check_seconds``,
  ``check_timeout``, ``check_choice``, ``check_str``);
- :mod:`.containers`: lists of values (token ids, log-probabilities), string pairs, ``state_dict`` keys;
- :mod:`.versions`: the weight version (``check_version``);
- :mod:`.tensors`: tensor kind, dtype, shape and masks (no host sync).

The first three import only the standard library, so light packages (``rlblocks.reward``, ``rlblocks.sandbox``)
check their arguments without importing torch; the tensor checks, which need torch, load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlblocks._lazy import lazy_exports

from .containers import (
    LOGPROB_SLACK,
    check_int_list,
    check_logprob_list,
    check_real_list,
    check_state_keys,
    check_str_pair,
    check_token_ids,
)
from .scalars import (
    MAX_WAIT_SECONDS,
    as_int,
    check_bool,
    check_choice,
    check_int,
    check_optional_int,
    check_real,
    check_seconds,
    check_str,
    check_timeout,
)
from .versions import check_version

if TYPE_CHECKING:
    from .tensors import (
        as_bool_mask,
        check_floating,
        check_group_inputs,
        check_integer,
        check_last_dim,
        check_ndim,
        check_real_tensor,
        check_same_shape,
        check_tensor,
        check_token_pair,
        shape_str,
    )

# heavy (torch): name -> module, imported on first access
_LAZY = {
    "as_bool_mask": ".tensors",
    "check_floating": ".tensors",
    "check_group_inputs": ".tensors",
    "check_integer": ".tensors",
    "check_last_dim": ".tensors",
    "check_ndim": ".tensors",
    "check_real_tensor": ".tensors",
    "check_same_shape": ".tensors",
    "check_tensor": ".tensors",
    "check_token_pair": ".tensors",
    "shape_str": ".tensors",
}

__all__ = [
    "LOGPROB_SLACK",
    "MAX_WAIT_SECONDS",
    "as_bool_mask",
    "as_int",
    "check_bool",
    "check_choice",
    "check_floating",
    "check_group_inputs",
    "check_int",
    "check_int_list",
    "check_integer",
    "check_last_dim",
    "check_logprob_list",
    "check_ndim",
    "check_optional_int",
    "check_real",
    "check_real_list",
    "check_real_tensor",
    "check_same_shape",
    "check_seconds",
    "check_state_keys",
    "check_str",
    "check_str_pair",
    "check_tensor",
    "check_timeout",
    "check_token_ids",
    "check_token_pair",
    "check_version",
    "shape_str",
]


__getattr__, __dir__ = lazy_exports(__name__, globals(), _LAZY)
