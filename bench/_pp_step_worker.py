"""One rank of the pipeline step-time benchmark: the zoo's model with pp under strategy="dynatrain", or the same
split driven by hand with torch.distributed.pipelining (no Lightning, no dynatrain); writes optimizer-step times."""

import argparse
import copy
import os
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import Schedule1F1B

import dynatrain
from dynatrain.data import LlamaDataModule
from dynatrain.launch.local import finish_rank
from dynatrain.lm.causal_lm import CausalLM
from dynatrain.models.configs import MODEL_CONFIGS
from dynatrain.models.llama import Transformer
from dynatrain.models.stage_split import stage_split
from _step_worker import StepClock  # the same per-step clock as the dense benchmark (this folder)
from _trainer import bench_trainer  # this folder

warnings.filterwarnings("ignore")


def dynatrain_times(args, world: int) -> list[float]:
    strategy = dynatrain.DynaTrainStrategy(parallel=f"pp={world}", parallelism={"pipeline_schedule": "1F1B"})
    clock = StepClock()
    trainer = bench_trainer(strategy, world, args.steps, [clock])
    data = LlamaDataModule(seq_len=args.seq_len, global_batch_size=args.micro_batch * args.microbatches,
                           micro_batch_size=args.micro_batch, max_corpus_bytes=2_000_000)
    trainer.fit(CausalLM(model=args.model, warmup_steps=2), datamodule=data)
    return [b - a for a, b in zip(clock.times, clock.times[1:])]


def by_hand_times(args, world: int) -> list[float]:
    """What a user of torch alone writes: prune a copy of the model to this rank's stage (torchtitan's way),
    FSDP2 per block and on the stage, one 1F1B schedule, AdamW."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("pp", "dp"))
    cfg = MODEL_CONFIGS[args.model]
    lo, hi = stage_split(cfg, world)[rank]
    model = Transformer(cfg)
    model.init_weights()
    stage_model = copy.deepcopy(model)
    for k in list(stage_model.layers.keys()):
        if not lo <= int(k) < hi:
            del stage_model.layers[k]
    if rank != 0:
        stage_model.tok_embeddings = None
    if rank != world - 1:
        stage_model.norm = stage_model.output = None
    for block in stage_model.layers.values():
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=False)
    fully_shard(stage_model, mesh=mesh["dp"], reshard_after_forward=False)
    stage = PipelineStage(stage_model, rank, world, torch.device("cpu"), group=mesh.get_group("pp"))

    def loss_fn(logits, labels):
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    schedule = Schedule1F1B(stage, args.microbatches, loss_fn=loss_fn)
    optimizer = torch.optim.AdamW(stage_model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(0)
    times = [time.perf_counter()]
    for _ in range(args.steps):
        tokens = torch.randint(0, cfg.vocab_size, (args.micro_batch * args.microbatches, args.seq_len), generator=gen)
        optimizer.zero_grad()
        if rank == 0:
            schedule.step(tokens)
        elif rank == world - 1:
            schedule.step(target=tokens)
        else:
            schedule.step()
        optimizer.step()
        times.append(time.perf_counter())
    dist.destroy_process_group()
    return [b - a for a, b in zip(times, times[1:])]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--mode", choices=["dynatrain", "by-hand"], required=True)
    ap.add_argument("--model", default="debug")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=4)
    args = ap.parse_args()
    world = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    times = dynatrain_times(args, world) if args.mode == "dynatrain" else by_hand_times(args, world)
    finish_rank(args.out, {"step_times": times})


if __name__ == "__main__":
    main()
