"""`LlamaDataModule`: token windows for causal language modelling, sampled by global sample index."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader

from dynatrain.data.corpus import DEFAULT_MAX_CORPUS_BYTES, embedded_corpus, folder_corpus, load_bin
from dynatrain.data.dataset import TokenWindows, split
from dynatrain.data.sampler import GlobalBatchSampler, ShardedEvalSampler, check_batch_sizes
from dynatrain.data.tokenizer import ByteTokenizer, HFTokenizer, check_vocab, load_tokenizer


class ResumableDataLoader(DataLoader):
    """A DataLoader whose position Lightning saves and restores with its loops.

    Having `state_dict`/`load_state_dict` marks it resumable for Lightning, which then restores it
    before the first batch of a mid-epoch resume instead of warning that the data order is lost.
    """

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self.sampler.load_state_dict(state)


class LlamaDataModule(pl.LightningDataModule):
    """Causal-LM data: windows of `seq_len + 1` tokens from one token stream.

    The training order is fixed by the global sample index (see `GlobalBatchSampler`): the global batch
    of every step is the same whatever the data-parallel size, so a layout switch or a resume on another
    number of devices keeps the data exact.

    Args:
        data: None for the embedded corpus (the Python standard library's sources); else a folder of text
            files (.txt, .md, .py, ...) or a pre-tokenized .bin file of uint16/uint32 token ids.
        tokenizer: "byte" or None for the built-in byte tokenizer, or the path of a `tokenizers` JSON file.
            For a .bin file it only serves to check the ids and to decode.
        seq_len: Tokens per training sample.
        global_batch_size: Samples per optimizer step over all data-parallel ranks. Must be a multiple of
            dp_size * micro_batch_size for every layout you run on.
        micro_batch_size: Samples per forward pass on one rank; the rest is gradient accumulation.
        val_fraction: Share of the token stream, taken from its end, held out for validation.
        max_corpus_bytes: How much of the standard library the embedded corpus reads (bytes of source).
        seed: Seed of the per-epoch shuffle of training samples.
        num_workers: DataLoader worker processes.
        bin_dtype: "uint16" or "uint32" for a .bin file; default: from a .uint16.bin/.uint32.bin suffix,
            else uint16.
        cache_dir: Where tokenised text is cached; it wins over $DYNATRAIN_CACHE, the default when it is not
            given, else ~/.cache/dynatrain.
    """

    def __init__(
        self,
        data: str | None = None,
        tokenizer: str | None = None,
        seq_len: int = 128,
        global_batch_size: int = 16,
        micro_batch_size: int = 4,
        val_fraction: float = 0.02,
        max_corpus_bytes: int = DEFAULT_MAX_CORPUS_BYTES,
        seed: int = 1234,
        num_workers: int = 0,
        bin_dtype: str | None = None,
        cache_dir: str | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        check_batch_sizes(global_batch_size, 1, micro_batch_size)
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if bin_dtype not in (None, "uint16", "uint32"):
            raise ValueError(f"bin_dtype must be 'uint16', 'uint32' or None, got {bin_dtype!r}")
        self.data = data
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.val_fraction = val_fraction
        self.max_corpus_bytes = max_corpus_bytes
        self.seed = seed
        self.num_workers = num_workers
        self.bin_dtype = bin_dtype
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else None
        self._is_bin = data is not None and Path(data).suffix.lower() == ".bin"
        if data is not None and not self._is_bin and not Path(data).expanduser().is_dir():
            raise ValueError(f"data={data!r} is neither a folder of text files nor a .bin file of tokens "
                             "(leave it unset for the embedded corpus)")
        # Pre-tokenized ids mean nothing to the byte tokenizer, so there is no default one for a .bin file.
        self.tokenizer: ByteTokenizer | HFTokenizer | None = (
            None if self._is_bin and tokenizer is None else load_tokenizer(tokenizer))
        self.dp_size, self.dp_rank = 1, 0
        self.train_set: TokenWindows | None = None
        self.val_set: TokenWindows | None = None
        self.train_sampler: GlobalBatchSampler | None = None
        self.val_sampler: ShardedEvalSampler | None = None
        self._tokens: np.ndarray | None = None
        self._pending_state: dict[str, Any] | None = None
        self._max_token: int | None = None

    # -- tokens ---------------------------------------------------------------------------------

    def _load_tokens(self) -> np.ndarray:
        if self.data is None:
            assert self.tokenizer is not None
            return embedded_corpus(self.tokenizer, self.max_corpus_bytes, self.cache_dir)
        if self._is_bin:
            vocab = None if self.tokenizer is None else self.tokenizer.vocab_size
            return load_bin(self.data, self.bin_dtype, vocab)
        assert self.tokenizer is not None
        return folder_corpus(self.data, self.tokenizer, None, self.cache_dir)

    def prepare_data(self) -> None:
        # Lightning runs this once per node before `setup`, so the other ranks find the cache built.
        self._load_tokens()

    def setup(self, stage: str | None = None) -> None:
        self.dp_size, self.dp_rank = self._layout_from_trainer()
        check_batch_sizes(self.global_batch_size, self.dp_size, self.micro_batch_size)
        if self._tokens is not None:
            return
        self._tokens = self._load_tokens()
        train, val = split(self._tokens, self.val_fraction, self.seq_len)
        self.train_set = TokenWindows(train, self.seq_len)
        self.val_set = TokenWindows(val, self.seq_len)

    def _layout_from_trainer(self) -> tuple[int, int]:
        trainer = self.trainer
        if trainer is None:
            return self.dp_size, self.dp_rank
        strategy = trainer.strategy
        size, rank = getattr(strategy, "dp_size", None), getattr(strategy, "dp_rank", None)
        if size is not None and rank is not None:
            return int(size), int(rank)
        return int(trainer.world_size), int(trainer.global_rank)

    @property
    def vocab_size(self) -> int:
        """Token ids the model must be able to embed."""
        if self._is_bin:
            if self._max_token is None:
                tokens = self._tokens if self._tokens is not None else self._load_tokens()
                self._max_token = int(tokens.max())
            return max(self._max_token + 1, self.tokenizer.vocab_size if self.tokenizer is not None else 0)
        assert self.tokenizer is not None
        return self.tokenizer.vocab_size

    def check_model_vocab(self, model_vocab_size: int) -> None:
        """Raise a ValueError when the model's embedding is too small for this data."""
        if self.tokenizer is not None and not self._is_bin:
            check_vocab(self.tokenizer, model_vocab_size)
        else:
            check_vocab(self.vocab_size, model_vocab_size)

    # -- layout ---------------------------------------------------------------------------------

    def accumulation_for(self, dp_size: int, micro_batch_size: int | None = None) -> int:
        """Micro-batches per rank per optimizer step on `dp_size` data-parallel ranks."""
        m = self.micro_batch_size if micro_batch_size is None else micro_batch_size
        return check_batch_sizes(self.global_batch_size, dp_size, m)

    def set_layout(self, dp_size: int, dp_rank: int) -> int:
        """Switch the data-parallel layout between optimizer steps; returns the new accumulation.

        Call it on every rank between optimizer steps. The training position is re-synchronised to the
        optimizer steps taken. With `num_workers=0` the running train iterator carries on under the new
        layout; with workers, micro-batches were read ahead under the old one, and the caller must start a
        fresh iterator on the train loader so that none of them is used.
        """
        accumulation = self.accumulation_for(dp_size)
        self.dp_size, self.dp_rank = dp_size, dp_rank
        if self.train_sampler is not None:
            self.train_sampler.seek(self.train_sampler.consumed_samples)
            self.train_sampler.set_layout(dp_size, dp_rank)
        if self.val_sampler is not None:
            self.val_sampler.set_layout(dp_size, dp_rank)
        return accumulation

    @property
    def consumed_samples(self) -> int:
        """Global sample index of the next optimizer step's first sample."""
        if self.train_sampler is not None:
            return self.train_sampler.consumed_samples
        return int((self._pending_state or {}).get("consumed_samples", 0))

    # -- loaders --------------------------------------------------------------------------------

    def _require_setup(self) -> None:
        if self.train_set is None:
            self.setup()
        # Read again: a strategy may settle its layout after the data module's `setup`.
        self.dp_size, self.dp_rank = self._layout_from_trainer()

    def train_dataloader(self) -> DataLoader:
        self._require_setup()
        assert self.train_set is not None
        sampler = GlobalBatchSampler(self.train_set, self.global_batch_size, self.micro_batch_size,
                                     self.dp_size, self.dp_rank, seed=self.seed)
        if self._pending_state is not None:
            sampler.load_state_dict(self._pending_state)
            self._pending_state = None
        elif self.train_sampler is not None:
            sampler.seek(self.train_sampler.consumed_samples)  # a reloaded loader continues, not restarts
        trainer = self.trainer
        if trainer is not None:
            # Count progress in optimizer steps: DataLoader workers read micro-batches ahead of training.
            sampler.attach_step_counter(lambda: trainer.global_step)
        self.train_sampler = sampler
        return self._loader(self.train_set, sampler, ResumableDataLoader)

    def val_dataloader(self) -> DataLoader | list:
        self._require_setup()
        assert self.val_set is not None
        if len(self.val_set) == 0:
            return []
        self.val_sampler = ShardedEvalSampler(self.val_set, self.dp_size, self.dp_rank,
                                              multiple_of=self.global_batch_size)
        if len(self.val_sampler) == 0:
            raise ValueError(f"the validation split has {len(self.val_set)} windows, fewer than the "
                             f"{self.dp_size} data-parallel ranks: raise val_fraction or lower seq_len")
        return self._loader(self.val_set, self.val_sampler, DataLoader)

    def _loader(self, dataset: TokenWindows, sampler: Any, cls: type[DataLoader]) -> DataLoader:
        return cls(
            dataset,
            batch_size=self.micro_batch_size,
            sampler=sampler,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=self._pin_memory(),
            drop_last=False,
        )

    def _pin_memory(self) -> bool:
        """Page-locked batches only for a CUDA trainer: on a GPU host, CPU ranks would each start a CUDA context."""
        device = getattr(getattr(self.trainer, "strategy", None), "root_device", None)
        return torch.cuda.is_available() if device is None else device.type == "cuda"

    # -- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        if self.train_sampler is not None:
            return self.train_sampler.state_dict()
        return dict(self._pending_state or {})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        # Kept for the next `train_dataloader()` too: Lightning restores this before it builds the loader,
        # and a sampler left from an earlier fit counts steps of an earlier trainer.
        self._pending_state = dict(state_dict)
        if self.train_sampler is not None:
            self.train_sampler.load_state_dict(state_dict)
