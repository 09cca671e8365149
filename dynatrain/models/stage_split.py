"""Which layers each pipeline stage holds: contiguous runs that balance the per-stage compute.

Pure Python, shared by the live split of a model (`models.pipeline_split`) and the analytic specs that plan 16,384-rank
switches, so both place every layer on the same stage.

A layout with ``pp`` ranks along the pipeline and ``v`` stages per rank has ``pp * v`` stages; stage ``j`` runs on
pp coordinate ``j % pp`` (torch's looped placement, which its interleaved schedules expect). Layer costs are in
units of one transformer block; the first stage also pays for what runs before the blocks (the embedding), the last
for what runs after them (final norm, output projection and loss). Layers need not divide evenly: the split
minimises the most expensive stage, ties going to the split whose earlier stages are lighter, since they hold
the most in-flight activations under 1F1B.
"""

from __future__ import annotations

from collections.abc import Sequence


def balanced_split(n_layers: int, n_stages: int, first_cost: float = 0.0, last_cost: float = 0.0,
                   layer_cost: float = 1.0) -> tuple[tuple[int, int], ...]:
    """``[lo, hi)`` layer ranges, one per stage, each at least one layer, minimising the largest stage cost."""
    if n_stages < 1:
        raise ValueError(f"a pipeline needs at least one stage, got {n_stages}")
    if n_layers < n_stages:
        raise ValueError(f"{n_stages} pipeline stages need at least one layer each, and the model has {n_layers}: "
                         f"use at most {n_layers} stages (pp x stages per rank)")
    if min(first_cost, last_cost) < 0 or layer_cost <= 0:
        raise ValueError("stage costs must be non-negative and a layer's positive")

    def cost(stage: int, lo: int, hi: int) -> float:
        extra = (first_cost if stage == 0 else 0.0) + (last_cost if stage == n_stages - 1 else 0.0)
        return (hi - lo) * layer_cost + extra

    def solve(allowed, score, total, pace=False):
        """Suffix DP over (stage k, first layer i): the best ``total`` (max or sum) of ``score(k, cost)`` over
        stages k.., each stage's cost ``allowed(k, cost)``; returns the best of the whole split and the cuts.

        ``pace``: the score is the cost and the total the max, with nothing disallowed. The rest's best then
        never rises as its first layer moves later (every stage of a shorter suffix can be made no longer), so
        once stage k costs at least the rest, a longer stage k only does worse and the search over j stops."""
        inf = float("inf")
        best = [[inf] * (n_layers + 1) for _ in range(n_stages + 1)]
        cut = [[0] * (n_layers + 1) for _ in range(n_stages + 1)]
        best[n_stages][n_layers] = 0.0
        for k in range(n_stages - 1, -1, -1):
            left = n_stages - k - 1  # stages after k, each needing a layer
            for i in range(k, n_layers - left):
                for j in range(i + 1, n_layers - left + 1):
                    c, rest = cost(k, i, j), best[k + 1][j]
                    if not allowed(k, c):
                        break  # a longer stage k costs more
                    if rest == inf:
                        continue
                    value = total(score(k, c), rest)
                    # Strictly better only: the first (shortest) run wins ties, keeping early stages light.
                    if value < best[k][i] - 1e-9:
                        best[k][i], cut[k][i] = value, j
                    if pace and c >= rest:
                        break
        return best[0][0], cut

    def within(*caps):
        limits = [tuple((w(k), cap + 1e-9) for w, cap in caps) for k in range(n_stages)]

        def allowed(k: int, c: float) -> bool:
            for weight, limit in limits[k]:
                if c * weight > limit:
                    return False
            return True
        return allowed

    one = lambda k: 1.0  # noqa: E731
    in_flight = lambda k: float(n_stages - k)  # noqa: E731  (1F1B: stage k holds n - k micro-batches)
    # 1. the busiest stage as light as possible (the step's pace);
    slowest, _ = solve(lambda k, c: True, lambda k, c: c, max, pace=True)
    # 2. then the least peak of in-flight activations (stage k runs n - k forwards before its first backward);
    memory, _ = solve(within((one, slowest)), lambda k, c: in_flight(k) * c, max)
    # 3. then the most even split (least sum of squared costs) among those.
    _, cut = solve(within((one, slowest), (in_flight, memory)), lambda k, c: c * c, lambda a, b: a + b)
    out, i = [], 0
    for k in range(n_stages):
        j = cut[k][i]
        out.append((i, j))
        i = j
    return tuple(out)


def model_stage_costs(model, block: float | None = None) -> tuple[float, float]:
    """(first, last) extra cost of a Llama-family config in units of one block's matmul FLOPs: the embedding is a
    lookup (nothing), the output projection is ``dim * vocab`` beside a block's parameters. ``block``: the
    multiply-adds of one block per token where they are not a dense block's (a mixture of experts counts the
    experts a token visits)."""
    dim, vocab = model.dim, model.vocab_size
    if block is None:
        block = 4 * dim * dim + 3 * dim * getattr(model, "ffn_dim", 4 * dim)
    return 0.0, dim * vocab / block


def stage_split(model, n_stages: int, block: float | None = None) -> tuple[tuple[int, int], ...]:
    """The layer ranges of ``n_stages`` stages for a zoo config (or any object with ``n_layers``, ``dim`` and
    ``vocab_size``); ``block`` as in `model_stage_costs`."""
    first, last = model_stage_costs(model, block)
    return balanced_split(model.n_layers, n_stages, first, last)


def stage_of_layer(split: Sequence[tuple[int, int]], layer: int) -> int:
    for stage, (lo, hi) in enumerate(split):
        if lo <= layer < hi:
            return stage
    raise ValueError(f"layer {layer} is in no stage of split {list(split)}")


def rank_stages(pp: int, stages_per_rank: int, coordinate: int) -> tuple[int, ...]:
    """The stages pp coordinate ``coordinate`` runs: ``coordinate, coordinate + pp, ...`` (looped placement)."""
    if not 0 <= coordinate < pp:
        raise ValueError(f"pp coordinate {coordinate} is outside pp={pp}")
    return tuple(coordinate + k * pp for k in range(stages_per_rank))
