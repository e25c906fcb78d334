"""A tiny model that calls the calculator: a 2-layer Llama with the tiny model's tokenizer, taught in seconds of
plain torch one episode of the Hermes template (a call of ``calculate`` on "2 + 3", the result, the answer "5"),
so the training tests see real multi-turn episodes from the real engine (the random tiny model never writes a tool
call)."""

from __future__ import annotations

from pathlib import Path

EXPRESSION, RESULT = "2 + 3", "5"
STEPS = 120
QUESTIONS = ["What is 2 + 3?", "Add 2 and 3.", "2 plus 3?", "Sum 2 and 3."]


def conversation(question: str) -> list[dict]:
    call = {"function": {"name": "calculate", "arguments": {"expression": EXPRESSION}}}
    return [
        {"role": "user", "content": question},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "calculate", "content": RESULT},
        {"role": "assistant", "content": RESULT},
    ]


SHORT_TEMPLATE = (  # the Hermes format, the tools named in one word: a short prompt is learned in fewer steps
    "{{ bos_token }}{%- if tools %}<|system|>\ncalculate<|end|>\n{% endif %}"
    "{%- for m in messages %}{%- if m.role == 'assistant' and m.tool_calls %}<|assistant|>\n"
    "{% for c in m.tool_calls %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}"
    "</tool_call>{% endfor %}<|end|>\n{% elif m.role == 'tool' %}<|user|>\n<tool_response>{{ m.content }}"
    "</tool_response><|end|>\n{% else %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def teach(folder: Path, template: str = SHORT_TEMPLATE) -> Path:
    """Write the taught model into ``folder``: the tiny model's tokenizer with ``template`` (Hermes tool calls), a
    fresh 2-layer Llama trained on the episode for each question, the loss on the assistant's turns."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from ladle.agents import environments
    from ladle.assets import tiny_model_dir
    from ladle.data.tokenize import chat_text

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir())
    tokenizer.chat_template = template
    tools = list(environments.load("calculator", {}).tools)
    rows = []
    for question in QUESTIONS:
        text, spans = chat_text(tokenizer, conversation(question), "response", tools)
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        labels = [
            token if any(a <= start < b for a, b in spans) else -100
            for token, (start, _) in zip(encoded["input_ids"], encoded["offset_mapping"], strict=True)
        ]
        rows.append((encoded["input_ids"], labels))
    width = max(len(ids) for ids, _ in rows)
    ids = torch.tensor([i + [tokenizer.pad_token_id] * (width - len(i)) for i, _ in rows])
    labels = torch.tensor([la + [-100] * (width - len(la)) for _, la in rows])
    mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in rows])
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(STEPS):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder
