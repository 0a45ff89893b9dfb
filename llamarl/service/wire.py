"""The Tinker SDK's wire format, on the server's side, with the SDK's own classes (`tinker`,
setup.cfg extra `service`): a forward_backward request arrives as its protobuf
(`tinker.proto.tinker_public_pb2.ForwardBackwardRequest`, zstd-compressed when the client
says so in Content-Encoding) and its answer goes back as the protobuf ForwardBackwardOutput
when the client accepts it (Accept: application/x-protobuf), else as the JSON the SDK's
pydantic types parse. This is the inverse of the SDK's `tinker/proto/request_conv.py` and
`response_conv.py` (read from tinker 0.38).

Tensors on the wire: TensorData (dense bytes, or sparse CSR: values + crow/col indices) in
float32 or int64; model input chunks: encoded_text (int32 token ids). Images and audio chunks
are refused (a text model).
"""

from __future__ import annotations

import numpy as np
import torch

PROTOBUF = "application/x-protobuf"


def _pb():
    from tinker.proto import tinker_public_pb2

    return tinker_public_pb2


def decompress(body: bytes, encoding: str | None) -> bytes:
    if not encoding or encoding == "identity":
        return body
    if encoding == "zstd":
        import zstandard

        return zstandard.ZstdDecompressor().decompress(body)
    if encoding == "gzip":
        import gzip

        return gzip.decompress(body)
    raise ValueError(f"Content-Encoding {encoding!r}: send identity, gzip or zstd")


def _tensor(msg, name: str) -> torch.Tensor:
    """A proto Tensor as a 1-D torch tensor (int64 or float32)."""
    pb = _pb()
    np_dtype = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64}.get(msg.dtype)
    if np_dtype is None:
        raise ValueError(f"{name}: dtype {msg.dtype} is not float32 or int64")
    shape = list(msg.shape)
    if msg.HasField("sparse_csr"):
        values = np.frombuffer(msg.sparse_csr.values, np_dtype)
        crow = np.frombuffer(msg.sparse_csr.crow_indices, np.int64)
        col = np.frombuffer(msg.sparse_csr.col_indices, np.int64)
        dense = torch.sparse_csr_tensor(torch.from_numpy(crow.copy()),
                                        torch.from_numpy(col.copy()),
                                        torch.from_numpy(values.copy()), size=shape).to_dense()
        out = dense
    else:
        out = torch.from_numpy(np.frombuffer(msg.dense, np_dtype).copy())
        if shape and int(np.prod(shape)) != out.numel():
            raise ValueError(f"{name}: shape {shape} does not hold {out.numel()} values")
        if shape:
            out = out.reshape(shape)
    if out.dim() != 1:
        raise ValueError(f"{name} has shape {list(out.shape)}: give one value per position")
    return out


def decode_forward_backward(body: bytes):
    """-> (model_id, seq_id, loss_fn, loss_fn_config, [tenants.Datum], forward_only): the
    SDK's forward() is this request with forward_only set (no gradient accumulated)."""
    from llamarl.service.tenants import Datum

    pb = _pb()
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # noqa: BLE001 - a malformed body is the client's
        raise ValueError(f"the forward_backward body is not a ForwardBackwardRequest: "
                         f"{e}") from None
    config: dict = {}
    for key, value in msg.loss_fn_config_v2.items():
        which = value.WhichOneof("value")
        config[key] = value.number if which == "number" else value.text
    for key, value in msg.loss_fn_config.items():
        config.setdefault(key, value)
    data = []
    for i, d in enumerate(msg.data):
        tokens = []
        for c in d.model_input:
            which = c.WhichOneof("chunk")
            if which != "encoded_text":
                raise ValueError(f"data[{i}].model_input has a {which} chunk: this server "
                                 "trains a text model, give encoded_text chunks")
            tokens.append(np.frombuffer(c.encoded_text.tokens, np.int32))
        ids = torch.from_numpy(np.concatenate(tokens).astype(np.int64)) if tokens else \
            torch.zeros(0, dtype=torch.long)
        inputs = {}
        for key, t in d.loss_fn_inputs.items():
            x = _tensor(t, f"data[{i}].loss_fn_inputs[{key!r}]")
            inputs[key] = x.long() if key == "target_tokens" else x.float()
        data.append(Datum(ids, inputs))
    return msg.model_id, msg.seq_id, msg.loss_fn, config, data, msg.forward_only


def forward_backward_output(logprobs: list[torch.Tensor], metrics: dict[str, float],
                            proto: bool) -> bytes | dict:
    """The answer: per datum `logprobs` [N] float32 (the loss_fn_outputs), and the metrics
    (`loss:sum`)."""
    if not proto:
        return {"loss_fn_output_type": "ArrayRecord", "metrics": metrics,
                "loss_fn_outputs": [{"logprobs": {"data": lp.tolist(), "dtype": "float32",
                                                  "shape": [len(lp)]}} for lp in logprobs]}
    pb = _pb()
    out = pb.ForwardBackwardOutput()
    out.loss_fn_output_type = "ArrayRecord"
    record = out.loss_fn_outputs.add()
    record.num_datums = len(logprobs)
    arrays = [lp.numpy().astype(np.float32) for lp in logprobs]
    offsets = np.zeros(len(arrays) + 1, np.int64)
    np.cumsum([a.nbytes for a in arrays], out=offsets[1:])
    field = record.fields["logprobs"]
    field.data = b"".join(a.tobytes() for a in arrays)
    field.offsets = offsets.tobytes()
    field.dtype = pb.DTYPE_FLOAT32
    for key, value in metrics.items():
        out.metrics[key] = float(value)
    return out.SerializeToString()


def sample_response(sequences: list[tuple[list[int], list[float], str]],
                    prompt_logprobs: list[float] | None) -> bytes:
    """The SDK's SampleResponse protobuf: per sequence (token ids, their logprobs, "stop" or
    "length"); the prompt's logprobs (NaN where there is none: the first token)."""
    pb = _pb()
    out = pb.SampleResponse()
    for ids, lps, reason in sequences:
        out.sequences.append(pb.SampledSequence(
            stop_reason=pb.STOP_REASON_LENGTH if reason == "length" else pb.STOP_REASON_STOP,
            tokens=np.asarray(ids, np.int32).tobytes(),
            logprobs=np.asarray(lps, np.float32).tobytes()))
    if prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(prompt_logprobs, np.float32).tobytes()
    return out.SerializeToString()
