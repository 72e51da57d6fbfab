"""PromptEncoder: a chat the model's template refuses (a role it lacks, as Mistral's and Gemma's templates
raise) is the caller's error, named `messages`, not an internal one."""
from __future__ import annotations

import copy

import pytest

from mii_async.errors import InvalidParameterError
from mii_async.text.prompts import PromptEncoder

STRICT = ("{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
          "{{ raise_exception('Conversation roles must be user or assistant') }}{% endif %}"
          "<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def strict_encoder(default_model_dir):
    from transformers import AutoTokenizer

    tok = copy.deepcopy(AutoTokenizer.from_pretrained(str(default_model_dir)))
    tok.chat_template = STRICT
    return PromptEncoder(tok)


def test_roles_the_template_takes_render(strict_encoder):
    text, ids = strict_encoder.encode([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
    assert text == "<user>hi<assistant>yo<assistant>" and ids


@pytest.mark.parametrize("role", ["system", "wizard"])
def test_a_role_the_template_refuses_names_messages(strict_encoder, role):
    with pytest.raises(InvalidParameterError) as err:
        strict_encoder.encode([{"role": role, "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert err.value.param == "messages"
    assert "Conversation roles must be user or assistant" in str(err.value)


def test_a_malformed_message_names_its_index(strict_encoder):
    with pytest.raises(InvalidParameterError) as err:
        strict_encoder.encode([{"role": "user", "content": "hi"}, {"role": "user"}])
    assert err.value.param == "messages[1]"
