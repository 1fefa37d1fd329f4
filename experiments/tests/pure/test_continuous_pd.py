"""The P/D experiment's own parts: the two gateways it compares are the layouts it names (checked
by the configuration loader, on the same engines), and a chat's TPOT counts the time between its
first and last text over the tokens between them. The run itself is the experiment; its figures
are in experiments/docs/continuous-pd.md."""

from experiments import continuous_pd as experiment
from experiments.continuous_long_prompts import gateway_file
from gateway.config import parse_config


def test_the_two_gateways_are_two_colocated_replicas_against_one_prefill_and_one_decode_replica():
    colocated, apart = (parse_config(gateway_file(replicas, "/tmp"), "ferry.toml").models[0]
                        for replicas in experiment.LAYOUTS.values())
    assert (colocated.workers, colocated.prefill_workers, colocated.decode_workers) == (2, 0, 0)
    assert (apart.workers, apart.prefill_workers, apart.decode_workers) == (2, 1, 1)
    assert (colocated.threads, colocated.num_blocks) == (apart.threads, apart.num_blocks)


def test_a_chats_tpot_is_its_first_to_last_text_over_the_tokens_after_the_first():
    served = {"ok": True, "ttft": 0.5, "last": 2.5, "output_tokens": 5}
    assert experiment.tpot(served) == 0.5
    assert experiment.tpot({**served, "output_tokens": 1}) is None  # one token: no time a token after it
    assert experiment.tpot({**served, "ok": False}) is None
