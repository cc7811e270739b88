"""Data layer: tokenizers, indexed-dataset preparation, documents, fixed-length GPT samples and the
elastic whole-document sampler."""

from megatron_epp.data.blend import Blend, BlendedDocuments, BlendedSamples, BlendError, BlendIndex
from megatron_epp.data.documents import DocumentDataset, DocumentSource, split_ranges
from megatron_epp.data.gpt_samples import GPTSamples, MockGPTSamples, sample_dict
from megatron_epp.data.length_stats import LengthStats
from megatron_epp.data.mock_documents import (
    MockDocuments,
    lengths_from_file,
    lognormal_lengths,
    progression_tokens,
)
from megatron_epp.data.prepare import DataError, PrepareResult, prepare_dataset
from megatron_epp.data.sequence_sampler import (
    GlobalBatch,
    SequenceSampler,
    TrainingSequence,
)
from megatron_epp.data.tokenizers import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    TokenizerError,
    build_tokenizer,
)

__all__ = [
    "Blend",
    "BlendError",
    "BlendIndex",
    "BlendedDocuments",
    "BlendedSamples",
    "ByteTokenizer",
    "DataError",
    "DocumentDataset",
    "DocumentSource",
    "GPTSamples",
    "GlobalBatch",
    "HFTokenizer",
    "LengthStats",
    "MockDocuments",
    "MockGPTSamples",
    "PrepareResult",
    "SequenceSampler",
    "Tokenizer",
    "TokenizerError",
    "TrainingSequence",
    "build_tokenizer",
    "lengths_from_file",
    "lognormal_lengths",
    "prepare_dataset",
    "progression_tokens",
    "sample_dict",
    "split_ranges",
]
