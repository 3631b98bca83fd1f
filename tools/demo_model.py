"""The demo's model and data: a small DLRM over synthetic clicks whose ids follow a Zipf law.

Shared by ``tierstore demo`` (tools/demo.py) and the benchmarks that train the same model.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from tierstore.tools.demo import DemoConfig

DENSE_FEATURES = 13

class ZipfIds:
    """Ids in [0, n) with P(rank k) proportional to k**-alpha; a fixed random
    permutation scatters the ranks over the ids, so hot rows are not adjacent."""

    def __init__(self, n: int, alpha: float, generator: torch.Generator):
        p = torch.arange(1, n + 1, dtype=torch.float64).pow_(-alpha)
        self.cdf = torch.cumsum(p, 0).div_(p.sum())
        self.perm = torch.randperm(n, generator=generator)
        self.n = n

    def sample(self, size: int, generator: torch.Generator) -> torch.Tensor:
        u = torch.rand(size, dtype=torch.float64, generator=generator)
        rank = torch.searchsorted(self.cdf, u).clamp_(max=self.n - 1)
        return self.perm[rank]


class ClickData:
    """Synthetic click batches. Labels come from a hidden logistic model: a
    dense linear term plus a hidden affinity per (table, row), averaged over
    each bag, so a model that learns the rows can predict the clicks."""

    def __init__(self, cfg: DemoConfig, generator: torch.Generator):
        self.cfg = cfg
        self.zipf = [ZipfIds(cfg.rows, cfg.alpha, generator) for _ in cfg.table_names]
        self.w_dense = torch.randn(DENSE_FEATURES, generator=generator) / math.sqrt(DENSE_FEATURES)
        self.affinity = [torch.randn(cfg.rows, generator=generator) for _ in cfg.table_names]

    def batch(self, generator: torch.Generator):
        cfg, B = self.cfg, self.cfg.batch
        dense = torch.randn(B, DENSE_FEATURES, generator=generator)
        logit = dense @ self.w_dense - 0.5
        sparse = {}
        for name, zipf, aff in zip(cfg.table_names, self.zipf, self.affinity):
            sizes = torch.randint(1, 2 * cfg.pooling, (B,), generator=generator)
            ids = zipf.sample(int(sizes.sum()), generator)
            offsets = torch.zeros(B, dtype=torch.int64)
            offsets[1:] = torch.cumsum(sizes[:-1], 0)
            bag_of = torch.repeat_interleave(torch.arange(B), sizes)
            logit += 1.5 * torch.zeros(B).index_add_(0, bag_of, aff[ids]) / sizes
            sparse[name] = (ids, offsets)
        labels = torch.bernoulli(torch.sigmoid(logit), generator=generator)
        return dense, sparse, labels


def _mlp(sizes: list[int], generator: torch.Generator) -> nn.Sequential:
    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        lin = nn.Linear(a, b)
        bound = 1 / math.sqrt(a)
        nn.init.uniform_(lin.weight, -bound, bound, generator=generator)
        nn.init.uniform_(lin.bias, -bound, bound, generator=generator)
        layers.append(lin)
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """Bottom MLP, embedding bags, pairwise dot interaction, top MLP."""

    def __init__(self, embeddings: Callable[[Mapping], Mapping[str, torch.Tensor]], names: list[str], dim: int,
                 generator: torch.Generator):
        super().__init__()
        self.embeddings, self.names = embeddings, names
        self.bottom = _mlp([DENSE_FEATURES, 64, dim], generator)
        k = len(names) + 1
        self.register_buffer("pairs", torch.triu_indices(k, k, offset=1), persistent=False)
        self.top = _mlp([dim + k * (k - 1) // 2, 64, 1], generator)

    def forward(self, dense: torch.Tensor, sparse: Mapping) -> torch.Tensor:
        x = self.bottom(dense)
        pooled = self.embeddings(sparse)
        z = torch.stack([x] + [pooled[n] for n in self.names], dim=1)
        inter = torch.bmm(z, z.transpose(1, 2))[:, self.pairs[0], self.pairs[1]]
        return self.top(torch.cat([x, inter], dim=1)).squeeze(1)


class InMemoryBags(nn.Module):
    """The --compare twin: one nn.EmbeddingBag(sparse=True) per table, same initial rows."""

    def __init__(self, initial: Mapping[str, torch.Tensor]):
        super().__init__()
        self.bags = nn.ModuleDict({n: nn.EmbeddingBag.from_pretrained(w, freeze=False, mode="sum", sparse=True)
                                   for n, w in initial.items()})

    def forward(self, sparse):
        return {n: self.bags[n](*f) for n, f in sparse.items()}
