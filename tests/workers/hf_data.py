"""One rank of a LightningModule around a stock Hugging Face `LlamaForCausalLM` (tiny config, random weights),
parallelised in its own configure_model() (fully_shard per decoder layer, Colwise/Rowwise tensor parallelism) and
fed by its own `train_dataloader()`: nothing in it is written for dynatrain. Lightning injects its sampler.
With --model other than "configure", a module without configure_model() (`AutoLM`), which the strategy
parallelises by default: a Hugging Face Llama (optionally with tied embeddings), Qwen2 or GPT-2, or the test suite's
own TinyLM (tests/workers/user_model.py).

With --trace an ElasticCallback drives its switches.

Records per optimizer step the global mean loss and the global sample indices the step trained on (each
data-parallel rank's once; the ranks of a tp group must agree). With --elastic it is a member or a joiner of an
elastic job.
"""

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

import dynatrain
from dynatrain.data.iterable import IterableTokenWindows
from dynatrain.callbacks.rescale import ElasticCallback
from dynatrain.elastic.manager import JOIN_CHECKPOINT
from dynatrain.settings import JOIN_ENV
from dynatrain.launch.local import finish_rank
from dynatrain.models.auto_parallel import tied_groups

sys.path.insert(0, str(Path(__file__).parent))
from user_switch import _snapshot  # noqa: E402

warnings.filterwarnings("ignore")
SEQ = 16
TOKENS = torch.randint(0, 256, (256, SEQ + 1), generator=torch.Generator().manual_seed(5))


class Windows(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        row = TOKENS[i]
        return row[:-1], row[1:], i


class EveryThird(Sampler):
    """A user's own sampler: every third sample first, then the rest."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter([i for i in range(self.n) if i % 3 == 0] + [i for i in range(self.n) if i % 3])

    def __len__(self) -> int:
        return self.n


class PlainStream(IterableDataset):
    """An iterable dataset that knows nothing of data parallelism."""

    def __iter__(self):
        for i in range(10**6):
            row = TOKENS[i % len(TOKENS)]
            yield row[:-1], row[1:], i


class ByGlobalRank(Sampler):
    """A broken split: every process reads its own share by global rank, whatever its tp group."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(dist.get_rank(), self.n, dist.get_world_size()))

    def __len__(self) -> int:
        return self.n // dist.get_world_size()


def build_model(name: str, heads: int = 4) -> torch.nn.Module:
    """The model of --model, random weights from a fixed seed, vocabulary 256 (the tokens of TOKENS)."""
    torch.manual_seed(0)
    if name in ("configure", "llama", "llama-tied"):
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(
            vocab_size=256, hidden_size=16 * heads, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=heads, num_key_value_heads=2 if heads % 2 == 0 else heads, max_position_embeddings=64,
            tie_word_embeddings=name == "llama-tied"))
    if name == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        return Qwen2ForCausalLM(Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=64, tie_word_embeddings=False))
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                          bos_token_id=0, eos_token_id=0))
    if name == "tiny":
        from user_model import TinyLM

        return TinyLM(heads=heads)
    raise ValueError(name)


class LMBase(pl.LightningModule):
    def __init__(self, data: str, samples: int, batch_size: int, shuffle: bool, workers: int,
                 model: str = "configure", heads: int = 4) -> None:
        super().__init__()
        self.model = build_model(model, heads)
        self.data, self.samples, self.batch_size, self.shuffle, self.workers = data, samples, batch_size, shuffle, workers
        self.step_losses: list[float] = []
        self.step_samples: list[list[int]] = []
        self._micro: list[torch.Tensor] = []
        self._indices: list[int] = []
        self.val_samples = 0
        self.val_losses: list[float] = []
        self.val_samples_seen: list[list[int]] = []
        self._val, self._val_indices = torch.zeros(2), []

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        out = self.model(tokens)  # a Hugging Face causal LM takes input_ids first and returns an output object
        return getattr(out, "logits", out)

    def train_dataloader(self):
        kw = dict(batch_size=self.batch_size, num_workers=self.workers)
        if self.data == "map":
            return DataLoader(Windows(self.samples), shuffle=self.shuffle, **kw)
        if self.data == "sampler":
            return DataLoader(Windows(self.samples), sampler=EveryThird(self.samples), **kw)
        if self.data == "broken":
            return DataLoader(Windows(self.samples), sampler=ByGlobalRank(self.samples), **kw)
        if self.data == "stream":
            return DataLoader(PlainStream(), **kw)
        if self.data == "protocol":
            tokens = TOKENS.reshape(-1)[: self.samples * SEQ + 1].numpy().astype(np.int64)
            return DataLoader(IterableTokenWindows(tokens, SEQ, shuffle=self.shuffle, seed=3,
                                                  batch_size=self.batch_size), **kw)
        raise ValueError(self.data)

    def val_dataloader(self):
        return DataLoader(Windows(self.val_samples), batch_size=self.batch_size, shuffle=False)

    def validation_step(self, batch, batch_idx):
        logits = self.logits(batch[0])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[1].flatten(), reduction="sum")
        self._val += torch.stack([loss.detach(), torch.tensor(float(batch[1].numel()))])
        self._val_indices.extend(int(i) for i in batch[2])

    def on_validation_epoch_end(self) -> None:
        dist.all_reduce(self._val)
        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, (self.trainer.strategy.dp_rank, self._val_indices))
        per_dp = dict(rows)
        self.val_losses.append((self._val[0] / self._val[1]).item())
        self.val_samples_seen.append(sorted(i for indices in per_dp.values() for i in indices))
        self._val, self._val_indices = torch.zeros(2), []

    def training_step(self, batch, batch_idx):
        tokens, labels = batch[0], batch[1]
        if len(batch) > 2:
            self._indices.extend(int(i) for i in batch[2])
        logits = self.logits(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        self._micro.append(loss.detach())
        return loss

    def on_before_optimizer_step(self, optimizer) -> None:
        loss = torch.stack(self._micro).mean()
        dist.all_reduce(loss)
        self.step_losses.append(loss.item() / dist.get_world_size())
        strategy = self.trainer.strategy
        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, (strategy.dp_rank, self._indices))
        per_dp: dict[int, list[int]] = {}
        for dp_rank, indices in rows:
            assert per_dp.setdefault(dp_rank, indices) == indices, "ranks of one data-parallel rank read different data"
        self.step_samples.append(sorted(i for indices in per_dp.values() for i in indices))
        self._micro.clear()
        self._indices = []

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1)


class HFLM(LMBase):
    """The Llama parallelised by its own configure_model()."""

    def configure_model(self) -> None:
        if any(hasattr(m, "reshard") for m in self.model.modules()):
            return  # already parallelised
        tp, dp = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        for layer in self.model.model.layers:
            if tp.size() > 1:
                parallelize_module(layer, tp, {
                    "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                    "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                    "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                    "mlp.down_proj": RowwiseParallel(),
                })
            fully_shard(layer, mesh=dp)
        fully_shard(self.model, mesh=dp)


class AutoLM(LMBase):
    """A model built in __init__ and no configure_model(): the strategy parallelises it by default."""


class Script(pl.Callback):
    """Requests its entries in order at the first micro-batch of their steps; a refused one is recorded. Each request
    holds training until it can run; with ``ahead`` it is planned ahead too (a world change then forms its world
    while steps go on, or, for a scale-out, from the boundary that admits its joiners)."""

    def __init__(self, entries: list[tuple[int, str]], ahead: bool = False) -> None:
        self.entries, self.next, self.errors, self.untouched = entries, 0, [], []
        self.ahead = ahead

    def state_dict(self) -> dict:
        return {"next": self.next}

    def load_state_dict(self, state: dict) -> None:
        self.next = state["next"]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        strategy = trainer.strategy
        if self.next < len(self.entries) and not strategy.switch_pending and strategy.at_step_boundary():
            step, layout = self.entries[self.next]
            if trainer.global_step >= step:
                self.next += 1
                before = _snapshot(trainer)
                try:
                    trainer.strategy.request_switch(layout, wait=True, plan_ahead=self.ahead)
                except ValueError as e:
                    self.errors.append(str(e))
                    self.untouched.append(before == _snapshot(trainer))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layout", default="dp_shard=4")
    ap.add_argument("--switches", default="", help="STEP:LAYOUT;...")
    ap.add_argument("--ahead", action="store_true", help="request the switches with plan_ahead=True")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--data", default="map", choices=["map", "sampler", "broken", "stream", "protocol"])
    ap.add_argument("--samples", type=int, default=96)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--accumulate", type=int, default=3)
    ap.add_argument("--shuffle", action="store_true")
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--elastic", action="store_true")
    ap.add_argument("--check-batches", action="store_true")
    ap.add_argument("--val", type=int, default=0, help="validate on this many samples at every epoch's end")
    ap.add_argument("--limit", type=int, default=None, help="limit_train_batches (micro-batches an epoch)")
    ap.add_argument("--save", default=None, metavar="STEP:DIR", help="ModelCheckpoint into DIR every STEP steps")
    ap.add_argument("--resume", default=None, help="resume from this checkpoint")
    ap.add_argument("--model", default="configure", choices=["configure", "llama", "llama-tied", "qwen2", "gpt2",
                                                              "tiny"],
                    help="configure: the Llama of HFLM's configure_model(); else AutoLM around that model")
    ap.add_argument("--heads", type=int, default=4, help="attention heads of the Llama or TinyLM")
    ap.add_argument("--trace", default=None, help="JSON [[step, devices or layout], ...] for an ElasticCallback")
    args = ap.parse_args()
    entries = [(int(s.split(":", 1)[0]), s.split(":", 1)[1]) for s in args.switches.split(";") if s]
    joining = os.environ.get(JOIN_ENV) == "1"
    world = 1 if joining else int(os.environ.get("WORLD_SIZE", "1"))
    pl.seed_everything(1234, verbose=False)
    strategy = dynatrain.DynaTrainStrategy(parallel=args.layout,
                                           switching={"verify_switches": True, "switch_budget_mb": 0.5},
                                           data={"check_batches": args.check_batches},
                                           elastic={"timeout": 60.0, "join_timeout": 120.0} if args.elastic else None)
    script = Script(entries, ahead=args.ahead)
    callbacks = [script]
    elastic = None
    if args.trace:
        elastic = ElasticCallback(trace=json.loads(args.trace), log_dir=os.path.dirname(os.path.abspath(args.out)))
        callbacks.append(elastic)
    if args.save:
        every, where = args.save.split(":", 1)
        callbacks.append(ModelCheckpoint(dirpath=where, every_n_train_steps=int(every), save_top_k=-1))
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=world, max_steps=args.steps, logger=False,
        default_root_dir=os.path.dirname(os.path.abspath(args.out)), accumulate_grad_batches=args.accumulate,
        limit_train_batches=args.limit,
        enable_checkpointing=bool(args.save), enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=1.0 if args.val else 0, callbacks=callbacks,
        use_distributed_sampler=args.data != "broken",
    )
    if args.model == "configure":
        module = HFLM(args.data, args.samples, args.batch_size, args.shuffle, args.workers)
    else:
        module = AutoLM(args.data, args.samples, args.batch_size, args.shuffle, args.workers, args.model, args.heads)
    module.val_samples = args.val
    error = None
    try:
        trainer.fit(module, ckpt_path=JOIN_CHECKPOINT if joining else args.resume)
    except Exception as e:  # noqa: BLE001 - the guard's error is what some runs check
        if not args.check_batches:
            raise
        error = f"{type(e).__name__}: {e}"
    finish_rank(args.out, {
        "losses": module.step_losses,
        "samples": module.step_samples,
        "layout": strategy.parallel_config.short(),
        "left": strategy.detached,
        "global_step": trainer.global_step,
        "reports": [r.as_dict() for r in strategy.switch_reports],
        "errors": script.errors,
        "tied": tied_groups(module),
        "untouched": script.untouched,
        "error": error,
        "accumulation": trainer.accumulate_grad_batches,
        "val_losses": module.val_losses,
        "val_samples": module.val_samples_seen,
        "decisions": [] if elastic is None else [d.as_dict() for d in elastic.decisions],
    })


if __name__ == "__main__":
    main()
