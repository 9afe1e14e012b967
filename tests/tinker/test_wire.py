"""The wire codecs against independent references: the SDK's own protobuf encoder and decoder
(``tinker.proto.request_conv`` / ``response_conv``) and the general per-datum decoder."""

from __future__ import annotations

import numpy as np
import pytest

from rlblocks.errors import RequestError
from rlblocks.tinker.wire import OutputRun, _decode_datum, decode_forward_backward, encode_forward_backward_output

pytest.importorskip("tinker")


def _body(data, loss_fn="importance_sampling") -> bytes:
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto

    req = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn),
                                       model_id="m", seq_id=3)
    return forward_backward_request_to_proto(req).SerializeToString()


def _rl_data(rng, n: int):
    from tinker import types

    out, ref = [], []
    for _ in range(n):
        k = int(rng.integers(1, 12))
        toks = rng.integers(0, 50, k + 1).tolist()
        lp = rng.normal(size=k).astype(np.float32)
        adv = rng.normal(size=k).astype(np.float32)
        out.append(types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                               loss_fn_inputs={"target_tokens": toks[1:], "logprobs": lp.tolist(),
                                               "advantages": adv.tolist()}))
        ref.append((toks[:-1], {"target_tokens": np.array(toks[1:]), "logprobs": lp, "advantages": adv}))
    return out, ref


def _same(fb, ref) -> None:
    assert len(fb.data) == len(ref)
    for d, (toks, inputs) in zip(fb.data, ref):
        assert d.tokens.dtype == np.int64 and d.tokens.tolist() == list(toks)
        assert sorted(d.inputs) == sorted(inputs)
        for k, v in inputs.items():
            assert d.inputs[k].dtype == (np.int64 if v.dtype.kind == "i" else np.float32)
            np.testing.assert_array_equal(d.inputs[k], v)


def test_columnar_decode_equals_the_datums_and_the_general_decoder():
    from tinker.proto import tinker_public_pb2 as pb

    data, ref = _rl_data(np.random.default_rng(0), 37)
    body = _body(data)
    fb = decode_forward_backward(body)
    assert (fb.model_id, fb.seq_id, fb.loss_fn) == ("m", 3, "importance_sampling")
    assert fb.columns is not None
    _same(fb, ref)
    msg = pb.ForwardBackwardRequest()
    msg.ParseFromString(body)
    for i, d in enumerate(msg.data):  # the general decoder reads the same values
        slow = _decode_datum(d, i)
        assert slow.tokens.tolist() == fb.data[i].tokens.tolist()
        for k, v in slow.inputs.items():
            np.testing.assert_array_equal(v, fb.data[i].inputs[k])
    cols = fb.columns
    np.testing.assert_array_equal(cols.lengths, [len(t) for t, _ in ref])
    np.testing.assert_array_equal(cols.tokens, np.concatenate([t for t, _ in ref]))
    for k in ("target_tokens", "logprobs", "advantages"):
        np.testing.assert_array_equal(cols.inputs[k], np.concatenate([x[k] for _, x in ref]))
        np.testing.assert_array_equal(cols.rows[k], cols.lengths)


def test_mixed_layouts_fall_back_to_per_datum_decoding():
    import torch
    from tinker import types

    data, ref = _rl_data(np.random.default_rng(1), 5)
    # a sparse CSR tensor and a 2-D [N, K] target in one request: no columns, every datum still exact
    w = torch.zeros(4, 3)
    w[1, 2], w[3, 0] = 0.5, -2.0
    tgt = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9], [1, 1, 1]])
    topk = types.Datum(model_input=types.ModelInput.from_ints([3, 4, 5, 6]),
                       loss_fn_inputs={"target_tokens": types.TensorData.from_torch(tgt),
                                       "weights": types.TensorData.from_torch_sparse(w)})
    fb = decode_forward_backward(_body([data[0], topk, *data[1:]], loss_fn="cross_entropy"))
    assert fb.columns is None
    _same(type(fb)(fb.model_id, fb.seq_id, fb.loss_fn, {}, False, [fb.data[0], *fb.data[2:]]), ref)
    np.testing.assert_array_equal(fb.data[1].inputs["target_tokens"], tgt.numpy())
    np.testing.assert_array_equal(fb.data[1].inputs["weights"], w.numpy())
    # datums with different field names: no columns either
    plain = types.Datum(model_input=types.ModelInput.from_ints([1, 2]), loss_fn_inputs={"target_tokens": [2, 3]})
    assert decode_forward_backward(_body([data[0], plain])).columns is None


def test_bad_tensor_bytes_name_the_datum():
    from tinker.proto import tinker_public_pb2 as pb

    data, _ = _rl_data(np.random.default_rng(2), 4)
    msg = pb.ForwardBackwardRequest()
    msg.ParseFromString(_body(data))
    msg.data[2].loss_fn_inputs["logprobs"].dense = b"\x00" * 7
    with pytest.raises(RequestError, match=r"data\[2\]\.loss_fn_inputs\['logprobs'\]\.dense: 7 bytes"):
        decode_forward_backward(msg.SerializeToString())
    msg.ParseFromString(_body(data))
    t = msg.data[1].loss_fn_inputs["advantages"]
    del t.shape[:]
    t.shape.append(99)
    with pytest.raises(RequestError, match=r"data\[1\]\.loss_fn_inputs\['advantages'\]: shape \[99\]"):
        decode_forward_backward(msg.SerializeToString())


def test_output_runs_decode_with_the_sdk():
    from tinker import types
    from tinker.proto.response_conv import deserialize_proto_response

    rng = np.random.default_rng(3)
    lengths = [rng.integers(1, 9, 5), rng.integers(1, 9, 3)]
    flat = [rng.normal(size=int(lengths[0].sum())).astype(np.float32),
            rng.normal(size=(int(lengths[1].sum()), 4)).astype(np.float32),
            rng.normal(size=int(lengths[0][:2].sum())).astype(np.float32)]
    runs = [OutputRun(lengths[0], {"logprobs": flat[0]}), OutputRun(lengths[1], {"logprobs": flat[1]}),
            OutputRun(lengths[0][:2], {"logprobs": flat[2]})]
    out = deserialize_proto_response(encode_forward_backward_output(runs, {"loss:sum": 1.5}),
                                     types.ForwardBackwardOutput)
    assert out.metrics == {"loss:sum": 1.5}
    expected = []
    for run, values in zip(runs, flat):
        ends = np.cumsum(run.lengths)
        expected += [values[a:b] for a, b in zip([0, *ends[:-1]], ends)]
    got = [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]
    assert len(got) == len(expected) == 10
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(g, e)
