"""The one reader of a model directory's chat template, which the engine's runner and the
gateway share: Hugging Face's precedence, named templates, special tokens, and what is not one."""

from __future__ import annotations

import json

import pytest

from gateway.text.chat import make_template
from gateway.text.model_template import ModelTemplate, read_chat_template

STANDALONE, IN_CONFIG = "{{ 'from the .jinja file' }}", "{{ 'from tokenizer_config.json' }}"


def write_config(directory, **settings) -> None:
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))


def test_a_standalone_file_wins_over_the_tokenizer_config_as_in_hugging_face(tmp_path):
    write_config(tmp_path, chat_template=IN_CONFIG, bos_token="<s>", eos_token={"content": "</s>"})
    (tmp_path / "chat_template.jinja").write_text(STANDALONE)
    assert read_chat_template(tmp_path) == ModelTemplate(STANDALONE, "<s>", "</s>")
    assert make_template("model", str(tmp_path / "tokenizer.json")).render("", [("user", "hi")]) == (
        "from the .jinja file"
    )


def test_the_tokenizer_config_s_template_serves_where_no_file_stands_alone(tmp_path):
    write_config(tmp_path, chat_template=IN_CONFIG, eos_token="<|im_end|>")
    assert read_chat_template(tmp_path) == ModelTemplate(IN_CONFIG, "", "<|im_end|>")


def test_of_a_list_of_named_templates_the_default_is_read(tmp_path):
    named = [{"name": "tool_use", "template": "{{ 'tools' }}"}, {"name": "default", "template": IN_CONFIG}]
    write_config(tmp_path, chat_template=named)
    assert read_chat_template(tmp_path).source == IN_CONFIG
    assert make_template("model", str(tmp_path)).render("", [("user", "hi")]) == "from tokenizer_config.json"


@pytest.mark.parametrize(
    "config",
    [
        None,  # no tokenizer_config.json at all
        "{not json",
        "[1, 2]",
        json.dumps({"bos_token": "<s>"}),
        json.dumps({"chat_template": 42}),
        json.dumps({"chat_template": [{"name": "tool_use", "template": "x"}, "junk"]}),  # no default
    ],
)
def test_a_directory_without_a_readable_template_has_none(tmp_path, config):
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_text(config)
    assert read_chat_template(tmp_path) is None
    with pytest.raises(ValueError, match="no chat template ships with the tokenizer"):
        make_template("model", str(tmp_path))
