"""Data: tokenizers, the embedded default corpus, token windows and the global-sample-index sampler."""

from dynatrain.data.corpus import embedded_corpus, folder_corpus, load_bin
from dynatrain.data.datamodule import LlamaDataModule, ResumableDataLoader
from dynatrain.data.dataset import TokenWindows, split
from dynatrain.data.sampler import GlobalBatchSampler, ShardedEvalSampler, check_batch_sizes
from dynatrain.data.tokenizer import ByteTokenizer, HFTokenizer, check_vocab, load_tokenizer

__all__ = [
    "ByteTokenizer",
    "GlobalBatchSampler",
    "HFTokenizer",
    "LlamaDataModule",
    "ResumableDataLoader",
    "ShardedEvalSampler",
    "TokenWindows",
    "check_batch_sizes",
    "check_vocab",
    "embedded_corpus",
    "folder_corpus",
    "load_bin",
    "load_tokenizer",
    "split",
]
