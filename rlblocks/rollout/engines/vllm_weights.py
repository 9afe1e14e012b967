"""How :class:`~rlblocks.rollout.engines.VLLMEngine` loads weights: every update path (checkpoint tensors as raw
bytes through ``collective_rpc``, NCCL broadcasts from a trainer in another job, CUDA IPC handles from a colocated
trainer; block-FP8 weights on any of them), the check that precedes each, and what runs inside vLLM's workers
(:class:`WorkerExtension`, :func:`refresh_tied_modules`), plus the trainer side of the NCCL path.

Every path follows one sequence (``_VLLMWeights._swap``): check the update with the rule every engine shares
(:mod:`rlblocks.rollout.engines._weights`; a refusal raises :class:`~rlblocks.errors.WeightUpdateError` and nothing
is loaded) → pause vLLM's scheduler (mode ``keep``) → load → re-derive what tied modules build from their weight →
``reset_prefix_cache(reset_running_requests=True)`` (no KV computed under old weights survives) → commit the version
into vLLM's engine core (which labels each output step with it) → resume, if this update paused. Docs:
``docs/rollout/vllm.md``. LoRA adapters load through :mod:`rlblocks.rollout.engines.vllm_lora`.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from rlblocks.errors import ArgumentError

from ._weights import WeightLayout, WeightSpec, check_update_version, refuse

__all__ = ["WorkerExtension", "nccl_trainer_init", "nccl_trainer_send", "refresh_tied_modules"]

WORKER_EXTENSION = "rlblocks.rollout.engines.vllm_weights.WorkerExtension"


def _encode_tensor(t: Tensor) -> tuple[str, list[int], bytes]:
    """``(dtype name, shape, raw bytes)``: plain msgpack types, so no pickle is needed on the RPC channel."""
    t = t.detach().to("cpu").contiguous()
    return str(t.dtype).removeprefix("torch."), list(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes()


def _decode_tensor(dtype: str, shape: Sequence[int], blob: bytes) -> Tensor:
    dt = getattr(torch, dtype)
    if len(blob) == 0:
        return torch.empty(tuple(shape), dtype=dt)
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).view(dt).reshape(tuple(shape))


class WorkerExtension:
    """Methods mixed into vLLM's worker class (engine arg ``worker_extension_cls``, set by
    :meth:`VLLMEngine.from_pretrained`), callable through ``collective_rpc`` by name.

    vLLM's RPC channel decodes untyped tensors as lists, and shipping a callable needs
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (pickle); so tensors travel as ``(dtype, shape, bytes)`` and are rebuilt
    here, then handed to the worker's own ``reload_weights(weights_iterator=...)``.
    """

    def rlblocks_reload_weights(self, encoded: list) -> int:
        tensors = ((name, _decode_tensor(dtype, shape, blob)) for name, dtype, shape, blob in encoded)
        self.reload_weights(weights_iterator=tensors)  # type: ignore[attr-defined]
        return len(encoded)

    def rlblocks_refresh_tied(self) -> list[list[str]]:
        """Re-derive what the modules of a tied tensor built from it (:func:`refresh_tied_modules` on this worker's
        model); returns ``[refreshed module names, module names that could not be refreshed]``."""
        refreshed, stale = refresh_tied_modules(self.model_runner.get_model())  # type: ignore[attr-defined]
        return [refreshed, stale]


def refresh_tied_modules(model: torch.nn.Module) -> tuple[list[str], list[str]]:
    """Re-run ``process_weights_after_loading`` on every module of ``model`` (a vLLM model) that shares a weight
    with another module (tied embeddings: vLLM's ``ParallelLMHead.tie_weights`` makes ``lm_head.weight`` *the*
    ``embed_tokens.weight`` parameter). Returns ``(refreshed, stale)`` module names.

    Why: vLLM's in-place reload (``reload_weights`` and the weight-transfer engines) processes a layer only when
    weights were loaded *into it*; a tied checkpoint names the tensor once (``model.embed_tokens.weight``), so the
    LM head is never processed again. Its parameter holds the new values (it is the embedding's), but what the
    head's ``process_weights_after_loading`` derived from it at start-up is kept: on CPU that is the GEMM handle
    with a pre-packed copy of the matrix (``dispatch_cpu_unquantized_gemm``: oneDNN, sgl-kernel or zentorch), so
    the engine sampled from the new body and the initial head. Re-running the unquantized embedding method
    rebuilds that handle from the current values (on CUDA it derives nothing: a no-op). Other quantisation
    methods are not re-run (their processing rewrites the parameter and is not idempotent): their names are
    returned in ``stale``."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    holders: dict[int, list[tuple[str, torch.nn.Module]]] = {}
    for name, module in model.named_modules():
        for p in module._parameters.values():
            if p is None or p.is_meta or p.numel() == 0:
                continue
            holders.setdefault(p.untyped_storage().data_ptr(), []).append((name, module))
    refreshed: list[str] = []
    stale: list[str] = []
    done: set[int] = set()
    for group in holders.values():
        if len({id(m) for _, m in group}) < 2:
            continue
        for name, module in group:
            if id(module) in done:
                continue
            done.add(id(module))
            method = getattr(module, "quant_method", None)
            if isinstance(method, UnquantizedEmbeddingMethod):
                method.process_weights_after_loading(module)
                refreshed.append(name)
            elif method is not None:
                stale.append(name)
    return refreshed, stale


class _VLLMWeights:
    """The weight paths of :class:`~rlblocks.rollout.engines.VLLMEngine` (a mixin: it uses the engine's ``_llm``,
    ``_state``, ``_control``, ``_version``, ``_vllm_paused`` and ``_apply_run_state``)."""

    def _init_weights(self, expected_weights: Mapping[str, Sequence[int]] | None) -> None:
        self._layout = None if expected_weights is None else WeightLayout.from_shapes(expected_weights)
        self._packed: dict[str, str] = {}
        self._fp8: dict[str, tuple[int, ...]] | None = None  # block-FP8 weights: {name: scale shape}, see _fp8_layout
        self._checkpoint_config: Any = None  # the HF config the layout was built from (None: layout given)
        self._label_versions: dict[str, int] = {"default": self._version}  # vLLM's version label -> version
        self._warned_stale = False  # a tied module vLLM cannot re-derive was warned about
        self._ipc_initialised = False  # vLLM's IPC transfer engine is initialised by the first IPC update

    def _weight_layout(self) -> WeightLayout:
        """Checkpoint-format names, shapes and tied aliases, from the HF model class built on the meta device."""
        if self._layout is None:
            from transformers import AutoConfig, AutoModelForCausalLM

            mc = self._llm.model_config
            cfg = AutoConfig.from_pretrained(mc.model, trust_remote_code=mc.trust_remote_code)
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(cfg, trust_remote_code=mc.trust_remote_code)
            # vLLM loads checkpoint names only: non-persistent buffers (rotary frequencies) are not part of it
            self._layout = WeightLayout.from_module(model, non_persistent_buffers=False)
            self._checkpoint_config = cfg
        if self._fp8 is None:
            self._fp8 = self._fp8_layout(self._checkpoint_config)
        if not self._packed:
            self._packed = self._packed_modules(self._llm.model_config)
        return self._layout

    def _fp8_layout(self, cfg: Any) -> dict[str, tuple[int, ...]]:
        """Block-FP8 engines (started from a checkpoint whose ``quantization_config`` is ``quant_method="fp8"`` with
        a ``weight_block_size``, e.g. one written by :func:`rlblocks.sync.save_fp8_checkpoint`): the weights it holds
        as FP8, ``{name: scale shape}``, under :class:`rlblocks.sync.FP8Rules` of that config; the layout gains
        their ``<name>_scale_inv`` entries. Empty for any other engine."""
        from rlblocks.sync.fp8 import SCALE_SUFFIX, FP8Rules, scale_shape

        # the checkpoint's own config (the one the layout was built from), not vLLM's copy of it
        qc = getattr(cfg, "quantization_config", None)
        if qc is not None and not isinstance(qc, Mapping):
            qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
        if not qc or "fp8" not in str(qc.get("quant_method", "")) or not qc.get("weight_block_size"):
            return {}
        rules = FP8Rules.from_hf_config(qc)
        specs = dict(self._layout.specs)
        fp8 = {}
        for name, spec in self._layout.specs.items():
            if rules.quantizes(name, spec.shape, spec.dtype or torch.float32):
                fp8[name] = scale_shape(spec.shape, rules.block)
                specs[name + SCALE_SUFFIX] = WeightSpec(fp8[name], torch.float32, required=spec.required)
        self._layout = WeightLayout(specs, aliases=self._layout.aliases)
        return fp8

    def _check_fp8(self, items: list) -> list:
        """A block-FP8 engine's update must carry every FP8 weight as ``float8_e4m3fn`` and its scales as float32
        (:mod:`rlblocks.sync.fp8`; a bf16 weight would be cast into the FP8 parameter without new scales): checked
        here, with the values (no NaN byte in a weight, every scale finite and positive). Returns the items with
        meta stand-ins for the FP8 tensors, whose values the shared rule cannot read (it checks names, shapes,
        completeness); :meth:`validate_weights` puts the real tensors back."""
        from rlblocks.sync.fp8 import FP8_DTYPE, SCALE_SUFFIX

        scales = {n + SCALE_SUFFIX: n for n in self._fp8}
        out = []
        for item in items:
            name, t = item if isinstance(item, tuple | list) and len(item) == 2 else (None, None)
            if not isinstance(t, Tensor) or (name not in self._fp8 and name not in scales):
                out.append(item)
                continue
            want = FP8_DTYPE if name in self._fp8 else torch.float32
            if t.dtype != want:
                hint = " (quantise with rlblocks.sync.quantize_named)" if want == FP8_DTYPE else ""
                raise refuse("VLLMEngine", f"{name!r}: this engine holds block-FP8 weights, expected {want}, "
                                           f"got {t.dtype}{hint}")
            if not t.is_meta and want == FP8_DTYPE and bool(((t.view(torch.uint8) & 0x7F) == 0x7F).any()):
                raise refuse("VLLMEngine", f"{name!r}: NaN values in an FP8 weight")
            if not t.is_meta and want == torch.float32 and not bool((torch.isfinite(t) & (t > 0)).all()):
                raise refuse("VLLMEngine", f"{name!r}: FP8 scales must be finite and positive")
            out.append((name, t.to("meta") if want == FP8_DTYPE else t))
        return out

    @staticmethod
    def _packed_modules(model_config: Any) -> dict[str, str]:
        """``{checkpoint module leaf: fused vLLM module leaf}``, e.g. ``q_proj -> qkv_proj``."""
        try:
            from vllm.model_executor.models import ModelRegistry

            model_cls, _ = ModelRegistry.resolve_model_cls(model_config.architectures, model_config)
            mapping = getattr(model_cls, "packed_modules_mapping", {}) or {}
        except Exception:
            mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
        return {leaf: fused for fused, leaves in mapping.items() for leaf in leaves}

    def _fused_module(self, name: str) -> str:
        module, _, _ = name.rpartition(".")
        prefix, _, leaf = module.rpartition(".")
        fused = self._packed.get(leaf, leaf)
        return f"{prefix}.{fused}" if prefix else fused

    def validate_weights(
        self, named_tensors: Iterable[tuple[str, Tensor]], *, partial: bool = False
    ) -> list[tuple[str, Tensor]]:
        """Check an update against the model before anything is loaded (the shared rule of
        :mod:`rlblocks.rollout.engines._weights`) and return it as ``[(checkpoint name, tensor)]``.

        Tied aliases are folded into the name vLLM loads (``lm_head.weight`` of a tied model becomes
        ``model.embed_tokens.weight``, which vLLM loads instead of skipping). vLLM also fuses e.g. ``q/k/v_proj``
        into ``qkv_proj`` and ``gate/up_proj`` into ``gate_up_proj``; loading part of one would leave the rest
        undefined, so a partial update must send every part of the fused modules it touches. Raises
        :class:`~rlblocks.errors.WeightUpdateError`."""
        layout = self._weight_layout()
        named_tensors = list(named_tensors)
        if self._fp8:
            real = {it[0]: it[1] for it in named_tensors if isinstance(it, tuple | list) and len(it) == 2
                    and isinstance(it[0], str)}
            checked = layout.validate(self._check_fp8(named_tensors), engine="VLLMEngine", partial=partial)
            items = [(n, real[n] if t.is_meta and n in real else t) for n, t in checked]
        else:
            items = layout.validate(named_tensors, engine="VLLMEngine", partial=partial)
        seen = {n for n, _ in items}
        groups: dict[str, set[str]] = {}
        for name in layout.required:
            groups.setdefault(self._fused_module(name), set()).add(name)
        for name in seen:
            missing = sorted(groups.get(self._fused_module(name), set()) - seen)
            if missing:
                raise refuse(
                    "VLLMEngine",
                    f"{name!r} is part of the fused vLLM module {self._fused_module(name)!r}; also send {missing}",
                )
        return items

    async def _commit_version(self, version: int) -> None:
        await self._llm.update_weight_version(str(version))
        self._label_versions[str(version)] = version
        self._version = version

    async def _refresh_tied(self) -> None:
        """After every load: the workers re-derive the state of tied modules (:func:`refresh_tied_modules`; without
        it a tied LM head keeps serving its start-up values on CPU), through :class:`WorkerExtension` (which
        :meth:`from_pretrained` installs) on every update path. A tied module that cannot be refreshed is warned
        about once."""
        answers = await self._llm.collective_rpc("rlblocks_refresh_tied")
        stale = sorted({n for answer in answers for n in answer[1]})
        if stale and not self._warned_stale:
            self._warned_stale = True
            warnings.warn(
                f"VLLMEngine: the tied modules {stale} use a quantisation method whose derived state cannot be "
                "rebuilt after an update; they may keep serving the weights they were started with",
                RuntimeWarning, stacklevel=3,
            )

    async def _swap(self, version: int, partial: bool, allow_rollback: bool, load: Any) -> None:
        """Quiesce, run ``load()``, reset caches, commit ``version``, resume (the order of the module docstring)."""
        async with self._control:
            # another update may have committed while this one waited for the lock
            version = check_update_version("VLLMEngine", version, self._version, allow_rollback=allow_rollback)
            self._state.check_update(partial)
            self._state.updating += 1
            try:
                if not self._vllm_paused:
                    await self._llm.pause_generation(mode="keep", clear_cache=False)
                    self._vllm_paused = True
                await load()
                await self._refresh_tied()
                await self._llm.reset_prefix_cache(reset_running_requests=True)
                await self._commit_version(version)
                if not partial:
                    self._state.on_complete_update()
            finally:
                self._state.updating -= 1
                await self._apply_run_state()

    async def update_weights(
        self,
        named_tensors: Iterable[tuple[str, Tensor]],
        *,
        version: int,
        partial: bool = False,
        allow_rollback: bool = False,
    ) -> None:
        """Load checkpoint-format tensors (HF names) and commit ``version`` (see the module docstring).

        The update is checked before anything is loaded; on a :class:`~rlblocks.errors.WeightUpdateError` the engine
        keeps its old weights and version. Tensors travel to the worker through ``collective_rpc`` as raw bytes (any
        device, any dtype; :class:`WorkerExtension` rebuilds them), one call for the whole set, so a fused module is
        never half-loaded: fine for small models and CPU; for large GPU models use :meth:`init_weight_transfer` +
        :meth:`update_weights_from_distributed` (NCCL), or, colocated on one GPU, :meth:`update_weights_from_ipc`
        (CUDA IPC, no host copy). The engine must run :class:`WorkerExtension`
        (``from_pretrained`` sets it; a custom ``worker_extension_cls`` must subclass it)."""
        self._state.check_open()
        version = check_update_version("VLLMEngine", version, self._version, allow_rollback=allow_rollback)
        self._state.check_update(partial)
        items = self.validate_weights(list(named_tensors), partial=partial)
        encoded = [(n, *_encode_tensor(t)) for n, t in items]

        async def load() -> None:
            await self._llm.collective_rpc("rlblocks_reload_weights", args=(encoded,))

        await self._swap(version, partial, allow_rollback, load)

    # ---- NCCL path (GPU only): a trainer in another job broadcasts into the workers
    async def init_weight_transfer(
        self, *, master_addr: str, master_port: int, world_size: int, rank_offset: int = 1, packed: bool = True
    ) -> None:
        """Join the trainer's NCCL group (vLLM's ``StatelessProcessGroup`` rendezvous on a TCPStore at
        ``master_addr:master_port`` + ``PyNcclCommunicator``). The trainer is rank 0; worker ``i`` of this
        engine is rank ``rank_offset + i``; ``world_size`` = 1 + all engine workers. The trainer calls
        :func:`nccl_trainer_init` concurrently. Needs CUDA and an engine started with
        ``weight_transfer_config={"backend": "nccl"}``. (``master_address=`` still works, with a warning.)"""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._state.check_open()
        if self._llm.vllm_config.weight_transfer_config is None:
            raise ArgumentError(
                "weight_transfer_config: start the engine with weight_transfer_config={'backend': 'nccl'} "
                "to use the NCCL weight-transfer path"
            )
        info = {  # vLLM's own field names
            "master_address": master_addr,
            "master_port": int(master_port),
            "rank_offset": int(rank_offset),
            "world_size": int(world_size),
            "packed": bool(packed),
        }
        await self._llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info))

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[torch.dtype],
        shapes: Sequence[Sequence[int]],
        *,
        version: int,
        partial: bool = False,
        allow_rollback: bool = False,
    ) -> None:
        """Receive one broadcast round from the trainer (which calls :func:`nccl_trainer_send` with the same
        names, dtypes and shapes, in the same order) and commit ``version``. Names, shapes, dtypes, completeness and
        the version are checked before the round starts (:class:`~rlblocks.errors.WeightUpdateError`, nothing
        received, old version kept: the trainer must not send then; values cannot be checked before they arrive).
        Same pause / reset / commit sequence as :meth:`update_weights`."""
        self._state.check_open()
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ArgumentError(
                f"names, dtypes, shapes: expected equal lengths, got {len(names)}, {len(dtypes)}, {len(shapes)}"
            )
        version = self._check_described(names, dtypes, shapes, version, partial, allow_rollback)
        info = {
            "names": self._receive_names(names),
            "dtype_names": [str(d).removeprefix("torch.") for d in dtypes],
            "shapes": [list(s) for s in shapes],
        }
        await self._swap(version, partial, allow_rollback, lambda: self._transfer(info))

    # ---- CUDA IPC path (GPU only): a colocated trainer hands its device memory over, no host round trip
    async def update_weights_from_ipc(
        self,
        update_info: Mapping[str, Any],
        *,
        version: int,
        partial: bool = False,
        allow_rollback: bool = False,
    ) -> None:
        """Load weights the colocated trainer exported as CUDA IPC handles (vLLM's IPC weight transfer), commit
        ``version``.

        ``update_info`` is :meth:`rlblocks.sync.HandoffSender.vllm_ipc_update_info` of a prepared handoff (or any
        mapping of the same form): ``names``, ``dtype_names`` (``"bfloat16"``), ``shapes`` and ``ipc_handles``, one
        ``{GPU uuid: reduce_tensor args}`` per tensor. Each worker maps the trainer's buffers and loads from them:
        the load into the parameters is the only copy, and no weight goes through host memory (the raw-bytes
        :meth:`update_weights` path copies every weight device -> host -> RPC -> device). The trainer must keep
        the exported buffers untouched and alive until this returns (``HandoffSender.release(msg)`` afterwards).

        Needs CUDA and an engine started with ``weight_transfer_config={"backend": "ipc"}``; :meth:`from_pretrained`
        then sets ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` for the engine processes, because the handles carry
        torch types that only pickle can move, and travel pickled on the engine's own local channel. The first call
        initialises vLLM's IPC transfer engine (non-packed: one handle per tensor). Names, shapes, dtypes,
        completeness and the version are checked before anything is mapped (:class:`~rlblocks.errors.WeightUpdateError`,
        nothing loaded, old version kept); the pause / reset / commit sequence is that of :meth:`update_weights`.
        """
        import base64
        import pickle

        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._state.check_open()
        backend = getattr(self._llm.vllm_config.weight_transfer_config, "backend", None)
        if backend != "ipc":
            raise ArgumentError(
                f"weight_transfer_config: start the engine with weight_transfer_config={{'backend': 'ipc'}} to use "
                f"the CUDA IPC path, got backend {backend!r}"
            )
        if not isinstance(update_info, Mapping):
            raise ArgumentError(f"update_info: expected a mapping, got {type(update_info).__name__}")
        missing = sorted({"names", "dtype_names", "shapes", "ipc_handles"} - set(update_info))
        if missing:
            raise ArgumentError(f"update_info: missing keys {missing} (got {sorted(update_info)})")
        names = list(update_info["names"])
        dtype_names = [str(d) for d in update_info["dtype_names"]]
        shapes = [list(s) for s in update_info["shapes"]]
        handles = update_info["ipc_handles"]
        if not isinstance(handles, list) or not all(isinstance(h, Mapping) and h for h in handles):
            raise ArgumentError("update_info['ipc_handles']: expected a list of non-empty {GPU uuid: handle} mappings")
        if not (len(names) == len(dtype_names) == len(shapes) == len(handles)):
            raise ArgumentError(
                f"update_info: names, dtype_names, shapes, ipc_handles: expected equal lengths, got "
                f"{len(names)}, {len(dtype_names)}, {len(shapes)}, {len(handles)}"
            )
        dtypes = []
        for name, d in zip(names, dtype_names):
            dtype = getattr(torch, d, None)
            if not isinstance(dtype, torch.dtype):
                raise ArgumentError(f"update_info['dtype_names'] of {name!r}: expected a torch dtype name, got {d!r}")
            dtypes.append(dtype)
        version = self._check_described(names, dtypes, shapes, version, partial, allow_rollback)
        info = {
            "names": self._receive_names(names),
            "dtype_names": dtype_names,
            "shapes": shapes,
            "ipc_handles_pickled": base64.b64encode(pickle.dumps([dict(h) for h in handles])).decode("ascii"),
        }

        async def load() -> None:
            if not self._ipc_initialised:
                await self._llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info={"packed": False}))
                self._ipc_initialised = True
            await self._transfer(info)

        await self._swap(version, partial, allow_rollback, load)

    def _check_described(self, names: Sequence[str], dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]],
                         version: int, partial: bool, allow_rollback: bool) -> int:
        """The checks of an update that arrives by vLLM's weight transfer (NCCL, CUDA IPC), where only names, dtypes
        and shapes are known before the load: version, engine state and the shared rule on meta tensors. Returns
        the checked version."""
        version = check_update_version("VLLMEngine", version, self._version, allow_rollback=allow_rollback)
        self._state.check_update(partial)
        metas = [(n, torch.empty(tuple(s), dtype=d, device="meta")) for n, d, s in zip(names, dtypes, shapes)]
        self.validate_weights(metas, partial=partial)
        return version

    async def _transfer(self, info: dict) -> None:
        """One update through vLLM's weight-transfer engine (initialised): start, update, finish."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await self._llm.start_weight_update()
        await self._llm.update_weights(WeightTransferUpdateRequest(update_info=info))
        await self._llm.finish_weight_update()

    def _receive_names(self, names: Sequence[str]) -> list[str]:
        """Names the workers load under: a tied alias sent alone becomes the name vLLM loads (a tied ``lm_head``
        would otherwise be skipped); sent beside its canonical name, it stays as it is."""
        layout = self._weight_layout()
        given = set(names)
        return [layout.canonical(n) if layout.canonical(n) not in given else n for n in names]


# ---------------------------------------------------------------------- trainer side of the NCCL path
def nccl_trainer_init(*, master_addr: str, master_port: int, world_size: int) -> Any:
    """Trainer (rank 0) side of :meth:`VLLMEngine.init_weight_transfer`, run concurrently with it: vLLM's
    ``StatelessProcessGroup`` on a TCPStore at ``master_addr:master_port`` plus a ``PyNcclCommunicator`` on the
    current CUDA device. Does not touch the default ``torch.distributed`` group. Returns the communicator.
    (``master_address=`` still works, with a warning.)"""
    from vllm.distributed.weight_transfer.nccl_common import trainer_init

    return trainer_init({"master_address": master_addr, "master_port": master_port, "world_size": world_size})


def nccl_trainer_send(group: Any, named_tensors: Iterable[tuple[str, Tensor]], *, packed: bool = True) -> None:
    """Broadcast CUDA tensors from the trainer (rank 0) to the engine workers, in order, while the engine runs
    :meth:`VLLMEngine.update_weights_from_distributed` with the same names, dtypes and shapes. ``packed`` must
    match the engine's :meth:`~VLLMEngine.init_weight_transfer` (packed buffers are vLLM's double-buffered
    ``packed_nccl_broadcast_producer``; unpacked is one broadcast per tensor). A broadcast sends the tensor's
    storage as laid out, so a non-contiguous tensor (a transposed or sliced view) is made contiguous first: the
    receiver reads the bytes in row-major order."""
    if packed:
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        packed_nccl_broadcast_producer(iterator=iter(named_tensors), group=group, src=0, post_iter_func=lambda x: x[1])
    else:
        for _, t in named_tensors:
            t = t.contiguous()
            group.broadcast(t, src=0, stream=torch.cuda.current_stream() if t.is_cuda else None)
