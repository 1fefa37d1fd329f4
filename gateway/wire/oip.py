"""The Open Inference Protocol v2 (KServe, Triton, MLServer) over REST, for fixed-mode models. Pure.

    POST /v2/models/{name}[/versions/{v}]/infer
      {id?, inputs: [{name: "input", datatype: BYTES, shape: [N] | [N, 1], data: [N strings]}],
       outputs?: [{name}]}
      ──> {model_name, model_version, id?, outputs: [{name, datatype, shape, data}]}

A model takes one input tensor of text, a row per job; it answers with ``output`` (BYTES,
``[N]``), or ``embedding`` (FP32, ``[N, dimensions]``, row-major) for an embedding model. What
the metadata route says of a model (:func:`metadata`) is what ``infer`` checks a request
against. Binary tensor data (Triton's extension) is refused; so is any other datatype. Errors
are the protocol's ``{"error": message}``, statuses from the one table with overload as 503.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import msgspec

from batcher.core.config import Outputs
from gateway.wire import api
from gateway.wire.api import InvalidRequest, checked_text, is_int, json_type, short, show
from gateway.wire.codec import Head
from gateway.wire.rows import json_object, texts, vectors

INPUT = "input"
PLATFORM = "ferry"


def tensors(outputs: Outputs) -> tuple[dict[str, Any], dict[str, Any]]:
    """A model's input and output tensors, as its metadata describes them (-1: any length)."""
    if outputs.kind == "embedding":
        answer = {"name": "embedding", "datatype": "FP32", "shape": [-1, outputs.dimensions]}
    else:
        answer = {"name": "output", "datatype": "BYTES", "shape": [-1]}
    return {"name": INPUT, "datatype": "BYTES", "shape": [-1]}, answer


def version_of(name: str) -> str:
    """The version part of a ferry model name (``minilm@1`` -> ``1``; none: empty)."""
    return name.rpartition("@")[2] if "@" in name else ""


def metadata(asked: str, served: str, outputs: Outputs) -> dict[str, Any]:
    """``GET /v2/models/{name}``: the name asked for, the version that serves it, the tensors."""
    tensor_in, tensor_out = tensors(outputs)
    version = version_of(served)
    return {"name": asked, "versions": [version] if version else [], "platform": PLATFORM,
            "inputs": [tensor_in], "outputs": [tensor_out]}


def error_reply(kind: api.ErrorKind, message: str) -> tuple[int, bytes]:
    status = 503 if kind.status == 529 else kind.status  # 529 is Anthropic's own, no registered status
    return status, msgspec.json.encode({"error": message})


def error_response(error: BaseException) -> tuple[int, bytes, dict[str, str]]:
    """Status, ``{"error": message}`` and headers; unknown errors say no more than that."""
    kind = api.error_kind(error)
    status, body = error_reply(kind, str(error) if kind is not api.INTERNAL else "internal error")
    headers = api.retry_after_headers(getattr(error, "retry_after", 1.0)) if kind.retry_after else {}
    return status, body, headers


class Infer:
    """``POST /v2/models/{name}/infer``: one tensor of text in, a row per job."""

    id_prefix = "infer-"
    idempotency_scope = "oip.infer:"
    error_response = staticmethod(error_response)
    limit_headers = None  # the protocol names no rate-limit headers
    error_reply = staticmethod(error_reply)
    session: str | None = None  # a weighted alias splits OIP requests by key

    def __init__(self, model: str, inputs: tuple[str, ...], request_id: str | None,
                 wanted: tuple[str, ...]) -> None:
        self.model, self.inputs, self.request_id, self.wanted = model, inputs, request_id, wanted
        self._tensor: dict[str, Any] = {}

    @classmethod
    def parse(cls, body: bytes, model: str | None) -> Infer:
        assert model is not None, "the URL names the model"
        document = json_object(body)
        request_id = document.get("id")
        if request_id is not None:
            checked_text(request_id, "id")
        given = document.get("inputs")
        if not isinstance(given, list) or len(given) != 1:
            count = len(given) if isinstance(given, list) else json_type(given)
            raise InvalidRequest(f"inputs: expected one input tensor, {INPUT!r}, got {count}")
        wanted = document.get("outputs") or []
        if not isinstance(wanted, list) or not all(isinstance(o, dict) for o in wanted):
            raise InvalidRequest(f"outputs: expected an array of {{name}} objects, got {show(wanted)}")
        for index, output in enumerate(wanted):
            _no_binary(output, f"outputs.{index}")
        _no_binary(document, "")
        names = tuple(checked_text(out.get("name"), f"outputs.{i}.name") for i, out in enumerate(wanted))
        return cls(model, _rows(given[0]), request_id, names)

    def fits(self, name: str, outputs: Outputs, mode: str) -> None:
        if mode != "fixed":
            raise InvalidRequest(f"model: {name} is a {mode}-mode model; the inference protocol serves "
                                 "fixed-mode models")
        _, tensor = tensors(outputs)
        for index, wanted in enumerate(self.wanted):
            if wanted != tensor["name"]:
                raise InvalidRequest(f"outputs.{index}.name: {name} has one output, "
                                     f"{tensor['name']!r}, got {show(wanted)}")
        self._tensor = tensor

    def whole(self, head: Head, answers: Sequence[str] | Sequence[bytes]) -> bytes:
        tensor = dict(self._tensor)
        if tensor["datatype"] == "FP32":
            rows = vectors(answers, None)
            tensor.update(shape=list(rows.shape), data=rows.ravel().tolist())
        else:
            tensor.update(shape=[len(answers)], data=list(answers))
        reply: dict[str, Any] = {"model_name": head.model, "model_version": version_of(head.model)}
        if self.request_id is not None:
            reply["id"] = self.request_id
        reply["outputs"] = [tensor]
        return msgspec.json.encode(reply)


def _rows(tensor: object) -> tuple[str, ...]:
    """The one input tensor's rows: BYTES of shape [N] or [N, 1], data flat or nested by row."""
    where = "inputs.0"
    if not isinstance(tensor, dict):
        raise InvalidRequest(f"{where}: expected a tensor object, got {json_type(tensor)}")
    name = tensor.get("name")
    if name != INPUT:
        raise InvalidRequest(f"{where}.name: expected {INPUT!r}, got {show(name)}")
    datatype = tensor.get("datatype")
    if datatype != "BYTES":
        raise InvalidRequest(f"{where}.datatype: expected 'BYTES' (text), got {show(datatype)}")
    _no_binary(tensor, where)
    shape = tensor.get("shape")
    if not (isinstance(shape, list) and len(shape) in (1, 2) and all(is_int(d) and d >= 0 for d in shape)
            and (len(shape) == 1 or shape[1] == 1)):
        raise InvalidRequest(f"{where}.shape: expected [N] or [N, 1], got {short(shape)}")
    data = tensor.get("data")
    if not isinstance(data, list):
        raise InvalidRequest(f"{where}.data: expected an array, got {json_type(data)}")
    if data and all(isinstance(row, list) and len(row) == 1 for row in data):
        data = [row[0] for row in data]  # nested by row, as the protocol allows
    if len(data) != math.prod(shape):
        raise InvalidRequest(f"{where}.data: shape {shape} holds {math.prod(shape)} values, got {len(data)}")
    return texts(data, f"{where}.data")


BINARY = ("binary_data", "binary_data_size", "binary_data_output")  # Triton's binary tensor extension


def _no_binary(table: dict, where: str) -> None:
    """Refuse Triton's binary tensor data extension: ferry reads tensors as JSON."""
    at = f"{where}.parameters" if where else "parameters"
    parameters = table.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise InvalidRequest(f"{at}: expected an object, got {show(parameters)}")
    if any(parameters.get(name) for name in BINARY):
        raise InvalidRequest(f"{at}: binary tensor data is not supported; send the tensor's data as JSON")
