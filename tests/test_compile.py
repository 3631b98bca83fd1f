"""torch.compile, torch.fx, torch.export and torch.jit.script of models holding tierstore's
modules: the real compilers over real LMDB stores."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch._dynamo

import tierstore
from tierstore import TableSpec, TieredEmbeddingBag, TieredEmbeddingBagCollection

B, DIM = 6, 4


class TwoTower(torch.nn.Module):
    """Dense layers around tierstore.nn's modules."""

    def __init__(self, bag, ebc):
        super().__init__()
        self.bag, self.ebc = bag, ebc
        self.mlp = torch.nn.Sequential(torch.nn.Linear(3 * DIM, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

    def forward(self, ids, offsets, features):
        pooled = self.ebc(features)
        return self.mlp(torch.cat([self.bag(ids, offsets), pooled["a"], pooled["b"]], dim=1)).squeeze(1)


def two_tower(path):
    torch.manual_seed(0)
    bag = TieredEmbeddingBag(30, DIM, mode="sum", path=path / "bag", ddr_rows=5, device="cpu", optimizer=tierstore.optim.Adagrad(lr=0.1))
    ebc = TieredEmbeddingBagCollection([TableSpec("a", 20, DIM), TableSpec("b", 25, DIM)], path=path / "ebc", ddr_rows=4,
                                       device="cpu", optimizer=tierstore.optim.RowWiseAdagrad(lr=0.1))
    return TwoTower(bag, ebc)


def tower_batch(g):
    ids = torch.randint(0, 20, (4 * B,), generator=g)
    offsets = torch.arange(0, 4 * B, 4)
    return ids, offsets, {"a": (ids.flip(0), offsets), "b": (ids + 3, offsets)}


def tower_rows(model):
    return [model.bag.store.read("t0", torch.arange(30), with_state=True)] + \
        [model.ebc.store.read(t, torch.arange(n), with_state=True) for t, n in (("a", 20), ("b", 25))]


def train_tower(model, backend=None, steps=4):
    torch._dynamo.reset()
    opt = torch.optim.SGD(model.mlp.parameters(), lr=0.1)
    fwd = torch.compile(model, backend=backend) if backend else model
    g, losses = torch.Generator().manual_seed(1), []
    for _ in range(steps):
        ids, offsets, features = tower_batch(g)
        loss = fwd(ids, offsets, features).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses, tower_rows(model)


def same(eager, compiled, backend) -> None:
    """aot_eager (AOTAutograd's graphs run by eager kernels): bit for bit. Inductor generates
    its own kernels for the dense layers, whose last bits may differ from eager's (a property
    of inductor, not of the store: the rows then follow their gradients)."""
    for a, b in zip(eager[0] + eager[1], compiled[0] + compiled[1]):
        if backend == "aot_eager":
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


COMPILE_BACKENDS = ["aot_eager", "inductor"]


@pytest.mark.parametrize("backend", COMPILE_BACKENDS)
def test_compile_breaks_the_graph_at_the_store_and_trains_as_eager(tmp_path, backend):
    eager = train_tower(two_tower(tmp_path / "e"))
    torch._dynamo.utils.counters.clear()
    compiled = train_tower(two_tower(tmp_path / "c"), backend)
    same(eager, compiled, backend)
    breaks = torch._dynamo.utils.counters["graph_break"]
    assert breaks and all("torch.compiler.disable" in reason for reason in breaks), breaks  # clean breaks only
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # the dense layers compiled


def test_fx_traces_a_model_with_the_modules_as_leaves(tmp_path):
    model = two_tower(tmp_path)
    gm = torch.fx.symbolic_trace(model)
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"][:2] == ["ebc", "bag"]
    ids, offsets, features = tower_batch(torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(gm(ids, offsets, features), model(ids, offsets, features))
    with pytest.raises(TypeError, match="Trace the model that holds it"):
        torch.fx.symbolic_trace(model.bag)


def test_export_and_jit_script_refuse_naming_torch_compile(tmp_path):
    model = two_tower(tmp_path).eval()
    ids, offsets, features = tower_batch(torch.Generator().manual_seed(3))
    with pytest.raises(RuntimeError, match=r"torch\.export cannot capture TieredEmbeddingBag.*torch\.compile"):
        torch.export.export(model, (ids, offsets, features), strict=False)
    with pytest.raises(RuntimeError, match=r"torch\.jit\.script cannot compile .*torch\.compile"):
        torch.jit.script(model)


# -- TorchRec's models -----------------------------------------------------------------------------
def torchrec_models():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("torchrec", reason="TorchRec (optional peer) is not installed: see docs")


def configs():
    from torchrec import EmbeddingBagConfig

    return [EmbeddingBagConfig(name="user", embedding_dim=DIM, num_embeddings=50, feature_names=["u"]),
            EmbeddingBagConfig(name="item", embedding_dim=DIM, num_embeddings=40, feature_names=["i"])]


def kjt_batch(g):
    from torchrec import KeyedJaggedTensor

    lengths = torch.randint(0, 4, (2 * B,), generator=g)
    values = torch.randint(0, 40, (int(lengths.sum()),), generator=g)
    return KeyedJaggedTensor.from_lengths_sync(keys=["u", "i"], values=values, lengths=lengths)


def dlrm(path):
    from torchrec.models.dlrm import DLRM
    from tierstore.torchrec import TieredEmbeddingBagCollection as Ours

    torch.manual_seed(0)
    ebc = Ours(configs(), path=path, ddr_rows=8, device="cpu", optimizer=tierstore.optim.RowWiseAdagrad(lr=0.1))
    return DLRM(embedding_bag_collection=ebc, dense_in_features=3, dense_arch_layer_sizes=[8, DIM], over_arch_layer_sizes=[8, 1])


def train_dlrm(model, backend=None, steps=4):
    torch._dynamo.reset()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fwd = torch.compile(model, backend=backend) if backend else model
    g, losses = torch.Generator().manual_seed(4), []
    for _ in range(steps):
        kjt, x, y = kjt_batch(g), torch.randn(B, 3, generator=g), (torch.rand(B, generator=g) < 0.5).float()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(fwd(x, kjt).squeeze(1), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    ebc = model.sparse_arch.embedding_bag_collection
    rows = [ebc.store.read(c.name, torch.arange(c.num_embeddings), with_state=True) for c in configs()]
    ebc.store.close()  # now, not when the compiled graphs that hold the model go, after tmp_path has
    return losses, rows


@pytest.mark.parametrize("backend", COMPILE_BACKENDS)
def test_compiled_dlrm_trains_as_eager(tmp_path, backend):
    torchrec_models()
    eager = train_dlrm(dlrm(tmp_path / "e"))
    torch._dynamo.utils.counters.clear()
    compiled = train_dlrm(dlrm(tmp_path / "c"), backend)
    same(eager, compiled, backend)
    breaks = torch._dynamo.utils.counters["graph_break"]
    assert breaks and all("torch.compiler.disable" in reason for reason in breaks), breaks


@pytest.mark.parametrize("trace", ["torch.fx", "torchrec.fx"])
def test_fx_traces_dlrm_and_the_collection_as_torchrecs(tmp_path, trace):
    torchrec = torchrec_models()
    import torchrec.fx  # noqa: F401

    symbolic_trace = torch.fx.symbolic_trace if trace == "torch.fx" else torchrec.fx.symbolic_trace
    model = dlrm(tmp_path)
    ebc = model.sparse_arch.embedding_bag_collection
    g = torch.Generator().manual_seed(5)
    kjt, x = kjt_batch(g), torch.randn(B, 3, generator=g)
    gm = symbolic_trace(model)
    tables = [n.target for n in gm.graph.nodes if n.op == "call_module" and "embedding_bags" in n.target]
    assert tables == ["sparse_arch.embedding_bag_collection.embedding_bags.user", "sparse_arch.embedding_bag_collection.embedding_bags.item"]
    with torch.no_grad():
        assert torch.equal(gm(x, kjt), model(x, kjt))
        traced = symbolic_trace(ebc)  # the collection itself, as TorchRec's traces
        assert torch.equal(traced(kjt).values(), ebc(kjt).values())


# -- the device step: held tables compile whole and export ------------------------------------------
def held_demo(path, device="cpu"):
    """tierstore demo's DLRM over tables held in HBM (hold_resident), and its click data."""
    from tierstore.tools.demo import DLRM, ClickData, DemoConfig, _specs, seeded

    cfg = DemoConfig(dir=path, rows=120, tables=2, batch=8, dim=DIM, hbm_rows=120, ddr_rows=240)
    ebc = TieredEmbeddingBagCollection(_specs(cfg), path=path / "store", hbm_rows=cfg.rows, device=device,
                                       optimizer=tierstore.optim.Adagrad(lr=0.1)).hold_resident()
    return DLRM(ebc, cfg.table_names, cfg.dim, seeded(1)).to(device), ClickData(cfg, seeded(0))


def on(device, batch):
    dense, sparse, labels = batch
    return dense.to(device), {k: tuple(t.to(device) for t in f) for k, f in sparse.items()}, labels.to(device)


def train_demo(model, data, backend=None, steps=4, mode=None):
    torch._dynamo.reset()
    device = next(model.parameters()).device
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fwd = torch.compile(model, backend=backend, fullgraph=True, mode=mode) if backend else model
    g, losses = torch.Generator().manual_seed(2), []
    for _ in range(steps):
        dense, sparse, labels = on(device, data.batch(g))
        loss = torch.nn.functional.binary_cross_entropy_with_logits(fwd(dense, sparse), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    store = model.embeddings.store
    return losses, [store.read(t, torch.arange(120), with_state=True) for t in model.names]


@pytest.mark.parametrize("backend", COMPILE_BACKENDS)
def test_held_demo_dlrm_compiles_whole_and_trains_as_eager(tmp_path, backend):
    """fullgraph=True: no graph break, the lookup and its fused update inside the graphs."""
    eager = train_demo(*held_demo(tmp_path / "e"))
    torch._dynamo.utils.counters.clear()
    compiled = train_demo(*held_demo(tmp_path / "c"), backend=backend)
    same(eager, compiled, backend)
    assert not torch._dynamo.utils.counters["graph_break"]
    assert not torch.equal(eager[1][0], held_demo(tmp_path / "fresh")[0].embeddings.store.read("cat0", torch.arange(120),
                                                                                                 with_state=True))


def test_held_demo_dlrm_exports_with_the_lookup_as_a_leaf(tmp_path):
    model, data = held_demo(tmp_path)
    g = torch.Generator().manual_seed(3)
    dense, sparse, _ = data.batch(g)
    program = torch.export.export(model, (dense, sparse))
    ops = [n.target for n in program.graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.tierstore.bag_lookup.default) == 2
    assert not any("embedding_bag" in str(op) or "searchsorted" in str(op) for op in ops)  # inside the leaves
    exported = program.module()
    assert torch.equal(exported(dense, sparse), model(dense, sparse))
    train_demo(model, data, steps=2)  # the program reads the store's rows as they are now
    assert torch.equal(exported(dense, sparse), model(dense, sparse))


@pytest.mark.gpu
def test_held_demo_dlrm_captured_by_cuda_graphs_trains_as_eager(tmp_path):
    """mode="reduce-overhead": the held step (lookup, update in place) inside CUDA graphs."""
    eager = train_demo(*held_demo(tmp_path / "e", "cuda"), steps=6)
    compiled = train_demo(*held_demo(tmp_path / "c", "cuda"), backend="inductor", mode="reduce-overhead", steps=6)
    same(eager, compiled, "inductor")
