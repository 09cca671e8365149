"""Rank assignment: which process takes each mesh position of the new layout.

Processes keep their identity across a switch, but DeviceMesh accepts any arrangement, so the positions
are free. Placing process ``c`` at position ``q`` saves the ``W[c, q]`` bytes of ``q``'s new shards that
``c`` already holds; the best assignment maximises the total saving (= minimises bytes on the wire).

* Without a node constraint this is a rectangular linear assignment problem, solved exactly on the nonzero
  entries of ``W`` only (``scipy.sparse.csgraph.min_weight_full_bipartite_matching``): a process holds what a
  few positions need, so at 16,384 processes ``W`` has some 300,000 entries, not 268 million. Positions that
  save nothing anywhere take the left-over processes in ascending order. It also decides who stays idle when
  more processes are available than positions.
* With ``gpus_per_node``, each new TP group (``tp`` consecutive positions) must sit inside one node, which
  is no longer a plain assignment problem. The heuristic solves it in two exact levels: (1) the value of
  placing TP group g on node n is the best matching of g's positions to n's processes; an assignment
  problem over (groups x node slots) puts groups on nodes; (2) per node, an exact assignment places its
  processes on the positions of the groups it received. Level 1 may over-count when two groups on the
  same node want the same process; the tests hold the result within 1% of an exact MILP.

Every step uses integer byte counts and deterministic solvers, so all ranks compute the same assignment.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linear_sum_assignment
from scipy.sparse import coo_matrix, csr_matrix, issparse
from scipy.sparse.csgraph import min_weight_full_bipartite_matching

from dynatrain.vps.layout import Layout
from dynatrain.vps.parallel_config import ParallelConfig

METHODS = ("identity", "optimal")
_MAX_PASSES = 50  # local-search passes; each pass only continues after a strict gain


@dataclass(frozen=True)
class Assignment:
    """The processes of the new layout. ``rank_map[q]`` takes new position q; ``idle`` are available
    processes left without a position (they send what they hold, then leave); ``joiners`` held nothing."""

    rank_map: tuple[int, ...]
    idle: tuple[int, ...]
    joiners: tuple[int, ...]
    method: str
    bytes_kept: int


def candidates(
    old: Layout, new_world: int, leave: Iterable[int] = (), joiners: Sequence[int] | None = None,
    lost: Iterable[int] = (),
) -> tuple[list[int], tuple[int, ...]]:
    """Processes that may take a new position, ascending, and the joiners among them.

    ``old`` is the layout before any loss; ``leave`` and ``lost`` processes get no new position. Without
    explicit ``joiners``, as many fresh ids (above every id of ``old``) join as the new world lacks.
    """
    gone = set(int(p) for p in leave) | set(int(p) for p in lost)
    unknown = sorted(p for p in gone if old.position_of(p) is None)
    if unknown:
        raise ValueError(f"processes {unknown} should leave but hold no position in the old layout {old.processes}")
    staying = [p for p in old.processes if p not in gone]
    if joiners is None:
        top = max(old.processes, default=-1)
        missing = max(0, new_world - len(staying))
        joiners = tuple(range(top + 1, top + 1 + missing))
    else:
        joiners = tuple(sorted(set(int(p) for p in joiners)))
        clash = sorted(set(joiners) & set(old.processes))
        if clash:
            raise ValueError(f"joiners {clash} already hold a position in the old layout")
    cands = sorted(staying + list(joiners))
    if len(cands) < new_world:
        raise ValueError(
            f"the new layout needs {new_world} processes but only {len(cands)} are available "
            f"({len(staying)} staying + {len(joiners)} joining): choose a smaller layout or add joiners"
        )
    return cands, joiners


def _check_nodes(pcfg: ParallelConfig, gpus_per_node: int) -> None:
    if gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be at least 1, got {gpus_per_node}")
    if pcfg.tp > gpus_per_node:
        raise ValueError(
            f"tp={pcfg.tp} does not fit in a node of {gpus_per_node} GPUs: choose tp <= {gpus_per_node}"
        )


def _node_blocks(cands: list[int], gpus_per_node: int) -> list[list[int]]:
    """Row indices of ``cands`` grouped by node (``process // gpus_per_node``), nodes ascending."""
    blocks: dict[int, list[int]] = {}
    for i, p in enumerate(cands):
        blocks.setdefault(p // gpus_per_node, []).append(i)
    return [blocks[n] for n in sorted(blocks)]


def _tp_groups(pcfg: ParallelConfig) -> int:
    """TP groups of a layout: ``tp`` consecutive positions each, every pipeline stage's included."""
    return pcfg.world_size // pcfg.tp


def _infeasible(pcfg: ParallelConfig, gpus_per_node: int, blocks: list[list[int]]) -> ValueError:
    return ValueError(
        f"cannot keep {_tp_groups(pcfg)} TP groups of tp={pcfg.tp} inside nodes of {gpus_per_node} GPUs: "
        f"the available processes per node are {[len(b) for b in blocks]}; "
        "use a smaller tp, fewer leavers, or no --gpus-per-node"
    )


def identity_map(cands: list[int], pcfg: ParallelConfig, gpus_per_node: int | None = None) -> list[int]:
    """The baseline: position q takes the q-th available process. With a node constraint, each TP group
    takes the lowest free processes of the first node that still has ``tp`` of them."""
    if gpus_per_node is None or pcfg.tp == 1:
        return cands[: pcfg.world_size]
    _check_nodes(pcfg, gpus_per_node)
    blocks = _node_blocks(cands, gpus_per_node)
    free = [list(b) for b in blocks]
    out: list[int] = []
    at = 0  # nodes only lose free processes: one skipped for having fewer than tp never qualifies again
    for _ in range(_tp_groups(pcfg)):
        while at < len(free) and len(free[at]) < pcfg.tp:
            at += 1
        if at == len(free):
            raise _infeasible(pcfg, gpus_per_node, blocks)
        node = free[at]
        out += [cands[i] for i in node[: pcfg.tp]]
        del node[: pcfg.tp]
    return out


def _lap(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Maximum-weight assignment of every column to a distinct row (rows >= columns)."""
    if w.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    rows, cols = linear_sum_assignment(np.asarray(w, dtype=np.float64), maximize=True)
    return rows, cols


def _sparse_lap(w: csr_matrix) -> np.ndarray:
    """For every column, its row in a maximum-weight assignment (rows >= columns) on the nonzero entries only.

    Each column also gets a private dummy row of weight 0: a column on a dummy is one that saves nothing
    wherever it goes, and takes a left-over real row afterwards (ascending), which is always possible and
    changes no total. Weights become costs ``top - w`` so every column is matched at least cost: the sum is
    ``columns * top - saved``, exact in float64 while it stays below 2**53."""
    n_r, n_c = w.shape
    if n_c == 0:
        return np.zeros(0, dtype=np.int64)
    w = w.tocoo()
    keep = w.data > 0
    rows, cols, vals = w.row[keep], w.col[keep], w.data[keep].astype(np.int64)
    top = int(vals.max(initial=0)) + 1
    if top * n_c >= 2 ** 53:
        raise ValueError("saved-bytes matrix too large to assign exactly in float64")
    dummy = np.arange(n_c)
    cost = coo_matrix(
        (np.concatenate([(top - vals).astype(np.float64), np.full(n_c, float(top))]),
         (np.concatenate([rows, n_r + dummy]), np.concatenate([cols, dummy]))),
        shape=(n_r + n_c, n_c)).tocsr()
    matched_rows, matched_cols = min_weight_full_bipartite_matching(cost.T.tocsr())  # rows of cost.T: columns
    row_of = np.full(n_c, -1, dtype=np.int64)
    row_of[matched_rows] = matched_cols
    real = row_of < n_r
    used = np.zeros(n_r, dtype=bool)
    used[row_of[real]] = True
    free_cols = np.flatnonzero(~real)
    row_of[free_cols] = np.flatnonzero(~used)[: len(free_cols)]
    return row_of


def optimal_map(
    w, cands: list[int], pcfg: ParallelConfig, gpus_per_node: int | None = None
) -> list[int]:
    """The assignment that keeps the most bytes in place (see the module docstring); ``w`` dense or sparse."""
    q_total = pcfg.world_size
    if w.shape != (len(cands), q_total):
        raise ValueError(f"saved matrix has shape {w.shape}, expected {(len(cands), q_total)}")
    out = [-1] * q_total
    if gpus_per_node is None or pcfg.tp == 1:
        row_of = _sparse_lap(csr_matrix(w))
        return [cands[int(r)] for r in row_of]
    _check_nodes(pcfg, gpus_per_node)
    tp, n_groups = pcfg.tp, _tp_groups(pcfg)
    blocks = _node_blocks(cands, gpus_per_node)
    caps = [min(len(b) // tp, n_groups) for b in blocks]
    if sum(caps) < n_groups:
        raise _infeasible(pcfg, gpus_per_node, blocks)
    rows_of = _NodeRows(w, blocks, tp)
    # Level 1: value of each (node, group), an exact small assignment where the node holds anything useful.
    # float64, exact for byte counts below 2**53: the solver reads it as it is, with no copy of (nodes x groups).
    value = np.zeros((len(blocks), n_groups))
    for n in range(len(blocks)):
        if caps[n] > 0:
            value[n, rows_of.useful_groups(n)] = rows_of.group_values(n)
    slot_node = [n for n, cap in enumerate(caps) for _ in range(cap)]
    s_idx, g_idx = _lap(value if slot_node == list(range(len(blocks))) else value[slot_node])
    node_of_group = [0] * n_groups
    for s, g in zip(s_idx.tolist(), g_idx.tolist()):
        node_of_group[g] = slot_node[s]
    if max(caps) > 1:
        # With one group per node a node's value is its group's, which the assignment above maximised exactly.
        node_of_group = _improve(rows_of, caps, node_of_group, value)
    # Level 2: exact placement inside each node.
    groups_on: list[list[int]] = [[] for _ in blocks]
    for g, n in enumerate(node_of_group):
        groups_on[n].append(g)
    for n in range(len(blocks)):
        groups = groups_on[n]
        if not groups:
            continue
        rows = blocks[n]
        cols = [g * tp + t for g in groups for t in range(tp)]
        r, c = _lap(rows_of.block(n, groups))
        for ri, ci in zip(r, c):
            out[cols[int(ci)]] = cands[rows[int(ri)]]
    return out


def _lap_value(block: np.ndarray) -> int:
    """The most a maximum-weight assignment of ``block``'s columns to distinct rows keeps."""
    if not block.size:
        return 0
    value = int(_bound_values(block[:, None, :])[0])
    return value if value >= 0 else _solved_value(block)


def _solved_value(block: np.ndarray) -> int:
    """What the solver's assignment of ``block`` keeps."""
    r, c = _lap(block)
    return int(block[r, c].sum())


def _bound_values(vals: np.ndarray) -> np.ndarray:
    """Per group ``g`` of ``vals`` (rows, groups, columns; rows >= columns, entries >= 0): the value of the best
    assignment of ``vals[:, g]``'s columns to distinct rows where an upper bound shows it without solving, else -1.

    Every row keeps at most its maximum, so the sum of the row maxima bounds the value. When the rows that keep
    anything have distinct best columns, each can take its best at once and the bound is the value. Likewise the sum
    of the column maxima, when the columns' best rows are distinct. (A row that saves on one position at most, or a
    position saved on by one process at most, is the common case of this.)"""
    rows, groups, cols = vals.shape
    out = np.full(groups, -1, dtype=np.int64)
    if not vals.size:
        out[:] = 0
        return out
    row_max, row_best = vals.max(axis=2), vals.argmax(axis=2)  # (rows, groups)
    kept = row_max > 0
    group_of_row = np.broadcast_to(np.arange(groups), (rows, groups))
    taken = np.bincount(group_of_row[kept] * cols + row_best[kept], minlength=groups * cols)
    rows_distinct = (taken.reshape(groups, cols) <= 1).all(axis=1)
    col_max, col_best = vals.max(axis=0), vals.argmax(axis=0)  # (groups, cols)
    wanted = col_max > 0
    group_of_col = np.broadcast_to(np.arange(groups)[:, None], (groups, cols))
    taken = np.bincount(group_of_col[wanted] * rows + col_best[wanted], minlength=groups * rows)
    cols_distinct = (taken.reshape(groups, rows) <= 1).all(axis=1)
    out[cols_distinct] = col_max.sum(axis=1)[cols_distinct]
    out[rows_distinct] = row_max.sum(axis=0)[rows_distinct]
    return out


class _NodeRows:
    """Each node's rows of ``W`` (its processes) on the TP groups where it saves anything: per node a dense
    ``(processes, useful groups, tp)`` array. A sparse ``W`` stays sparse (at 16,384 processes the dense matrix
    takes 2 GiB), and the blocks the searches ask for many thousand times are slices of these arrays."""

    def __init__(self, w, blocks: list[list[int]], tp: int) -> None:
        self.blocks, self.tp = blocks, tp
        self.groups: list[np.ndarray] = []  # per node: its useful groups, ascending
        self.vals: list[np.ndarray] = []  # per node: (processes, len(groups), tp)
        self._index: list[dict[int, int] | None] = []
        sparse = issparse(w)
        w = csr_matrix(w) if sparse else np.asarray(w)
        for rows in blocks:
            if not sparse:
                sub = w[rows]
                r, cols = np.nonzero(sub)
                data = sub[r, cols]
            elif rows and rows[-1] - rows[0] + 1 == len(rows):
                # A node's processes are consecutive rows (candidates ascend): read their CSR entries directly.
                a, b = w.indptr[rows[0]], w.indptr[rows[-1] + 1]
                r = np.repeat(np.arange(len(rows)), np.diff(w.indptr[rows[0]:rows[-1] + 2]))
                cols, data = w.indices[a:b], w.data[a:b]
            else:
                sub = w[rows].tocoo()
                r, cols, data = sub.row, sub.col, sub.data
            keep = data > 0
            r, cols, data = r[keep], cols[keep].astype(np.int64), data[keep]
            groups = np.unique(cols // tp)
            dense = np.zeros((len(rows), len(groups), tp), dtype=w.dtype)
            np.add.at(dense, (r, np.searchsorted(groups, cols // tp), cols % tp), data)
            self.groups.append(groups)
            self.vals.append(dense)
            self._index.append(None)

    def useful_groups(self, n: int) -> np.ndarray:
        """TP groups (ascending) in which node ``n``'s processes save anything (entries are never negative)."""
        return self.groups[n]

    def group_values(self, n: int) -> np.ndarray:
        """Per useful group of node ``n``: the most its processes keep when they take that group's positions."""
        vals = self.vals[n]
        out = _bound_values(vals)  # every group at once; only the groups no bound settles go to the solver
        for i in np.flatnonzero(out < 0).tolist():
            out[i] = _solved_value(vals[:, i])
        return out

    def _at(self, n: int) -> dict[int, int]:
        """Node ``n``'s useful group -> its index in ``vals[n]``."""
        index = self._index[n]
        if index is None:
            index = self._index[n] = {g: i for i, g in enumerate(self.groups[n].tolist())}
        return index

    def kept(self, n: int, groups: tuple[int, ...]) -> int:
        """The most node ``n``'s processes keep when they take the positions of ``groups``. The groups where
        they save nothing add only zero columns, which change no maximum, and are left out."""
        index = self._at(n)
        at = [index[g] for g in groups if g in index]
        return _lap_value(self.vals[n][:, at].reshape(len(self.blocks[n]), -1)) if at else 0

    def block(self, n: int, groups: list[int]) -> np.ndarray:
        """``W[node n's rows]`` on every position of ``groups``, in order, dense."""
        rows, index = len(self.blocks[n]), self._at(n)
        out = np.zeros((rows, len(groups), self.tp), dtype=self.vals[n].dtype)
        for j, g in enumerate(groups):
            if g in index:
                out[:, j] = self.vals[n][:, index[g]]
        return out.reshape(rows, -1)


def _improve(
    rows_of: _NodeRows, caps: list[int], node_of_group: list[int], value: np.ndarray
) -> list[int]:
    """Local search on the group -> node map: move a group to a node with a free slot, or swap two groups,
    whenever the exact per-node values say the total improves. Only nodes where a group is worth something
    are tried, which keeps it sparse at 1,024 ranks. Strict integer gains: it terminates, deterministically."""
    cache: dict[tuple[int, tuple[int, ...]], int] = {}

    def f(n: int, groups: tuple[int, ...]) -> int:
        key = (n, groups)
        got = cache.get(key)
        if got is None:
            got = cache[key] = rows_of.kept(n, groups)
        return got

    n_groups = len(node_of_group)
    on: list[list[int]] = [[] for _ in rows_of.blocks]
    for g, n in enumerate(node_of_group):
        on[n].append(g)
    worth = [np.nonzero(value[:, g])[0].tolist() for g in range(n_groups)]
    for _ in range(_MAX_PASSES):
        improved = False
        for g in range(n_groups):
            a = node_of_group[g]
            rest_a = tuple(x for x in on[a] if x != g)
            # What g adds at a. Moving g to b adds at most value[b, g] there, and taking h back adds at most
            # value[a, h] at a (a block's best assignment never gains more than a column group's own best):
            # a b where even that sum does not exceed it cannot gain, and is not tried.
            margin = f(a, tuple(on[a])) - f(a, rest_a)
            for b in worth[g]:
                if b == a or value[b, g] + max((value[a, h] for h in on[b]), default=0) <= margin:
                    continue
                base = f(a, tuple(on[a])) + f(b, tuple(on[b]))
                best, partner = 0, None  # partner None: a plain move into a free slot of b
                if len(on[b]) < caps[b]:
                    best = f(a, rest_a) + f(b, tuple(sorted(on[b] + [g]))) - base
                for h in on[b]:
                    gain = (f(a, tuple(sorted(rest_a + (h,))))
                            + f(b, tuple(sorted([x for x in on[b] if x != h] + [g]))) - base)
                    if gain > best:
                        best, partner = gain, h
                if best > 0:
                    on[a].remove(g)
                    on[b] = sorted(on[b] + [g])
                    node_of_group[g] = b
                    if partner is not None:
                        on[b].remove(partner)
                        on[a] = sorted(on[a] + [partner])
                        node_of_group[partner] = a
                    improved = True
                    break
        if not improved:
            break
    return node_of_group


def kept_bytes(w, cands: list[int], rank_map: Sequence[int]) -> int:
    """Bytes the positions of ``rank_map`` need that their processes already hold (``w`` dense or sparse)."""
    row = {p: i for i, p in enumerate(cands)}
    rows = np.array([row[p] for p in rank_map], dtype=np.int64)
    return int(np.asarray(w[rows, np.arange(len(rank_map))]).sum())


def check_rank_map(
    rank_map: Sequence[int], cands: list[int], pcfg: ParallelConfig, gpus_per_node: int | None
) -> tuple[int, ...]:
    """Validate an explicit rank map: right length, distinct available processes, TP groups in nodes."""
    rank_map = tuple(int(p) for p in rank_map)
    if len(rank_map) != pcfg.world_size:
        raise ValueError(f"the rank map has {len(rank_map)} entries; layout {pcfg.short()} needs {pcfg.world_size}")
    if len(set(rank_map)) != len(rank_map):
        raise ValueError(f"the rank map {list(rank_map)} names a process twice")
    bad = sorted(set(rank_map) - set(cands))
    if bad:
        raise ValueError(f"the rank map names processes {bad} that are not available (left, lost or unknown)")
    if gpus_per_node is not None and pcfg.tp > 1:
        for g in range(_tp_groups(pcfg)):
            nodes = {p // gpus_per_node for p in rank_map[g * pcfg.tp:(g + 1) * pcfg.tp]}
            if len(nodes) > 1:
                raise ValueError(f"TP group {g} of the rank map spans nodes {sorted(nodes)}; keep it in one node")
    return rank_map


def assign(
    w: np.ndarray, cands: list[int], joiners: Sequence[int], pcfg: ParallelConfig,
    method: str | Sequence[int] = "optimal", gpus_per_node: int | None = None,
) -> Assignment:
    """Choose the new rank map by ``method`` ("identity", "optimal" or an explicit list of processes)."""
    if isinstance(method, str):
        if method == "identity":
            rank_map = tuple(identity_map(cands, pcfg, gpus_per_node))
        elif method == "optimal":
            rank_map = tuple(optimal_map(w, cands, pcfg, gpus_per_node))
            if gpus_per_node is not None and pcfg.tp > 1:
                # The node-constrained heuristic is not exact: never do worse than the baseline.
                ident = tuple(identity_map(cands, pcfg, gpus_per_node))
                if kept_bytes(w, cands, ident) > kept_bytes(w, cands, rank_map):
                    rank_map = ident
        else:
            raise ValueError(f"unknown rank map {method!r}: use {' or '.join(METHODS)}, or a list of processes")
        name = method
    else:
        rank_map = check_rank_map(method, cands, pcfg, gpus_per_node)
        name = "explicit"
    used = set(rank_map)
    return Assignment(
        rank_map, tuple(p for p in cands if p not in used), tuple(sorted(joiners)), name,
        kept_bytes(w, cands, rank_map),
    )
