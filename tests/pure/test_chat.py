"""Chat templates: the built-in labelled one, a model's own Jinja template, and one from a file."""

from __future__ import annotations

import json

import pytest

from gateway.config import parse_config
from gateway.text.chat import Labelled, TemplateRefused, make_template

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TURNS = [("user", "hello"), ("assistant", "hi"), ("user", "bye")]


def test_the_labelled_template_is_what_fixed_mode_workers_read():
    assert (
        Labelled().render("be brief", TURNS)
        == "System: be brief\n\nUser: hello\n\nAssistant: hi\n\nUser: bye"
    )


def test_a_model_s_own_template_comes_from_its_tokenizer_config(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>"})
    )
    template = make_template("model", str(tmp_path))
    assert template.render("be brief", TURNS[:1]) == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_standalone_jinja_file_beside_the_tokenizer_or_named_in_the_config(tmp_path):
    (tmp_path / "chat_template.jinja").write_text(CHATML)
    assert (
        make_template("model", str(tmp_path / "tokenizer.json"))
        .render("", TURNS[:1])
        .startswith("<|im_start|>user")
    )
    own = tmp_path / "mine.jinja"
    own.write_text("{{ messages | length }} turns")
    assert make_template(str(own)).render("", TURNS) == "3 turns"


def test_a_template_may_refuse_a_conversation_and_the_client_gets_a_400(tmp_path):
    own = tmp_path / "strict.jinja"
    own.write_text(
        "{% if messages[0]['role'] != 'user' %}"
        "{{ raise_exception('the first turn must be the user') }}{% endif %}ok"
    )
    template = make_template(str(own))
    assert template.render("", TURNS) == "ok"
    with pytest.raises(TemplateRefused, match="the first turn must be the user"):
        template.render("", [("assistant", "hi")])


def test_a_template_cannot_reach_python(tmp_path):
    own = tmp_path / "evil.jinja"
    own.write_text("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(Exception, match=r"unsafe|access"):
        make_template(str(own)).render("", TURNS)


def test_a_model_without_a_template_and_a_missing_file_are_refused(tmp_path):
    with pytest.raises(ValueError, match="no chat template ships with the tokenizer"):
        make_template("model", str(tmp_path))
    minimal = (
        "[[tiers]]\nname = 'paid'\n[[models]]\nname = 'm@1'\nworker = ['echo']\n"
        "chat_template = 'absent.jinja'\n"
    )
    with pytest.raises(
        ValueError, match=r"models\[0\].chat_template: expected one of \['labelled', 'model'\] or a .jinja"
    ):
        parse_config(minimal, "f.toml")
