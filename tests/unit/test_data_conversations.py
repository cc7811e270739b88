"""Conversations (``megatron_epp.data.conversations``, ``epp-prepare-data --sft``): rendered and masked as transformers'
``apply_chat_template(..., return_assistant_tokens_mask=True)``, written with aligned loss masks, read back by the
sampler with its labels' masks, and bad lines refused in one line naming the file and line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_epp.config.parser import parse_config
from megatron_epp.data import prepare as prepare_data
from megatron_epp.data.conversations import ChatTemplate, ConversationEncoder, ConversationError, check_messages
from megatron_epp.data.documents import DocumentDataset, LossMaskMismatch, loss_mask_prefix
from megatron_epp.data.sequence_sampler import SequenceSampler
from megatron_epp.data.tokenizers import build_tokenizer
from megatron_epp.executor.batches import chunk_batches
from megatron_epp.plan import Chunk, Pipeline, Plan, Segment
from megatron_epp.training.corpus_check import check_corpus
from tests.corpus import write_corpus
from tests.chat import CHATML, CONVERSATIONS, INST, REASONING_CONVERSATION, TOOL_CONVERSATION, without_generation, write_chat_tokenizer, write_jsonl


def encoder(directory: Path, template: str | None = None) -> ConversationEncoder:
    """The directory's template (or ``template`` with the directory's special tokens) and tokenizer."""
    own = ChatTemplate.from_tokenizer(directory)
    chosen = own if template is None else ChatTemplate(template, own.special_tokens)
    return ConversationEncoder(chosen, build_tokenizer("HuggingFaceTokenizer", str(directory)))


@pytest.mark.parametrize("template, eos, in_config", [(CHATML, "<|im_end|>", False), (INST, "</s>", True)], ids=["chatml", "inst"])
def test_ids_and_mask_equal_transformers(tmp_path, template, eos, in_config):
    """transformers' ids and assistant mask of the {% generation %}-marked template, from the directory as transformers
    reads it (chat_template.jinja, or tokenizer_config.json's chat_template); the same template without the marks
    (assistant turns found by rendering prefixes) gives the same mask. A None value is dropped and reasoning is passed
    under transformers' names, as apply_chat_template passes them."""
    transformers = pytest.importorskip("transformers")
    directory = write_chat_tokenizer(tmp_path / "tok", template, in_config=in_config, eos=eos)
    reference = transformers.AutoTokenizer.from_pretrained(str(directory))
    marked, by_prefix = encoder(directory), encoder(directory, without_generation(template))
    assert marked.template.marks_generation and not by_prefix.template.marks_generation
    for conversation in CONVERSATIONS + ([TOOL_CONVERSATION, REASONING_CONVERSATION] if template == CHATML else []):
        want = reference.apply_chat_template(conversation, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert 0 < sum(want["assistant_masks"]) < len(want["input_ids"])
        for enc in (marked, by_prefix):
            got = enc.encode(conversation)
            assert got.ids.tolist() == want["input_ids"]
            assert got.loss_mask.tolist() == want["assistant_masks"]


def test_assistant_tokens_are_the_replies(tmp_path):
    """What trains is the assistant's words and end of turn, nothing of the prompt (decoded, by hand)."""
    directory = write_chat_tokenizer(tmp_path / "tok", without_generation(CHATML))
    enc = encoder(directory)
    got = enc.encode(CONVERSATIONS[1])
    trained = enc.tokenizer.detokenize(got.ids[got.loss_mask == 1])
    assert trained == "Blue — the sky's.<|im_end|>\n"


def test_template_that_rewrites_earlier_turns_is_refused(tmp_path):
    """A template that renders an assistant turn differently once it is not the last (as reasoning templates drop
    earlier reasoning) leaves no prefix to find it by: one line, never a guessed mask."""
    rewrites = CHATML.replace("m['content'] + '<|im_end|>\\n'", "(m['content'] if loop.last else 'earlier') + '<|im_end|>\\n'")
    directory = write_chat_tokenizer(tmp_path / "tok", without_generation(rewrites))
    with pytest.raises(ConversationError, match=r"message 2 \(assistant\): the chat template renders the conversation up to"):
        encoder(directory).encode(CONVERSATIONS[0])


@pytest.mark.parametrize("record, message", [
    ({"text": "x"}, 'no "messages"'),
    ({"messages": []}, '"messages" is not a non-empty list'),
    ({"messages": [{"role": "robot", "content": "x"}]}, "message 0: unknown role 'robot'"),
    ({"messages": [{"role": "user", "content": None}]}, "message 0 (user): content is NoneType, not a string"),
    ({"messages": ["hi"]}, "message 0 is not an object"),
])
def test_messages_are_checked(record, message):
    with pytest.raises(ConversationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_messages(record)


def test_no_template_is_one_line(tmp_path):
    directory = write_chat_tokenizer(tmp_path / "tok", CHATML)
    (directory / "chat_template.jinja").unlink()
    with pytest.raises(ConversationError, match="no chat template"):
        ChatTemplate.from_tokenizer(directory)
    with pytest.raises(ConversationError, match="not a Jinja template"):
        ChatTemplate("{% for m in messages %}")


def prepare(capsys, *flags):
    """``epp-prepare-data FLAGS``: its exit status, stdout and stderr."""
    code = prepare_data.main([*flags, "--no-progress"])
    out, err = capsys.readouterr()
    return code, out, err


def test_prepare_writes_aligned_masks(tmp_path, capsys):
    """The dataset holds each conversation's ids, its loss masks beside it (one uint8 entry each, the same lengths);
    the sampler gives each sequence its labels' masks (label j: token j + 1), truncated with it; two tokenizer
    processes write the same files."""
    directory = write_chat_tokenizer(tmp_path / "tok", without_generation(CHATML))
    data = write_jsonl(tmp_path / "chats.jsonl", CONVERSATIONS * 3)
    tok = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(directory)]
    code, out, err = prepare(capsys, "--sft", "--input", str(data), "--output-prefix", str(tmp_path / "ds"), *tok)
    assert code == 0, err
    assert "ds_loss_mask.bin/.idx" in out and "conversations with none" in out
    docs = DocumentDataset(str(tmp_path / "ds"), loss_masks=True)
    enc = encoder(directory)
    for i, conversation in enumerate(CONVERSATIONS * 3):
        want = enc.encode(conversation)
        assert docs[i].tolist() == want.ids.tolist() and docs.loss_mask(i).tolist() == want.loss_mask.tolist()
    assert prepare(capsys, "--sft", "--input", str(data), "--output-prefix", str(tmp_path / "pool"), "--workers", "2", *tok)[0] == 0
    for suffix in (".bin", "_loss_mask.bin"):
        assert (tmp_path / f"ds{suffix}").read_bytes() == (tmp_path / f"pool{suffix}").read_bytes()

    cap = 20
    sampler = SequenceSampler(docs, global_batch_size=len(docs), seq_length=cap, truncate=True)
    batch = next(sampler.iterate())
    for s in batch.sequences():
        whole, mask = docs[s.doc_index], docs.loss_mask(s.doc_index)
        n = min(len(whole) - 1, cap)
        assert s.tokens.tolist() == whole[:n].tolist() and s.labels.tolist() == whole[1 : n + 1].tolist()
        assert s.loss_mask.tolist() == mask[1 : n + 1].tolist()


def test_masks_are_checked_on_load(tmp_path):
    """--sft's datasets: masks missing, or of other documents, are one line."""
    directory = write_chat_tokenizer(tmp_path / "tok", without_generation(CHATML))
    tok = build_tokenizer("HuggingFaceTokenizer", str(directory))
    template = ChatTemplate.from_tokenizer(directory)
    prepare_data.prepare_conversations([write_jsonl(tmp_path / "a.jsonl", CONVERSATIONS)], tmp_path / "a", tok, template, progress=False)
    prepare_data.prepare_conversations([write_jsonl(tmp_path / "b.jsonl", CONVERSATIONS[::-1])], tmp_path / "b", tok, template,
                                       progress=False)
    DocumentDataset(str(tmp_path / "a"))  # without --sft the masks are not read
    for ext in (".bin", ".idx"):  # a's masks replaced by b's
        Path(loss_mask_prefix(str(tmp_path / "a")) + ext).write_bytes(Path(loss_mask_prefix(str(tmp_path / "b")) + ext).read_bytes())
    with pytest.raises(LossMaskMismatch, match="they differ from document 0 on: not the loss masks of these tokens"):
        DocumentDataset(str(tmp_path / "a"), loss_masks=True)
    for ext in (".bin", ".idx"):
        Path(loss_mask_prefix(str(tmp_path / "b")) + ext).unlink()
    with pytest.raises(LossMaskMismatch, match="b_loss_mask.bin/.idx not found: --sft trains on the loss masks"):
        DocumentDataset(str(tmp_path / "b"), loss_masks=True)
    for ext in (".bin", ".idx"):  # b's tokens as its masks: the same lengths, not uint8
        Path(loss_mask_prefix(str(tmp_path / "b")) + ext).write_bytes((tmp_path / f"b{ext}").read_bytes())
    with pytest.raises(LossMaskMismatch, match="b_loss_mask.idx: tokens of uint16, not the uint8 of loss masks"):
        DocumentDataset(str(tmp_path / "b"), loss_masks=True)


BAD_LINES = [
    ("not json", "not a JSON line"),
    ('{"text": "a document"}', 'no "messages"'),
    ('{"messages": [{"role": "narrator", "content": "x"}]}', "message 0: unknown role 'narrator'"),
    ('{"messages": [{"role": "user", "content": ["a", "list"]}]}', "message 0 (user): content is list, not a string"),
    (json.dumps({"messages": [{"role": "assistant", "content": "first"}, {"role": "user", "content": "second"}]}),
     "the chat template failed: roles must alternate user/assistant"),
]


@pytest.mark.parametrize("line, message", BAD_LINES)
def test_bad_line_is_one_line_naming_file_and_line(tmp_path, capsys, line, message):
    """A bad line (after two good ones) is one line ``FILE:LINE: ...``, exit 2, and nothing is written: an older
    dataset at the prefix stays as it was."""
    directory = write_chat_tokenizer(tmp_path / "tok", without_generation(INST), eos="</s>")
    data = write_jsonl(tmp_path / "chats.jsonl", CONVERSATIONS[1:], raw_lines=("", line))
    out = tmp_path / "ds"
    for ext in (".bin", ".idx"):
        Path(f"{out}{ext}").write_text("older")
    code, _, err = prepare(capsys, "--sft", "--input", str(data), "--output-prefix", str(out),
                           "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(directory))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"epp-prepare-data: error: {data}:4: {message}"), err
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ds")) == ["ds.bin", "ds.idx"]
    assert Path(f"{out}.bin").read_text() == "older"


def test_sft_flags_that_do_not_apply(tmp_path, capsys):
    data = write_jsonl(tmp_path / "chats.jsonl", CONVERSATIONS)
    code, _, err = prepare(capsys, "--sft", "--input", str(data), "--output-prefix", str(tmp_path / "x"))
    assert code == 2 and err.strip() == ("epp-prepare-data: error: --sft needs --tokenizer-type HuggingFaceTokenizer "
                                         "--tokenizer-model DIR (its chat template), not ByteTokenizer")


def test_chunks_keep_each_tokens_mask():
    """chunk_batches with masks: a split slice, a hybrid chunk's parts and a batched chunk keep their tokens' masks, the
    padding 0; context-parallel ranks' blocks make the whole chunk's."""
    lengths = [9, 5, 4]
    masks = [torch.tensor([0, 0, 1, 1, 1, 0, 0, 1, 1]), torch.tensor([1, 0, 1, 0, 1]), torch.tensor([0, 0, 0, 1])]
    sequences = [(torch.arange(n) + 10 * s, torch.arange(n) + 10 * s + 1, m) for s, (n, m) in enumerate(zip(lengths, masks))]
    chunks = [Chunk(0, "split", [Segment(0, 0, 4)]), Chunk(1, "hybrid", [Segment(0, 4, 9), Segment(1, 0, 5)]),
              Chunk(2, "batched", [Segment(2, 0, 4)])]
    plan = Plan(lengths, 1, [2], [Pipeline(chunks, [[0, 0, 0]])], builder="test").validate()
    whole = list(chunk_batches(plan, sequences, torch.device("cpu"), 4))
    for batch, chunk in zip(whole, chunks):
        want = torch.cat([masks[s.seq][s.start : s.end].float() for s in chunk.segments])
        assert torch.equal(batch["loss_mask"][0, : chunk.num_tokens], want)
        assert not batch["loss_mask"][0, chunk.num_tokens :].any()
    ranks = [list(chunk_batches(plan, sequences, torch.device("cpu"), 4, r, 2)) for r in range(2)]
    for c in range(len(chunks)):
        assert torch.equal(torch.cat([ranks[r][c]["loss_mask"] for r in range(2)], dim=1), whole[c]["loss_mask"])
    unmasked = list(chunk_batches(plan, [s[:2] for s in sequences], torch.device("cpu"), 4))
    assert [int(b["loss_mask"].sum()) for b in unmasked] == [c.num_tokens for c in chunks]


def test_a_global_batch_without_trained_tokens_has_loss_zero(monkeypatch):
    """reduce_losses of a global batch whose masks are all 0 (conversations cut before any assistant token): 0, not
    0/0."""
    from megatron_epp.training.gpt_step import reduce_losses

    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, group=None: None)
    assert reduce_losses([{"lm loss": torch.tensor([0.0, 0.0])}], None) == 0.0
    assert reduce_losses([{"lm loss": torch.tensor([3.0, 2.0])}, {"lm loss": torch.tensor([1.0, 2.0])}], None) == 1.0
    assert np.isfinite(reduce_losses([{"lm loss": torch.tensor([0.0, 0.0])}], None))


def conversation_dataset(tmp_path, conversations) -> str:
    directory = write_chat_tokenizer(tmp_path / "tok", without_generation(CHATML))
    template = ChatTemplate.from_tokenizer(directory)
    tok = build_tokenizer("HuggingFaceTokenizer", str(directory))
    prepare_data.prepare_conversations([write_jsonl(tmp_path / "chats.jsonl", conversations)], tmp_path / "chats", tok, template,
                                       progress=False)
    return str(tmp_path / "chats")


def test_pretrain_sft_refusals(pretrain_in_process, tmp_path):
    """pretrain_gpt.py --sft: one line for the stock path, mock data, a dataset without masks, and a conversation over
    the cap without --epp-truncate-documents (with it, the masks are truncated along: the start-up summary says so)."""
    chats = conversation_dataset(tmp_path, CONVERSATIONS * 4)
    plain = write_corpus(tmp_path / "plain", ["some text"] * 8)
    model = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--split", "1,0,0"]
    hf = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path / "tok")]
    cases = [
        ([*hf, "--sft", "--data-path", chats], "--sft needs --elastic-pp"),
        ([*hf, "--sft", "--elastic-pp", "--mock-data"], "--sft trains on conversations: give --data-path"),
        (["--sft", "--elastic-pp", "--data-path", plain], f"--data-path {plain}: {plain}_loss_mask.bin/.idx not found"),
        ([*hf, "--sft", "--elastic-pp", "--data-path", chats, "--seq-length", "32"],
         "8 of 12 train documents are longer than the context cap --seq-length 32 (longest 54 tokens)"),
    ]
    for flags, message in cases:
        proc = pretrain_in_process(*model, *flags)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], (flags, proc.stderr)
    model += hf
    summary, _ = check_corpus(parse_config([*model, "--sft", "--elastic-pp", "--data-path", chats, "--seq-length", "32",
                                            "--epp-truncate-documents"], world_size=1))
    assert "8 truncated to --seq-length 32 (and their loss masks)" in summary and "--sft" in summary, summary
    summary, _ = check_corpus(parse_config([*model, "--elastic-pp", "--data-path", chats, "--seq-length", "64"], world_size=1))
    assert "loss masks beside the data (conversations) not used" in summary, summary
