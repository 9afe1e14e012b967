"""Delta sync throughput next to memcpy, and wire size, at densities 0.1 %, 3 %, 50 % (bf16 and fp32), and on a real
model's weights.

Run: .venv/bin/python benchmarks/sync/bench_delta.py [--melems 32] [--reps 5] [--threads N] [--sync-threads N]
     [--baseline OLD_DELTA_PY | --baseline-rev GIT_REV] [--model HF_DIR_OR_NAME] [--quick]

For each (dtype, density): a model of --melems million elements in 8 tensors and one random sparse update. With
--model (an HF directory, or a named model such as smollm2-135m when ``cookbook.plumbing.models`` is installed),
also the checkpoint's own tensors in bf16, with an RL step's changed fraction (--model-densities, default 3 % and
0.1 %): the chosen values move by one bf16 ulp, as a small optimizer step's changes do once rounded to bf16.
--model-step-lr LR (default 1e-6) adds a row on the weights before and after one real AdamW step of the model at
that learning rate, rounded to bf16 (see adamw_step), at whatever fraction that step changed.
--quick (CI): a 1M-element model, 2 reps, 3 % only; it checks that everything runs and every applied model equals
the sent one, never a speed. Timed, with the methods interleaved rep by rep (load changes on a shared machine hit all
of them alike):
  memcpy       the fastest copy of the same bytes: one dst.copy_(src) per tensor into a preallocated, already
               written destination, the best of MEMCPY_TRIES passes within each rep (torch intra-op threads:
               --threads, default every CPU this process may use)
  encode       DeltaEncoder.encode (compare with the snapshot, pick encodings, update the snapshot, CRC), with the
               native word loop of rlblocks.sync._bits when numba is installed
  enc torch    the same with the torch path (RLBLOCKS_SYNC_NATIVE=0)
  apply        DeltaDecoder.apply(verify=True): base CRC of the current contents, writes, CRC after writing
  apply*       DeltaDecoder.apply(verify=False)
  old enc / old apply   the same with an older implementation, loaded as separate modules: --baseline names an
               older rlblocks/sync/delta.py (a _bits.py beside it is loaded as its _bits, else today's is used), and
               --baseline-rev REV takes both files from git (`--baseline-rev main`); its packets must be
               byte-identical to the new ones (the wire format is unchanged), which is asserted.
Sync threads (--sync-threads) default to every CPU too. The load average is printed before and after.
GB/s are model bytes / time (best of --reps, median in brackets; every rep starts from fresh copies, made outside
the timed region). x/memcpy = the median over reps of memcpy's time / x's time within the rep.
wire/full = len(to_bytes()) / model bytes; bound = 1.1 * density * (itemsize + 2) / itemsize (gap16 positions +
values, plus 10 %); zstd = the same with compress=True.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
import warnings
from pathlib import Path

import torch


def _load_source(name: str, source: str, path: str):
    mod = types.ModuleType(name)
    mod.__file__ = path
    sys.modules[name] = mod  # dataclasses look their module up while the class is being built
    exec(compile(source, path, "exec"), mod.__dict__)
    return mod


def load_baseline(path: str):
    """An older delta.py as a module of its own; a _bits.py beside it becomes its ``rlblocks.sync._bits``."""
    src = Path(path).read_text()
    bits = Path(path).with_name("_bits.py")
    if bits.is_file():
        _load_source("rlblocks_sync_bits_baseline", bits.read_text(), str(bits))
        src = src.replace("from rlblocks.sync._bits import", "from rlblocks_sync_bits_baseline import")
    return _load_source("rlblocks_sync_delta_baseline", src, path)


def baseline_from_git(rev: str) -> str:
    """``rlblocks/sync/delta.py`` and ``_bits.py`` of ``rev`` written to a temporary directory; the delta.py path."""
    out = Path(tempfile.mkdtemp(prefix="bench_delta_baseline_"))
    root = Path(__file__).resolve().parents[2]
    for f in ("delta.py", "_bits.py"):
        text = subprocess.run(["git", "show", f"{rev}:rlblocks/sync/{f}"], cwd=root, check=True, capture_output=True,
                              text=True).stdout
        (out / f).write_text(text)
    return str(out / "delta.py")


MEMCPY_TRIES = 5  # memcpy: best of this many passes per rep (the fastest copy the machine gives right now)


def timed(c: str, base: dict, new: dict, dst: dict, parsed, old, old_parsed) -> float:
    """Seconds of one run of method ``c`` (set-up outside the timed region; applied weights checked after)."""
    from rlblocks.sync import DeltaDecoder, DeltaEncoder

    if c == "memcpy":  # the yardstick: the fastest pass of one copy_ per tensor into a warm destination
        best = float("inf")
        for _ in range(MEMCPY_TRIES):
            t0 = time.perf_counter()
            for k, v in new.items():
                dst[k].copy_(v)
            best = min(best, time.perf_counter() - t0)
        assert all(torch.equal(dst[k].view(torch.uint8), new[k].view(torch.uint8)) for k in new)
        return best
    if c in ("encode", "enc torch", "old enc"):
        enc = old.DeltaEncoder(base) if c == "old enc" else DeltaEncoder(base)
        os.environ["RLBLOCKS_SYNC_NATIVE"] = "0" if c == "enc torch" else "1"
        t0 = time.perf_counter()
        if c == "old enc":
            enc.encode(new, version=1)
        else:
            enc.encode(new, version=1)
        dt = time.perf_counter() - t0
        os.environ["RLBLOCKS_SYNC_NATIVE"] = "1"
        return dt
    recv = {k: v.clone() for k, v in base.items()}
    dec = old.DeltaDecoder(recv) if c == "old apply" else DeltaDecoder(recv)
    t0 = time.perf_counter()
    if c == "old apply":
        dec.apply(old_parsed)
    else:
        dec.apply(parsed, verify=c == "apply")
    dt = time.perf_counter() - t0
    assert all(torch.equal(recv[k].view(torch.uint8), new[k].view(torch.uint8)) for k in new)
    return dt


def piece_crc_rates(reps: int) -> str:
    """GB/s of the compiled loops' CRC of one 256 KiB piece from cache: ISA-L's function, and the 256-bit fold
    where the CPU has it (both checked against zlib first), best of 3 runs of ``reps`` calls each."""
    import zlib

    import numpy as np

    from rlblocks.sync import _native
    from rlblocks.sync._bits import SUB_BYTES, _find_crc_fn

    fn = _find_crc_fn()
    buf = np.random.default_rng(0).integers(0, 256, SUB_BYTES, dtype=np.uint8)
    ways = {"isal": _native.crc_narrow} | ({"256-bit fold": _native.crc_wide} if _native.HAS_CLMUL256 else {})
    out = []
    for name, f in ways.items():
        assert f(fn, 0, buf.ctypes.data, buf.size) == zlib.crc32(buf.tobytes()), name
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(reps):
                f(fn, 0, buf.ctypes.data, buf.size)
            best = min(best, time.perf_counter() - t0)
        out.append(f"{name} {buf.size * reps / best / 1e9:.1f} GB/s")
    return "CRC-32 of a 256 KiB piece from cache, one thread: " + ", ".join(out)


def model_dir_of(name: str) -> Path:
    path = Path(name)
    if path.is_dir():
        return path
    root = Path(__file__).resolve().parents[2]
    # cookbook/plumbing imports its sibling modules by name (rgym): the cookbook folder goes on the path as well
    sys.path[:0] = [str(root), str(root / "cookbook")]
    try:
        from cookbook.plumbing.models import model_dir
    except ImportError:
        raise SystemExit(f"--model {name}: not a directory, and no named-model helper is installed") from None
    return Path(model_dir(name))


def model_tensors(name: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors (an HF directory, or a named model's) in bf16, flattened."""
    from safetensors.torch import load_file

    path = model_dir_of(name)
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update({k: v.to(torch.bfloat16).reshape(-1).clone() for k, v in load_file(str(f)).items()})
    return out


def adamw_step(name: str, lr: float) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The model's weights in bf16 before and after one real optimizer step: float32 master weights, the loss of
    a small real batch (next-token NLL of four arithmetic questions and answers) backpropagated through the whole
    model, one ``torch.optim.AdamW`` step at ``lr``, each weight then rounded to bf16 as a trainer sends it.
    Adam's first step moves every parameter with a nonzero gradient by ``lr`` (``m / sqrt(v) = sign(g)``), so
    the changed fraction depends on ``lr`` and the weights' magnitudes, hardly on the loss."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_dir_of(name)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    params = dict(model.named_parameters())  # tied weights once
    before = {k: v.detach().to(torch.bfloat16).reshape(-1).clone() for k, v in params.items()}
    texts = [f"What is {a} + {b}? <answer>{a + b}</answer>" for a, b in ((12, 34), (57, 21), (90, 88), (43, 16))]
    tok.padding_side = "right"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    batch = tok(texts, return_tensors="pt", padding=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    model(**batch, labels=labels).loss.backward()
    torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0).step()
    after = {k: v.detach().to(torch.bfloat16).reshape(-1).clone() for k, v in params.items()}
    return before, after


def ulp_step(base: dict[str, torch.Tensor], density: float, g: torch.Generator) -> dict[str, torch.Tensor]:
    """``base`` with a ``density`` fraction of each tensor's values moved by one bf16 ulp (up or down at random):
    what a small optimizer step leaves of a bf16 model once rounded."""
    new = {}
    for k, v in base.items():
        t = v.clone()
        idx = torch.randperm(t.numel(), generator=g)[: round(density * t.numel())]
        bits = t.view(torch.int16)
        step = torch.randint(0, 2, (idx.numel(),), generator=g, dtype=torch.int16) * 2 - 1
        bits[idx] = bits[idx] + step  # the neighbouring bf16 value (the same sign: |w| is not at 0 or inf here)
        new[k] = t
    return new


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--melems", type=int, default=32, help="model size in million elements (default 32)")
    ap.add_argument("--reps", type=int, default=5)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    ap.add_argument("--threads", type=int, default=cpus, help=f"torch intra-op threads (default: the {cpus} CPUs)")
    ap.add_argument("--sync-threads", type=int, default=cpus, help="rlblocks.sync worker threads (chunks in "
                                                                     "parallel; default: every CPU)")
    ap.add_argument("--baseline", default=None, help="path of an older delta.py to time side by side")
    ap.add_argument("--baseline-rev", default=None, help="git revision whose delta.py and _bits.py are the baseline")
    ap.add_argument("--densities", type=float, nargs="+", default=[0.001, 0.03, 0.5])
    ap.add_argument("--model", default=None, help="HF directory (or named model): rows on its weights in bf16")
    ap.add_argument("--model-densities", type=float, nargs="+", default=[0.03, 0.001])
    ap.add_argument("--model-step-lr", type=float, default=1e-6,
                    help="with --model, also a row of one real AdamW step at this learning rate (verl's and TRL's "
                         "GRPO default, 1e-6; 0: no such row)")
    ap.add_argument("--quick", action="store_true", help="CI: 1M elements, 2 reps, 3 %%; checks, never speed")
    a = ap.parse_args()
    if a.quick:
        a.melems, a.reps, a.densities = 1, 2, [0.03]
    if a.model:  # a named model is converted (or a bad name refused) before the synthetic rows, not after them
        a.model = str(model_dir_of(a.model))
    torch.set_num_threads(a.threads)
    os.environ["RLBLOCKS_SYNC_THREADS"] = str(a.sync_threads)
    from rlblocks.sync import DeltaEncoder, DeltaPacket
    from rlblocks.sync._bits import CRC_BACKEND, native_available

    native = native_available()
    crc_name = CRC_BACKEND
    if native:
        from rlblocks.sync._native import WIDE_CRC

        crc_name += " (compiled loops: 256-bit VPCLMULQDQ fold)" if WIDE_CRC else " (compiled loops: isal)"

    path = baseline_from_git(a.baseline_rev) if a.baseline_rev else a.baseline
    old = load_baseline(path) if path else None
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f} (1/5/15 min) at "
          f"start; native word loop: {'yes (numba)' if native else 'no (torch path)'}")
    if native:
        print(piece_crc_rates(2 if a.quick else 400))
    warnings.simplefilter("ignore", RuntimeWarning)  # "delta not smaller than full" at high density: expected here
    n_t = 8
    per = a.melems * 1_000_000 // n_t
    print(f"synthetic model {a.melems}M elements in {n_t} tensors; torch threads {a.threads}, sync threads "
          f"{a.sync_threads}, CRC {crc_name}; best of {a.reps} interleaved reps, GB/s of model bytes (median in "
          "brackets)")
    cols = ["memcpy", "encode", "enc torch", "apply", "apply*"] + (["old enc", "old apply"] if old else [])
    print(f"{'model':<14}{'density':>8}" + "".join(f"{c:>14}" for c in cols)
          + f"{'enc/memcpy':>11}{'apply/memcpy':>13}" + (f"{'old e/m':>9}{'old a/m':>9}" if old else "")
          + f"{'wire/full':>10}{'bound':>8}{'zstd':>8}")
    g = torch.Generator().manual_seed(0)

    def cases():
        for dtype in (torch.bfloat16, torch.float32):
            for density in a.densities:
                base = {f"t{i}": torch.randn(per, generator=g).to(dtype) for i in range(n_t)}
                new = {k: v.clone() for k, v in base.items()}
                for t in new.values():
                    idx = torch.randperm(per, generator=g)[: int(density * per)]
                    t[idx] = -t[idx] - 1
                yield str(dtype).split(".")[-1], density, base, new
        if a.model:
            base = model_tensors(a.model)
            print(f"model {a.model}: {sum(t.numel() for t in base.values()) / 1e6:.1f}M elements in {len(base)} "
                  "tensors, bf16; changed values move by one ulp")
            for density in a.model_densities:
                yield "model bf16", density, base, ulp_step(base, density, g)
            if a.model_step_lr > 0:
                del base
                before, after = adamw_step(a.model, a.model_step_lr)
                changed = sum(int(torch.count_nonzero(before[k].view(torch.int16) != after[k].view(torch.int16)))
                              for k in before)
                total = sum(t.numel() for t in before.values())
                print(f"model one AdamW step at lr {a.model_step_lr:g}: {changed / total:.4%} of the bf16 values "
                      f"changed ({len(before)} tensors)")
                yield "model step", changed / total, before, after

    for label, density, base, new in cases():
        full = sum(t.numel() * t.element_size() for t in base.values())
        wire = DeltaEncoder(base).encode(new, version=1).to_bytes()
        parsed = DeltaPacket.from_bytes(wire)
        if old is not None:
            old_wire = old.DeltaEncoder(base).encode(new, version=1).to_bytes()
            assert old_wire == wire, "the baseline's packet differs from the new one: wire format changed"
            old_parsed = old.DeltaPacket.from_bytes(wire)
        dst = {k: v.clone() for k, v in base.items()}  # preallocated and written: the copy meets no page fault
        times: dict[str, list[float]] = {c: [] for c in cols}
        for _ in range(a.reps):
            for c in cols:
                times[c].append(timed(c, base, new, dst, parsed, old, old_parsed if old else None))
        best = {c: full / min(ts) / 1e9 for c, ts in times.items()}
        med = {c: full / statistics.median(ts) / 1e9 for c, ts in times.items()}
        # x/memcpy: the median over reps of the ratio within each rep (timed next to each other)
        ratio = {c: statistics.median(m / t for m, t in zip(times["memcpy"], ts)) for c, ts in times.items()}
        zwire = len(DeltaEncoder(base, compress=True).encode(new, version=1).to_bytes())
        es = next(iter(base.values())).element_size()
        bound = 1.1 * density * (es + 2) / es
        print(
            f"{label:<14}{density:>8.3f}"
            + "".join(f"{best[c]:>7.2f} ({med[c]:4.2f})" for c in cols)
            + f"{ratio['encode']:>11.2f}{ratio['apply']:>13.2f}"
            + (f"{ratio['old enc']:>9.2f}{ratio['old apply']:>9.2f}" if old else "")
            + f"{len(wire) / full:>10.4f}{bound:>8.4f}{zwire / full:>8.4f}",
            flush=True,
        )
        del new, dst, parsed, wire
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f} at the end")
    if a.quick:
        print("quick: ok (every applied model and every copy equal the sent one)")


if __name__ == "__main__":
    main()
