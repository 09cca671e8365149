"""A fault for the switch's check to catch: one byte of a weight a process received flipped after the transfer."""

import torch


def flip_received_byte(plan, rank: int, dst: dict) -> bool:
    """Flip one bit of the first element of the first received piece of an attention weight; whether one was."""
    pieces = [t for messages in plan.rank_plan(rank).recvs for m in messages for t in m.pieces
              if t.state.endswith("wq.weight")]
    if not pieces:
        return False
    t = pieces[0]
    origin = plan.new.shards(t.state, rank).offsets[t.dst_shard]
    first = tuple(o + lo for o, lo in zip(origin, t.dst_box.lo))
    with torch.no_grad():
        dst[t.state][first].view(-1).view(torch.uint8)[0] ^= 1
    return True
