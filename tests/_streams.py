"""Data for the streaming-pipeline tests, written locally: a LitData folder of token blocks and JSON Lines shards
for a Hugging Face streaming dataset. Sample i's tokens start with i (tests/workers/stream_data.py's `tokens_of`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from stream_data import SEQ, tokens_of  # noqa: E402


def write_litdata(folder: Path, samples: int, per_chunk: int = 10) -> Path:
    """``samples`` blocks of SEQ + 1 tokens, optimised for `TokensLoader(block_size=SEQ + 1)`, ``per_chunk`` a chunk."""
    import torch
    from litdata.streaming.item_loader import TokensLoader
    from litdata.streaming.writer import BinaryWriter

    writer = BinaryWriter(str(folder), chunk_size=(SEQ + 1) * per_chunk, item_loader=TokensLoader())
    for i in range(samples):
        writer.add_item(i, torch.tensor(tokens_of(i), dtype=torch.int32))
    writer.done()
    writer.merge()
    return folder


def write_jsonl(folder: Path, samples: int, shards: int) -> Path:
    """``samples`` examples {"id", "tokens"} in ``shards`` files, example i in file i % shards."""
    folder.mkdir(parents=True, exist_ok=True)
    for f in range(shards):
        with open(folder / f"part-{f:02d}.jsonl", "w") as out:
            for i in range(f, samples, shards):
                out.write(json.dumps({"id": i, "tokens": tokens_of(i)}) + "\n")
    return folder
