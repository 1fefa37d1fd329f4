"""The codecs of the routes whose inputs are jobs of their own, alone: ``/v1/embeddings`` and the
Open Inference Protocol's ``infer``. What they accept, the 400 that names each mistake, the
limits checked before the items they count, and the bodies they write."""

from __future__ import annotations

import base64
import json
import struct

import pytest

from batcher.core.config import Outputs
from batcher.core.errors import Overloaded
from gateway.wire import oip
from gateway.wire.api import InvalidRequest
from gateway.wire.codec import Head
from gateway.wire.embeddings import Embeddings
from gateway.wire.rows import MAX_ROWS

EMBEDDING = Outputs("embedding", 4)
HEAD = Head("emb-1", "m@3", 7, 0)


def packed(*values: float) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def embeddings(**fields) -> Embeddings:
    return Embeddings.parse(json.dumps({"model": "m", "input": "hi", **fields}).encode())


def test_an_embeddings_body_takes_a_string_or_strings_and_answers_in_openais_shape():
    request = embeddings(input=["a", "b"], user="u1")
    fields = (request.model, request.inputs, request.session, request.encoding)
    assert fields == ("m", ("a", "b"), "u1", "float")
    request.fits("m@3", EMBEDDING, "fixed")
    body = json.loads(request.whole(HEAD, [packed(1, 0, 0, 0), packed(0, 0.5, 0, 0)]))
    assert body == {"object": "list", "model": "m@3", "usage": {"prompt_tokens": 7, "total_tokens": 7},
                    "data": [{"object": "embedding", "index": 0, "embedding": [1, 0, 0, 0]},
                             {"object": "embedding", "index": 1, "embedding": [0, 0.5, 0, 0]}]}
    base = json.loads(embeddings(encoding_format="base64").whole(HEAD, [packed(1, 2, 3, 4)]))
    assert base64.b64decode(base["data"][0]["embedding"]) == packed(1, 2, 3, 4)  # OpenAI's bytes


def test_fewer_dimensions_are_the_first_ones_renormalised_and_only_where_the_table_allows():
    request = embeddings(dimensions=2)
    with pytest.raises(InvalidRequest, match="dimensions: m@3 gives 4 dimensions and cannot shorten them"):
        request.fits("m@3", EMBEDDING, "fixed")
    request.fits("m@3", Outputs("embedding", 4, shortenable=True), "fixed")
    shortened = json.loads(request.whole(HEAD, [packed(3, 4, 1, 1)]))["data"][0]["embedding"]
    assert shortened == pytest.approx([0.6, 0.8], rel=1e-6)  # float32
    embeddings(dimensions=4).fits("m@3", EMBEDDING, "fixed")  # its own length: nothing to shorten
    with pytest.raises(InvalidRequest, match="model: m@3 is not an embedding model"):
        request.fits("m@3", Outputs(), "fixed")


@pytest.mark.parametrize(("fields", "message"), [
    ({"input": []}, "input: expected at least one input, got none"),
    ({"input": [1, 2]}, "input: token ids are not supported"),
    ({"input": [[1, 2]]}, "input: token ids are not supported"),
    ({"input": ["a", ""]}, "input.1: expected a non-empty string"),
    ({"input": ["a", 3.5]}, "input.1: expected a string, got a number"),
    ({"input": {"a": 1}}, "input: expected a string or an array of strings"),
    ({"input": ["x"] * (MAX_ROWS + 1)}, f"input: at most {MAX_ROWS:,} inputs per request"),
    ({"input": ["x" * (1 << 20)] * 3}, "input: at most 2,097,152 characters of text in all inputs together"),
    ({"encoding_format": "int8"}, "encoding_format: expected one of ['float', 'base64']"),
    ({"dimensions": 0}, "dimensions: expected an integer >= 1, got 0"),
    ({"model": ""}, "model: expected a model name"),
])
def test_every_mistake_in_an_embeddings_body_is_a_400_naming_its_field(fields, message):
    with pytest.raises(InvalidRequest, match=message.replace("[", r"\[").replace("]", r"\]")):
        embeddings(**fields)


def test_a_body_that_is_not_a_json_object_is_named_so():
    with pytest.raises(InvalidRequest, match="body: expected a JSON object, got invalid JSON"):
        Embeddings.parse(b"{nope")
    with pytest.raises(InvalidRequest, match="body: expected a JSON object, got an array"):
        Embeddings.parse(b"[1]")


def tensor(**fields) -> dict:
    return {"name": "input", "datatype": "BYTES", "shape": [2], "data": ["a", "b"], **fields}


def infer(*inputs, **fields) -> oip.Infer:
    return oip.Infer.parse(json.dumps({"inputs": list(inputs), **fields}).encode(), "m")


def test_an_infer_request_is_one_bytes_tensor_a_row_per_job_flat_or_nested():
    assert infer(tensor()).inputs == ("a", "b")
    assert infer(tensor(shape=[2, 1], data=[["a"], ["b"]])).inputs == ("a", "b")
    text = infer(tensor(), id="q9", outputs=[{"name": "output"}])
    text.fits("m@3", Outputs(), "fixed")
    assert json.loads(text.whole(HEAD, ["A", "B"])) == {
        "model_name": "m@3", "model_version": "3", "id": "q9",
        "outputs": [{"name": "output", "datatype": "BYTES", "shape": [2], "data": ["A", "B"]}]}
    vectors = infer(tensor())
    vectors.fits("m@3", EMBEDDING, "fixed")
    assert json.loads(vectors.whole(HEAD, [packed(1, 2, 3, 4), packed(5, 6, 7, 8)]))["outputs"] == [
        {"name": "embedding", "datatype": "FP32", "shape": [2, 4], "data": [1, 2, 3, 4, 5, 6, 7, 8]}]


@pytest.mark.parametrize(("body", "message"), [
    ({"inputs": []}, "inputs: expected one input tensor, 'input', got 0"),
    ({"inputs": [tensor(), tensor()]}, "inputs: expected one input tensor, 'input', got 2"),
    ({"inputs": [tensor(name="text")]}, "inputs.0.name: expected 'input', got \"text\""),
    ({"inputs": [tensor(datatype="FP32", data=[1.0, 2.0])]}, "inputs.0.datatype: expected 'BYTES' (text)"),
    ({"inputs": [tensor(shape=[2, 3])]}, "inputs.0.shape: expected [N] or [N, 1], got [2, 3]"),
    ({"inputs": [tensor(shape=[3])]}, "inputs.0.data: shape [3] holds 3 values, got 2"),
    ({"inputs": [tensor(shape=[-1])]}, "inputs.0.shape: expected [N] or [N, 1]"),
    ({"inputs": [tensor(data="ab")]}, "inputs.0.data: expected an array, got a string"),
    ({"inputs": [tensor(parameters={"binary_data_size": 8})]}, "inputs.0.parameters: binary tensor data"),
    ({"inputs": [tensor()], "outputs": [{"name": "o", "parameters": {"binary_data": True}}]},
     "outputs.0.parameters: binary tensor data is not supported"),
    ({"inputs": [tensor(shape=[MAX_ROWS + 1], data=["x"] * (MAX_ROWS + 1))]},
     f"inputs.0.data: at most {MAX_ROWS:,} inputs per request"),
])
def test_every_mistake_in_an_infer_body_is_a_400_naming_its_place(body, message):
    with pytest.raises(InvalidRequest) as caught:
        oip.Infer.parse(json.dumps(body).encode(), "m")
    assert str(caught.value).startswith(message)


def test_infer_checks_the_model_and_the_outputs_asked_for_against_its_metadata():
    with pytest.raises(InvalidRequest, match=r"outputs\.0\.name: m@3 has one output, 'embedding'"):
        infer(tensor(), outputs=[{"name": "output"}]).fits("m@3", EMBEDDING, "fixed")
    with pytest.raises(InvalidRequest, match="model: m@3 is a continuous-mode model"):
        infer(tensor()).fits("m@3", Outputs(), "continuous")
    assert oip.metadata("m", "m@3", EMBEDDING) == {
        "name": "m", "versions": ["3"], "platform": "ferry",
        "inputs": [{"name": "input", "datatype": "BYTES", "shape": [-1]}],
        "outputs": [{"name": "embedding", "datatype": "FP32", "shape": [-1, 4]}]}


def test_oip_errors_are_the_protocols_own_shape_with_overload_as_a_retryable_503():
    status, body, headers = oip.error_response(Overloaded("the queue is full", 2.5))
    assert (status, json.loads(body), headers["Retry-After"]) == (503, {"error": "the queue is full"}, "3")
    status, body, _ = oip.error_response(KeyError("a secret"))
    assert (status, json.loads(body)) == (500, {"error": "internal error"})
