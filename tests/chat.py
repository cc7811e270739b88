"""Conversation data for a test: a tiny Hugging Face tokenizer directory with a chat template, built here (a byte-level
BPE trained in milliseconds with the ``tokenizers`` package, ChatML's special tokens), conversations, their JSONL."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>"]
VOCAB_SIZE = 384

# ChatML (Qwen's form): the assistant's turn after its header, <|im_end|> and the newline after it, marked
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}"
    "{% if m['reasoning_content'] is defined %}{{ '<think>' + m['reasoning_content'] + '</think>' }}{% endif %}"
    "{{ m['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
    "{% elif m['role'] == 'tool' %}{{ m | tojson }}{{ '<|im_end|>\\n' }}"
    "{% else %}{{ m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Mistral's form: bos_token, no generation prompt, alternation enforced with raise_exception, a namespace, loop
# controls, the year by strftime_now
INST = (
    "{{ bos_token }}{{ '[Y' + strftime_now('%Y') + ']' }}{% set ns = namespace(turns=0) %}"
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ '[SYS] ' + m['content'] + ' [/SYS]' }}{% continue %}{% endif %}"
    "{% if (m['role'] == 'user') != (ns.turns % 2 == 0) %}{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
    "{% set ns.turns = ns.turns + 1 %}"
    "{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% else %}{% generation %}{{ ' ' + m['content'] + eos_token }}{% endgeneration %}{% endif %}{% endfor %}"
)

CONVERSATIONS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hello there"},
     {"role": "assistant", "content": "Hi. How can I help?"}, {"role": "user", "content": "what is two and two?"},
     {"role": "assistant", "content": "Four, of course."}],
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue — the sky's."}],
    [{"role": "user", "content": "the quick brown fox"}, {"role": "assistant", "content": "jumps over the lazy dog"},
     {"role": "user", "content": "and then?"}, {"role": "assistant", "content": "It sleeps."}],
]
TOOL_CONVERSATION = [{"role": "user", "content": "weather?"}, {"role": "tool", "content": "sunny, 21 C", "name": None},
                     {"role": "assistant", "content": "Sunny and 21 degrees."}]
# reasoning under one of transformers' names (the template reads reasoning_content)
REASONING_CONVERSATION = [{"role": "user", "content": "two and two?"},
                          {"role": "assistant", "content": "Four.", "thinking": "two plus two"}]


def without_generation(template: str) -> str:
    """``template`` without its ``{% generation %}`` marks: the same text, the assistant's tokens found by prefixes."""
    return template.replace("{% generation %}", "").replace("{% endgeneration %}", "")


def write_chat_tokenizer(directory: Path, template: str, in_config: bool = False, bos: str = "<s>",
                         eos: str = "<|im_end|>") -> Path:
    """A tokenizer directory as transformers 5 saves one: ``tokenizer.json``, ``tokenizer_config.json`` (the named
    special tokens) and the template as ``chat_template.jinja`` (``in_config``: in ``tokenizer_config.json``, the older
    form)."""
    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [m["content"] for c in CONVERSATIONS + [TOOL_CONVERSATION] for m in c] + ["system user assistant tool"]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus * 8, trainer)
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos, "pad_token": "<|endoftext|>"}
    if in_config:
        config["chat_template"] = template
    else:
        (directory / "chat_template.jinja").write_text(template)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def write_jsonl(path: Path, conversations: list, raw_lines: tuple[str, ...] = ()) -> Path:
    """``conversations`` as JSONL lines ``{"messages": ...}``, then ``raw_lines`` as they are."""
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations) + "".join(line + "\n" for line in raw_lines))
    return path
