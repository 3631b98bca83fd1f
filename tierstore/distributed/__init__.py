"""Embedding tables sharded across processes on torch.distributed.

``ShardedEmbeddingBagCollection`` is TieredEmbeddingBagCollection split by a
ShardingPlan: each rank keeps its shards in a TieredStore of its own under
``path/rank-<r>``; forward takes the rank's local batch and returns its pooled
bags; backward sends each row's gradient to the rank that owns it, which runs
the fused optimizer there.

Determinism: with float32 exchange, N ranks train exactly as one process
training TieredEmbeddingBagCollection on the concatenated global batch (rank
0's local batch, then rank 1's, ...), bit for bit. For that:
- the requesting rank pools with the same embedding_bag call as nn.py, from
  rows it fetched from their owners;
- an owner sums a row's gradient from each occurrence's contribution (the
  grad_out row of its bag, its weight), not from per-rank partial sums, and
  in the order the single process sums them: the order torch.sort gives the
  table's global ids. Ids travel by all-to-all, each to the ranks holding its
  row (every rank receives the ids of its shards, not the global batch): a
  table's or column shard's owner gets all of the table's ids and sorts them as
  the single process does; a row shard's owner sorts its own ids stably, which
  is torch.sort's order where that is stable (up to 16 ids, and from its radix
  sort's threshold, 32,768 ids, on: ``sort_is_stable``). Between the two,
  torch.sort's order of equal ids depends on every id of the table's global
  batch, so there a training forward sends a row-sharded table's ids whole to
  each of its owners (8 bytes per entry and owner). A stable sort on both
  sides would spare that but part the single process from torch: its order
  is the one nn.EmbeddingBag's sparse gradients are coalesced in, which keeps
  its rows bit-identical to torch's (Adam, tests/test_nn.py);
- a column shard of a row-wise optimizer (RowWiseAdagrad, whose step divides
  by the mean of the whole row's squared gradient) receives whole-row
  gradients and keeps the row's accumulator itself; partial sums of squares
  combined across shards would round differently from the single process.

Every collective call begins with one all_gather of a fixed-size header: the
call (an op code and its argument: table, with_state, training or not, the
forward a backward belongs to), a hash of the settings that shape the messages
(plan, tables, optimizer, comm_dtype, mode; also compared one by one at
construction: SettingsMismatchError), an ok/error flag and the id count. A call
that moves ids then exchanges their sizes (all_to_all_single of 3 int64s a table:
what the receiver gets of the table, the sender's id count, its weight flag), so
each rank knows what it receives before the ids and rows move. The header is the same size whatever was called, so ranks that call different
collectives compare their calls (RankFailedError naming each rank's call, on
every rank) instead of handing gloo messages of different sizes, which aborts
the process. Bad input on one rank raises its own named error there
(BagIndexError, KeyError, ...) and RankFailedError naming it on the others,
before any row moves. A rank whose training forward had no outputs (an empty
batch, ``{}``) has nothing to run backward through: it takes part in the
others' backward from the header of its next collective call. Work between
collectives that may fail on one rank (the owners' store reads, a write,
flush, checkpoint) is followed by such an exchange too, so no rank waits in a
collective that a failed rank never enters. A collective that fails (a dead
rank, a timeout set by ``init_process_group(timeout=...)``) raises
RankFailedError. The owners' update at the end of backward has no collective
after it: a failure there raises on that rank only, and the others learn of it
at their next collective (RankFailedError once the rank exits, or the timeout).
"""
from tierstore.capacity.planner import plan
from tierstore.distributed.collection import ShardedEmbeddingBagCollection
from tierstore.distributed.comm import SettingsMismatchError
from tierstore.training.sharding import PlanMismatchError, RankFailedError, Shard, ShardingPlan, TablePlan

__all__ = ["PlanMismatchError", "RankFailedError", "SettingsMismatchError", "Shard", "ShardedEmbeddingBagCollection",
           "ShardingPlan", "TablePlan", "plan"]
