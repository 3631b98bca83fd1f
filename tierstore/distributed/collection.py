"""ShardedEmbeddingBagCollection: the module, its forward and backward over the ranks (the design:
tierstore.distributed's docstring)."""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from prometheus_client import REGISTRY, CollectorRegistry
from torch import nn

from tierstore.distributed.checkpoint import Checkpoints
from tierstore.distributed.reporting import Announcer, ShardedMetrics
from tierstore.distributed.comm import (_COMM_NAMES, _OP, _PENDING, _SETTINGS, _TOTAL, COMM_DTYPES, _Comm, _digest, _error_of,
                                        _Op, _Reader, raise_settings_mismatch)
from tierstore.distributed.tables import _Step, _Table
from tierstore.engine.prefetch import PrefetchGroup
from tierstore.engine.tensors import as_ids, as_values, resolve_device
from tierstore.errors import ArgumentTypeError, SettingError, StateError, UnknownTableError
from tierstore.nn import feature_parts
from tierstore.optim import RowOptimizer
from tierstore.precision import round_stochastic
from tierstore.spec import TableSpec
from tierstore.store import Sizes, StoreConfig, TieredStore
from tierstore.training.bags import MODES, Bags, EmbeddingBagConfig, Rows, mean_grads, plan_bags, sort_is_stable, sum_rows
from tierstore.training.checkpointing import FusedOptimizer, SharedViews, TableViews, state_layout, table_views
from tierstore.training.sharding import PlanMismatchError, RankFailedError, ShardingPlan


class _ShardedBagFunction(torch.autograd.Function):
    """Pools the batch's bags from the fetched rows; backward is the collective update.

    ``anchor`` requires grad when the rows are trained (every rank agrees on it);
    one function covers every table, so each rank runs one backward exchange per step."""

    @staticmethod
    def forward(ctx, anchor, module, step: _Step, *psws):
        ctx.module, ctx.step = module, step
        outs = []
        for name, psw in zip(step.names, psws):
            bags = step.bags[name]
            w = step.weights[name].to(module.device)
            p = None if psw is None else bags.select(psw.reshape(-1).to(module.device))
            out, _ = bags.pool(w, bags.rows.positions(), module._mode, p)
            outs.append(out)
        ctx.psw_shapes = [None if p is None else p.shape for p in psws]
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        step, module = ctx.step, ctx.module
        grads = [g.contiguous() for g in grads]
        psw_grads = []
        for i, name in enumerate(step.names):
            if not ctx.needs_input_grad[3 + i]:
                psw_grads.append(None)
                continue
            psw_grads.append(step.bags[name].psw_grad(grads[i], step.weights[name], ctx.psw_shapes[i]))
        if ctx.needs_input_grad[0]:
            module._update(step, dict(zip(step.names, grads)))
        return (None, None, None, *psw_grads)



class ShardedEmbeddingBagCollection(SharedViews, Checkpoints, nn.Module):
    """TieredEmbeddingBagCollection with its tables sharded over a process group by ``plan``.

    Every rank constructs it with the same tables, plan, optimizer, comm_dtype
    and mode (compared at construction: PlanMismatchError, SettingsMismatchError)
    and calls forward/backward, read, write, flush, checkpoint and close in the
    same order: they are collectives (ranks that call different ones raise
    RankFailedError). A rank whose training forward got no features (``{}``)
    takes part in the others' backward from its next call.
    ``store=StoreConfig(...)`` gives the settings of each rank's store (any of the
    config's fields but its path, beside the keywords; ``memory_budget`` is per rank).
    ``comm_dtype="float16"``/``"bfloat16"`` casts the exchanged rows and
    gradients (not the stored rows). ``module.store`` is what LookaheadLoader
    prefetches through; ``module.local_store`` is this rank's TieredStore (None
    when the plan gives it no shard).
    """

    def __init__(
        self,
        tables: Sequence[TableSpec],
        plan: ShardingPlan,
        path: str | Path,
        *,
        process_group=None,
        hbm_rows: Sizes | None = None,
        ddr_rows: Sizes | None = None,
        policy: str = "lru",
        optimizer: RowOptimizer | None = None,
        mode: str = "sum",
        device: str | torch.device | None = None,
        comm_dtype: str | None = None,
        include_last_offset: bool = False,
        registry: CollectorRegistry | None = None,
        memory_budget: int | str | None = None,
        store: StoreConfig | None = None,
    ):
        super().__init__()
        if store is not None and not isinstance(store, StoreConfig):
            raise ArgumentTypeError(f"store must be a tierstore.StoreConfig (the settings of each rank's store), got {type(store).__name__}")
        if store is not None and store.path is not None:
            raise SettingError(f"store=StoreConfig(path={str(store.path)!r}): each rank's store is PATH/rank-K under the "
                             "module's path; leave the config's path unset")
        if not dist.is_available() or not dist.is_initialized():
            raise StateError("torch.distributed is not initialized; call torch.distributed.init_process_group(...) "
                               "on every rank first (gloo over 127.0.0.1 for CPU stores)")
        self._comm = _Comm(process_group)
        self.rank, self.world_size = self._comm.rank, self._comm.world
        self._forwards, self._pending = 0, None  # forwards done; a training forward with no outputs, not yet joined
        error, settings = None, {}
        try:
            self._configure(tables, plan, optimizer, mode, comm_dtype, include_last_offset)
            settings = self._settings_of()
        except Exception as e:
            error = e
        self._settings = _digest(json.dumps(settings))
        # every rank learns of a bad argument anywhere before it opens a store
        head = self._comm.header(error, [_Op.INIT, 0, self._settings, 0, 0])
        self._comm.raise_failures(error, head)
        if bool((head[:, _OP] != _Op.INIT).any()):
            raise RankFailedError(self._mismatch(head))
        if len(set(head[:, _SETTINGS].tolist())) > 1:
            raise_settings_mismatch(self._comm, settings, self.rank)
        self.path = Path(path)
        mine = [t for t in self._tables.values() if t.mine is not None]
        self.local_store: TieredStore | None = None
        if mine:
            self.local_store = TieredStore(self.path / f"rank-{self.rank}", tables=[t.shard_spec(t.mine, optimizer) for t in mine],
                                           hbm_rows=hbm_rows, ddr_rows=ddr_rows, policy=policy, device=device,
                                           registry=registry, name=f"{self.path}/rank-{self.rank}", memory_budget=memory_budget,
                                           config=store)
            self.local_store.metrics.add_labels(rank=str(self.rank))
        self.device = resolve_device(device) if device is not None else (
            self.local_store.device if self.local_store is not None else torch.device("cpu"))
        self.store = Announcer(self)
        self.lookups = {"sent": 0, "served": 0, "steps": 0}
        self._metrics = ShardedMetrics(self, registry if registry is not None else REGISTRY)

    @property
    def received_bytes(self) -> dict[str, int]:
        """Bytes this rank has received from the others, by what they carried: ``headers``
        (each call's all_gather), ``sizes`` (what each rank receives next), ``ids``, ``rows``
        (forward's rows and read/write's) and ``grads``."""
        return dict(self._comm.received)

    def _configure(self, tables, plan, optimizer, mode, comm_dtype, include_last_offset) -> None:
        tables = list(tables)
        if not tables or not all(isinstance(t, TableSpec) for t in tables):
            raise ArgumentTypeError("tables must be a non-empty list of tierstore.TableSpec")
        if not isinstance(plan, ShardingPlan):
            raise ArgumentTypeError(f"plan must be a tierstore.distributed.ShardingPlan (from plan(...) or ShardingPlan.from_json), got {type(plan).__name__}")
        if optimizer is not None and not isinstance(optimizer, RowOptimizer):
            raise ArgumentTypeError(f"optimizer must be a tierstore.optim optimizer (SGD, Adagrad, RowWiseAdagrad, Adam), got {type(optimizer).__name__}")
        if mode not in ("sum", "mean"):
            raise SettingError(f'mode must be "sum" or "mean" for sharded tables, got {mode!r}')
        if comm_dtype not in COMM_DTYPES:
            raise SettingError(f"comm_dtype must be None, 'float32', 'float16' or 'bfloat16', got {comm_dtype!r}")
        if plan.world_size != self.world_size:
            raise PlanMismatchError(f"the plan is for world size {plan.world_size} but the process group has {self.world_size} ranks")
        specs = [dataclasses.replace(s, state_dim=optimizer.state_dim(s.dim) if optimizer else 0) for s in tables]
        plan.check(specs)
        for tp in plan.tables.values():
            if len(set(tp.ranks)) != len(tp.ranks):
                raise PlanMismatchError(f"table {tp.table!r}: a rank holds two of its shards ({tp.ranks}); give each rank one shard of a table")
        self.optimizer, self.plan = optimizer, plan
        self._mode_name, self._mode = mode, MODES[mode]
        self._comm_dtype = COMM_DTYPES[comm_dtype]
        layout = state_layout(optimizer)
        coupled = optimizer is not None and optimizer.row_coupled
        self._tables = {}
        for spec in specs:
            tp = plan.tables[spec.name]
            mine = tp.ranks.index(self.rank) if self.rank in tp.ranks else None
            self._tables[spec.name] = _Table(spec, tp, mine, layout, coupled and tp.sharding == "column")
        self._configs = {s.name: EmbeddingBagConfig(s.num_rows, s.dim, mode, include_last_offset, None, s.name, s.init)
                         for s in specs}

    def _settings_of(self) -> dict[str, str]:
        """What must be the same on every rank, as text: the plan and tables shape the
        messages (and say which rank owns what), the optimizer the state and gradient
        widths, comm_dtype every row's bytes; mode changes no size but each rank's part of
        the one training step."""
        return {"plan": dataclasses.replace(self.plan, predicted=()).to_json(),
                "tables": json.dumps([dataclasses.replace(t.spec, state_dim=0).to_json() for t in self._tables.values()]),
                "optimizer": repr(self.optimizer),
                "comm_dtype": _COMM_NAMES[self._comm_dtype],
                "mode": self._mode_name}

    # -- what a step moves -------------------------------------------------------------------
    def _known(self, name) -> str:
        if name not in self._tables:
            raise UnknownTableError(f"unknown table {name!r}; the collection has tables {sorted(self._tables)}")
        return name

    # -- the header every collective call begins with ------------------------------------------
    def _begin(self, op: _Op, arg: int = 0, error: BaseException | None = None, total: int = 0) -> torch.Tensor:
        """Every rank's header of this call, [world, 6], once the ranks agree on the call and
        settings: raises ``error`` here and RankFailedError naming it on the others, and
        RankFailedError on every rank when the ranks called different collectives. A rank with
        a training forward it could not run backward through (``self._pending``) takes part
        in the others' backward of that forward here first."""
        while True:
            head = self._comm.header(error, [op, arg, self._settings, self._pending.number if self._pending else 0, total])
            joined = self._join(head)
            if joined is None:
                break
            if not joined:
                return head  # this rank's backward: the others take part from their own calls
            step, self._pending = self._pending, None
            self._exchange_grads(step, {})  # then this call's header again: the others are at their next call
        self._comm.raise_failures(error, head)
        calls = head[:, _OP: _PENDING]
        if bool((calls != calls[0]).any()):
            raise RankFailedError(self._mismatch(head))
        return head

    def _join(self, head: torch.Tensor) -> bool | None:
        """None unless some ranks run backward of a forward and all the others have that forward
        pending (it gave them no outputs); then whether this rank is one of the others."""
        backward = head[:, _OP] == _Op.BACKWARD
        if not bool(backward.any()) or bool(backward.all()):
            return None
        calls = head[backward][:, _OP: _PENDING]
        others = head[~backward]
        if bool((calls != calls[0]).any()) or bool((others[:, _PENDING] != calls[0, 1]).any()) or \
                bool((others[:, _SETTINGS] != calls[0, 2]).any()):
            return None
        return not bool(backward[self.rank])

    def _call(self, op: int, arg: int) -> str:
        if op == _Op.FORWARD:
            return "forward with training (an optimizer, grad enabled)" if arg else "forward without training (torch.no_grad())"
        if op == _Op.BACKWARD:
            return f"backward of forward {arg}"
        if op in (_Op.READ, _Op.WRITE):
            names = list(self._tables)
            table = names[arg // 2] if 0 <= arg // 2 < len(names) else "?"
            return f"{'read' if op == _Op.READ else 'write'}({table!r}, with_state={bool(arg % 2)})"
        return {_Op.INIT: "the constructor", _Op.FLUSH: "flush()", _Op.CHECKPOINT: "checkpoint()", _Op.CLOSE: "close()",
                _Op.ANNOUNCE: "prefetch (a LookaheadLoader announcing a batch)"}.get(op, f"step {op} of a call")

    def _mismatch(self, head: torch.Tensor) -> str:
        calls = ", ".join(f"rank {r}: {self._call(op, arg)}" for r, (op, arg) in enumerate(head[:, _OP: _SETTINGS].tolist()))
        if bool((head[:, _OP: _SETTINGS] == head[0, _OP: _SETTINGS]).all()):
            return (f"the ranks call {calls} of differently configured modules (settings digests {head[:, _SETTINGS].tolist()} "
                    f"by rank); every rank must call the same module's collectives (aborted on rank {self.rank}; nothing changed)")
        return (f"the ranks called different collectives ({calls}); every rank must call the module's forward/backward, "
                "read, write, flush, checkpoint and close in the same order, with the same table and with_state, and train "
                f"(an optimizer, grad enabled) on every rank or on none (aborted on rank {self.rank}; nothing changed)")

    def _gather(self, op: _Op, arg: int, local: dict[str, torch.Tensor], error: BaseException | None,
                flags: Sequence[int] = (), exact: bool = False) -> tuple[dict[str, list[torch.Tensor]], torch.Tensor, set[str]]:
        """Begin the call and send each table's ``local`` ids to the ranks holding its shards,
        each only those its shard holds, with per-table ``flags``: ({table: [ids from each
        rank]}, flags [world, len(flags)], the row-sharded tables whose owners got only their own
        ids: they sort them with stable=True).
        An all-to-all of sizes goes first: what each rank receives of each table, with every
        rank's id count of each table and its flags. ``exact`` (a training forward): a row-sharded
        table whose step torch.sort orders unstably goes whole to each owner, which sorts it as
        the single process does (the package's docstring)."""
        names, world = list(self._tables), self.world_size
        n_tables = len(names)
        ids = {n: local[n].to("cpu", torch.int64) if n in local else torch.zeros(0, dtype=torch.int64) for n in names}
        self._begin(op, arg, error, sum(len(v) for v in ids.values()))
        masks = {n: self._tables[n].masks(ids[n]) for n in names}
        sizes = torch.zeros(world, 3 * n_tables, dtype=torch.int64)  # to each rank: its ids, my counts, my flags
        sizes[:, n_tables: 2 * n_tables] = torch.tensor([len(ids[n]) for n in names], dtype=torch.int64)
        sizes[:, 2 * n_tables: 2 * n_tables + len(flags)] = torch.tensor(list(flags), dtype=torch.int64)
        for i, n in enumerate(names):
            t = self._tables[n]
            for k, m in enumerate(masks[n]):  # a loop per shard
                sizes[t.rank_of(k), i] = int(m.sum())
        got = self._comm.exchange([[row] for row in sizes], [sizes[0].numel() * 8] * world, "sizes")
        got = torch.stack([b.view(torch.int64) for b in got])
        split = {i: n for i, n in enumerate(names)
                 if self._tables[n].tplan.sharding == "row" and len(self._tables[n].tplan.shards) > 1}
        whole = {n for i, n in split.items() if exact and not sort_is_stable(int(got[:, n_tables + i].sum()))}
        send: list[list[torch.Tensor]] = [[] for _ in range(world)]
        for n in names:
            t = self._tables[n]
            for k, m in enumerate(masks[n]):
                send[t.rank_of(k)].append(ids[n] if n in whole else ids[n][m])
        counts = torch.zeros(world, n_tables, dtype=torch.int64)  # ids from each rank, per table
        for i, n in enumerate(names):
            if self._tables[n].mine is not None:
                counts[:, i] = got[:, n_tables + i] if n in whole else got[:, i]
        parts = self._comm.exchange(send, (8 * counts.sum(1)).tolist(), "ids")
        segs = {n: [] for n in names}
        for part, row in zip(parts, counts.tolist()):  # a loop per rank
            for n, piece in zip(names, part.view(torch.int64).split(row)):
                segs[n].append(piece)
        return segs, got[:, 2 * n_tables: 2 * n_tables + len(flags)], set(split.values()) - whole

    def _fetch(self, segs: dict[str, list[torch.Tensor]], local: Mapping[str, torch.Tensor], names: Sequence[str],
               with_state: bool, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Rows of this rank's unique ``local`` ids of each table in ``names`` (sorted), from
        their owners, which serve the ids ``segs`` brought them."""
        world = self.world_size
        send: list[list[torch.Tensor]] = [[] for _ in range(world)]
        recv = [0] * world
        size = torch.empty(0, dtype=dtype).element_size()
        mine, error, served = {}, None, 0
        for name in names:
            t = self._tables[name]
            if t.mine is not None and error is None:  # serve every rank's ids that this shard holds
                want = [u[t.masks(u)[t.mine]] for u in (torch.unique(s) for s in segs[name])]
                uid = torch.unique(torch.cat(want))
                try:
                    rows = self.local_store.read(name, uid, with_state=with_state).cpu()
                except Exception as e:  # the others must not wait in the exchange for rows that will not come
                    error = e
                else:
                    for r, w in enumerate(want):
                        send[r].append(rows.index_select(0, torch.searchsorted(uid, w)).to(dtype))
                    served += sum(len(w) for w in want)
            uid = torch.unique(local[name]) if name in local else torch.zeros(0, dtype=torch.int64)
            masks = t.masks(uid)
            mine[name] = (uid, masks)
            for k in range(len(t.tplan.shards)):
                recv[t.rank_of(k)] += int(masks[k].sum()) * len(t.cols(k, with_state)) * size
        self._begin(_Op.FETCHED, error=error)
        self.lookups["served"] += served
        self.lookups["sent"] += sum(len(uid) for uid, _ in mine.values())
        got = [_Reader(b) for b in self._comm.exchange(send, recv, "rows")]
        out = {}
        for name in names:
            t = self._tables[name]
            uid, masks = mine[name]
            rows = torch.empty(len(uid), t.spec.width if with_state else t.spec.dim)
            for k in range(len(t.tplan.shards)):
                cols = t.cols(k, with_state)
                pos = torch.nonzero(masks[k]).squeeze(1)
                rows[pos.unsqueeze(1), cols] = got[t.rank_of(k)].take(len(pos), len(cols), dtype)
            out[name] = rows
        return out

    # -- forward and backward ------------------------------------------------------------------
    def _plan_batch(self, features) -> tuple[dict[str, Bags], dict[str, torch.Tensor | None]]:
        if not isinstance(features, Mapping):
            raise ArgumentTypeError("features must be a mapping {table: (values, offsets)}")
        bags, psws = {}, {}
        for name, feature in features.items():  # validate every table before anything moves
            values, offsets, psw = feature_parts(name, feature)
            bags[name] = plan_bags(self._configs[self._known(name)], values, offsets, psw)
            psws[name] = psw
        return bags, psws

    def forward(self, features: Mapping[str, object]) -> dict[str, torch.Tensor]:
        train = self.optimizer is not None and torch.is_grad_enabled()
        error, bags, psws = None, {}, {}
        try:
            bags, psws = self._plan_batch(features)
        except Exception as e:
            error = e
        names = list(self._tables)
        has_psw = [int(psws.get(n) is not None) for n in names]
        local = {n: b.ids for n, b in bags.items()}
        segs, flags, partial = self._gather(_Op.FORWARD, int(train), local, error, has_psw, exact=train)
        weights = self._fetch(segs, local, names, False, self._comm_dtype)
        self.lookups["steps"] += 1
        self._forwards += 1
        step = _Step(list(bags), bags, {n: None if p is None else b.select(p.detach().reshape(-1).cpu()) for (n, b), p in
                                        zip(bags.items(), psws.values())},
                     segs, {n: flags[:, i].bool().tolist() for i, n in enumerate(names)}, weights, self._forwards, partial)
        # no outputs ({}): nothing to run backward through, so this rank's part of the backward
        # (receiving the gradients of the rows it owns) starts from its next collective call
        self._pending = step if train and not step.names else None
        anchor = torch.empty(0, requires_grad=True) if train else None
        outs = _ShardedBagFunction.apply(anchor, self, step, *(psws[n] for n in step.names))
        return dict(zip(step.names, outs))

    def _update(self, step: _Step, grads: dict[str, torch.Tensor]) -> None:
        """Backward: send each occurrence's gradient to the shards holding its row; each
        owner sums its rows' gradients in the single process's order and steps them."""
        self._begin(_Op.BACKWARD, step.number)
        self._exchange_grads(step, grads)

    def _exchange_grads(self, step: _Step, grads: dict[str, torch.Tensor]) -> None:
        world, dtype = self.world_size, self._comm_dtype
        size = torch.empty(0, dtype=dtype).element_size()
        send: list[list[torch.Tensor]] = [[] for _ in range(world)]
        for name, t in self._tables.items():  # in the plan's order on every rank
            bags = step.bags.get(name)
            if bags is None:
                continue
            g = grads[name].cpu()
            if self._mode_name == "mean":
                g = mean_grads(g, bags.sizes)
            occ = g.index_select(0, bags.bag_of)
            psw = step.psw[name]
            for k, mask in enumerate(t.masks(bags.ids)):
                sel = torch.nonzero(mask).squeeze(1)
                send[t.rank_of(k)].append(occ.index_select(0, sel)[:, t.grad_cols(k)].to(dtype))
                if psw is not None:
                    send[t.rank_of(k)].append(psw.index_select(0, sel).to(torch.float32))
        owned, recv = {}, [0] * world
        for name, t in self._tables.items():
            if t.mine is not None:
                owned[name] = [t.masks(s)[t.mine] for s in step.segs[name]]
                width = len(t.grad_cols(t.mine))
                for r, m in enumerate(owned[name]):
                    recv[r] += int(m.sum()) * (width * size + 4 * step.psw_from[name][r])
        got = [_Reader(b) for b in self._comm.exchange(send, recv, "grads")]
        for name, masks in owned.items():
            t = self._tables[name]
            width = len(t.grad_cols(t.mine))
            G, P = [], []
            for r, m in enumerate(masks):
                n = int(m.sum())
                G.append(got[r].take(n, width, dtype))
                P.append(got[r].take(n, 1, torch.float32).squeeze(1) if step.psw_from[name][r] else torch.ones(n))
            weighted = any(step.psw_from[name])
            self._step_rows(name, step.segs[name], masks, torch.cat(G), torch.cat(P) if weighted else None,
                            name in step.partial)

    def _step_rows(self, name: str, segs: list[torch.Tensor], masks: list[torch.Tensor], G: torch.Tensor,
                   P: torch.Tensor | None, partial: bool) -> None:
        t, store = self._tables[name], self.local_store
        mask = torch.cat(masks)
        # the single process's order: the sort of the global batch's ids, ties included, then this shard's rows;
        # from this shard's ids alone (partial) where that sort keeps equal ids in batch order
        grouped = Rows.group(torch.cat(segs), mask, stable=partial)
        uid = grouped.uid
        local = (torch.cumsum(mask, 0) - 1).index_select(0, grouped.perm)  # entries among those received
        grad = sum_rows(G, local, grouped.counts, None if P is None else P.index_select(0, local))
        rows = store.read(name, uid, with_state=True)
        grad = grad.to(rows.device)
        shard = t.tplan.shards[t.mine]
        dim = shard.dim
        if t.coupled:  # the whole row's gradient sets the row's accumulator; this shard's columns move
            step = self.optimizer.direction(rows[:, dim:], grad)
            rows[:, :dim].add_(step[:, shard.col_start: shard.col_stop])
        else:
            self.optimizer.step(rows[:, :dim], rows[:, dim:], grad)
        if t.spec.dtype != "float32":
            rows[:, :dim] = round_stochastic(rows[:, :dim], t.spec.dtype, uid, store.trainer(name).update_key())
        store.write(name, uid, rows, with_state=True)

    # -- prefetch (LookaheadLoader) --------------------------------------------------------------
    def batch_reads(self, features: Mapping[str, object]) -> dict[str, torch.Tensor]:
        """The ids a forward of ``features`` reads, by table. Never raises (a bad batch
        reads nothing here and raises at its own forward): a rank that skipped the
        announcement would leave the others waiting."""
        try:
            return {name: torch.as_tensor(f[0] if isinstance(f, (tuple, list)) else f).reshape(-1).to(torch.int64)
                    for name, f in features.items() if name in self._tables}
        except Exception:
            return {}

    def prefetch(self, features: Mapping[str, object]) -> PrefetchGroup:
        """Announce a later ``forward(features)`` to the ranks owning its rows (collective)."""
        return self._announce(self.batch_reads(features))

    def _announce(self, reads: Mapping[str, torch.Tensor]) -> PrefetchGroup:
        local = {}
        for name, ids in reads.items():  # only a hint: what is not an id of a known table is left out
            spec = self._tables[name].spec if name in self._tables else None
            ids = torch.as_tensor(ids).reshape(-1)
            if spec is None or ids.dtype.is_floating_point or ids.dtype == torch.bool:
                continue
            ids = ids.to(torch.int64)
            ok = ids >= 0 if spec.num_rows is None else (ids >= 0) & (ids < spec.num_rows)
            local[name] = ids[ok]
        segs, _, _ = self._gather(_Op.ANNOUNCE, 0, local, None)
        wanted = {}
        for name, t in self._tables.items():
            if t.mine is not None:
                ids = torch.unique(torch.cat(segs[name]))
                wanted[name] = ids[t.masks(ids)[t.mine]]
        if self.local_store is None:
            return PrefetchGroup(())
        return self.local_store.prefetch_batch(wanted) or PrefetchGroup(())

    # -- rows wherever they live (collectives) ----------------------------------------------------
    def _table_ids(self, table: str, ids) -> tuple[_Table, torch.Tensor]:
        t = self._tables[self._known(table)]
        return t, as_ids(t.spec, ids).cpu()

    def _agree_table(self, op: _Op, table, with_state, ids, error) -> dict[str, list[torch.Tensor]]:
        index = list(self._tables).index(table) if isinstance(table, str) and table in self._tables else -1
        segs, _, _ = self._gather(op, 2 * index + (with_state is True), {table: ids} if error is None else {}, error)
        return segs

    def read(self, table: str, ids, with_state: bool = False) -> torch.Tensor:
        """Rows of this rank's ``ids`` wherever they live, [len(ids), dim] (with state:
        the whole row's layout, as TieredEmbeddingBagCollection stores it). Collective."""
        error, t, uid, inverse = None, None, torch.zeros(0, dtype=torch.int64), None
        try:
            if not isinstance(with_state, bool):
                raise ArgumentTypeError(f"with_state must be True or False, got {with_state!r}")
            t, ids = self._table_ids(table, ids)
            uid, inverse = torch.unique(ids, return_inverse=True)
        except Exception as e:
            error = e
        segs = self._agree_table(_Op.READ, table, with_state, uid, error)
        rows = self._fetch(segs, {table: uid}, [table], with_state, torch.float32)[table]
        return rows.index_select(0, inverse).to(self.device)

    def write(self, table: str, ids, values, with_state: bool = False) -> None:
        """Set rows of this rank's ``ids`` wherever they live; for an id given more than
        once (by one rank or several) the last in rank order wins. Collective."""
        error, ids_t, vals = None, torch.zeros(0, dtype=torch.int64), None
        try:
            if not isinstance(with_state, bool):
                raise ArgumentTypeError(f"with_state must be True or False, got {with_state!r}")
            t, ids_t = self._table_ids(table, ids)
            vals = as_values(t.spec, values, len(ids_t), t.spec.width if with_state else t.spec.dim)
        except Exception as e:
            error, ids_t = e, torch.zeros(0, dtype=torch.int64)
        segs = self._agree_table(_Op.WRITE, table, with_state, ids_t, error)
        t = self._tables[table]
        send: list[list[torch.Tensor]] = [[] for _ in range(self.world_size)]
        for k, mask in enumerate(t.masks(ids_t)):
            send[t.rank_of(k)].append(vals[mask][:, t.cols(k, with_state)])
        recv = [0] * self.world_size
        if t.mine is not None:
            masks = [t.masks(s)[t.mine] for s in segs[table]]
            width = len(t.cols(t.mine, with_state))
            recv = [int(m.sum()) * width * 4 for m in masks]
        got = self._comm.exchange(send, recv, "rows")
        error = None
        if t.mine is not None:
            values = torch.cat([_Reader(b).take(int(m.sum()), width, torch.float32) for b, m in zip(got, masks)])
            try:
                self.local_store.write(table, torch.cat([s[m] for s, m in zip(segs[table], masks)]), values, with_state=with_state)
            except Exception as e:
                error = e
        # every rank returns or raises together: none goes on to a collective the failed one never calls
        self._begin(_Op.WRITTEN, error=error)

    def flush(self) -> None:
        """Make every rank's rows durable (each flushes its store). Collective: a rank's
        failure raises there, and RankFailedError naming it on the others."""
        self._begin(_Op.FLUSH)
        self._begin(_Op.FLUSHED, error=_error_of(self.local_store.flush if self.local_store is not None else None))

    # -- checkpoints through torch.distributed.checkpoint (tierstore.training.checkpointing) -------------
    def views(self, table: str) -> TableViews:
        """This rank's shard of ``table`` and its optimizer state as TableViews of the whole
        table's shape: what state_dict() and fused_optimizer hold, and DCP saves and loads
        (each rank its own rows; a checkpoint of another plan or world size is resharded)."""
        t = self._tables[self._known(table)]
        s = t.tplan.shards[t.mine] if t.mine is not None else None
        if s is None:
            rows, cols = (0, 0), (0, t.spec.dim)
        else:
            rows = (s.row_start, s.row_stop) if s.row_start is not None else (0, t.spec.num_rows or 0)
            cols = (s.col_start, s.col_stop)
        return table_views(self.local_store, table, t.spec.num_rows, t.spec.dim, t.spec.dtype, self.optimizer, rows, cols)

    @property
    def fused_optimizer(self) -> FusedOptimizer:
        """The optimizer state of this rank's shards: ``{"state": {"embedding_bags.<table>.weight": {"<table>.momentum1": ...}}}``."""
        return FusedOptimizer(self.optimizer, {f"embedding_bags.{name}.weight": state for name in self._tables
                                               if (state := self.views(name).state)})

    def _view_tables(self) -> list[str]:
        return list(self._tables)

    def close(self) -> None:
        """Flush and close this rank's store, after every rank got here. Collective."""
        try:
            self._begin(_Op.CLOSE)
        finally:
            self._metrics.close()
            if self.local_store is not None:
                self.local_store.close()

    def extra_repr(self) -> str:
        return (f"rank={self.rank}, world_size={self.world_size}, tables={list(self._tables)}, "
                f"optimizer={self.optimizer!r}, comm_dtype={self._comm_dtype}")
