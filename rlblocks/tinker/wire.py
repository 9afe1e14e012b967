"""The Tinker wire formats the SDK speaks, decoded into tensors and encoded back (no HTTP here).

``forward_backward`` requests arrive as the SDK's protobuf ``ForwardBackwardRequest`` (optionally zstd-compressed);
``ForwardBackwardOutput`` and ``SampleResponse`` results go back as protobuf (SDK 0.38 reads those two only as
protobuf); every other body is JSON validated by the SDK's own pydantic request types. The schema is the SDK's
(``tinker.proto.tinker_public_pb2``, ``tinker.types``), so a request the SDK can build is one this server can read.

Layouts (the SDK's ``proto/request_conv.py`` and ``proto/response_conv.py``):

- token chunks: int32 little-endian bytes; tensors: dense bytes in their dtype (float32 / int64 on the public wire)
  with an optional ``shape`` (empty: 1-D), or sparse CSR (values, int64 row pointers and column indices; unlisted
  entries are 0, the SDK's ``pad_value``);
- a ``ForwardBackwardOutput`` holds one ``ArrayRecord`` per run of datums whose fields share trailing shapes; each
  field is a ``BatchedTensor``: the datums' flat arrays concatenated, ``offsets`` the ``n + 1`` byte offsets, the
  leading dimension implied by each datum's byte count.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from rlblocks.errors import RequestError

_NP_OF_DTYPE = {1: np.dtype("<f4"), 2: np.dtype("<i8"), 3: np.dtype("<i4")}  # pb.DTYPE_FLOAT32 / INT64 / INT32
_DTYPE_NAMES = {1: "float32", 2: "int64", 3: "int32", 4: "bfloat16"}


def _pb():
    from tinker.proto import tinker_public_pb2

    return tinker_public_pb2


@dataclass
class WireDatum:
    """One decoded ``Datum``: its input tokens (int64 ``[N]``) and its ``loss_fn_inputs`` as dense arrays (float32 /
    int64). Arrays are numpy (decoding and the checks stay cheap per datum); torch tensors work the same."""

    tokens: np.ndarray | list[int]
    inputs: dict[str, np.ndarray | Tensor]
    has_provenance: bool = False


@dataclass
class WireForwardBackward:
    """A decoded ``ForwardBackwardRequest``."""

    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool
    data: list[WireDatum] = field(default_factory=list)
    columns: WireColumns | None = None


@dataclass
class WireColumns:
    """The same datums concatenated, for checks that run once per request instead of once per datum.

    Set by :func:`decode_forward_backward` when every datum has the same ``loss_fn_inputs`` names, each field
    one dtype and 1-D per datum; ``data[i]``'s arrays are views of these. ``tokens``: every datum's input tokens
    end to end (int64); ``lengths[i]``: datum ``i``'s token count; ``inputs[name]``: the field's values end to
    end; ``rows[name][i]``: datum ``i``'s element count of that field.
    """

    tokens: np.ndarray
    lengths: np.ndarray
    inputs: dict[str, np.ndarray]
    rows: dict[str, np.ndarray]


def _decompress(body: bytes, content_encoding: str | None) -> bytes:
    enc = (content_encoding or "").strip().lower()
    if enc in ("", "identity"):
        return body
    if enc == "zstd":
        import zstandard

        try:
            return zstandard.ZstdDecompressor().decompress(body, max_output_size=max(len(body) * 64, 1 << 20))
        except zstandard.ZstdError as e:
            raise RequestError(f"body: not a valid zstd stream ({e})") from None
    raise RequestError(f"Content-Encoding: expected 'zstd' or none, got {content_encoding!r}", status=415)


def _tensor(msg, where: str) -> np.ndarray:
    """A public-proto ``Tensor`` as a dense array (float32 / int64), with its bytes checked against its shape."""
    np_dtype = _NP_OF_DTYPE.get(msg.dtype)
    if np_dtype is None:
        raise RequestError(f"{where}.dtype: expected float32 or int64, got {_DTYPE_NAMES.get(msg.dtype, msg.dtype)}")
    shape = list(msg.shape)
    if shape and min(shape) < 0:
        raise RequestError(f"{where}.shape: expected non-negative sizes, got {shape}")
    if msg.WhichOneof("encoding") == "sparse_csr":
        csr = msg.sparse_csr
        if len(shape) != 2:
            raise RequestError(f"{where}: a sparse CSR tensor needs a 2-D shape, got {shape}")
        for name, raw, itemsize in (("values", csr.values, np_dtype.itemsize), ("crow_indices", csr.crow_indices, 8),
                                    ("col_indices", csr.col_indices, 8)):
            if len(raw) % itemsize:
                raise RequestError(f"{where}.sparse_csr.{name}: {len(raw)} bytes is not a whole number of elements")
        values = np.frombuffer(csr.values, dtype=np_dtype)
        crow = np.frombuffer(csr.crow_indices, dtype="<i8")
        col = np.frombuffer(csr.col_indices, dtype="<i8")
        rows, cols = shape
        bad_rows = len(crow) != rows + 1 or crow[0] != 0 or crow[-1] != len(col) or bool((np.diff(crow) < 0).any())
        bad_cols = len(col) != len(values) or bool(((col < 0) | (col >= cols)).any())
        if bad_rows or bad_cols:
            raise RequestError(f"{where}.sparse_csr: not a valid CSR layout of shape {shape} "
                               f"({len(crow)} row pointers, {len(col)} columns, {len(values)} values)")
        dense = np.zeros(shape, dtype=np_dtype)
        row_of = np.repeat(np.arange(rows), np.diff(crow))
        dense[row_of, col] = values
        arr = dense
    else:
        raw = msg.dense
        if len(raw) % np_dtype.itemsize:
            raise RequestError(f"{where}.dense: {len(raw)} bytes is not a whole number of {np_dtype.name} elements")
        arr = np.frombuffer(raw, dtype=np_dtype)
        if len(shape) > 1:
            if math.prod(shape) != arr.size:
                raise RequestError(f"{where}: shape {shape} holds {math.prod(shape)} elements, got {arr.size}")
            arr = arr.reshape(shape)
        elif shape and shape[0] != arr.size:
            raise RequestError(f"{where}: shape {shape} holds {shape[0]} elements, got {arr.size}")
    return arr.astype(np.int64) if arr.dtype.kind == "i" and arr.dtype.itemsize == 4 else arr


def decode_forward_backward(body: bytes, content_encoding: str | None = None) -> WireForwardBackward:
    """Parse a protobuf ``ForwardBackwardRequest`` body (as the SDK's ``TrainingClient`` sends it).

    Raises :class:`~rlblocks.errors.RequestError` naming the field for an unreadable body, a non-text model input
    chunk (images and audio are not served), a tensor whose bytes do not match its dtype and shape.
    """
    pb = _pb()
    from google.protobuf.message import DecodeError

    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(_decompress(body, content_encoding))
    except DecodeError as e:
        raise RequestError(f"body: not a protobuf ForwardBackwardRequest ({e})") from None
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():  # the SDK dual-writes numbers; v2 also carries strings
        config[k] = v.text if v.WhichOneof("value") == "text" else float(v.number)
    out = WireForwardBackward(msg.model_id, int(msg.seq_id), msg.loss_fn, config, bool(msg.forward_only))
    # Fast path: a datum whose model input is one text chunk and whose tensors are dense, 1-D and of a wire dtype
    # keeps its raw bytes, and each field becomes one array for the whole request (one np.frombuffer, not one per
    # datum: upb attribute reads and numpy calls cost microseconds each, times thousands of tensors). Any other
    # datum goes through the general per-tensor decoder, which also words the errors.
    data = msg.data
    n = len(data)
    token_raw: list[bytes | None] = [None] * n
    fields: list[dict[str, tuple[int, bytes, int]] | None] = [None] * n
    slow: dict[int, WireDatum] = {}
    provenance = [False] * n
    names0: list[str] | None = None
    for i, d in enumerate(data):
        provenance[i] = len(d.model_input_spans) > 0
        chunks = d.model_input
        ok = len(chunks) == 1 and chunks[0].WhichOneof("chunk") == "encoded_text"
        if ok:
            raw = chunks[0].encoded_text.tokens
            ok = len(raw) % 4 == 0
        entry: dict[str, tuple[int, bytes, int]] = {}
        if ok:
            m = d.loss_fn_inputs
            for name in m:
                t = m[name]
                dtype, shape, raw_t = t.dtype, t.shape, t.dense
                nd = len(shape)
                # non-empty dense bytes mean the dense arm of the encoding oneof (setting sparse_csr clears it)
                if dtype not in _NP_OF_DTYPE or nd > 1 or not raw_t or (nd and shape[0] < 0):
                    ok = False
                    break
                entry[name] = (dtype, raw_t, shape[0] if nd else -1)
        if ok:
            names = list(entry)
            if names0 is None:
                names0 = names
            token_raw[i], fields[i] = raw, entry
        else:
            slow[i] = _decode_datum(d, i)
    if not slow and n:
        out.columns = _columns(token_raw, fields, names0)
    if out.columns is not None:
        cols = out.columns
        toks = _pieces(cols.tokens, cols.lengths)
        per_field = [(k, _pieces(v, cols.rows[k])) for k, v in cols.inputs.items()]
        out.data = [WireDatum(toks[i], {k: p[i] for k, p in per_field}, provenance[i]) for i in range(n)]
        return out
    for i in range(n):
        if i in slow:
            out.data.append(slow[i])
            continue
        tokens = np.frombuffer(token_raw[i], dtype="<i4").astype(np.int64)
        inputs = {name: _dense(dtype, raw, shape0, f"data[{i}].loss_fn_inputs['{name}']")
                  for name, (dtype, raw, shape0) in fields[i].items()}
        out.data.append(WireDatum(tokens, inputs, provenance[i]))
    return out


def _pieces(values: np.ndarray, counts: np.ndarray) -> list[np.ndarray]:
    """``values`` cut into consecutive views of ``counts`` elements (plain slicing: ``np.split`` costs ~5x more)."""
    ends = np.cumsum(counts).tolist()
    return [values[a:b] for a, b in zip([0, *ends[:-1]], ends)]


def _dense(dtype: int, raw: bytes, shape0: int, where: str) -> np.ndarray:
    """One fast-path tensor (dense, 1-D or without shape), checked as :func:`_tensor` checks it."""
    np_dtype = _NP_OF_DTYPE[dtype]
    if len(raw) % np_dtype.itemsize:
        raise RequestError(f"{where}.dense: {len(raw)} bytes is not a whole number of {np_dtype.name} elements")
    arr = np.frombuffer(raw, dtype=np_dtype)
    if shape0 >= 0 and shape0 != arr.size:
        raise RequestError(f"{where}: shape [{shape0}] holds {shape0} elements, got {arr.size}")
    return arr.astype(np.int64) if dtype == 3 else arr


def _columns(token_raw: list, fields: list, names0: list[str] | None) -> WireColumns | None:
    """The fast-path datums as :class:`WireColumns`, or ``None`` when they do not share one layout (then each
    datum is decoded on its own, which words any error)."""
    names = names0 or []
    if any(list(f) != names for f in fields):
        return None
    tok_bytes = np.fromiter((len(r) for r in token_raw), dtype=np.int64, count=len(token_raw))
    inputs, rows = {}, {}
    for name in names:
        col = [f[name] for f in fields]
        dtype = col[0][0]
        if any(c[0] != dtype for c in col):
            return None
        np_dtype = _NP_OF_DTYPE[dtype]
        nbytes = np.fromiter((len(c[1]) for c in col), dtype=np.int64, count=len(col))
        if (nbytes % np_dtype.itemsize).any():
            return None
        count = nbytes // np_dtype.itemsize
        shape0 = np.fromiter((c[2] for c in col), dtype=np.int64, count=len(col))
        if ((shape0 >= 0) & (shape0 != count)).any():
            return None
        values = np.frombuffer(b"".join(c[1] for c in col), dtype=np_dtype)
        inputs[name] = values.astype(np.int64) if dtype == 3 else values
        rows[name] = count
    tokens = np.frombuffer(b"".join(token_raw), dtype="<i4").astype(np.int64)
    return WireColumns(tokens, tok_bytes // 4, inputs, rows)


def _decode_datum(d, i: int) -> WireDatum:
    """One ``Datum`` through the general decoder (any chunk list, sparse and N-D tensors, every error worded)."""
    parts: list[np.ndarray] = []
    for j, chunk in enumerate(d.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise RequestError(f"data[{i}].model_input.chunks[{j}]: expected an encoded_text chunk, got {kind!r} "
                               "(image and audio inputs are not supported by this server)")
        raw = chunk.encoded_text.tokens
        if len(raw) % 4:
            raise RequestError(f"data[{i}].model_input.chunks[{j}].tokens: {len(raw)} bytes is not int32 tokens")
        parts.append(np.frombuffer(raw, dtype="<i4"))
    tokens = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)
    inputs = {name: _tensor(t, f"data[{i}].loss_fn_inputs['{name}']") for name, t in d.loss_fn_inputs.items()}
    return WireDatum(tokens, inputs, has_provenance=len(d.model_input_spans) > 0)


@dataclass
class OutputRun:
    """Consecutive datums' outputs: ``fields[name]`` holds their values end to end (``[sum(lengths), *trailing]``,
    float32 or int64), datum ``i`` of the run owning ``lengths[i]`` leading rows."""

    lengths: np.ndarray
    fields: dict[str, np.ndarray]


def encode_forward_backward_output(runs: Sequence[OutputRun], metrics: Mapping[str, float]) -> bytes:
    """Serialise the outputs of a request's datums (in order, as :class:`OutputRun` groups with the same field
    names) and its metrics; consecutive runs whose trailing shapes agree share one ``ArrayRecord``."""
    pb = _pb()
    msg = pb.ForwardBackwardOutput()
    msg.loss_fn_output_type = "ArrayRecord"
    for k, v in metrics.items():
        msg.metrics[k] = float(v)
    start = 0
    while start < len(runs):
        key = {k: a.shape[1:] for k, a in runs[start].fields.items()}
        end = start + 1
        while end < len(runs) and {k: a.shape[1:] for k, a in runs[end].fields.items()} == key:
            end += 1
        group = runs[start:end]
        lengths = np.concatenate([r.lengths for r in group]).astype(np.int64)
        rec = msg.loss_fn_outputs.add()
        rec.num_datums = len(lengths)
        for name, trailing in key.items():
            values = [np.ascontiguousarray(r.fields[name]) for r in group]
            bt = rec.fields[name]
            bt.dtype = pb.DTYPE_FLOAT32 if values[0].dtype == np.float32 else pb.DTYPE_INT64
            bt.trailing_shape.extend(int(x) for x in trailing)
            offsets = np.zeros(len(lengths) + 1, dtype="<i8")
            offsets[1:] = np.cumsum(lengths * (math.prod(trailing) * values[0].itemsize))
            bt.offsets = offsets.tobytes()
            bt.data = b"".join(v.tobytes() for v in values)
        start = end
    return msg.SerializeToString()


@dataclass
class WireSequence:
    """One sampled sequence for :func:`encode_sample_response`."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" | "length"
    topk_ids: Tensor | None = None  # [n, k] int
    topk_logprobs: Tensor | None = None  # [n, k] float


def _topk(pb, ids: Tensor, lps: Tensor):
    t = pb.TopkLogprobs()
    t.length, t.k = int(ids.shape[0]), int(ids.shape[1])
    t.token_ids = ids.to(torch.int32).contiguous().numpy().astype("<i4").tobytes()
    t.logprobs = lps.to(torch.float32).contiguous().numpy().astype("<f4").tobytes()
    return t


def encode_sample_response(
    sequences: Sequence[WireSequence],
    *,
    prompt_logprobs: Tensor | None = None,
    topk_prompt: tuple[Tensor, Tensor] | None = None,
) -> bytes:
    """Serialise a ``SampleResponse``: tokens int32, logprobs float32, prompt logprobs float32 with NaN where not
    computed (position 0), top-k as dense ``[n, k]`` matrices (id 0 and logprob -99999 where empty)."""
    pb = _pb()
    msg = pb.SampleResponse()
    for s in sequences:
        seq = msg.sequences.add()
        seq.stop_reason = pb.STOP_REASON_STOP if s.stop_reason == "stop" else pb.STOP_REASON_LENGTH
        seq.tokens = np.asarray(s.tokens, dtype="<i4").tobytes()
        seq.logprobs = np.asarray(s.logprobs, dtype="<f4").tobytes()
        if s.topk_ids is not None and s.topk_logprobs is not None:
            seq.topk_sampled_logprobs.CopyFrom(_topk(pb, s.topk_ids, s.topk_logprobs))
    if prompt_logprobs is not None:
        msg.prompt_logprobs = prompt_logprobs.to(torch.float32).numpy().astype("<f4").tobytes()
    if topk_prompt is not None:
        msg.topk_prompt_logprobs.CopyFrom(_topk(pb, *topk_prompt))
    return msg.SerializeToString()
