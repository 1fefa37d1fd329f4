"""The long-prompt experiment's own parts: the two gateways it compares are the layouts it names
(checked by the configuration loader), and its flood prompts share no prefix for the cache to
find. The run itself is the experiment; its figures are in experiments/docs/continuous-long-prompts.md."""

from experiments import continuous_long_prompts as experiment
from gateway.config import parse_config


def test_the_two_gateways_are_one_ordinary_and_one_long_replica_against_two_ordinary_ones():
    def model(long_pool: bool):
        text = experiment.gateway_file(experiment.replicas(long_pool), "/tmp")
        return parse_config(text, "ferry.toml").models[0]

    pool, colocated = model(True), model(False)
    assert (pool.workers, pool.long_workers, pool.long_prompt_tokens) == (1, 1, experiment.LONG_PROMPT_TOKENS)
    assert (colocated.workers, colocated.long_workers) == (2, 0)
    assert (pool.threads, colocated.threads, pool.num_blocks) == (1, 1, colocated.num_blocks)


def test_each_flood_prompt_is_its_own_from_its_first_words_and_about_as_long_as_asked():
    first, second = experiment.flood_prompt(1, 3000), experiment.flood_prompt(2, 3000)
    preamble = "Summarise this log in one line. "
    assert first[len(preamble):].split()[:2] != second[len(preamble):].split()[:2]
    assert 2500 < len(first.split()) < 3000  # ~1.1 SmolLM2 tokens a word (2,893 tokens measured)
