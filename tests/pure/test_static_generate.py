"""The fixed-mode language model worker (``generate``), pure: one static, padded, greedy batch a
call over the engine's runner, here a simulated one (seeded tokens that end with a set chance)."""

from __future__ import annotations

from workers.engine.cost_model import PRESETS
from workers.engine.simulated import SimulatedRunner
from workers.models import Generate

EOS = 2


class Counting(SimulatedRunner):
    """A simulated runner that counts its steps."""

    steps = 0

    def run(self, schedule):
        self.steps += 1
        return super().run(schedule)


def generate(max_tokens: int = 40) -> tuple[Generate, Counting]:
    runner = Counting(PRESETS["llama-70b"], num_blocks=512, eos_token_id=EOS, eos_prob=0.08, vocab=128)
    model = Generate(
        runner, lambda text: list(text.encode()), lambda ids: bytes(ids).decode(), max_tokens, "g"
    )
    return model, runner


PROMPTS = [f"prompt number {i}: " + "x" * (3 * i) for i in range(8)]


def test_a_batch_answers_what_each_prompt_gives_alone_cut_at_its_end_of_sequence():
    model, _ = generate()
    together = model.run_batch(PROMPTS)
    alone = [model.run_batch([prompt])[0] for prompt in PROMPTS]
    assert together == alone
    assert len({len(answer) for answer in together}) > 1  # they end at different lengths
    assert all(len(answer) <= 40 and "\x02" not in answer for answer in together)


def test_a_static_batch_runs_until_its_longest_answer_ends_with_the_short_ones_as_padding():
    model, runner = generate()
    answers = model.run_batch(PROMPTS)
    lengths = sorted(len(answer) for answer in answers)
    assert lengths[-1] < 40  # every answer here ends with its end-of-sequence id
    assert runner.steps == lengths[-1] + 1  # one step a token of the longest, its end included
    runner.steps = 0
    model.run_batch([PROMPTS[[len(a) for a in answers].index(lengths[0])]])
    assert runner.steps == lengths[0] + 1 < lengths[-1] + 1  # alone, the shortest is done sooner
