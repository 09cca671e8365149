import warnings
from types import SimpleNamespace

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dynatrain.data.datamodule import LlamaDataModule, ResumableDataLoader
from dynatrain.data.sampler import GlobalBatchSampler

SMALL = dict(seq_len=16, global_batch_size=8, micro_batch_size=2, max_corpus_bytes=40_000, val_fraction=0.05)


@pytest.fixture
def make_dm(tmp_path):
    def make(**kwargs):
        return LlamaDataModule(**{**SMALL, "cache_dir": str(tmp_path / "cache"), **kwargs})

    return make


def fake_trainer(**kwargs):
    base = dict(world_size=1, global_rank=0, global_step=0, strategy=SimpleNamespace())
    return SimpleNamespace(**{**base, **kwargs})


def test_windows_and_shapes_from_the_embedded_corpus(make_dm):
    dm = make_dm()
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (2, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.max()) < dm.vocab_size == 259
    # The validation windows come after every training window in the stream.
    train_tokens, val_tokens = dm.train_set.tokens, dm.val_set.tokens
    assert len(train_tokens) + len(val_tokens) == len(dm._tokens)
    assert len(dm.train_set) * 16 + 1 <= len(train_tokens)


def test_layout_comes_from_the_strategy_then_the_world(make_dm):
    dm = make_dm()
    dm.trainer = fake_trainer(world_size=4, global_rank=3, strategy=SimpleNamespace(dp_size=2, dp_rank=1))
    dm.setup("fit")
    assert (dm.dp_size, dm.dp_rank) == (2, 1)
    assert dm.train_dataloader().sampler.rank == 1
    dm.trainer = fake_trainer(world_size=4, global_rank=3)
    dm.setup("fit")
    assert (dm.dp_size, dm.dp_rank) == (4, 3)
    dm.trainer = fake_trainer(world_size=3, global_rank=0)
    with pytest.raises(ValueError, match="global_batch_size=8 is not a multiple of"):
        dm.setup("fit")


def test_batches_are_pinned_only_for_a_cuda_trainer(make_dm, monkeypatch):
    # On a GPU host, a CPU rank that pinned its batches would start a CUDA context of its own.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    dm = make_dm()
    dm.trainer = fake_trainer(strategy=SimpleNamespace(root_device=torch.device("cpu")))
    dm.setup("fit")
    assert dm.train_dataloader().pin_memory is False
    dm.trainer = fake_trainer(strategy=SimpleNamespace(root_device=torch.device("cuda", 0)))
    assert dm.train_dataloader().pin_memory is True
    dm.trainer = None  # no trainer: pinned where CUDA is visible
    assert dm.train_dataloader().pin_memory is True


def test_accumulation_and_bad_arguments(make_dm, tmp_path):
    dm = make_dm(global_batch_size=24)
    assert [dm.accumulation_for(d) for d in (1, 2, 3, 4)] == [12, 6, 4, 3]
    with pytest.raises(ValueError, match="multiple of 10"):
        dm.accumulation_for(5)
    with pytest.raises(ValueError, match="multiple of 4"):
        make_dm(global_batch_size=10, micro_batch_size=4)
    with pytest.raises(ValueError, match="neither a folder"):
        make_dm(data=str(tmp_path / "nothing.txt"))
    with pytest.raises(ValueError, match="val_fraction"):
        make_dm(val_fraction=1.0)


def test_state_dict_resumes_on_another_dp_size(make_dm):
    dm = make_dm()
    dm.setup("fit")
    loader = dm.train_dataloader()
    it = iter(loader)
    for _ in range(3 * dm.accumulation_for(1)):
        next(it)
    state = dm.state_dict()
    assert state["consumed_samples"] == 24 and loader.state_dict() == state

    ranks = []
    for r in range(2):
        other = make_dm()
        other.trainer = fake_trainer(world_size=2, global_rank=r)
        other.setup("fit")
        other.load_state_dict(state)
        ranks.append([b[0] for b in other.train_dataloader()][:2])  # step 3 is 2 micro-batches per rank
    got = torch.cat([ranks[d][a] for a in range(2) for d in range(2)])
    expected = torch.stack([dm.train_set[i][0] for i in dm.train_sampler.global_batch(3)])
    assert torch.equal(got, expected)


def test_set_layout_resyncs_to_optimizer_steps(make_dm):
    dm = make_dm()
    trainer = fake_trainer()
    dm.trainer = trainer
    dm.setup("fit")
    loader = dm.train_dataloader()
    it = iter(loader)
    for _ in range(4 + 1):  # step 0 (4 micro-batches) plus one fetched ahead
        next(it)
    trainer.global_step = 1
    assert dm.set_layout(2, 0) == 2
    first = next(iter(loader))[0]
    expected = torch.stack([dm.train_set[i][0] for i in dm.train_sampler.rank_indices(1, 2, 0)[:2]])
    assert torch.equal(first, expected)


def test_validation_is_sharded_and_identical_across_layouts(make_dm):
    seen = {}
    for dp in (1, 2, 4):
        rows = []
        for r in range(dp):
            dm = make_dm()
            dm.trainer = fake_trainer(world_size=dp, global_rank=r)
            dm.setup("validate")
            batches = [b[0] for b in dm.val_dataloader()]
            rows.append(torch.cat(batches))
        assert len({len(x) for x in rows}) == 1
        seen[dp] = sorted(tuple(w.tolist()) for w in torch.cat(rows))
    assert seen[1] == seen[2] == seen[4] and len(seen[1]) % 8 == 0 and seen[1]


def test_bin_data_and_vocab_checks(tmp_path, make_dm):
    tokens = (np.arange(5000) % 1000).astype(np.uint16)
    tokens.tofile(tmp_path / "toks.uint16.bin")
    dm = make_dm(data=str(tmp_path / "toks.uint16.bin"))
    assert dm.tokenizer is None and dm.vocab_size == 1000
    dm.check_model_vocab(1000)
    with pytest.raises(ValueError, match="vocab_size is 512 but the data needs 1000"):
        dm.check_model_vocab(512)
    dm.setup("fit")
    x, y = dm.train_set[0]
    assert x.tolist() == list(range(16)) and y.tolist() == list(range(1, 17))
    with pytest.raises(ValueError, match="token id 999 .* 259 ids"):
        make_dm(data=str(tmp_path / "toks.uint16.bin"), tokenizer="byte").setup("fit")
    text = make_dm()
    text.check_model_vocab(512)
    with pytest.raises(ValueError, match="needs 259"):
        text.check_model_vocab(256)


def test_text_folder(tmp_path, make_dm):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text("hello world " * 400)
    dm = make_dm(data=str(folder))
    dm.setup("fit")
    x, _ = dm.train_set[0]
    assert bytes(x.tolist()).decode() == "hello world hell"


class Recorder(pl.LightningModule):
    """Records the input windows of every micro-batch, keyed by the optimizer step they belong to."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(259, 4)
        self.head = nn.Linear(4, 259)
        self.seen: dict[int, list[torch.Tensor]] = {}

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.setdefault(self.global_step, []).append(x.clone())
        return F.cross_entropy(self.head(self.emb(x)).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(dm, max_steps, root, ckpt_path=None, callbacks=()):
    model = Recorder()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False,
                         enable_checkpointing=bool(callbacks), callbacks=list(callbacks), enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0,
                         accumulate_grad_batches=dm.accumulation_for(1), default_root_dir=str(root))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    assert not [w for w in caught if "not resumable" in str(w.message)]
    return trainer, model


def assert_global_batches(dm, model, steps):
    assert sorted(model.seen) == list(steps)
    for step, xs in model.seen.items():
        expected = torch.stack([dm.train_set[i][0] for i in dm.train_sampler.global_batch(step)])
        assert torch.equal(torch.cat(xs), expected), f"step {step} saw other samples"


def test_lightning_fit_and_resume_after_max_steps(make_dm, tmp_path):
    dm = make_dm()
    trainer, model = fit(dm, 3, tmp_path)
    assert_global_batches(dm, model, range(3))
    assert dm.state_dict()["consumed_samples"] == 3 * 8
    trainer.save_checkpoint(tmp_path / "end.ckpt")

    resumed = make_dm()
    _, model = fit(resumed, 6, tmp_path, ckpt_path=str(tmp_path / "end.ckpt"))
    assert isinstance(resumed.trainer.train_dataloader, ResumableDataLoader)
    assert_global_batches(dm, model, range(3, 6))


# Worker processes fetch micro-batches ahead of training: the saved position must not count them.
@pytest.mark.parametrize("micro_batch_size,num_workers", [(2, 0), (8, 2)])
def test_lightning_resume_from_a_checkpoint_saved_mid_epoch(make_dm, tmp_path, micro_batch_size, num_workers):
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=3, save_top_k=-1)
    dm = make_dm(micro_batch_size=micro_batch_size, num_workers=num_workers)
    _, model = fit(dm, 5, tmp_path, callbacks=[saver])
    assert_global_batches(dm, model, range(5))
    (ckpt,) = (tmp_path / "ckpts").glob("*step=3.ckpt")

    resumed = make_dm(micro_batch_size=micro_batch_size, num_workers=num_workers)
    _, model = fit(resumed, 5, tmp_path, ckpt_path=str(ckpt))
    assert_global_batches(dm, model, range(3, 5))


def test_lightning_keeps_the_sampler():
    # Lightning swaps in its own DistributedSampler unless the sampler already is one.
    assert issubclass(GlobalBatchSampler, torch.utils.data.DistributedSampler)
