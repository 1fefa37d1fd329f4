"""``prefill_workers`` and ``decode_workers``: together, in place of ``workers`` (their sum), on
ferry's engine over a model at a fixed size, each refusal naming its field; the engines' argv
says which slots prefill. The hand-off itself: ``tests/engine/test_kv_handoff.py`` and
``tests/system/test_kv_handoff.py``."""

from __future__ import annotations

import pytest

from batcher.continuous.config import ContinuousModelConfig


def model(**fields: object) -> ContinuousModelConfig:
    return ContinuousModelConfig(name="m@1", model="smollm2-135m", **fields)  # type: ignore[arg-type]


def test_prefill_and_decode_workers_replace_workers_name_the_prefill_slots_and_the_kv_path():
    apart = model(prefill_workers=2, decode_workers=3)
    assert apart.workers == 5 and apart.disaggregated and apart.pool_config().workers == 5
    argv = apart.engine_argv()
    assert argv[argv.index("--prefill-slots") + 1] == "2"
    assert "--prefill-slots" not in model(workers=2).engine_argv() and not model().disaggregated
    # local engines share the gateway's host: KV through /dev/shm; under Ray, as frames
    assert "--kv-shm" in argv and "--kv-shm" not in model(workers=2).engine_argv()
    assert "--kv-shm" not in model(prefill_workers=1, decode_workers=1, placement="ray").engine_argv()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"prefill_workers": 1}, "decode_workers: expected 1..4096 .with the other one., got 0"),
        ({"prefill_workers": 0, "decode_workers": 2}, "prefill_workers: expected 1..4096"),
        ({"prefill_workers": 1, "decode_workers": 1, "workers": 3}, "workers: expected left out"),
        ({"prefill_workers": 1, "decode_workers": 1, "engine": "vllm"}, "prefill_workers: expected 0 unless"),
        ({"prefill_workers": 1, "decode_workers": 1, "max_workers": 4}, "prefill_workers: expected 0 with"),
    ],
)
def test_a_pool_of_two_roles_is_refused_where_it_cannot_run(fields, message):
    with pytest.raises(ValueError, match=message):
        model(**fields)


def test_a_simulated_model_hands_nothing_off():
    with pytest.raises(ValueError, match="prefill_workers: expected 0 unless ferry's engine runs a model"):
        ContinuousModelConfig(name="s@1", simulated="llama-70b", prefill_workers=1, decode_workers=1)
