"""One rank of a LightningModule (the suite's TinyLM, parallelised in its own configure_model()) trained on the streaming pipelines
a user brings, each read as its library's documentation teaches, nothing in them written for dynatrain:

- ``litdata``: LitData `StreamingDataset` with `TokensLoader`, shuffled, read by `StreamingDataLoader` with workers;
- ``hf``: a Hugging Face `datasets.IterableDataset` streamed from local JSON Lines files, shuffled with a buffer,
  split by node, read by a plain `DataLoader`;
- ``hf-stateful``: the same read by torchdata's `StatefulDataLoader`;
- ``map-stateful``: torchdata's `StatefulDataLoader` over a map-style dataset (Lightning injects its sampler).

Several pipelines train together through one `CombinedLoader(mode="min_size")`: the step's loss is the sum of theirs.
Records per optimizer step and pipeline the global mean loss and the sample ids every data-parallel rank read (the
ranks of a tp group must agree). The test writes the data (tests/test_data_streams_mp.py).
"""

import argparse
import os
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import CombinedLoader
from torch.utils.data import DataLoader

import dynatrain
from dynatrain.elastic.manager import JOIN_CHECKPOINT
from dynatrain.settings import JOIN_ENV
from dynatrain.launch.local import finish_rank

sys.path.insert(0, str(Path(__file__).parent))
from hf_data import Script, Windows  # noqa: E402
from user_model import TinyLM, parallelize  # noqa: E402

warnings.filterwarnings("ignore")
SEQ = 16


def tokens_of(sample_id: int) -> list[int]:
    """The SEQ + 1 tokens of sample ``sample_id``: the id first (so a batch names its samples), then noise."""
    g = torch.Generator().manual_seed(1000 + sample_id)
    return [sample_id, *torch.randint(0, 256, (SEQ,), generator=g).tolist()]


class Samples(Windows):
    """hf_data's map-style dataset of ``n`` samples, each as the streams give theirs."""

    def __getitem__(self, i: int):
        return {"id": i, "tokens": torch.tensor(tokens_of(i))}


class StreamLM(pl.LightningModule):
    def __init__(self, args) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = TinyLM()
        self.args = args
        self.names = args.pipelines.split(",")
        self.losses: list[dict[str, float]] = []
        self.samples: list[dict[str, list[int]]] = []
        self._micro: dict[str, list[torch.Tensor]] = {n: [] for n in self.names}
        self._ids: dict[str, list[int]] = {n: [] for n in self.names}

    def configure_model(self) -> None:
        if not any(hasattr(m, "reshard") for m in self.model.modules()):
            parallelize(self.model, self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"])

    def _loader(self, name: str):
        a, m = self.args, self.args.batch_size
        rank, size = self.trainer.strategy.dp_rank, self.trainer.strategy.dp_size
        if name == "litdata":
            from litdata import StreamingDataLoader, StreamingDataset, TokensLoader

            data = StreamingDataset(a.litdata, item_loader=TokensLoader(block_size=SEQ + 1), shuffle=True, seed=3)
            return StreamingDataLoader(data, batch_size=m, num_workers=a.workers)
        if name in ("hf", "hf-stateful"):
            from datasets import load_dataset
            from datasets.distributed import split_dataset_by_node

            files = sorted(str(p) for p in Path(a.hf).glob("*.jsonl"))
            data = load_dataset("json", data_files=files, streaming=True, split="train")
            data = split_dataset_by_node(data.shuffle(seed=7, buffer_size=8).with_format("torch"), rank, size)
            if name == "hf":
                return DataLoader(data, batch_size=m)
            from torchdata.stateful_dataloader import StatefulDataLoader

            return StatefulDataLoader(data, batch_size=m)
        if name == "map-stateful":
            from torchdata.stateful_dataloader import StatefulDataLoader

            return StatefulDataLoader(Samples(a.samples), batch_size=m, shuffle=True)
        raise ValueError(name)

    def train_dataloader(self):
        loaders = {name: self._loader(name) for name in self.names}
        return CombinedLoader(loaders, mode="min_size") if len(loaders) > 1 else loaders[self.names[0]]

    def training_step(self, batch, batch_idx):
        batches = batch if len(self.names) > 1 else {self.names[0]: batch}
        total = 0.0
        for name, b in batches.items():
            tokens = b if isinstance(b, torch.Tensor) else b["tokens"]
            ids = tokens[:, 0] if isinstance(b, torch.Tensor) else b["id"]
            self._ids[name].extend(int(i) for i in ids)
            logits = self.model(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten().long())
            self._micro[name].append(loss.detach())
            total = total + loss
        return total

    def on_before_optimizer_step(self, optimizer) -> None:
        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, (self.trainer.strategy.dp_rank, self._ids))
        per_dp: dict[int, dict] = {}
        for dp_rank, ids in rows:
            assert per_dp.setdefault(dp_rank, ids) == ids, "ranks of one data-parallel rank read different data"
        losses = torch.stack([torch.stack(self._micro[n]).mean() for n in self.names])
        dist.all_reduce(losses)
        self.losses.append({n: v / dist.get_world_size() for n, v in zip(self.names, losses.tolist())})
        self.samples.append({n: sorted(i for ids in per_dp.values() for i in ids[n]) for n in self.names})
        self._micro = {n: [] for n in self.names}
        self._ids = {n: [] for n in self.names}

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--pipelines", default="litdata,hf,hf-stateful,map-stateful")
    ap.add_argument("--litdata", default=None, help="LitData's optimised folder")
    ap.add_argument("--hf", default=None, help="folder of JSON Lines files")
    ap.add_argument("--samples", type=int, default=96, help="samples of the map-style dataset")
    ap.add_argument("--layout", default="dp_shard=4")
    ap.add_argument("--switches", default="", help="STEP:LAYOUT;...")
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--accumulate", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2, help="LitData's DataLoader workers")
    ap.add_argument("--elastic", action="store_true")
    ap.add_argument("--save", default=None, metavar="STEP:DIR", help="ModelCheckpoint into DIR every STEP steps")
    ap.add_argument("--resume", default=None)
    args = ap.parse_args()
    entries = [(int(s.split(":", 1)[0]), s.split(":", 1)[1]) for s in args.switches.split(";") if s]
    joining = os.environ.get(JOIN_ENV) == "1"
    pl.seed_everything(1234, verbose=False)
    strategy = dynatrain.DynaTrainStrategy(parallel=args.layout, switching={"verify_switches": False},
                                           elastic={"timeout": 60.0, "join_timeout": 120.0} if args.elastic else None)
    script = Script(entries)
    callbacks = [script]
    if args.save:
        every, where = args.save.split(":", 1)
        callbacks.append(ModelCheckpoint(dirpath=where, every_n_train_steps=int(every), save_top_k=-1))
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=1 if joining else int(os.environ.get("WORLD_SIZE", "1")),
        max_steps=args.steps, logger=False, default_root_dir=os.path.dirname(os.path.abspath(args.out)),
        accumulate_grad_batches=args.accumulate, enable_checkpointing=bool(args.save), enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=callbacks)
    module = StreamLM(args)
    trainer.fit(module, ckpt_path=JOIN_CHECKPOINT if joining else args.resume)
    finish_rank(args.out, {
        "losses": module.losses, "samples": module.samples, "layout": strategy.parallel_config.short(),
        "left": strategy.detached, "global_step": trainer.global_step, "errors": script.errors,
        "switches": len(strategy.switch_reports), "accumulation": trainer.accumulate_grad_batches,
    })


if __name__ == "__main__":
    main()
