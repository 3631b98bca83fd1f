"""TorchRec's planner over tierstore shards: the memory a shard takes is its tiers', not its table's.

TorchRec's ``EmbeddingShardingPlanner`` places shards so that each rank's HBM and DDR
hold them. A tierstore shard keeps its rows in LMDB on disk and only its tiers in
memory: ``hbm_rows`` and ``ddr_rows`` rows per table (with the optimizer state), at
most ``memory_budget`` bytes per rank. ``TieredShardEstimator`` gives the planner that
figure, plus TorchRec's own estimate of the ids and pooled embeddings a shard
moves (with a memory_budget, the budget is reserved once on each rank instead); its time estimate is TorchRec's for its fused CPU kernel (TorchRec's
hardware model has no entry for a customized kernel). ``planner(sharder,
topology, ...)`` is an EmbeddingShardingPlanner that uses it.
"""
from __future__ import annotations

from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.constants import BIGINT_DTYPE, DEFAULT_PERF_ESTIMATOR
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.estimator import EmbeddingPerfEstimatorFactory
from torchrec.distributed.planner.shard_estimators import (EmbeddingStorageEstimator, _calculate_shard_io_sizes,
                                                           get_num_poolings)
from torchrec.distributed.planner.storage_reservations import HeuristicalStorageReservation
from torchrec.distributed.planner.types import ParameterConstraints, ShardEstimator, ShardingOption, Storage, Topology

from tierstore.engine.memory import parse_bytes
from tierstore.errors import ArgumentTypeError, SettingError

KERNEL = EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value
_MODELLED_AS = EmbeddingComputeKernel.FUSED.value


def _rows(sizes, table: str) -> int:
    if sizes is None:
        return 0
    return int(sizes.get(table, 0)) if isinstance(sizes, dict) else int(sizes)


class TieredShardEstimator(ShardEstimator):
    """TorchRec's perf and storage estimates, with a tierstore shard's memory in place of its table's."""

    def __init__(self, sharder, topology: Topology, constraints: dict[str, ParameterConstraints] | None = None):
        self._sharder = sharder
        self._topology = topology
        self._constraints = constraints
        self._perf = EmbeddingPerfEstimatorFactory.create(DEFAULT_PERF_ESTIMATOR, topology=topology, constraints=constraints)
        self._storage = EmbeddingStorageEstimator(topology=topology, constraints=constraints)

    def estimate(self, sharding_options: list[ShardingOption], sharder_data_map=None) -> None:
        ours = [o for o in sharding_options if o.compute_kernel == KERNEL]
        for o in ours:
            o.compute_kernel = _MODELLED_AS
        try:
            self._perf.estimate(sharding_options, sharder_data_map=sharder_data_map)
            self._storage.estimate(sharding_options, sharder_data_map=sharder_data_map)
        finally:
            for o in ours:
                o.compute_kernel = KERNEL
        for o in ours:
            for shard, storage in zip(o.shards, self.shard_storages(o)):
                shard.storage = storage

    def shard_storages(self, o: ShardingOption) -> list[Storage]:
        """Each shard's memory: its tiers' rows (weights and optimizer state), at most the
        rank's memory_budget, and the ids and pooled embeddings it moves (TorchRec's estimate)."""
        opts, topo = self._sharder.store_options, self._topology
        batch_sizes = (self._constraints[o.name].batch_sizes if self._constraints and o.name in self._constraints
                       and self._constraints[o.name].batch_sizes else [o.batch_size] * o.num_inputs)
        inputs, outputs = _calculate_shard_io_sizes(
            sharding_type=o.sharding_type, batch_sizes=batch_sizes, world_size=topo.world_size,
            local_world_size=topo.intra_group_size, input_lengths=o.input_lengths, emb_dim=o.tensor.shape[1],
            shard_sizes=[s.size for s in o.shards], input_data_type_size=BIGINT_DTYPE,
            output_data_type_size=o.tensor.element_size(), num_poolings=get_num_poolings(self._constraints, o),
            is_pooled=o.is_pooled)
        on_gpu = topo.compute_device in ("cuda", "mtia")
        budget = opts.get("memory_budget") is not None
        optimizer = self._sharder.optimizer
        out = []
        for shard, io in zip(o.shards, (i + p for i, p in zip(inputs, outputs))):
            rows, cols = shard.size
            row_bytes = cols * o.tensor.element_size() + 4 * (optimizer.state_dim(cols) if optimizer else 0)
            hbm = min(rows, _rows(opts.get("hbm_rows"), o.name)) * row_bytes
            ddr = min(rows, _rows(opts.get("ddr_rows"), o.name)) * row_bytes
            if not on_gpu:  # the HBM tier lives in host memory on a CPU device
                hbm, ddr = 0, hbm + ddr
            if budget:  # host memory is within the rank's memory_budget, which RankBudget reserves once per rank
                ddr = 0
            out.append(Storage(hbm=hbm + (io if on_gpu else 0), ddr=ddr + (0 if on_gpu else io)))
        return out


class RankBudget(HeuristicalStorageReservation):
    """TorchRec's heuristic reservation, then the sharder's memory_budget from every rank's host
    memory: the budget is per rank, however many shards land there."""

    def __init__(self, budget: int, percentage: float = 0.15):
        super().__init__(percentage=percentage)
        self._budget = budget

    def reserve(self, topology: Topology, batch_size: int, module, sharders, constraints=None) -> Topology:
        reserved = super().reserve(topology, batch_size, module, sharders, constraints)
        for device in reserved.devices:
            device.storage.ddr -= self._budget
        return reserved


def planner(sharder, topology: Topology, batch_size: int = 512,
            constraints: dict[str, ParameterConstraints] | None = None, **kwargs) -> EmbeddingShardingPlanner:
    """TorchRec's EmbeddingShardingPlanner whose estimates count a tierstore shard's tiers
    (TieredShardEstimator) and, with a memory_budget, reserve it on every rank (RankBudget);
    ``kwargs`` go to the planner (proposer=, partitioner=, ...)."""
    if not isinstance(topology, Topology):
        raise ArgumentTypeError("topology must be TorchRec's torchrec.distributed.planner.Topology(world_size=..., "
                                f"compute_device=\"cpu\" or \"cuda\"), the ranks to plan over; got {type(topology).__name__}")
    enumerator = EmbeddingEnumerator(topology=topology, batch_size=batch_size, constraints=constraints,
                                     estimator=[TieredShardEstimator(sharder, topology, constraints)])
    budget = sharder.store_options.get("memory_budget")
    if budget is not None:
        if kwargs.get("storage_reservation") is not None:
            raise SettingError("with the sharder's memory_budget the planner reserves it on every rank (RankBudget, over "
                               "TorchRec's heuristic): drop storage_reservation=, or the sharder's memory_budget")
        kwargs["storage_reservation"] = RankBudget(parse_bytes(budget, "memory_budget"),
                                                   kwargs.pop("heuristical_storage_reservation_percentage", 0.15))
    return EmbeddingShardingPlanner(topology=topology, batch_size=batch_size, constraints=constraints, enumerator=enumerator,
                                    **kwargs)
