"""Conversations (chat data) -> token ids and the loss mask of the assistant's tokens.

A conversation is a JSONL line ``{"messages": [{"role": ..., "content": ...}, ...]}`` (roles :data:`ROLES`; other keys
of a message, e.g. ``tool_calls``, go to the template as they are). It is rendered with the model's own chat template,
the Jinja template of its tokenizer directory (``chat_template.jinja`` beside ``tokenizer.json``, else
``tokenizer_config.json``'s ``chat_template``: transformers' order), in the environment transformers renders it in: a
sandbox with ``trim_blocks`` and ``lstrip_blocks``, loop controls, ``raise_exception``, ``strftime_now``, a ``tojson``
that escapes no HTML, and the tokenizer's named special tokens (``bos_token``, ``eos_token``, ...) as variables. The
text is tokenised as ``apply_chat_template`` does: the tokenizer's encoding without added special tokens (the template
writes them).

Which tokens train (mask 1): those of the assistant's messages, the prompt's (system, user, tool) never.

* A template that marks them with ``{% generation %}`` ... ``{% endgeneration %}`` says so itself: the mask is
  transformers' ``return_assistant_tokens_mask``, every token overlapping a marked span.
* Otherwise (most templates) an assistant message ``i`` is what its rendering adds after the generation prompt: the
  text between the rendering of ``messages[:i]`` with ``add_generation_prompt=True`` and that of ``messages[:i + 1]``,
  end-of-turn token included (and what the template writes after it, e.g. ChatML's newline after ``<|im_end|>``: as
  Megatron-LM's SFT masks, which trains a turn after its role header). Both renderings must be prefixes of the whole
  conversation's; a template that renders an earlier turn differently in a longer conversation (one that drops the
  reasoning of earlier turns) is refused in one line, never masked by guess.

Nothing else is added: no beginning- or end-of-document token (the template writes what the model saw in its own
training), so the ids are ``apply_chat_template``'s, and the document's last token is the template's last.

Errors are one line (:class:`ConversationError`); ``epp-prepare-data --sft`` prefixes the file and line.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

import jinja2
import jinja2.ext
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROLES = ("system", "user", "assistant", "tool")
TRAINED_ROLE = "assistant"
# transformers' named special tokens (PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES): the template's variables
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
TEMPLATE_FILE = "chat_template.jinja"
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class ConversationError(ValueError):
    """A conversation (or chat template) that cannot be rendered and masked; the message is one line."""


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


class _GenerationSpans(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body and, while :attr:`spans` is a list, records the body's
    character span in the output (transformers' ``AssistantTracker``: the offset is the length of the blocks the
    template has yielded so far, :attr:`blocks`)."""

    tags = {"generation"}

    def __init__(self, environment: jinja2.Environment) -> None:
        super().__init__(environment)
        self.blocks: list[str] | None = None
        self.spans: list[tuple[int, int]] | None = None

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_generation"), [], [], body).set_lineno(lineno)

    def _generation(self, caller) -> str:
        text = caller()
        if self.spans is not None:
            start = len("".join(self.blocks))
            self.spans.append((start, start + len(text)))
        return text


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace(...)`` without underscore names (transformers': no way to CPython's internals)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot store underscore names on a namespace: {name!r}")


class _TemplateDict:
    """``dict(...)`` in a template, without the class itself (transformers')."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationSpans, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                       namespace=_TemplateNamespace)
    return env


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an ``AddedToken``'s dict (``content``)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    """A compiled chat template and the special-token variables it is rendered with (see the module docstring)."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None, name: str = "chat template") -> None:
        self.name = name
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self.marks_generation = bool(_GENERATION_TAG.search(source))
        self._env = _environment()
        try:
            self._template = self._env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ConversationError(f"{name}: not a Jinja template (line {exc.lineno}: {_one_line(exc)})") from None
        self._tracker = next(e for e in self._env.extensions.values() if isinstance(e, _GenerationSpans))

    def __reduce__(self):  # to tokenizer processes: compiled again there (a compiled template does not pickle)
        return ChatTemplate, (self.source, self.special_tokens, self.name)

    @classmethod
    def from_tokenizer(cls, tokenizer_model: str | Path) -> "ChatTemplate":
        """The template of a Hugging Face tokenizer (``--tokenizer-model``: its directory or its ``tokenizer.json``): its
        ``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template`` (a string, or named templates of
        which ``default``), with the named special tokens of ``tokenizer_config.json`` (``special_tokens_map.json``
        for those it lacks)."""
        path = Path(tokenizer_model)
        directory = path if path.is_dir() else path.parent
        config = _read_json(directory / "tokenizer_config.json")
        tokens = _read_json(directory / "special_tokens_map.json")
        tokens.update({k: v for k, v in config.items() if k in SPECIAL_TOKEN_KEYS})
        special = {k: t for k in SPECIAL_TOKEN_KEYS if (t := _token_text(tokens.get(k))) is not None}
        file = directory / TEMPLATE_FILE
        if file.is_file():
            return cls(file.read_text(encoding="utf-8"), special, str(file))
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: [{"name": ..., "template": ...}]
            source = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        if isinstance(source, dict):
            source = source.get("default")
        if not isinstance(source, str):
            raise ConversationError(f"--tokenizer-model {tokenizer_model}: no chat template (neither {TEMPLATE_FILE} nor a "
                                    f"chat_template in tokenizer_config.json in {directory})")
        return cls(source, special, f"{directory / 'tokenizer_config.json'}: chat_template")

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = False,
               track: bool = False) -> tuple[str, list[tuple[int, int]]]:
        """The template's text for ``messages`` and, with ``track``, the character spans of its ``{% generation %}``
        blocks; a template that fails (``raise_exception``, an undefined name, ...) is a :class:`ConversationError`."""
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        self._tracker.blocks, self._tracker.spans = (blocks, spans) if track else (None, None)
        try:
            for block in self._template.generate(messages=list(messages), tools=None, documents=None,
                                                  add_generation_prompt=add_generation_prompt, **self.special_tokens):
                blocks.append(block)  # one at a time: a {% generation %} block's offset is the text yielded before it
        except Exception as exc:  # the template's own code: anything it raises is its failure on this conversation
            raise ConversationError(f"the chat template failed: {_one_line(exc)}") from None
        finally:
            self._tracker.blocks = self._tracker.spans = None
        return "".join(blocks), spans


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConversationError(f"{path}: not JSON ({_one_line(exc)})") from None
    return value if isinstance(value, dict) else {}


def check_messages(record: Any) -> list[dict]:
    """The ``messages`` of a parsed JSONL record, checked: a non-empty list of objects with a known ``role`` and a
    string ``content``; else a :class:`ConversationError`."""
    if not isinstance(record, dict) or "messages" not in record:
        raise ConversationError('no "messages" (a conversation is {"messages": [{"role": ..., "content": ...}, ...]})')
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise ConversationError('"messages" is not a non-empty list')
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ConversationError(f"message {i} is not an object")
        role = message.get("role")
        if role not in ROLES:
            raise ConversationError(f"message {i}: unknown role {role!r} (known: {', '.join(ROLES)})")
        if not isinstance(message.get("content"), str):
            raise ConversationError(f"message {i} ({role}): content is {type(message.get('content')).__name__}, not a string")
    return messages


@dataclass(frozen=True)
class EncodedConversation:
    """A conversation's token ids and its per-token loss mask (1: an assistant token, trained)."""

    ids: np.ndarray  # int64 (n,)
    loss_mask: np.ndarray  # uint8 (n,)


class ConversationEncoder:
    """Renders, tokenises and masks conversations with ``template`` and ``tokenizer`` (a
    :class:`~megatron_epp.data.tokenizers.HFTokenizer`: its ``encode_with_offsets``)."""

    def __init__(self, template: ChatTemplate, tokenizer) -> None:
        if not hasattr(tokenizer, "encode_with_offsets"):
            raise ConversationError(f"conversations need a Hugging Face tokenizer.json (--tokenizer-type HuggingFaceTokenizer "
                                    f"--tokenizer-model DIR), not {tokenizer.name}")
        self.template = template
        self.tokenizer = tokenizer

    def assistant_spans(self, messages: Sequence[dict], text: str) -> list[tuple[int, int]]:
        """The character spans of the assistant's messages in ``text`` (the whole conversation's rendering), by rendering
        prefixes (see the module docstring)."""
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != TRAINED_ROLE:
                continue
            before, _ = self.template.render(messages[:i], add_generation_prompt=True)
            through, _ = self.template.render(messages[: i + 1])
            if not (text.startswith(through) and through.startswith(before)):
                raise ConversationError(
                    f"message {i} (assistant): the chat template renders the conversation up to it (with the generation "
                    "prompt before it) as no prefix of the whole conversation's text, so its tokens cannot be told apart; "
                    "mark them with {% generation %} in the template")
            if len(through) > len(before):
                spans.append((len(before), len(through)))
        return spans

    def encode(self, messages: Sequence[dict]) -> EncodedConversation:
        """``messages`` (checked by :func:`check_messages`) as ids and loss mask; a :class:`ConversationError` if the
        template fails on them or renders no text."""
        messages = [_as_transformers_passes(m) for m in messages]
        text, spans = self.template.render(messages, track=self.template.marks_generation)
        if not self.template.marks_generation:
            spans = self.assistant_spans(messages, text)
        ids, offsets = self.tokenizer.encode_with_offsets(text)
        if not ids:
            raise ConversationError("the chat template renders it as no tokens")
        return EncodedConversation(np.asarray(ids, dtype=np.int64), overlap_mask(offsets, spans))


REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")  # transformers' names of a message's reasoning


def _as_transformers_passes(message: dict) -> dict:
    """A message as ``apply_chat_template`` hands it to the template: keys whose value is None dropped, and its reasoning
    (the first of :data:`REASONING_KEYS` given) also under ``thinking`` and ``reasoning_content``."""
    message = {key: value for key, value in message.items() if value is not None}
    reasoning = next((message[key] for key in REASONING_KEYS if key in message), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


def overlap_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """1 for each token (character ``offsets``) overlapping one of ``spans`` (sorted character ranges): transformers'
    rule for ``return_assistant_tokens_mask``, so a token across a span's edge trains."""
    mask = np.zeros(len(offsets), dtype=np.uint8)
    k = 0
    for t, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if end > spans[k][0]:
            mask[t] = 1
    return mask
