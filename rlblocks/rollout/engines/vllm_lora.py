"""LoRA adapters on :class:`~rlblocks.rollout.engines.VLLMEngine`: an adapter (a PEFT directory, a ``PeftModel``
or ``rlblocks.sync.lora_state``'s tensors) is written where vLLM can load it, registered under its policy version
(``LoRARequest(lora_name(version), version + 1, path, load_inplace=True)``) and used by every new request; no pause
is needed, because a running request keeps the adapter it started with. Adapters older than
``version - max_staleness`` are removed once no request in flight uses them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

from rlblocks.errors import ArgumentError, WeightUpdateError

from ._weights import check_update_version

__all__: list[str] = []


class _VLLMLoRA:
    """The LoRA half of :class:`~rlblocks.rollout.engines.VLLMEngine` (a mixin: it uses the engine's ``_llm``,
    ``_state``, ``_control``, ``_version`` and ``_commit_version``)."""

    def _init_lora(self, llm: Any, max_staleness: int, lora_dir: str | os.PathLike | None) -> None:
        self._max_staleness = max_staleness
        self._lora_enabled = llm.vllm_config.lora_config is not None
        self._loras: dict[int, Any] = {}  # version -> LoRARequest
        self._lora_users: dict[int, int] = {}  # version -> number of in-flight requests using it
        self._lora_version: int | None = None  # adapter that new requests get (None: base model)
        self._gc_tasks: set[asyncio.Task] = set()
        self._own_lora_dir = lora_dir is None
        self._lora_dir = Path(lora_dir) if lora_dir is not None else None

    def _use_lora(self) -> tuple[int | None, Any]:
        """The adapter a new request runs with, ``(version, LoRARequest)`` (``(None, None)``: the base model); the
        request holds it until :meth:`_release_lora`."""
        v = self._lora_version
        if v is None:
            return None, None
        self._lora_users[v] = self._lora_users.get(v, 0) + 1
        return v, self._loras[v]

    def _remove_lora_dir(self) -> None:
        """Delete the adapters this engine wrote (at close)."""
        if self._own_lora_dir and self._lora_dir is not None:
            shutil.rmtree(self._lora_dir, ignore_errors=True)

    def _write_adapter(self, lora: Any, version: int) -> str:
        """Materialise ``lora`` as a PEFT adapter directory vLLM can load; return its path."""
        if isinstance(lora, str | os.PathLike):
            path = Path(lora)
            if not (path / "adapter_config.json").is_file():
                raise ArgumentError(
                    f"lora: expected a PEFT adapter directory with "
                    f"adapter_config.json, got {str(path)!r}"
                )
            return str(path)
        if hasattr(lora, "peft_config") and hasattr(lora, "save_pretrained"):  # a PeftModel
            target = self._adapter_path(version)
            lora.save_pretrained(str(target))
            return str(target)
        if not isinstance(lora, Mapping):
            raise ArgumentError(
                "lora: expected a PEFT adapter directory, a PeftModel, or a mapping with 'config' and 'tensors' "
                f"(as rlblocks.sync.lora_state returns), got {type(lora).__name__}"
            )
        config = lora.get("config")
        tensors = lora.get("tensors", lora.get("state_dict"))
        if config is None or not isinstance(tensors, Mapping) or not tensors:
            raise ArgumentError(f"lora: expected keys 'config' and 'tensors' (non-empty), got keys {sorted(lora)}")
        if hasattr(config, "to_dict"):
            config = config.to_dict()
        config = {k: (sorted(v) if isinstance(v, set) else v) for k, v in dict(config).items()}
        config.setdefault("peft_type", "LORA")
        from safetensors.torch import save_file

        target = self._adapter_path(version)
        clean = {}
        for name, t in tensors.items():
            if not isinstance(t, Tensor):
                raise ArgumentError(f"lora['tensors'][{name!r}]: expected a torch.Tensor, got {type(t).__name__}")
            # PEFT's in-memory names carry the adapter name (".lora_A.default.weight"); files do not.
            for adapter in {".default.", f".{config.get('adapter_name', 'default')}."}:
                name = name.replace(f".lora_A{adapter}", ".lora_A.").replace(f".lora_B{adapter}", ".lora_B.")
            clean[name] = t.detach().to("cpu").contiguous()
        save_file(clean, str(target / "adapter_model.safetensors"))
        (target / "adapter_config.json").write_text(json.dumps(config, default=str))
        return str(target)

    def _adapter_path(self, version: int) -> Path:
        if self._lora_dir is None:
            self._lora_dir = Path(tempfile.mkdtemp(prefix="rlblocks_vllm_lora_"))
        target = self._lora_dir / f"v{version:08d}"
        target.mkdir(parents=True, exist_ok=True)
        return target

    @staticmethod
    def lora_name(version: int) -> str:
        """The stable adapter name of ``version`` (its vLLM ``lora_int_id`` is ``version + 1``)."""
        return f"rlblocks-v{version}"

    async def update_lora(self, lora: Any, *, version: int, allow_rollback: bool = False) -> None:
        """Register the adapter of ``version`` and make new requests use it; no pause is needed.

        ``lora`` is a PEFT adapter directory, a ``PeftModel``, ``{"config": LoraConfig | dict, "tensors": {peft
        name: Tensor}}`` (what ``rlblocks.sync.lora_state`` returns), or ``None`` to serve the base model again.
        The adapter is registered as ``LoRARequest(lora_name(version), version + 1, path, load_inplace=True)``:
        re-sending a version replaces it in place. Requests already running keep the adapter they started with
        (their tokens carry its version). Adapters older than ``version - max_staleness`` are removed once no
        in-flight request uses them, so at least ``max_staleness + 1`` versions stay registered (TRL #7017).
        ``version`` is committed as the engine version too, with the version rule of :meth:`update_weights` (an older
        version needs ``allow_rollback=True``; :class:`~rlblocks.errors.WeightUpdateError`). Needs an engine started
        with ``enable_lora=True``."""
        from vllm.lora.request import LoRARequest

        self._state.check_open()
        if not self._lora_enabled:
            raise ArgumentError("lora: this engine was started without enable_lora=True")
        version = check_update_version("VLLMEngine", version, self._version, allow_rollback=allow_rollback)
        if version < 0:
            raise ArgumentError(f"version: expected an int >= 0 (vLLM's lora_int_id is version + 1), got {version}")
        async with self._control:
            version = check_update_version("VLLMEngine", version, self._version, allow_rollback=allow_rollback)
            if lora is None:
                self._lora_version = None
            else:
                path = self._write_adapter(lora, version)
                req = LoRARequest(self.lora_name(version), version + 1, path, load_inplace=True)
                if await self._llm.add_lora(req) is False:
                    raise WeightUpdateError(
                        f"VLLMEngine.update_lora refused: vLLM did not register the adapter of version {version} at "
                        f"{path}; nothing was loaded (adapter and version unchanged)"
                    )
                self._loras[version] = req
                self._lora_version = version
            await self._commit_version(version)
            await self._gc_loras()

    def registered_lora_versions(self) -> list[int]:
        """Adapter versions this engine keeps registered in vLLM."""
        return sorted(self._loras)

    def _release_lora(self, version: int) -> None:
        n = self._lora_users.get(version, 0) - 1
        if n <= 0:
            self._lora_users.pop(version, None)
        else:
            self._lora_users[version] = n
        if version < self._version - self._max_staleness and n <= 0 and not self._state.closed:
            # Removal is async; run it without blocking the request's return (keep a reference to the task).
            with contextlib.suppress(RuntimeError):
                task = asyncio.get_running_loop().create_task(self._gc_loras())
                self._gc_tasks.add(task)
                task.add_done_callback(self._gc_tasks.discard)

    async def _gc_loras(self) -> None:
        keep_from = self._version - self._max_staleness
        for v in sorted(self._loras):
            if v >= keep_from or self._lora_users.get(v, 0) > 0:
                continue
            req = self._loras.pop(v, None)
            if req is None:  # removed meanwhile by a concurrent collection
                continue
            await self._llm.remove_lora(req.lora_int_id)
            if self._own_lora_dir and self._lora_dir is not None and Path(req.lora_path).parent == self._lora_dir:
                shutil.rmtree(req.lora_path, ignore_errors=True)
