"""Checkpoints and training runs on disk, under ``--state-dir``, named by the ``tinker://`` paths the SDK uses.

Layout (every write goes to a temporary directory first and is renamed into place, so a reader never sees a
half-written checkpoint and a crash leaves the previous one intact)::

    <state-dir>/runs/<training_run_id>/run.json                      base model, LoRA, metadata
    <state-dir>/runs/<training_run_id>/weights/<name>/               save_state:   tinker://<run>/weights/<name>
        adapter_model.safetensors  adapter_config.json               a PEFT adapter directory (loads with peft)
        optimizer.safetensors                                        AdamW moments and step counts
        meta.json
    <state-dir>/runs/<training_run_id>/sampler_weights/<name>/       save_weights_for_sampler(name): adapter only

``training_run_id`` is the model id (``<session>:train:<n>``, as the SDK derives it). Tensors are stored in their
own dtype (float32 adapters), so a load restores the weights and Adam moments bit for bit. A checkpoint saved with
``ttl_seconds`` expires then: it is no longer listed or loadable, and its files are removed when next looked at.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from torch import Tensor

from rlblocks.checkpoint import replace_dir
from rlblocks.errors import RequestError

_KIND_DIR = {"training": "weights", "sampler": "sampler_weights"}
_DIR_KIND = {v: k for k, v in _KIND_DIR.items()}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
_RUN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,199}$")


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, tz=timezone.utc).isoformat()


@dataclass(frozen=True)
class TinkerPath:
    """A parsed ``tinker://<training_run_id>/<weights|sampler_weights>/<name>``."""

    run: str
    kind: str  # "training" | "sampler"
    name: str

    def __str__(self) -> str:
        return f"tinker://{self.run}/{_KIND_DIR[self.kind]}/{self.name}"

    @property
    def checkpoint_id(self) -> str:
        return f"{_KIND_DIR[self.kind]}/{self.name}"

    @classmethod
    def parse(cls, path: object, field: str = "path") -> TinkerPath:
        """Parse and check a path; raises ``RequestError`` naming ``field``."""
        if not isinstance(path, str) or not path.startswith("tinker://"):
            raise RequestError(f"{field}: expected 'tinker://<training_run_id>/weights/<name>' (or sampler_weights), "
                               f"got {path!r}")
        parts = path[len("tinker://"):].split("/")
        if len(parts) != 3 or parts[1] not in _DIR_KIND or not _RUN.match(parts[0]) or not _NAME.match(parts[2]):
            raise RequestError(f"{field}: expected 'tinker://<training_run_id>/weights/<name>' (or sampler_weights), "
                               f"got {path!r}")
        return cls(parts[0], _DIR_KIND[parts[1]], parts[2])


def check_name(name: object, field: str = "path") -> str:
    """A checkpoint name: letters, digits, '.', '_', '-' (no '/'), at most 200 characters."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise RequestError(f"{field}: expected a checkpoint name of letters, digits, '.', '_' and '-' (starting with "
                           f"a letter or digit, no '/'), got {name!r}")
    return name


class CheckpointStore:
    """The files under ``<state_dir>/runs`` (see the module docstring)."""

    def __init__(self, state_dir: str | Path) -> None:
        self.root = Path(state_dir) / "runs"
        self.root.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ runs
    def write_run(self, run: str, info: dict[str, Any]) -> None:
        d = self.root / run
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / ".run.json.tmp"
        tmp.write_text(json.dumps(info, sort_keys=True))
        tmp.replace(d / "run.json")

    def read_run(self, run: str) -> dict[str, Any] | None:
        if not _RUN.match(run):
            return None
        f = self.root / run / "run.json"
        return json.loads(f.read_text()) if f.is_file() else None

    def runs(self) -> list[dict[str, Any]]:
        out = []
        for d in sorted(self.root.iterdir()) if self.root.is_dir() else []:
            info = self.read_run(d.name)
            if info is not None:
                out.append(info)
        return out

    # ------------------------------------------------------------------ checkpoints
    def _dir(self, p: TinkerPath) -> Path:
        return self.root / p.run / _KIND_DIR[p.kind] / p.name

    def exists(self, p: TinkerPath) -> bool:
        return self._meta(p) is not None

    def _meta(self, p: TinkerPath) -> dict[str, Any] | None:
        f = self._dir(p) / "meta.json"
        if not f.is_file():
            return None
        meta = json.loads(f.read_text())
        if meta.get("expires_at") is not None and meta["expires_at"] <= time.time():
            shutil.rmtree(self._dir(p), ignore_errors=True)
            return None
        return meta

    def save(self, p: TinkerPath, adapter: dict[str, Any], optimizer: dict[str, Tensor] | None, *,
             overwrite: bool = False, ttl_seconds: int | None = None, user_metadata: dict | None = None) -> int:
        """Write a checkpoint; returns its size in bytes. Refuses an existing name unless ``overwrite``."""
        from safetensors.torch import save_file

        if self.read_run(p.run) is None:
            raise RequestError(f"model_id: no training run {p.run!r}", status=404)
        target = self._dir(p)
        if self.exists(p) and not overwrite:
            raise RequestError(f"path: checkpoint {p.checkpoint_id!r} of {p.run!r} already exists (pass "
                               "overwrite=True to replace it)", status=409)
        now = time.time()
        with replace_dir(target) as tmp:
            save_file({k: v.contiguous() for k, v in adapter["tensors"].items()},
                      str(tmp / "adapter_model.safetensors"))
            (tmp / "adapter_config.json").write_text(json.dumps(adapter["config"], default=str, sort_keys=True))
            if optimizer is not None:
                save_file({k: v.contiguous() for k, v in optimizer.items()}, str(tmp / "optimizer.safetensors"))
            size = sum(f.stat().st_size for f in tmp.iterdir())
            meta = {"time": now, "size_bytes": size, "user_metadata": user_metadata or None,
                    "expires_at": None if ttl_seconds is None else now + ttl_seconds,
                    "has_optimizer": optimizer is not None}
            (tmp / "meta.json").write_text(json.dumps(meta, sort_keys=True))
        return size

    def load(self, p: TinkerPath, *, optimizer: bool) -> tuple[dict[str, Any], dict[str, Tensor] | None]:
        """``(adapter, optimizer_state or None)``; raises ``RequestError`` (404) for a missing checkpoint and (400)
        for optimizer state asked of a checkpoint that has none."""
        from safetensors.torch import load_file

        meta = self._meta(p)
        if meta is None:
            raise RequestError(f"path: no checkpoint {str(p)!r}", status=404)
        d = self._dir(p)
        adapter = {"tensors": load_file(str(d / "adapter_model.safetensors")),
                   "config": json.loads((d / "adapter_config.json").read_text())}
        opt = None
        if optimizer:
            if not meta.get("has_optimizer"):
                raise RequestError(f"path: {str(p)!r} holds no optimizer state (save it with save_state)")
            opt = load_file(str(d / "optimizer.safetensors"))
        return adapter, opt

    def delete(self, p: TinkerPath) -> None:
        if not self.exists(p):
            raise RequestError(f"checkpoint_id: no checkpoint {p.checkpoint_id!r} in training run {p.run!r}",
                               status=404)
        shutil.rmtree(self._dir(p))

    def checkpoint(self, p: TinkerPath) -> dict[str, Any] | None:
        """The ``tinker.types.Checkpoint`` fields of one checkpoint (JSON-ready), or None."""
        meta = self._meta(p)
        if meta is None:
            return None
        return {"checkpoint_id": p.checkpoint_id, "checkpoint_type": p.kind, "time": _iso(meta["time"]),
                "tinker_path": str(p), "size_bytes": meta.get("size_bytes"), "public": False,
                "user_metadata": meta.get("user_metadata"),
                "expires_at": None if meta.get("expires_at") is None else _iso(meta["expires_at"])}

    def checkpoints(self, run: str) -> list[dict[str, Any]]:
        """Every live checkpoint of ``run``, oldest first."""
        out = []
        for kind, sub in _KIND_DIR.items():
            d = self.root / run / sub
            for c in sorted(d.iterdir()) if d.is_dir() else []:
                if c.name.startswith("."):
                    continue
                info = self.checkpoint(TinkerPath(run, kind, c.name))
                if info is not None:
                    out.append(info)
        return sorted(out, key=lambda c: c["time"])


__all__ = ["CheckpointStore", "TinkerPath", "check_name"]
