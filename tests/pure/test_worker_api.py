"""The worker API alone, in this process: an object by import path, built with its options and
device, warmed up; what ``run_batch`` may return and how it crosses the frames; what the pool
makes of a reply of the wrong kind."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest

from batcher.core.config import Outputs
from batcher.fixed.replies import wrong_outputs
from workers import api
from workers.protocol import Result


class Tagged:
    """A model of the tests' own: its options and device in every output."""

    def __init__(self, tag: str, device: str) -> None:
        self.tag, self.device, self.warm = tag, device, False

    def warmup(self) -> None:
        self.warm = True

    def run_batch(self, inputs):
        return [f"{self.tag}:{self.device}:{text}" for text in inputs]


def untagged():
    return Tagged("none", "nowhere")


def test_a_class_is_built_with_its_options_and_device_and_warmed_up():
    model = api.build(f"{__name__}:Tagged", {"tag": "t"}, device="cuda:0")
    assert model.warm and model.run_batch(["x"]) == ["t:cuda:0:x"]
    assert api.build(f"{__name__}:untagged", {}).run_batch(["x"]) == ["none:nowhere:x"]  # takes no device
    assert api.build(f"{__name__}:Tagged", {"tag": "t", "device": "cpu"}, device="cuda:0").device == "cpu"
    assert api.model_name(model, "t:T") == "t:T"


def test_a_package_beside_the_configuration_is_found_on_its_pythonpath(tmp_path):
    (tmp_path / "beside_ferry_mod.py").write_text("class M:\n    name = 'm'\n    def run_batch(self, x):\n"
                                                  "        return x\n")
    model = api.build("beside_ferry_mod:M", {}, [str(tmp_path)])
    assert api.model_name(model, "beside_ferry_mod:M") == "m"


@pytest.mark.parametrize(("target", "error"), [
    ("no_such_module_here:X", ModuleNotFoundError),
    (f"{__name__}:Missing", AttributeError),
    (f"{__name__}:math", TypeError),  # a module: not callable
    ("math:pi", TypeError),
    ("builtins:dict", TypeError),  # builds, has no run_batch
])
def test_a_target_that_cannot_be_built_raises_what_the_start_error_names(target, error):
    with pytest.raises(error):
        api.build(target, {})


def test_texts_and_vectors_cross_as_texts_and_packed_float32():
    assert api.result(1, ["a", "b"]) == Result(1, ["a", "b"], [])
    packed = [struct.pack("<2f", 1, 2), struct.pack("<2f", 3, 4)]
    assert api.result(2, [[1, 2], (3.0, 4.0)]).vectors == packed
    assert api.result(3, np.array([[1, 2], [3, 4]], dtype=np.float64)).vectors == packed
    assert api.result(4, [np.array([1, 2]), np.array([3, 4], dtype=np.int32)]).vectors == packed


@pytest.mark.parametrize(("outputs", "error", "message"), [
    (["a", [1.0]], TypeError, "run_batch returned 1 strings and 1 other outputs"),
    ([{"a": 1}], TypeError, "output 0: expected a string or a vector of numbers, got dict"),
    ([[1.0, True]], TypeError, "output 0: expected a string or a vector of numbers"),
    ([[1.0, math.nan]], ValueError, "output 0: a value that is not a finite number"),
    (np.array([[1.0, np.inf]]), ValueError, "a row: a value that is not a finite number"),
    (np.zeros((2, 2, 2)), ValueError, "run_batch returned an array of shape (2, 2, 2)"),
    ("ab", TypeError, "run_batch returned str; expected a list"),
])
def test_an_output_that_is_neither_fails_the_call_naming_it(outputs, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        api.result(1, outputs)


def test_the_pool_fails_a_reply_of_the_wrong_kind_or_length():
    vectors = Result(1, [], [struct.pack("<3f", 1, 2, 3)])
    assert wrong_outputs(Result(1, ["a"], []), Outputs()) == ""
    assert wrong_outputs(vectors, Outputs()) == "the model returned vectors, not texts"
    texts = Result(1, ["a"], [])
    assert wrong_outputs(texts, Outputs("embedding", 3)) == "the model returned texts, not vectors"
    assert wrong_outputs(vectors, Outputs("embedding", 3)) == ""
    assert wrong_outputs(vectors, Outputs("embedding", 4)) == "the model returned a vector of 3 values, not 4"
