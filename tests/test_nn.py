"""TieredEmbeddingBag and TieredEmbeddingBagCollection on real LMDB stores.

Oracles: torch.nn.EmbeddingBag itself (outputs, errors, gradients), torch.optim
SGD / Adagrad on sparse gradients, torch.optim.Adam per touched row, and a
plain row-wise Adagrad written here. Determinism is checked bit for bit
(torch.equal) across tier sizes and policies.
"""
import gc
import tempfile

import numpy as np
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import tierstore
from tierstore import TableSpec, TieredEmbeddingBag, TieredEmbeddingBagCollection, TieredStore, optim
from tierstore.nn import BagOffsetsError, BagTypeError
from tierstore.precision import round_nearest

pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks")  # raised inside torch.optim.Adagrad

N, D = 40, 6


def weights0(seed=0, n=N, d=D):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed))


def batches(seed, steps, n=N, bags=6, max_len=9):
    """Skewed ids (hot rows repeat within and across batches), empty bags included."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        sizes = torch.randint(0, max_len, (bags,), generator=g)
        ids = (torch.rand(int(sizes.sum()), generator=g) ** 3 * n).long()
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)[:-1]])
        psw = torch.rand(len(ids), generator=g) + 0.5
        target = torch.randn(bags, D, generator=g)
        out.append((ids, offsets, psw, target))
    return out


def loss_of(out, target):
    return ((out - target) ** 2).mean()


def all_rows(emb, n=N):
    return emb.store.read(emb.table, torch.arange(n), with_state=True)


def make(path, opt, mode="sum", w=None, **kw):
    return TieredEmbeddingBag.from_pretrained(weights0() if w is None else w, mode=mode, path=path, optimizer=opt,
                                              freeze=opt is None, **kw)


# -- the nn.EmbeddingBag contract ------------------------------------------------------

bag_lists = st.lists(st.lists(st.integers(0, N - 1), max_size=6), max_size=5)


@given(
    bags=bag_lists,
    mode=st.sampled_from(["sum", "mean", "max"]),
    include_last_offset=st.booleans(),
    padding_idx=st.sampled_from([None, 0, 3, -1]),
    use_psw=st.booleans(),
    two_d=st.booleans(),
    trailing=st.lists(st.integers(0, N - 1), max_size=3),
)
def test_forward_and_sgd_step_match_nn_embeddingbag(bags, mode, include_last_offset, padding_idx, use_psw, two_d, trailing):
    use_psw = use_psw and mode == "sum"
    if two_d:
        length = min((len(b) for b in bags), default=0)
        assume(length > 0)  # torch fails on [B, 0] input ("step must be nonzero"); ours returns zeros
        inp = torch.tensor([b[:length] for b in bags], dtype=torch.long).reshape(len(bags), length)
        offsets = None
    else:
        inp = torch.tensor([i for b in bags for i in b], dtype=torch.long)
        starts = np.cumsum([0] + [len(b) for b in bags])
        offsets = torch.tensor(starts if include_last_offset else starts[:-1], dtype=torch.long)
    ours_inp = inp
    if include_last_offset and not two_d:
        # entries after the last offset are ignored; torch's forward ignores them too, but its sparse
        # backward fails on them and it crashes when there are no bags, so torch gets the input without them
        ours_inp = torch.cat([inp, torch.tensor(trailing, dtype=torch.long)])
    psw = torch.rand(ours_inp.shape, requires_grad=True) if use_psw else None
    w = weights0(1)
    ref = torch.nn.EmbeddingBag.from_pretrained(w.clone(), freeze=False, mode=mode, sparse=mode != "max",
                                                include_last_offset=include_last_offset, padding_idx=padding_idx)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.3)
    with tempfile.TemporaryDirectory() as d:
        emb = make(d, optim.SGD(lr=0.3), mode=mode, w=w, include_last_offset=include_last_offset,
                   padding_idx=padding_idx, hbm_rows=4, ddr_rows=4)
        out = emb(ours_inp, offsets, per_sample_weights=psw)
        psw_ref = psw.detach()[: inp.numel()].reshape(inp.shape).clone().requires_grad_() if use_psw else None
        expect = ref(inp, offsets, per_sample_weights=psw_ref)
        torch.testing.assert_close(out, expect.detach(), rtol=1e-5, atol=1e-6)
        target = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
        (out * target).sum().backward()
        (expect * target).sum().backward()
        ref_opt.step()
        torch.testing.assert_close(all_rows(emb), ref.weight.detach(), rtol=1e-5, atol=1e-6)
        if use_psw:
            torch.testing.assert_close(psw.grad.reshape(-1)[: inp.numel()].reshape(inp.shape), psw_ref.grad, rtol=1e-5, atol=1e-5)
            assert not psw.grad.reshape(-1)[inp.numel():].any()
        emb.close()


def _error_cases():
    L = torch.long
    return [
        ("id too large", dict(), (torch.tensor([1, N]), torch.tensor([0])), {}),
        ("negative id", dict(), (torch.tensor([1, -1]), torch.tensor([0])), {}),
        ("offsets[0] != 0", dict(), (torch.tensor([1, 2]), torch.tensor([1])), {}),
        ("offsets[-1] > len", dict(), (torch.tensor([1, 2]), torch.tensor([0, 3])), {}),
        ("last offset > len", dict(include_last_offset=True), (torch.tensor([1, 2]), torch.tensor([0, 3])), {}),
        ("no offsets with include_last_offset", dict(include_last_offset=True), (torch.tensor([1, 2]), torch.tensor([], dtype=L)), {}),
        ("1-D without offsets", dict(), (torch.tensor([1, 2]), None), {}),
        ("2-D with offsets", dict(), (torch.tensor([[1, 2]]), torch.tensor([0])), {}),
        ("3-D input", dict(), (torch.zeros(1, 1, 1, dtype=L), None), {}),
        ("2-D offsets", dict(), (torch.tensor([1, 2]), torch.tensor([[0]])), {}),
        ("float ids", dict(), (torch.tensor([1.0, 2.0]), torch.tensor([0])), {}),
        ("float offsets", dict(), (torch.tensor([1, 2]), torch.tensor([0.0])), {}),
        ("psw shape", dict(), (torch.tensor([1, 2]), torch.tensor([0])), {"per_sample_weights": torch.ones(3)}),
        ("psw dtype", dict(), (torch.tensor([1, 2]), torch.tensor([0])), {"per_sample_weights": torch.ones(2, dtype=torch.float64)}),
        ("psw with mean", dict(mode="mean"), (torch.tensor([1, 2]), torch.tensor([0])), {"per_sample_weights": torch.ones(2)}),
        ("psw with max", dict(mode="max"), (torch.tensor([1, 2]), torch.tensor([0])), {"per_sample_weights": torch.ones(2)}),
    ]


@pytest.mark.parametrize("name,kw,args,kwargs", _error_cases(), ids=[c[0] for c in _error_cases()])
def test_refused_calls_raise_as_torch_and_leave_the_store_unchanged(tmp_path, name, kw, args, kwargs):
    mode = kw.pop("mode", "sum")
    ref = torch.nn.EmbeddingBag(N, D, mode=mode, **kw)
    with pytest.raises(Exception) as theirs:
        ref(*args, **kwargs)
    emb = make(tmp_path, optim.SGD(lr=0.1), mode=mode, hbm_rows=8, ddr_rows=8, **kw)
    emb(torch.tensor([1, 2, 3]), torch.tensor([0])).sum().backward()  # some cache state to keep
    before = (emb.store.stats(), emb.store.resident_rows(emb.table))
    with pytest.raises(type(theirs.value)) as ours:
        emb(*args, **kwargs)
    assert (emb.store.stats(), emb.store.resident_rows(emb.table)) == before
    assert str(ours.value), "the error must say what is wrong"
    if name in ("id too large", "negative id"):
        assert isinstance(ours.value, IndexError) and "not in the valid range" in str(ours.value)
    if name.startswith("float") or name == "psw dtype":
        assert isinstance(ours.value, BagTypeError) and isinstance(ours.value, TypeError)
    elif "offset" in name and isinstance(ours.value, RuntimeError):
        assert isinstance(ours.value, BagOffsetsError) and isinstance(ours.value, ValueError)
    emb.close()


def test_decreasing_offsets_are_refused_with_a_clear_error(tmp_path):
    emb = make(tmp_path, optim.SGD(lr=0.1))
    with pytest.raises(BagOffsetsError, match=r"non-decreasing.*offsets\[1\]=2 > offsets\[2\]=1"):
        emb(torch.tensor([1, 2, 3]), torch.tensor([0, 2, 1]))
    with pytest.raises(RuntimeError):  # torch raises RuntimeError for these too
        emb(torch.tensor([1, 2, 3]), torch.tensor([0, 2, 1]))
    emb.close()


def test_empty_inputs_match_torch(tmp_path):
    ref = torch.nn.EmbeddingBag(N, D, mode="mean")
    emb = TieredEmbeddingBag(N, D, mode="mean", path=tmp_path, optimizer=optim.SGD(lr=0.1))
    for inp, off in [(torch.tensor([], dtype=torch.long), torch.tensor([0, 0])),
                     (torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long))]:
        out = emb(inp, off)
        assert out.shape == ref(inp, off).shape and not out.any()
        out.sum().backward()
    out = emb(torch.zeros(3, 0, dtype=torch.long))  # torch fails here ("step must be nonzero"): three empty bags
    assert out.shape == (3, D) and not out.any()
    assert emb.store.stats()["ssd"]["writes"] == 0
    emb.close()


def test_default_mode_and_init_follow_torch(tmp_path):
    emb = TieredEmbeddingBag(2000, 8, path=tmp_path, padding_idx=5)
    assert emb.mode == "mean" == torch.nn.EmbeddingBag(2, 2).mode
    w = emb.store.read(emb.table, torch.arange(2000))
    assert not w[5].any()  # the padding row starts at zero, as in torch
    others = torch.cat([w[:5], w[6:]])
    assert abs(others.mean()) < 0.05 and abs(others.std() - 1) < 0.05  # N(0, 1)
    assert sum(p.numel() for p in emb.parameters()) == 0  # the store is the parameter store
    emb.close()


# -- training against the references, with small tiers ----------------------------------

def _torch_grad(w, mode, ids, offsets, psw, target):
    """Summed sparse gradient of the loss wrt the table, from nn.EmbeddingBag."""
    bag = torch.nn.EmbeddingBag.from_pretrained(w.clone(), freeze=False, mode=mode, sparse=True)
    loss_of(bag(ids, offsets, per_sample_weights=psw), target).backward()
    g = bag.weight.grad.coalesce()
    return g.indices()[0], g.values()


class _TorchSparse:
    def __init__(self, w, make_opt):
        self.p = torch.nn.Parameter(w.clone())
        self.opt = make_opt([self.p])

    def step(self, mode, ids, offsets, psw, target):
        rows, vals = _torch_grad(self.p.detach(), mode, ids, offsets, psw, target)
        self.p.grad = torch.sparse_coo_tensor(rows[None], vals, self.p.shape, check_invariants=True)
        self.opt.step()

    def weights(self):
        return self.p.detach()


class _TorchAdamPerRow:
    """torch.optim.Adam applied densely to the touched rows: each row is a parameter
    that gets a gradient only on the steps whose batch touches it."""

    def __init__(self, w, **kw):
        self.params = [torch.nn.Parameter(r.clone()) for r in w]
        self.opt = torch.optim.Adam(self.params, **kw)

    def step(self, mode, ids, offsets, psw, target):
        rows, vals = _torch_grad(self.weights(), mode, ids, offsets, psw, target)
        for p in self.params:
            p.grad = None
        for r, v in zip(rows.tolist(), vals):
            self.params[r].grad = v.clone()
        self.opt.step()

    def weights(self):
        return torch.stack([p.detach() for p in self.params])


class _PlainRowWiseAdagrad:
    def __init__(self, w, lr, eps):
        self.w, self.acc, self.lr, self.eps = w.double().clone(), torch.zeros(len(w), dtype=torch.float64), lr, eps

    def step(self, mode, ids, offsets, psw, target):
        rows, vals = _torch_grad(self.w.float(), mode, ids, offsets, psw, target)
        for r, g in zip(rows.tolist(), vals.double()):
            self.acc[r] += (g * g).mean()
            self.w[r] -= self.lr * g / (self.acc[r].sqrt() + self.eps)

    def weights(self):
        return self.w.float()


# name -> (our optimizer, reference, mode, per-sample weights?, bit-identical to the reference?)
# torch.optim.SGD adds an uncoalesced sparse gradient occurrence by occurrence and the
# row-wise reference runs in float64, so those two are equal within float tolerance;
# Adam follows torch's op sequence on the same summed gradients: bit for bit. Adagrad
# rounds its step -lr * (g / d) before adding it, where torch fuses that multiply
# into the add: within float tolerance.
REFERENCES = {
    "sgd": (lambda: optim.SGD(lr=0.5), lambda w: _TorchSparse(w, lambda p: torch.optim.SGD(p, lr=0.5)), "sum", True, False),
    "adagrad": (lambda: optim.Adagrad(lr=0.2, eps=1e-10),
                lambda w: _TorchSparse(w, lambda p: torch.optim.Adagrad(p, lr=0.2, eps=1e-10)), "mean", False, False),
    "adam": (lambda: optim.Adam(lr=0.05, betas=(0.9, 0.99), eps=1e-7),
             lambda w: _TorchAdamPerRow(w, lr=0.05, betas=(0.9, 0.99), eps=1e-7), "sum", False, True),
    "rowwise_adagrad": (lambda: optim.RowWiseAdagrad(lr=0.2, eps=1e-8), lambda w: _PlainRowWiseAdagrad(w, 0.2, 1e-8),
                        "mean", False, False),
}


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_training_matches_reference_with_tiny_tiers(tmp_path, name):
    make_opt, make_ref, mode, use_psw, bitwise = REFERENCES[name]
    w = weights0(2)
    emb = make(tmp_path, make_opt(), mode=mode, w=w, hbm_rows=4, ddr_rows=6)
    ref = make_ref(w)
    for ids, offsets, psw, target in batches(3, 30):
        psw = psw if use_psw else None
        loss_of(emb(ids, offsets, per_sample_weights=psw), target).backward()
        ref.step(mode, ids, offsets, psw, target)
    assert emb.store.stats()["ssd"]["writes"] > 0, "the tiers must be small enough to evict to LMDB"
    if bitwise:
        assert torch.equal(all_rows(emb)[:, :D], ref.weights())
    else:
        torch.testing.assert_close(all_rows(emb)[:, :D], ref.weights(), rtol=1e-4, atol=1e-5)
    emb.close()


def _train(path, opt, mode, steps, use_psw, flush_every=0, **tiers):
    emb = make(path, opt, mode=mode, w=weights0(4), **tiers)
    for i, (ids, offsets, psw, target) in enumerate(steps):
        loss_of(emb(ids, offsets, per_sample_weights=psw if use_psw else None), target).backward()
        if flush_every and i % flush_every == 0:
            emb.store.flush()  # rows updated after a flush must be dirty again
    return emb


@pytest.mark.parametrize("make_opt,mode,use_psw,dtype", [
    (lambda: optim.Adam(lr=0.05), "sum", True, "float32"),
    (lambda: optim.RowWiseAdagrad(lr=0.3), "mean", False, "float32"),
    (lambda: optim.Adagrad(lr=0.3), "max", False, "float32"),
    (lambda: optim.SGD(lr=0.3), "sum", False, "float32"),
    (lambda: optim.Adagrad(lr=0.3), "sum", True, "float32"),
    (lambda: optim.RowWiseAdagrad(lr=0.3), "mean", False, "float16"),
    (lambda: optim.SGD(lr=0.3), "sum", True, "bfloat16"),
    (lambda: optim.Adam(lr=0.05), "max", False, "bfloat16"),
], ids=["adam-sum-psw", "rowwise-mean", "adagrad-max", "sgd-sum", "adagrad-sum-psw", "rowwise-mean-fp16", "sgd-sum-psw-bf16",
        "adam-max-bf16"])
def test_bit_identical_whatever_the_tiers_and_policy(tmp_path, make_opt, mode, use_psw, dtype):
    steps = batches(5, 40)
    configs = {
        "all in hbm": dict(hbm_rows=N),
        "hbm=8 lru": dict(hbm_rows=8),
        "hbm=8 ddr=8 lru": dict(hbm_rows=8, ddr_rows=8),
        "hbm=8 ddr=8 lfu": dict(hbm_rows=8, ddr_rows=8, policy="lfu"),
        "hbm=3 ddr=5 lfu": dict(hbm_rows=3, ddr_rows=5, policy="lfu"),
        "ddr only": dict(ddr_rows=8),
    }
    final = {}
    for name, tiers in configs.items():
        emb = _train(tmp_path / name.replace(" ", "_"), make_opt(), mode, steps, use_psw, flush_every=7, dtype=dtype, **tiers)
        final[name] = all_rows(emb)
        emb.close()
        with TieredStore(tmp_path / name.replace(" ", "_"), readonly=True) as reopened:  # state survived flush and close
            assert torch.equal(reopened.read(emb.table, torch.arange(N), with_state=True), final[name])
    base = final["all in hbm"]
    assert base.shape[1] == D or base[:, D:].any(), "the optimizer state must be non-trivial"
    assert torch.equal(round_nearest(base[:, :D], dtype), base[:, :D]), f"weights must be {dtype} values"
    for name, rows in final.items():
        assert torch.equal(rows, base), f"{name} differs from all-in-HBM"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_state_survives_reopen_and_training_continues_bit_identically(tmp_path, dtype):
    """A reduced-precision table's update count (its rounding's key) is durable too."""
    steps = batches(6, 30)
    opt = optim.Adam(lr=0.05)
    whole = _train(tmp_path / "whole", opt, "sum", steps, True, hbm_rows=N, dtype=dtype)
    expect = all_rows(whole)
    whole.close()

    first = _train(tmp_path / "split", optim.Adam(lr=0.05), "sum", steps[:15], True, hbm_rows=4, ddr_rows=4, dtype=dtype)
    first.close()
    again = TieredEmbeddingBag(N, D, mode="sum", path=tmp_path / "split", optimizer=optim.Adam(lr=0.05), hbm_rows=4, ddr_rows=4,
                               dtype=dtype)
    for ids, offsets, psw, target in steps[15:]:
        loss_of(again(ids, offsets, per_sample_weights=psw), target).backward()
    assert torch.equal(all_rows(again), expect)
    again.close()


def test_checkpoint_is_a_consistent_snapshot_and_restores_by_opening(tmp_path):
    steps = batches(8, 20)
    emb = _train(tmp_path / "run", optim.RowWiseAdagrad(lr=0.3), "sum", steps[:10], False, hbm_rows=6, ddr_rows=6)
    snap = all_rows(emb)
    emb.store.checkpoint(tmp_path / "ckpt")
    for ids, offsets, _, target in steps[10:]:  # training goes on after the checkpoint
        loss_of(emb(ids, offsets), target).backward()
    final = all_rows(emb)
    assert not torch.equal(final, snap)
    with TieredStore(tmp_path / "ckpt", readonly=True) as ck:
        assert torch.equal(ck.read(emb.table, torch.arange(N), with_state=True), snap)
    restored = TieredEmbeddingBag(N, D, mode="sum", path=tmp_path / "ckpt", optimizer=optim.RowWiseAdagrad(lr=0.3), hbm_rows=2)
    for ids, offsets, _, target in steps[10:]:
        loss_of(restored(ids, offsets), target).backward()
    assert torch.equal(all_rows(restored), final)
    with pytest.raises(FileExistsError, match="new directory"):
        emb.store.checkpoint(tmp_path / "ckpt")
    restored.close()
    emb.close()


def test_learning_rate_can_change_during_training(tmp_path):
    opt = optim.Adagrad(lr=0.5)
    emb = make(tmp_path, opt, mode="mean", hbm_rows=5)
    ref = _TorchSparse(weights0(), lambda p: torch.optim.Adagrad(p, lr=0.5))
    sched = torch.optim.lr_scheduler.StepLR(ref.opt, step_size=5, gamma=0.5)
    for ids, offsets, _, target in batches(9, 20):
        loss_of(emb(ids, offsets), target).backward()
        ref.step("mean", ids, offsets, None, target)
        sched.step()
        opt.lr = sched.get_last_lr()[0]
    assert opt.lr == 0.5 * 0.5**4
    torch.testing.assert_close(all_rows(emb)[:, :D], ref.weights(), rtol=1e-4, atol=1e-5)
    emb.close()


# -- forward without backward, several forwards before backward -------------------------

def test_forward_without_backward_changes_nothing_and_leaves_nothing_pending(tmp_path):
    steps = batches(10, 12)
    plain = _train(tmp_path / "plain", optim.Adam(lr=0.05), "sum", steps, False, hbm_rows=5, ddr_rows=5)
    emb = make(tmp_path / "evals", optim.Adam(lr=0.05), w=weights0(4), hbm_rows=5, ddr_rows=5)
    for ids, offsets, _, target in steps:
        with torch.no_grad():
            emb(ids, offsets)
        emb.eval()
        dropped = emb(ids, offsets)  # a graph that is never backpropagated
        del dropped
        gc.collect()
        emb.train()
        loss_of(emb(ids, offsets), target).backward()
    assert torch.equal(all_rows(emb), all_rows(plain))
    emb.store.flush()
    writes = emb.store.stats()["ssd"]["writes"]
    with torch.no_grad():
        out = emb(*steps[0][:2])
    assert not out.requires_grad
    emb.store.flush()  # nothing became dirty: evaluation writes no rows
    assert emb.store.stats()["ssd"]["writes"] == writes
    plain.close()
    emb.close()


@pytest.mark.parametrize("opt_name", ["sgd", "adagrad"])
@pytest.mark.parametrize("tiers", ["tiny", "resident", "evicted-between"])
def test_two_forwards_before_backward_each_backward_updates_its_own_rows(tmp_path, opt_name, tiers):
    # "resident": both forwards pool straight from the tier and both backwards update it
    # in place; "evicted-between": a's rows fill the tier at its forward, b's forward
    # (not resident) evicts some, so a's backward finds its slots reassigned
    make_opt, make_ref, *_ = REFERENCES[opt_name]
    (a_ids, a_off, _, a_t), (b_ids, b_off, _, b_t) = batches(11, 2, bags=8)
    assert set(a_ids.tolist()) & set(b_ids.tolist()), "the two batches must share rows"
    assert not set(b_ids.tolist()) <= set(a_ids.tolist())
    warm = torch.arange(N) if tiers == "resident" else torch.unique(a_ids)
    emb = make(tmp_path, make_opt(), **(dict(hbm_rows=3, ddr_rows=3) if tiers == "tiny" else dict(hbm_rows=len(warm))))
    if tiers != "tiny":
        emb.store.read(emb.table, warm)
        generation = emb.store._tables[emb.table].hbm.generation
    out_a = emb(a_ids, a_off)
    out_b = emb(b_ids, b_off)
    if tiers != "tiny":  # the resident cases took the paths they name
        assert (emb.store._tables[emb.table].hbm.generation == generation) == (tiers == "resident")
    loss_of(out_b, b_t).backward()
    loss_of(out_a, a_t).backward()
    # reference: both gradients taken at the starting weights, applied as two steps, b then a
    w = weights0()
    ref = make_ref(w)
    ga, gb = _torch_grad(w, "sum", a_ids, a_off, None, a_t), _torch_grad(w, "sum", b_ids, b_off, None, b_t)
    for rows, vals in (gb, ga):
        ref.p.grad = torch.sparse_coo_tensor(rows[None], vals, ref.p.shape, check_invariants=True)
        ref.opt.step()
    torch.testing.assert_close(all_rows(emb)[:, :D], ref.weights(), rtol=1e-5, atol=1e-6)
    emb.close()


# -- the collection, from_pretrained, unbounded tables ------------------------------------

def test_collection_matches_separate_embeddingbags(tmp_path):
    specs = [TableSpec("user", 30, 4, init=tierstore.RowInit.normal(0, 0.5, seed=1)),
             TableSpec("item", 50, 3, init=tierstore.RowInit.uniform(-1, 1, seed=2))]
    ebc = TieredEmbeddingBagCollection(tables=specs, path=tmp_path, hbm_rows={"user": 4, "item": 6}, ddr_rows=4,
                                       optimizer=optim.SGD(lr=0.2))
    assert {n: s.state_dim for n, s in ebc.store.tables.items()} == {"user": 0, "item": 0}
    refs = {s.name: torch.nn.EmbeddingBag.from_pretrained(ebc.store.read(s.name, torch.arange(s.num_rows)), freeze=False,
                                                          mode="sum", sparse=True) for s in specs}
    ref_opt = torch.optim.SGD([p for r in refs.values() for p in r.parameters()], lr=0.2)
    g = torch.Generator().manual_seed(12)
    for _ in range(10):
        feats = {}
        for s in specs:
            ids = torch.randint(0, s.num_rows, (12,), generator=g)
            feats[s.name] = (ids, torch.tensor([0, 3, 3, 7]))
        pooled = ebc(feats)
        expect = {k: refs[k](*v) for k, v in feats.items()}
        for k in feats:
            torch.testing.assert_close(pooled[k], expect[k].detach(), rtol=1e-5, atol=1e-6)
        sum(v.square().sum() for v in pooled.values()).backward()
        ref_opt.zero_grad()
        sum(v.square().sum() for v in expect.values()).backward()
        ref_opt.step()
    for s in specs:
        torch.testing.assert_close(ebc.store.read(s.name, torch.arange(s.num_rows)), refs[s.name].weight.detach(),
                                   rtol=1e-5, atol=1e-6)
    before = ebc.store.stats()
    with pytest.raises(KeyError, match="unknown table 'nope'"):
        ebc({"user": (torch.tensor([1]), torch.tensor([0])), "nope": (torch.tensor([1]), torch.tensor([0]))})
    with pytest.raises(IndexError):  # the second table's bad id refuses the whole call
        ebc({"user": (torch.tensor([1]), torch.tensor([0])), "item": (torch.tensor([50]), torch.tensor([0]))})
    assert ebc.store.stats() == before
    ebc.close()


def test_a_collections_tables_are_one_node_of_the_graph_and_each_output_steps_only_its_table(tmp_path):
    """One forward of several tables is one node of the autograd graph (its cost paid once per
    step, not per table), and still each table's update follows its own output: a table whose
    output the loss leaves out keeps its rows, a frozen table's output has no grad, and the
    gradient of per-sample weights is torch's."""
    specs = [TableSpec(name, 20, 4, init=tierstore.RowInit.normal(0, 0.5, seed=k)) for k, name in enumerate("abcd")]
    ebc = TieredEmbeddingBagCollection(tables=specs, path=tmp_path, hbm_rows=8, ddr_rows=8, optimizer=optim.Adagrad(lr=0.3))
    ebc["d"].requires_grad_(False)
    refs = {s.name: torch.nn.EmbeddingBag.from_pretrained(ebc.store.read(s.name, torch.arange(20)), freeze=False,
                                                          mode="sum", sparse=True) for s in specs}
    ref_opt = torch.optim.Adagrad([refs[t].weight for t in "ab"], lr=0.3)
    g = torch.Generator().manual_seed(5)
    offsets = torch.tensor([0, 2, 2, 6])
    for _ in range(3):
        ids = {t: torch.randint(0, 20, (9,), generator=g) for t in "abcd"}
        psw = torch.rand(9, generator=g, requires_grad=True)
        pooled = ebc({"a": (ids["a"], offsets), "b": (ids["b"], offsets, psw), "c": (ids["c"], offsets),
                      "d": (ids["d"], offsets)})
        assert len({pooled[t].grad_fn for t in "abc"}) == 1
        assert not pooled["d"].requires_grad
        ref_psw = psw.detach().clone().requires_grad_(True)
        expect = {"a": refs["a"](ids["a"], offsets), "b": refs["b"](ids["b"], offsets, per_sample_weights=ref_psw)}
        (pooled["a"].square().sum() + pooled["b"].square().sum()).backward()  # "c" and "d" out of the loss
        ref_opt.zero_grad()
        (expect["a"].square().sum() + expect["b"].square().sum()).backward()
        ref_opt.step()
        torch.testing.assert_close(psw.grad, ref_psw.grad, rtol=1e-5, atol=1e-6)
    for s in specs:
        torch.testing.assert_close(ebc.store.read(s.name, torch.arange(20)), refs[s.name].weight.detach(), rtol=1e-5, atol=1e-6)
    ebc.close()


def test_collection_sets_state_dim_from_the_optimizer(tmp_path):
    ebc = TieredEmbeddingBagCollection(tables=[TableSpec("a", 10, 4)], path=tmp_path, optimizer=optim.Adam())
    assert ebc.store.tables["a"].state_dim == 9
    ebc.close()
    with pytest.raises(ValueError, match="state_dim"):
        TieredEmbeddingBagCollection(tables=[TableSpec("a", 10, 4, state_dim=3)], path=tmp_path / "x", optimizer=optim.Adam())


def test_from_pretrained_freeze_semantics(tmp_path):
    w = weights0()
    frozen = TieredEmbeddingBag.from_pretrained(w, mode="sum", path=tmp_path / "f")
    out = frozen(torch.tensor([1, 2]), torch.tensor([0]))
    assert not out.requires_grad
    torch.testing.assert_close(out, torch.nn.EmbeddingBag.from_pretrained(w, mode="sum")(torch.tensor([1, 2]), torch.tensor([0])))
    psw = torch.ones(2, requires_grad=True)  # rows frozen, per-sample weights still get their gradient
    frozen(torch.tensor([1, 2]), torch.tensor([0]), per_sample_weights=psw).sum().backward()
    torch.testing.assert_close(psw.grad, w[[1, 2]].sum(1))
    assert torch.equal(frozen.store.read(frozen.table, torch.arange(N)), w)
    frozen.close()
    with pytest.raises(ValueError, match="freeze=True with an optimizer"):
        TieredEmbeddingBag.from_pretrained(w, freeze=True, path=tmp_path / "g", optimizer=optim.SGD())
    with pytest.raises(ValueError, match="needs optimizer="):
        TieredEmbeddingBag.from_pretrained(w, freeze=False, path=tmp_path / "h")
    with pytest.raises(ValueError, match="2-dimensional"):
        TieredEmbeddingBag.from_pretrained(torch.zeros(3), path=tmp_path / "i")


def test_unbounded_table_trains_arbitrary_ids(tmp_path):
    emb = TieredEmbeddingBag(None, 4, mode="sum", path=tmp_path, optimizer=optim.SGD(lr=1.0), hbm_rows=2,
                             init=tierstore.RowInit.uniform(-1, 1, seed=3))
    ids = torch.tensor([2**62, 5, 2**62 + 1, 5])
    before = emb.store.read(emb.table, ids)
    emb(ids, torch.tensor([0, 2])).sum().backward()
    after = emb.store.read(emb.table, ids)
    torch.testing.assert_close(after, before - torch.tensor([1.0, 2.0, 1.0, 2.0])[:, None].expand(4, 4))
    with pytest.raises(IndexError, match="valid range"):
        emb(torch.tensor([-3]), torch.tensor([0]))
    emb.close()


def test_constructor_errors_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="path= .* or store="):
        TieredEmbeddingBag(10, 4)
    with pytest.raises(TypeError, match="tierstore.optim"):
        TieredEmbeddingBag(10, 4, path=tmp_path / "a", optimizer=torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))
    with pytest.raises(ValueError, match="mode has to be one of"):
        TieredEmbeddingBag(10, 4, mode="avg", path=tmp_path / "b")
    with pytest.raises(ValueError, match="padding_idx must be within num_embeddings"):
        TieredEmbeddingBag(10, 4, padding_idx=10, path=tmp_path / "c")
    with pytest.raises(ValueError, match="not supported"):
        TieredEmbeddingBag(10, 4, max_norm=1.0, path=tmp_path / "d")
    store = TieredStore(tmp_path / "s", [TableSpec("t", 10, 4, state_dim=1)])
    with pytest.raises(KeyError, match="no table 'x'"):
        TieredEmbeddingBag(10, 4, store=store, table="x")
    with pytest.raises(ValueError, match="state_dim=1 per row"):
        TieredEmbeddingBag(10, 4, store=store, table="t", optimizer=optim.Adam())
    with pytest.raises(ValueError, match="num_embeddings=20"):
        TieredEmbeddingBag(20, 4, store=store, table="t")
    shared = TieredEmbeddingBag(10, 4, store=store, table="t", optimizer=optim.RowWiseAdagrad())
    assert shared.store is store and shared.table == "t"
    shared.close()  # does not close a store it did not open
    store.read("t", [1])
    store.close()


@pytest.mark.gpu
def test_cuda_hbm_trains_like_cpu_and_bit_identically_across_tiers(tmp_path):
    steps = batches(13, 20)
    rows = {}
    for name, tiers in {"cpu": dict(hbm_rows=N, device="cpu"), "cuda all": dict(hbm_rows=N, device="cuda"),
                        "cuda hbm=4": dict(hbm_rows=4, ddr_rows=6, device="cuda")}.items():
        emb = make(tmp_path / name.replace(" ", "_"), optim.RowWiseAdagrad(lr=0.3), mode="sum", **tiers)
        for ids, offsets, psw, target in steps:
            loss_of(emb(ids.cuda() if "cuda" in name else ids, offsets, per_sample_weights=psw.to(emb.store.device)),
                    target.to(emb.store.device)).backward()
        rows[name] = all_rows(emb).cpu()
        emb.close()
    assert torch.equal(rows["cuda all"], rows["cuda hbm=4"])
    torch.testing.assert_close(rows["cuda all"], rows["cpu"], rtol=1e-4, atol=1e-5)


def test_jagged_bags_plan_as_plan_bags_and_refuse_an_id_out_of_range():
    """The DMP lookup plans a KeyedJaggedTensor's bags (offsets from 0 to the ids' end) without
    plan_bags's checks of their layout: the same plan, and an id outside the table the same error."""
    from tierstore.training.bags import EmbeddingBagConfig, jagged_bags, plan_bags

    c = EmbeddingBagConfig(50, 4, "sum", True, None, "t")
    ids, offsets = torch.tensor([3, 7, 3, 49, 0, 7], dtype=torch.int32), torch.tensor([0, 2, 2, 5, 6])
    ours, theirs = jagged_bags(c, ids, offsets), plan_bags(c, ids, offsets, None)
    for field in ("ids", "sizes", "offsets"):
        assert torch.equal(getattr(ours, field), getattr(theirs, field))
    assert ours.used is theirs.used is None and ours.n_input == theirs.n_input
    assert torch.equal(ours.ends(), theirs.ends()) and torch.equal(ours.rows.positions(), theirs.rows.positions())
    for bad in (50, -1):
        ids[3] = bad
        with pytest.raises(IndexError, match="not in the valid range") as got:
            jagged_bags(c, ids, offsets)
        with pytest.raises(IndexError) as want:
            plan_bags(c, ids, offsets, None)
        assert str(got.value) == str(want.value)
