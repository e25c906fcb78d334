"""A recipe's own chat template laid over its base (``chat_template``): read by preparation, training and the
server alike, named by its text in the data fingerprint, and refused with the fix when it cannot be read."""

from __future__ import annotations

import pytest

from ladle.assets.templates import with_template
from ladle.errors import LadleError


def test_a_template_overlay_is_the_base_with_its_template_and_changes_the_data_fingerprint(tiny_model, tmp_path):
    from transformers import AutoTokenizer

    from ladle.config.training import DataConfig
    from ladle.data.prepare import fingerprint

    assert with_template(tiny_model, None) == tiny_model
    over = with_template(tiny_model, "ladle://templates/chatml-tools")
    assert over != tiny_model and with_template(tiny_model, "ladle://templates/chatml-tools") == over  # made once
    assert (over / "model.safetensors").resolve() == (tiny_model / "model.safetensors").resolve()
    tokenizer = AutoTokenizer.from_pretrained(over)
    assert "<tool_call>" in tokenizer.chat_template
    assert AutoTokenizer.from_pretrained(tiny_model).chat_template != tokenizer.chat_template
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    own = tmp_path / "mine.jinja"
    own.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    data = DataConfig(path="ladle://demo-alpaca")
    prints = {fingerprint(data, folder) for folder in (tiny_model, over, with_template(tiny_model, str(own)))}
    assert len(prints) == 3


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        ("ladle://templates/nope", "no such shipped template. Use one of ladle://templates/chatml-tools"),
        ("/no/such/file.jinja", "cannot read it (FileNotFoundError"),
    ],
)
def test_a_template_that_cannot_be_read_is_refused_naming_it(tiny_model, ref, message):
    with pytest.raises(LadleError, match="chat_template = ") as refused:
        with_template(tiny_model, ref)
    assert message in str(refused.value)


def test_the_calculator_datas_tool_is_the_environments():
    from ladle.agents import environments
    from ladle.assets.calculator import CALCULATE, split

    assert list(environments.load("calculator", {}).tools) == [CALCULATE]
    warm, prompts, held = split()
    assert (len(warm), len(prompts), len(held)) == (200, 400, 64)
    expressions = [{q["expression"] for q in part} for part in (warm, prompts, held)]
    assert not (expressions[0] & expressions[1] or expressions[0] & expressions[2] or expressions[1] & expressions[2])
    assert all(q["question"].startswith("What is ") for q in warm)  # the warm-up writes expressions out
