"""tierstore.torchrec against the real TorchRec: its EmbeddingBagCollection's
output, and torchrec.models.dlrm.DLRM trained on both collections."""
import functools
import warnings

import pytest
import torch

import tierstore
from tierstore.engine.prefetch import LookaheadLoader

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # FBGEMM and TorchRec warn about CPU-only builds on import
    torchrec = pytest.importorskip("torchrec", reason="TorchRec (optional peer) is not installed: see the README's TorchRec section")
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_configs import DataType
    from tierstore.torchrec import TieredEmbeddingBagCollection

B, DIM = 6, 4


def configs(shared=True):
    """Two tables, one with mean pooling; "shared" is a feature both pool (DLRM's
    SparseArch, which looks features up by name, cannot take one)."""
    return [
        EmbeddingBagConfig(name="user", embedding_dim=DIM, num_embeddings=50, feature_names=["u_click"] + ["shared"] * shared),
        EmbeddingBagConfig(name="item", embedding_dim=DIM, num_embeddings=40, feature_names=["i_view"] + ["shared"] * shared,
                           pooling=PoolingType.MEAN),
    ]


def batch(g, weighted=False):
    keys = ["u_click", "shared", "i_view"]
    lengths = torch.randint(0, 4, (len(keys) * B,), generator=g)
    values = (torch.rand(int(lengths.sum()), generator=g) ** 2 * 40).long()  # < 40: valid in both tables, repeats
    weights = torch.rand(len(values), generator=g) + 0.5 if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths, weights=weights)


def theirs_with_our_rows(ours):
    ebc = EmbeddingBagCollection(tables=configs(len(ours.embedding_bag_configs()[0].feature_names) > 1), is_weighted=ours.is_weighted())
    with torch.no_grad():
        for cfg in ours.embedding_bag_configs():
            ebc.embedding_bags[cfg.name].weight.copy_(ours.store.read(cfg.name, torch.arange(cfg.num_embeddings)))
    return ebc


def test_output_has_torchrecs_keys_layout_and_values(tmp_path):
    ours = TieredEmbeddingBagCollection(configs(), path=tmp_path, ddr_rows=8, device="cpu")
    theirs = theirs_with_our_rows(ours)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        kjt = batch(g)
        a, b = ours(kjt), theirs(kjt)
        assert a.keys() == b.keys() == ["u_click", "shared@user", "i_view", "shared@item"]
        assert a.length_per_key() == b.length_per_key() and a.values().shape == b.values().shape == (B, 4 * DIM)
        torch.testing.assert_close(a.values(), b.values(), rtol=0, atol=1e-6)
    ours.close()


def test_dlrm_trains_the_same_with_sgd_through_lmdb(tmp_path):
    lr = 0.1
    ours = TieredEmbeddingBagCollection(configs(shared=False), path=tmp_path, ddr_rows=6, device="cpu", optimizer=tierstore.optim.SGD(lr=lr))
    theirs = theirs_with_our_rows(ours)
    torch.manual_seed(0)
    model_ours = DLRM(embedding_bag_collection=ours, dense_in_features=3, dense_arch_layer_sizes=[8, DIM],
                      over_arch_layer_sizes=[8, 1])
    model_theirs = DLRM(embedding_bag_collection=theirs, dense_in_features=3, dense_arch_layer_sizes=[8, DIM],
                        over_arch_layer_sizes=[8, 1])
    dense = {k: v for k, v in model_ours.state_dict().items() if "embedding_bag_collection" not in k}
    model_theirs.load_state_dict(dense, strict=False)
    opt_ours = torch.optim.SGD([p for p in model_ours.parameters()], lr=lr)  # the rows are not parameters: fused SGD
    opt_theirs = torch.optim.SGD(model_theirs.parameters(), lr=lr)
    g = torch.Generator().manual_seed(1)
    for step in range(12):
        kjt, x, y = batch(g), torch.randn(B, 3, generator=g), (torch.rand(B, generator=g) < 0.5).float()
        losses = []
        for model, opt in ((model_ours, opt_ours), (model_theirs, opt_theirs)):
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x, kjt).squeeze(1), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=1e-5), step
    assert ours.store.stats()["ssd"]["writes"] > 0  # rows went through LMDB
    for cfg in configs(shared=False):
        a, b = ours.store.read(cfg.name, torch.arange(cfg.num_embeddings)), theirs.embedding_bags[cfg.name].weight.detach()
        torch.testing.assert_close(a, b, rtol=0, atol=1e-8)  # 1e-10 seen: the step rounded before the add (torch's SGD fuses it)
    ours.close()


def test_lookahead_prefetch_over_keyed_jagged_batches_changes_nothing(tmp_path):
    g = torch.Generator().manual_seed(2)
    data = [(batch(g, weighted=True), torch.randn(B, 4 * DIM, generator=g)) for _ in range(10)]
    tables = [EmbeddingBagConfig(name=c.name, embedding_dim=DIM, num_embeddings=c.num_embeddings, feature_names=c.feature_names)
              for c in configs()]  # weighted features: sum pooling
    rows = {}
    for depth in (0, 3):
        ebc = TieredEmbeddingBagCollection(tables, path=tmp_path / str(depth), is_weighted=True, ddr_rows=10, device="cpu",
                                           optimizer=tierstore.optim.RowWiseAdagrad(lr=0.2))
        for kjt, grad in LookaheadLoader(data, ebc, depth=depth, ids=lambda b: ebc.batch_reads(b[0])):
            ebc(kjt).values().backward(grad)
        rows[depth] = {c.name: ebc.store.read(c.name, torch.arange(c.num_embeddings), with_state=True) for c in tables}
        if depth:
            assert ebc.store.prefetch_stats()["tables"]["user"]["served_rows"] > 0
        ebc.close()
    assert all(torch.equal(rows[0][k], rows[3][k]) for k in rows[0])


@pytest.mark.parametrize("change, match", [
    (dict(pooling=PoolingType.NONE), "pooling"),
    (dict(data_type=DataType.INT8), "data_type"),
    (dict(init_fn=lambda w: w.fill_(0.5)), "init_fn"),
    (dict(init_fn=functools.partial(torch.nn.init.trunc_normal_, std=0.02)), "init_fn"),
])
def test_what_it_cannot_do_is_refused(tmp_path, change, match):
    cfg = EmbeddingBagConfig(name="t", embedding_dim=DIM, num_embeddings=10, **change)
    with pytest.raises(ValueError, match=match):
        TieredEmbeddingBagCollection([cfg], path=tmp_path / "s", device="cpu")
    assert not (tmp_path / "s").exists()  # refused before the store is created


def test_a_batch_without_a_feature_names_it(tmp_path):
    ours = TieredEmbeddingBagCollection(configs(), path=tmp_path, device="cpu")
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["u_click"], values=torch.tensor([1]), lengths=torch.tensor([1]))
    with pytest.raises(KeyError, match=r"\['shared', 'i_view'\] are not in the KeyedJaggedTensor"):
        ours(kjt)
    ours.close()


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("kernels", ["torch", "fbgemm"])
def test_rowwise_adagrad_agrees_step_by_step_with_torchrecs_fused_optimizer(tmp_path, kernels, shared):
    """shared: each table pools two features, a row both read takes one step on the sum of
    their gradients (its state grows by the square of the sum), as FBGEMM's TBE updates it."""
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
    from torchrec.optim import RowWiseAdagrad

    lr, eps = 0.1, 1e-8
    tables = configs(shared)
    ours = TieredEmbeddingBagCollection(tables, path=tmp_path, ddr_rows=6, device="cpu", kernels=kernels,
                                        optimizer=tierstore.optim.RowWiseAdagrad(lr=lr, eps=eps))
    theirs = FusedEmbeddingBagCollection(tables=configs(shared), optimizer_type=RowWiseAdagrad,
                                         optimizer_kwargs={"lr": lr, "eps": eps})
    # FBGEMM's module per (pooling, dtype) group holds its tables' weights and row-wise state
    state = {cfg.name: s[0] for module, group in zip(theirs._emb_modules, theirs._key_to_tables.values())
             for cfg, s in zip(group, module._emb_module.split_optimizer_states())}
    g = torch.Generator().manual_seed(3)
    for step in range(8):
        with torch.no_grad():  # the same rows and state before each step
            for cfg in tables:
                rows = ours.store.read(cfg.name, torch.arange(cfg.num_embeddings), with_state=True)
                theirs.embedding_bags[cfg.name].weight.copy_(rows[:, :DIM])
                state[cfg.name].copy_(rows[:, DIM])
        kjt, grad = batch(g), torch.randn(B, (2 + 2 * shared) * DIM, generator=g)
        ours(kjt).values().backward(grad)
        theirs(kjt).values().backward(grad)
        for cfg in tables:
            rows = ours.store.read(cfg.name, torch.arange(cfg.num_embeddings), with_state=True)
            if kernels == "fbgemm" and not shared:  # the same kernel: the same bits (with two features a row's
                # gradient is summed over them in another order: 1 ulp seen)
                assert torch.equal(rows[:, :DIM], theirs.embedding_bags[cfg.name].weight), step
                assert torch.equal(rows[:, DIM], state[cfg.name]), step
            else:  # two correct float32 implementations, rounding in their own order (3e-8 seen, rows ~0.1)
                torch.testing.assert_close(rows[:, :DIM], theirs.embedding_bags[cfg.name].weight.detach(), rtol=0, atol=1e-7)
                torch.testing.assert_close(rows[:, DIM], state[cfg.name], rtol=1e-6, atol=0)
    assert ours.store.stats()["ssd"]["writes"] > 0
    ours.close()


# -- checkpoints ----------------------------------------------------------------------
def dlrm(ebc):
    torch.manual_seed(0)
    return DLRM(embedding_bag_collection=ebc, dense_in_features=3, dense_arch_layer_sizes=[8, DIM], over_arch_layer_sizes=[8, 1])


def test_a_torchrec_dlrm_checkpoint_loads_strictly_into_ours_and_back(tmp_path):
    theirs = dlrm(EmbeddingBagCollection(tables=configs(shared=False)))
    ours = dlrm(TieredEmbeddingBagCollection(configs(shared=False), path=tmp_path, ddr_rows=6, device="cpu",
                                             optimizer=tierstore.optim.SGD(lr=0.1)))
    assert list(ours.state_dict()) == list(theirs.state_dict())  # sparse_arch.embedding_bag_collection.embedding_bags.<t>.weight
    ours.load_state_dict(theirs.state_dict())  # strict
    g = torch.Generator().manual_seed(5)
    kjt, x = batch(g), torch.randn(B, 3, generator=g)
    assert torch.equal(ours(x, kjt), theirs(x, kjt))
    ours(x, kjt).sum().backward()  # trains our rows
    back = dlrm(EmbeddingBagCollection(tables=configs(shared=False)))
    back.load_state_dict(ours.state_dict())  # and back, strict
    for cfg in configs(shared=False):
        w = back.sparse_arch.embedding_bag_collection.embedding_bags[cfg.name].weight
        assert torch.equal(w.detach(), ours.sparse_arch.embedding_bag_collection.store.read(cfg.name, torch.arange(cfg.num_embeddings)))
    assert torch.equal(back(x, kjt), ours(x, kjt))
    ours.sparse_arch.embedding_bag_collection.close()


def test_dcp_round_trip_of_a_dlrm_with_its_fused_optimizer_state(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torchrec.optim.keyed import KeyedOptimizer

    ebc = TieredEmbeddingBagCollection(configs(shared=False), path=tmp_path / "s", ddr_rows=6, device="cpu",
                                       optimizer=tierstore.optim.RowWiseAdagrad(lr=0.1))
    model = dlrm(ebc)
    assert isinstance(ebc.fused_optimizer, KeyedOptimizer)
    state = ebc.fused_optimizer.state_dict()["state"]
    assert {k: {n: tuple(v.shape) for n, v in s.items()} for k, s in state.items()} == {
        "embedding_bags.user.weight": {"user.momentum1": (50,)}, "embedding_bags.item.weight": {"item.momentum1": (40,)}}
    dense = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(6)

    def train(steps):
        for _ in range(steps):
            kjt, x = batch(g), torch.randn(B, 3, generator=g)
            dense.zero_grad()
            model(x, kjt).sum().backward()
            dense.step()

    def everything():
        rows = {c.name: ebc.store.read(c.name, torch.arange(c.num_embeddings), with_state=True) for c in configs(shared=False)}
        return rows, {k: v.detach().clone() for k, v in model.state_dict().items() if "embedding_bag" not in k}

    train(3)
    saved = everything()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... a single process"
        dcp.save({"model": model.state_dict(), "optim": ebc.fused_optimizer.state_dict()}, checkpoint_id=tmp_path / "ckpt")
        train(2)
        sd = {"model": model.state_dict(), "optim": ebc.fused_optimizer.state_dict()}
        dcp.load(sd, checkpoint_id=tmp_path / "ckpt")
    model.load_state_dict(sd["model"])
    ebc.fused_optimizer.load_state_dict(sd["optim"])
    rows, dense_now = everything()
    for k in saved[0]:
        assert torch.equal(rows[k].view(torch.int32), saved[0][k].view(torch.int32)), k
    for k in saved[1]:
        assert torch.equal(dense_now[k], saved[1][k]), k
    ebc.close()


# -- the rest of TorchRec's contract ------------------------------------------------------
def read_table(ebc, cfg, with_state=False):
    return ebc.store.read(cfg.name, torch.arange(cfg.num_embeddings), with_state=with_state)


def test_init_fn_and_weight_init_bounds_give_each_row_its_value_deterministically(tmp_path):
    tables = [EmbeddingBagConfig(name="lo", embedding_dim=DIM, num_embeddings=500, feature_names=["a"],
                                 weight_init_min=0.25, weight_init_max=0.5),
              EmbeddingBagConfig(name="n", embedding_dim=DIM, num_embeddings=500, feature_names=["b"],
                                 init_fn=functools.partial(torch.nn.init.normal_, mean=3.0, std=0.1)),
              EmbeddingBagConfig(name="z", embedding_dim=DIM, num_embeddings=50, feature_names=["c"],
                                 init_fn=torch.nn.init.zeros_)]
    a = TieredEmbeddingBagCollection(tables, path=tmp_path / "a", device="cpu")
    b = TieredEmbeddingBagCollection(tables, path=tmp_path / "b", device="cpu")
    lo, n, z = (read_table(a, t) for t in tables)
    assert 0.25 <= float(lo.min()) and float(lo.max()) < 0.5 and float(lo.max()) > 0.45
    assert abs(float(n.mean()) - 3.0) < 0.01 and abs(float(n.std()) - 0.1) < 0.01
    assert not bool(z.any())
    assert all(torch.equal(read_table(a, t), read_table(b, t)) for t in tables)  # per row, whatever the store
    a.close()
    b.close()


def test_fp16_tables_pool_their_half_rows_in_float32(tmp_path):
    tables = [EmbeddingBagConfig(name=c.name, embedding_dim=DIM, num_embeddings=c.num_embeddings, feature_names=c.feature_names,
                                 pooling=c.pooling, data_type=DataType.FP16) for c in configs(shared=False)]
    ours = TieredEmbeddingBagCollection(tables, path=tmp_path, ddr_rows=6, device="cpu")
    theirs = theirs_with_our_rows(ours)  # float32 copies of the half rows
    for cfg in tables:
        rows = read_table(ours, cfg)
        assert torch.equal(rows.half().float(), rows)
    kjt = batch(torch.Generator().manual_seed(7))
    assert torch.equal(ours(kjt).values(), theirs(kjt).values())
    ours.close()


def vbe_batch():
    """Variable batch sizes: feature u_click has 2 bags, i_view 3, spread to 4 samples by inverse indices."""
    return KeyedJaggedTensor(keys=["u_click", "i_view"], values=torch.tensor([1, 2, 3, 4, 5, 6, 7]),
                             lengths=torch.tensor([2, 1, 1, 0, 3]), stride_per_key_per_rank=[[2], [3]],
                             inverse_indices=(["u_click", "i_view"], torch.tensor([[0, 1, 1, 0], [2, 0, 1, 2]])))


def test_variable_batch_sizes_tensordict_and_torchrecs_signature_as_torchrec(tmp_path):
    from torchrec.modules.embedding_modules import EmbeddingBagCollectionInterface

    ours = TieredEmbeddingBagCollection(configs(shared=False), False, "cpu", path=tmp_path)  # (tables, is_weighted, device)
    assert isinstance(ours, EmbeddingBagCollectionInterface) and not ours.is_weighted()
    assert ours.embedding_bags["user"] is ours.bags["user"] and "embedding_bags.item" in dict(ours.named_modules())
    theirs = theirs_with_our_rows(ours)
    kjt = vbe_batch()
    got = ours(kjt)
    assert got.values().shape == (4, 2 * DIM) and torch.equal(got.values(), theirs(kjt).values())
    tensordict = pytest.importorskip("tensordict", reason="tensordict (TorchRec's optional input type) is not installed")
    plain = batch(torch.Generator().manual_seed(8)).to_dict()
    td = tensordict.TensorDict({k: torch.nested.nested_tensor_from_jagged(jt.values(), lengths=jt.lengths())
                                for k, jt in plain.items() if k != "shared"}, batch_size=[B])
    assert torch.equal(ours(td).values(), theirs(td).values())
    ours.close()


def test_meta_device_creates_no_files_and_gives_shapes(tmp_path):
    ours = TieredEmbeddingBagCollection(configs(shared=False), device="meta", path=tmp_path / "s")
    assert not (tmp_path / "s").exists() and ours.device == torch.device("meta")
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == {
        "embedding_bags.user.weight": (50, DIM), "embedding_bags.item.weight": (40, DIM)}
    kjt = batch(torch.Generator().manual_seed(9)).to("meta")
    theirs = EmbeddingBagCollection(tables=configs(shared=False), device=torch.device("meta"))
    assert ours(kjt).values().shape == theirs(kjt).values().shape == (B, 2 * DIM)
    with pytest.raises(RuntimeError, match="meta device has no rows"):
        ours.fused_optimizer


def test_reset_parameters_and_a_zero_learning_rate(tmp_path):
    opt = tierstore.optim.Adagrad(lr=0.5)
    ours = TieredEmbeddingBagCollection(configs(shared=False), path=tmp_path, ddr_rows=6, device="cpu", optimizer=opt)
    initial = {c.name: read_table(ours, c, with_state=True) for c in configs(shared=False)}
    g = torch.Generator().manual_seed(10)
    opt.lr = 0.0  # a warm-up schedule's first step: the state accumulates, no weight moves (as torch.optim.Adagrad)
    ours(batch(g)).values().square().sum().backward()
    after = {c.name: read_table(ours, c, with_state=True) for c in configs(shared=False)}
    assert all(torch.equal(after[k][:, :DIM], initial[k][:, :DIM]) for k in after)
    assert any(bool(after[k][:, DIM:].any()) for k in after)
    opt.lr = 0.5
    ours(batch(g)).values().square().sum().backward()
    assert not all(torch.equal(read_table(ours, c), initial[c.name][:, :DIM]) for c in configs(shared=False))
    ours.reset_parameters()
    for c in configs(shared=False):
        assert torch.equal(read_table(ours, c, with_state=True), initial[c.name])
        assert len(ours.store.stored_ids(c.name)) == 0
    ours.close()


# -- ported from TorchRec: torchrec/modules/tests/test_embedding_modules.py, EmbeddingBagCollectionTest -----
# The same tables and batches, run on ours and on TorchRec's EmbeddingBagCollection holding our rows:
# the same keys and offsets, and the same values bit for bit.
def _ported_batch(weighted: bool, device="cpu"):
    if not weighted:  # test_unweighted, test_shared_tables: features f1, f2 over a batch of 3
        return KeyedJaggedTensor.from_offsets_sync(keys=["f1", "f2"], values=torch.tensor([0, 1, 2, 3, 4, 5, 6, 7]),
                                                   offsets=torch.tensor([0, 2, 2, 3, 4, 5, 8]))
    return KeyedJaggedTensor.from_offsets_sync(  # test_weighted, test_forward_with_meta_device, test_fx
        keys=["f1", "f3", "f2"], values=torch.tensor([1, 2, 4, 5, 4, 3, 2, 9, 1, 3, 4, 7], device=device),
        offsets=torch.tensor([0, 2, 4, 6, 8, 10, 12], device=device),
        weights=torch.tensor([0.1, 0.2, 0.4, 0.5, 0.4, 0.3, 0.2, 0.9, 0.1, 0.3, 0.4, 0.7], device=device))


def _weighted_tables():
    return [EmbeddingBagConfig(name="t1", embedding_dim=3, num_embeddings=10, feature_names=["f1", "f3"]),
            EmbeddingBagConfig(name="t2", embedding_dim=4, num_embeddings=10, feature_names=["f2"])]


PORTED = {  # test name in TorchRec's file: (tables, weighted, output size, keys, offsets)
    "test_unweighted": (lambda: [
        EmbeddingBagConfig(name="t1", embedding_dim=3, num_embeddings=10, feature_names=["f1"],
                           init_fn=functools.partial(torch.nn.init.normal_, mean=0.0, std=1.5)),
        EmbeddingBagConfig(name="t2", embedding_dim=4, num_embeddings=10, feature_names=["f2"],
                           init_fn=functools.partial(torch.nn.init.uniform_, a=-0.036, b=0.036))],
        False, (3, 7), ["f1", "f2"], [0, 3, 7]),
    "test_shared_tables": (lambda: [EmbeddingBagConfig(name="t1", embedding_dim=3, num_embeddings=10, feature_names=["f1", "f2"])],
                           False, (3, 6), ["f1", "f2"], [0, 3, 6]),
    "test_weighted": (_weighted_tables, True, (2, 10), ["f1", "f3", "f2"], [0, 3, 6, 10]),
}


@pytest.mark.parametrize("name", sorted(PORTED))
def test_ported_embedding_bag_collection(tmp_path, name):
    tables, weighted, size, keys, offsets = PORTED[name]
    ours = TieredEmbeddingBagCollection(tables(), weighted, path=tmp_path, device="cpu")
    theirs = EmbeddingBagCollection(tables=tables(), is_weighted=weighted)
    with torch.no_grad():
        for cfg in tables():
            theirs.embedding_bags[cfg.name].weight.copy_(ours.store.read(cfg.name, torch.arange(cfg.num_embeddings)))
    got, want = ours(_ported_batch(weighted)), theirs(_ported_batch(weighted))
    assert got.values().size() == size and got.keys() == keys and got.offset_per_key() == offsets
    assert torch.equal(got.values(), want.values())
    ours.close()


def test_ported_shared_features(tmp_path):
    """test_shared_features: one feature pooled by two tables, keys f1@t1, f1@t2."""
    tables = [EmbeddingBagConfig(name="t1", embedding_dim=3, num_embeddings=10, feature_names=["f1"]),
              EmbeddingBagConfig(name="t2", embedding_dim=4, num_embeddings=10, feature_names=["f1"])]
    ours = TieredEmbeddingBagCollection(tables, path=tmp_path, device="cpu")
    kjt = KeyedJaggedTensor.from_offsets_sync(keys=["f1"], values=torch.tensor([0, 1, 2, 3, 4, 5, 6, 7]),
                                              offsets=torch.tensor([0, 2, 2, 3, 4, 5, 8]))
    got = ours(kjt)
    assert got.values().size() == (6, 7) and got.keys() == ["f1@t1", "f1@t2"] and got.offset_per_key() == [0, 3, 7]
    ours.close()


def test_ported_forward_with_meta_device_and_device(tmp_path):
    """test_forward_with_meta_device and test_device (the meta parts; no store, no files)."""
    ours = TieredEmbeddingBagCollection(_weighted_tables(), is_weighted=True, device=torch.device("meta"), path=tmp_path / "s")
    got = ours(_ported_batch(True, device="meta"))
    assert got.values().size() == (2, 10) and got.keys() == ["f1", "f3", "f2"] and got.offset_per_key() == [0, 3, 6, 10]
    assert got.values().device == torch.device("meta") == ours.device == ours.embedding_bags["t1"].weight.device
    assert not (tmp_path / "s").exists()


def test_ported_fx_and_scripting(tmp_path):
    """test_fx: torchrec.fx traces the collection and the graph gives the same output; test_scripting:
    TorchRec's EBC scripts, ours refuses naming torch.compile (its forward reads a store in Python)."""
    from torchrec.fx import symbolic_trace

    ours = TieredEmbeddingBagCollection(_weighted_tables(), is_weighted=True, path=tmp_path, device="cpu")
    gm = symbolic_trace(ours)
    got = gm(_ported_batch(True))
    assert got.values().size() == (2, 10) and got.keys() == ["f1", "f3", "f2"] and got.offset_per_key() == [0, 3, 6, 10]
    assert torch.equal(got.values(), ours(_ported_batch(True)).values())
    with pytest.raises(RuntimeError, match=r"torch\.jit\.script cannot compile .*torch\.compile"):
        torch.jit.script(ours)
    with pytest.raises(ValueError, match="Duplicate table name"):  # test_duplicate_config_name_fails
        TieredEmbeddingBagCollection([_weighted_tables()[0], _weighted_tables()[0]], path=tmp_path / "dup", device="cpu")
    ours.close()


# -- held tables: the collection as ops, compiled whole and exported as TorchRec's ------------------
def held_tables():
    """A table two features pool and one with mean pooling."""
    return [EmbeddingBagConfig(name="t1", embedding_dim=DIM, num_embeddings=30, feature_names=["f1", "f2"]),
            EmbeddingBagConfig(name="t2", embedding_dim=DIM, num_embeddings=20, feature_names=["f3"], pooling=PoolingType.MEAN)]


def held_batch(g):
    lengths = torch.randint(0, 5, (3 * B,), generator=g)
    values = (torch.rand(int(lengths.sum()), generator=g) ** 2 * 20).long()  # repeats, < 20: valid in both tables
    return KeyedJaggedTensor.from_lengths_sync(keys=["f1", "f2", "f3"], values=values, lengths=lengths)


def train_held(ebc, steps=3, backend=None):
    torch._dynamo.reset()
    fwd = torch.compile(ebc, backend=backend, fullgraph=True) if backend else ebc
    g = torch.Generator().manual_seed(4)
    for _ in range(steps):
        fwd(held_batch(g)).values().backward(torch.randn(B, 3 * DIM, generator=g))
    return [ebc.store.read(c.name, torch.arange(c.num_embeddings), with_state=True) for c in held_tables()]


@pytest.mark.parametrize("optimizer", [tierstore.optim.SGD, tierstore.optim.RowWiseAdagrad])
def test_held_collection_compiles_whole_and_trains_as_the_host_step(tmp_path, optimizer):
    """hold_resident: torch.compile(fullgraph=True) takes the whole forward, KeyedJaggedTensor
    handling included, as it takes TorchRec's collection; eager and compiled (AOTAutograd's
    graphs) train the rows of the host step through small tiers bit for bit."""
    import torch._dynamo

    def make(name, **kw):
        return TieredEmbeddingBagCollection(held_tables(), path=tmp_path / name, device="cpu", optimizer=optimizer(lr=0.1), **kw)

    host = train_held(make("host", hbm_rows=4, ddr_rows=8))
    eager = train_held(make("eager", hbm_rows=30).hold_resident())
    torch._dynamo.utils.counters.clear()
    compiled = train_held(make("compiled", hbm_rows=30).hold_resident(), backend="aot_eager")
    assert not torch._dynamo.utils.counters["graph_break"]
    for h, e, c in zip(host, eager, compiled):
        assert torch.equal(h, e) and torch.equal(h, c)
    assert not torch.equal(host[0], make("fresh").store.read("t1", torch.arange(30), with_state=True))


def test_held_collection_exports_with_a_lookup_per_table(tmp_path):
    """torch.export (non-strict, as TorchRec's collection exports): one tierstore.bag_lookup
    leaf per table (its features pooled together); the program reads the store's rows as they are when it runs."""
    ebc = TieredEmbeddingBagCollection(held_tables(), path=tmp_path, hbm_rows=30, device="cpu",
                                       optimizer=tierstore.optim.SGD(lr=0.1)).hold_resident()
    kjt = held_batch(torch.Generator().manual_seed(5))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchRec's "non-strict export of KJT.to_dict is slow"
        program = torch.export.export(ebc, (kjt,), strict=False)
    ops = [n.target for n in program.graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.tierstore.bag_lookup.default) == 2
    exported = program.module()
    assert torch.equal(exported(kjt).values(), ebc(kjt).values())
    train_held(ebc, steps=2)
    assert torch.equal(exported(kjt).values(), ebc(kjt).values())
    unheld = TieredEmbeddingBagCollection(held_tables(), path=tmp_path / "unheld", device="cpu")
    with pytest.raises(RuntimeError, match=r"torch\.export cannot capture .*hold_resident"):
        torch.export.export(unheld, (kjt,), strict=False)


def test_a_serving_collection_pools_the_exported_rows_as_the_trained_one(tmp_path):
    """tierstore.torchrec.ServingEmbeddingBagCollection over `tierstore.export` of a trained
    collection: KeyedJaggedTensor in, the same KeyedTensor out (float32 rows: equal to the
    training collection's forward; int8: within a few hundredths)."""
    from tierstore.torchrec import ServingEmbeddingBagCollection

    ours = TieredEmbeddingBagCollection(configs(), path=tmp_path / "train", ddr_rows=8, device="cpu",
                                        optimizer=tierstore.optim.SGD(lr=0.5))
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        ours(batch(g)).values().sum().backward()
    ours.store.flush()
    kjt = batch(g)
    with torch.no_grad():
        want = ours(kjt)
    for dtype, atol in (("float32", 1e-6), ("int8", 0.05)):
        tierstore.export(tmp_path / "train", tmp_path / dtype, dtype=dtype)
        serving = ServingEmbeddingBagCollection(configs(), tmp_path / dtype, hbm_rows=16)
        got = serving(kjt)
        assert got.keys() == want.keys() and got.length_per_key() == want.length_per_key()
        torch.testing.assert_close(got.values(), want.values(), rtol=0, atol=atol)
        serving.close()
    ours.close()
    with pytest.raises(ValueError, match="embedding_dim=5"):
        ServingEmbeddingBagCollection([EmbeddingBagConfig(name="user", embedding_dim=5, num_embeddings=50)], tmp_path / "int8")
