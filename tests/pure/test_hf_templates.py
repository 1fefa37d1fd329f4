"""Chat templates render as Hugging Face renders them: the templates of real model families
(Llama 3.1 and 3.2, Qwen 2.5, Mistral, Gemma 2, Phi-3.5, SmolLM2), and the features transformers
adds to Jinja, each held byte for byte against transformers' own ``apply_chat_template``."""

from __future__ import annotations

import datetime

import jinja2
import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from gateway.text.chat import Jinja, TemplateRefused
from gateway.text.model_template import ModelTemplate
from tests.support.real_templates import real_templates

TEMPLATES = real_templates()
CONVERSATIONS = {
    "one question": ("", [("user", "What is the capital of France?")]),
    "a system prompt": ("Answer in one word.", [("user", "Capital of France?")]),
    "turns": ("Be brief.", [("user", "Hi!"), ("assistant", "Hello. <b>How</b> can I help?"),
                            ("user", "Say \"ok\" & stop.")]),
    "unicode": ("", [("user", "  Grüße aus Zürich 👋 \n")]),
    "a prefill": ("", [("user", "Greek name for the Sun? (A) Sol (B) Helios"),
                       ("assistant", "The best answer is (")]),
}


def transformers_render(template: ModelTemplate, system: str, turns, prefill: bool) -> str:
    """transformers' ``apply_chat_template`` over the same template and special tokens."""
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>")), **template.special_tokens
    )
    messages = [{"role": "system", "content": system}] if system else []
    messages += [{"role": role, "content": text} for role, text in turns]
    return tokenizer.apply_chat_template(messages, chat_template=template.source, tokenize=False,
                                         add_generation_prompt=not prefill, continue_final_message=prefill)


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("family", TEMPLATES)
def test_a_real_template_renders_byte_for_byte_as_transformers_renders_it(family, conversation):
    template, (system, turns) = TEMPLATES[family], CONVERSATIONS[conversation]
    prefill = turns[-1][0] == "assistant"
    try:
        expected = transformers_render(template, system, turns, prefill)
    except jinja2.TemplateError as refusal:  # Gemma takes no system prompt: both refuse it
        with pytest.raises(TemplateRefused, match=str(refusal)):
            Jinja(template, family).render(system, turns, prefill)
        return
    assert Jinja(template, family).render(system, turns, prefill) == expected


def test_every_family_is_there():
    assert set(TEMPLATES) == {"llama-3.1", "llama-3.2", "qwen-2.5", "mistral-7b-v0.3", "gemma-2", "phi-3.5",
                              "smollm2"}


FEATURES = (
    "{%- set ns = namespace(seen=0) %}"
    "{%- for m in messages %}{%- if loop.index > 2 %}{% break %}{% endif %}"
    "{%- if m.role == 'system' %}{% continue %}{% endif %}{% set ns.seen = ns.seen + 1 %}"
    "{% generation %}<{{ m.role }}>{{ m.content }}{% endgeneration %}{% endfor %}"
    "|{{ ns.seen }}|{{ messages | tojson }}|{{ messages[-1] | tojson(indent=2, sort_keys=true) }}"
    "|{{ dict(a=1, b='<&>') | tojson(separators=(',', ':')) }}|{{ strftime_now('%Y-%m-%d') }}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def test_what_transformers_adds_to_jinja_renders_the_same():
    template = ModelTemplate(FEATURES, "<s>", "</s>")
    turns = [("user", "<b>a</b> & \"b\" é"), ("assistant", "c"), ("user", "d")]
    expected = transformers_render(template, "sys", turns, False)
    assert Jinja(template, "features").render("sys", turns) == expected


def test_strftime_now_reads_the_clock():
    template = ModelTemplate("{{ strftime_now('%d %b %Y') }}")
    assert Jinja(template, "date").render("", [("user", "x")]) == datetime.datetime.now().strftime("%d %b %Y")


@pytest.mark.parametrize(
    "source",
    [
        "{% set ns = namespace(_hidden=1) %}",
        "{% set ns = namespace() %}{% set ns._x = 1 %}",
        "{{ messages.__class__.__mro__ }}",
        "{{ ''.__class__.__subclasses__() }}",
    ],
)
def test_the_sandbox_holds(source):
    with pytest.raises(jinja2.exceptions.SecurityError):
        Jinja(ModelTemplate(source), "hostile").render("", [("user", "x")])


def test_a_template_that_cannot_continue_a_prefill_refuses_it():
    template = ModelTemplate("{% for m in messages %}{{ m.role }}{% endfor %}")
    with pytest.raises(TemplateRefused, match="cannot continue a final assistant turn"):
        Jinja(template, "roles only").render("", [("user", "a"), ("assistant", "b")], prefill=True)
