"""Run a SwitchPlan on numpy arrays, the way the engine runs it on tensors, and check everything it promises.

Each state's global value is a distinct integer per element. Old local tensors are cut from it with the
old layout; the plan is executed round by round (allocate late, send/receive, local copies, free early);
the new local tensors must equal the new layout's cut of the same global value, every element written once.
"""

from __future__ import annotations

import numpy as np

from dynatrain.planner.schedule import SwitchPlan


def global_values(plan: SwitchPlan) -> dict[str, np.ndarray]:
    out, base = {}, 0
    for spec in plan.old.states:
        out[spec.name] = (np.arange(spec.numel, dtype=np.int64) + base).reshape(spec.shape)
        base += spec.numel
    return out


def _local(layout, spec, process, values):
    held = layout.shards(spec.name, process)
    if held is None:
        return None
    arr = np.full(held.local_shape, -1, dtype=np.int64)
    if values is not None:
        for box, off in zip(held.boxes, held.offsets):
            arr[box.shift(box.lo).offset(off).slices()] = values[box.slices()]
    return arr


def _view(layout, spec, process, arr, shard, box):
    off = layout.shards(spec.name, process).offsets[shard]
    return arr[box.offset(off).slices()]


def execute(plan: SwitchPlan) -> dict:
    """Execute the plan; assert every invariant; return statistics."""
    g = global_values(plan)
    old, new = plan.old, plan.new
    specs = {s.name: s for s in old.states}
    procs = plan.processes
    src = {(p, s.name): _local(old, s, p, g[s.name]) for p in procs for s in old.states}
    dst = {(p, s.name): _local(new, s, p, None) for p in procs for s in new.states}
    writes = {k: (None if v is None else np.zeros(v.shape, np.int64)) for k, v in dst.items()}
    plans = {p: plan.rank_plan(p) for p in procs}
    released: set = set()
    allocated: set = set()
    wire = 0

    def read(p, t):
        key = (p, t.state, t.src_shard)
        assert key not in released, f"rank {p} reads {key} after freeing it"
        assert p in old.processes, f"rank {p} sends but held nothing"
        held = old.shards(t.state, p)
        assert held.boxes[t.src_shard].shift(held.boxes[t.src_shard].lo).contains(t.src_box)
        return _view(old, specs[t.state], p, src[(p, t.state)], t.src_shard, t.src_box).copy()

    def write(p, t, data):
        key = (p, t.state, t.dst_shard)
        assert key in allocated, f"rank {p} writes {key} before allocating it"
        held = new.shards(t.state, p)
        assert held.boxes[t.dst_shard].shift(held.boxes[t.dst_shard].lo).contains(t.dst_box)
        _view(new, specs[t.state], p, dst[(p, t.state)], t.dst_shard, t.dst_box)[...] = data
        _view(new, specs[t.state], p, writes[(p, t.state)], t.dst_shard, t.dst_box)[...] += 1

    for p, rp in plans.items():
        for key, k in rp.release_round.items():
            if k == -1:
                released.add((p, *key))
    for k in range(plan.num_rounds):
        for p, rp in plans.items():
            for key, a in rp.alloc_round.items():
                if a == k:
                    allocated.add((p, *key))
        sent = {}
        for p, rp in plans.items():
            pairs = [(m.src, m.dst) for m in rp.sends[k]]
            assert len(pairs) == len(set(pairs)), f"two messages {p}->same peer in round {k}"
            staging = rp.staging_bytes(k)
            assert staging <= plan.budget_bytes, f"rank {p} stages {staging} > {plan.budget_bytes} in round {k}"
            for m in rp.sends[k]:
                assert m.src == p and m.dst != p and m.round == k
                assert m.nbytes == sum(t.nbytes for t in m.pieces) > 0
                sent[(m.src, m.dst)] = (m, [read(p, t) for t in m.pieces])
        received = set()
        for p, rp in plans.items():
            for m in rp.recvs[k]:
                assert m.dst == p and m.src != p
                sm, data = sent[(m.src, m.dst)]
                assert sm == m, f"sender and receiver disagree on message {m.src}->{m.dst} round {k}"
                for t, d in zip(m.pieces, data):
                    write(p, t, d)
                wire += m.nbytes
                received.add((m.src, m.dst))
        assert received == set(sent), f"round {k}: sends without receives {set(sent) - received}"
        assert sorted(received) == sorted((s, d) for s, d, _, _ in plan.rounds_traffic[k])
        for p, rp in plans.items():
            for t in rp.local_copies[k]:
                assert t.src == t.dst == p
                write(p, t, read(p, t))
        for p, rp in plans.items():
            for key, r in rp.release_round.items():
                if r == k:
                    released.add((p, *key))
    for (p, name), arr in dst.items():
        if arr is None:
            continue
        held = new.shards(name, p)
        expect = _local(new, specs[name], p, g[name])
        covered = np.zeros(arr.shape, bool)
        for box, off in zip(held.boxes, held.offsets):
            covered[box.shift(box.lo).offset(off).slices()] = True
        w = writes[(p, name)]
        assert (w[covered] == 1).all(), f"rank {p} {name}: element written {w[covered].max()} or 0 times"
        assert (w[~covered] == 0).all()
        assert np.array_equal(arr[covered], expect[covered]), f"rank {p} {name}: wrong values"
    assert wire == plan.bytes_moved == plan.table.bytes_moved
    assert plan.bytes_moved == plan.new.needed_bytes - plan.assignment.bytes_kept
    for p in plan.new.processes:
        assert p not in plan.assignment.idle
    return {"wire": wire, "rounds": plan.num_rounds}
