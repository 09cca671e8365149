"""`dynatrain selfcheck --chaos SEED`: a random sequence of layouts, drawn from a seed, for the selfcheck to run.

Each draw keeps the world (re-lays the same processes out) or changes it to another size up to ``max_devices``
(processes leave, or join), and picks uniformly among the layouts of that world the model accepts over the terms
asked for (``dp_replicate``, ``dp_shard``, ``tp``, ``pp``, ``ep``), never the layout it comes from; for a module of
the user's, whose config is unknown here, tp takes powers of two. A sequence is
drawn again, from the same generator, until at least three terms take a value above 1 somewhere in it. With a death,
one transition is a process killed in the middle of a step of a layout that keeps every shard twice; the survivors
rebuild the state in memory and go on with the strategy's fallback layout, from which the sequence continues. Pure:
no torch, so the same seed names the same sequence everywhere; the selfcheck prints both.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

from dynatrain.vps.parallel_config import ParallelConfig

TERMS = ("dp_replicate", "dp_shard", "tp", "pp", "ep")
CHANGE_WORLD = 0.4  # the chance that a draw changes the number of processes


def candidates(world: int, model, terms: tuple[str, ...]) -> list[ParallelConfig]:
    """Every layout of ``world`` processes over ``terms`` that the model accepts."""
    unknown = set(terms) - set(TERMS)
    if unknown:
        raise ValueError(f"unknown layout term(s) {sorted(unknown)}; choose from {', '.join(TERMS)}")
    sizes = [d for d in range(1, world + 1) if world % d == 0]
    layers = getattr(model, "n_layers", None)
    out = []
    for r, s, t, p in itertools.product(sizes, sizes, sizes, sizes):
        if r * s * t * p != world:
            continue
        if (r > 1 and "dp_replicate" not in terms) or (t > 1 and "tp" not in terms) or \
                (p > 1 and ("pp" not in terms or layers is None or p > layers)):
            continue
        if model is None and t & (t - 1):
            continue  # a module of the user's says which tp it serves only when asked: powers of two, as heads are
        eps = [e for e in range(1, s + 1) if s % e == 0] if "ep" in terms else [1]
        for e in eps:
            try:
                out.append(ParallelConfig(dp_replicate=r, dp_shard=s, tp=t, pp=p, ep=e).validate(model, world))
            except ValueError:
                continue
    return out


def terms_used(layouts: list[ParallelConfig]) -> set[str]:
    return {name for p in layouts for name in TERMS if getattr(p, name) > 1}


def survivors_of(layout: ParallelConfig, model) -> ParallelConfig:
    """The layout the processes left after one of ``layout``'s dies go on with (no policy: the strategy's fallback)."""
    count = layout.world_size - 1
    for candidate in layout.survivor_layouts(count):
        try:
            return candidate.validate(model, count)
        except ValueError:
            continue
    raise ValueError(f"no layout fits the {count} processes left of {layout.short()}")


def _recoverable(layout: ParallelConfig) -> bool:
    """A lost process is rebuilt from replicas in memory: every shard on two processes, no pipeline stages."""
    return layout.dp_replicate >= 2 and layout.pp == 1 and layout.ep == 1


@dataclass(frozen=True)
class Chaos:
    layouts: list[ParallelConfig]  # the first the run starts on; one more per switch
    death: int | None = None  # transition ``death`` (layouts[death] -> layouts[death + 1]) is a process dying

    @property
    def switches(self) -> str:
        return " > ".join(p.short() for p in self.layouts)


def draw(seed: int, switches: int, model, max_devices: int = 4, terms: tuple[str, ...] = TERMS[:4],
         deaths: int = 0, min_terms: int = 3) -> Chaos:
    """``switches`` transitions, reproducible from ``seed``; with ``deaths=1`` one of them is a process that dies
    while its layout keeps a replica of every shard, and the next layout is what the survivors fall back to."""
    if switches < 1 + deaths:
        raise ValueError(f"a chaos run needs at least {1 + deaths} switch(es), got {switches}")
    if deaths not in (0, 1):
        raise ValueError(f"a chaos run injects at most one death, got {deaths}")
    rng = random.Random(seed)
    by_world = {w: candidates(w, model, terms) for w in range(1, max_devices + 1)}
    worlds = [w for w, c in by_world.items() if c]
    if not worlds:
        raise ValueError(f"no layout over {', '.join(terms)} fits the model on 1 to {max_devices} processes")
    hsdp = {w: [c for c in cs if _recoverable(c)] for w, cs in by_world.items()}
    if deaths and not any(hsdp.values()):
        raise ValueError("a death needs a layout with dp_replicate >= 2 (every shard on two processes): allow the "
                         "dp_replicate term and at least 2 devices")
    for _ in range(1000):
        death = rng.randrange(1, switches) if deaths else None
        current = rng.choice(by_world[max(worlds)])
        layouts = [current]
        for i in range(switches):
            if i == death:
                current = survivors_of(current, model)
            elif death is not None and i + 1 == death:
                current = rng.choice([c for w in worlds for c in hsdp[w] if c != current] or [current])
            else:
                world = current.world_size
                if rng.random() < CHANGE_WORLD or len(by_world[world]) < 2:
                    world = rng.choice([w for w in worlds if w != world and by_world[w]] or [world])
                current = rng.choice([c for c in by_world[world] if c != current])
            layouts.append(current)
        valid = death is None or (_recoverable(layouts[death]) and layouts[death] != layouts[death - 1])
        if valid and len(terms_used(layouts)) >= min(min_terms, len(terms)):
            return Chaos(layouts, death)
    raise ValueError(f"no sequence over {', '.join(terms)} uses {min_terms} terms: allow more terms or devices")
