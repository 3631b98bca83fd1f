"""Reduced-precision weights: rounding, the row codec, what LMDB stores, training.

Oracles: torch's own dtype conversions (round to nearest even) and
torch.nextafter for a value's neighbours; a float32 twin of each store."""
import lmdb
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tierstore import TableSpec, TieredEmbeddingBag, TieredStore, optim
from tierstore.io import RowCodec, encode_keys
from tierstore.io import rowlog
from tierstore.precision import DTYPES, round_nearest, round_stochastic, update_key

HALF = ["float16", "bfloat16"]
floats = st.floats(-1e4, 1e4, width=32, allow_subnormal=False)


@pytest.mark.parametrize("dtype", HALF)
@given(values=st.lists(floats, min_size=1, max_size=40), count=st.integers(0, 2**40))
def test_stochastic_rounding_picks_a_neighbour_and_keeps_representable_values(dtype, values, count):
    v = torch.tensor(values, dtype=torch.float32).reshape(-1, 1)
    ids = torch.arange(len(v))
    r = round_stochastic(v, dtype, ids, update_key("t", count))
    assert torch.equal(round_nearest(r, dtype), r), "results are values of the dtype"
    low_precision = DTYPES[dtype]
    down = torch.nextafter(v.to(low_precision), torch.tensor(-torch.inf, dtype=low_precision)).float()
    up = torch.nextafter(v.to(low_precision), torch.tensor(torch.inf, dtype=low_precision)).float()
    assert bool(((r >= torch.minimum(down, v)) & (r <= torch.maximum(up, v))).all()), "within one step of the dtype"
    exact = round_nearest(v, dtype) == v
    assert torch.equal(r[exact], v[exact])
    assert torch.equal(r, round_stochastic(v, dtype, ids, update_key("t", count))), "a pure function of its key"


@pytest.mark.parametrize("dtype", HALF)
def test_stochastic_rounding_is_unbiased_where_nearest_loses_small_updates(dtype):
    """1 + a step far below the dtype's resolution: round-to-nearest stays at 1
    forever; stochastic rounding lands on the neighbour in proportion."""
    gap = float(torch.nextafter(torch.tensor(1.0, dtype=DTYPES[dtype]), torch.tensor(2.0, dtype=DTYPES[dtype])).float() - 1)
    v = torch.full((4000, 16), 1.0 + gap / 10)
    r = round_stochastic(v, dtype, torch.arange(4000), update_key("t", 7))
    assert torch.equal(round_nearest(v, dtype), torch.ones_like(v))
    share_up = float((r > 1).float().mean())
    assert abs(share_up - 0.1) < 0.01, share_up  # 64000 draws: a standard error of 0.0012
    other = round_stochastic(v, dtype, torch.arange(4000), update_key("t", 8))
    assert not torch.equal(r, other), "another update draws other numbers"


@pytest.mark.parametrize("dtype", ["float32"] + HALF)
@given(data=st.data())
def test_codec_round_trips_rows_of_the_dtype_in_fewer_bytes(dtype, data):
    dim, state_dim = data.draw(st.integers(1, 9)), data.draw(st.integers(0, 3))
    n = data.draw(st.integers(0, 6))
    raw = torch.tensor(data.draw(st.lists(floats, min_size=n * (dim + state_dim), max_size=n * (dim + state_dim))),
                       dtype=torch.float32).reshape(n, dim + state_dim)
    rows = torch.cat([round_nearest(raw[:, :dim], dtype), raw[:, dim:]], 1).numpy()
    codec = RowCodec(dim, state_dim, dtype)
    encoded = codec.encode(rows)
    assert all(len(b) == dim * DTYPES[dtype].itemsize + 4 * state_dim for b in encoded)
    present = [b if i % 3 else None for i, b in enumerate(encoded)]  # some rows absent
    out = np.full((n, dim + state_dim), np.nan, dtype=np.float32)
    found = codec.decode(present, out)
    assert found.tolist() == [i % 3 != 0 for i in range(n)]
    assert np.array_equal(out[found], rows[found])
    assert np.isnan(out[~found]).all(), "absent rows are left as they were"


@pytest.mark.parametrize("dtype", HALF)
def test_a_half_table_stores_half_the_weight_bytes_and_reads_what_was_written_rounded(tmp_path, dtype):
    spec = TableSpec("t", 100, 8, dtype=dtype, state_dim=2)
    values = torch.randn(100, 10)
    with TieredStore(tmp_path / "s", [spec], ddr_rows=20) as store:
        store.write("t", torch.arange(100), values, with_state=True)
        expect = torch.cat([round_nearest(values[:, :8], dtype), values[:, 8:]], 1)
        assert torch.equal(store.read("t", torch.arange(100), with_state=True), expect)
        assert store.tables["t"].row_bytes == 8 * 2 + 2 * 4
    env = lmdb.open(str(tmp_path / "s"), readonly=True, max_dbs=8, lock=False)
    with env.begin(db=env.open_db(b"s:t", create=False)) as txn:  # segments of the log layout (io.rowlog)
        assert {rowlog.HEADER.unpack_from(v)[3] for _, v in txn.cursor()} == {8 * 2 + 2 * 4}  # each slot's bytes
    env.close()
    with TieredStore(tmp_path / "s", readonly=True) as again:
        assert again.tables["t"].dtype == dtype
        assert torch.equal(again.read("t", torch.arange(100), with_state=True), expect)


def test_half_rows_train_close_to_float32_and_hold_their_dtype(tmp_path):
    """The same steps on float32 and bfloat16 tables: the loss follows float32's,
    and every stored weight is a bfloat16 value."""
    torch.manual_seed(0)
    target = torch.randn(64, 16)
    losses = {}
    for dtype in ("float32", "bfloat16"):
        emb = TieredEmbeddingBag(500, 16, mode="sum", path=tmp_path / dtype, optimizer=optim.RowWiseAdagrad(lr=0.05),
                                 ddr_rows=100, dtype=dtype)
        g = torch.Generator().manual_seed(1)
        losses[dtype] = []
        for _ in range(60):
            ids = torch.randint(0, 500, (64 * 4,), generator=g)
            loss = (emb(ids, torch.arange(0, 256, 4)) - target).pow(2).mean()
            loss.backward()
            losses[dtype].append(float(loss))
        w = emb.store.read(emb.table, torch.arange(500))
        assert torch.equal(round_nearest(w, dtype), w)
        emb.close()
    f32, bf16 = np.array(losses["float32"]), np.array(losses["bfloat16"])
    assert f32[-10:].mean() < 0.8 * f32[:10].mean(), "training must make progress for the comparison to mean anything"
    assert abs(bf16[-10:].mean() - f32[-10:].mean()) < 0.05 * f32[-10:].mean()


def test_dtype_errors_name_the_choices(tmp_path):
    with pytest.raises(ValueError, match="bfloat16"):
        TableSpec("t", 10, 4, dtype="int8")
    TieredStore(tmp_path / "s", [TableSpec("t", 10, 4, dtype="float16")]).close()
    with TieredStore(tmp_path / "s") as store, pytest.raises(ValueError, match="dtype='float32' contradicts"):
        TieredEmbeddingBag(10, 4, store=store, table="t", dtype="float32")


def test_keys_are_the_update_count_of_the_table():
    assert update_key("a", 1) != update_key("a", 2) != update_key("b", 1)
    assert len({update_key("t", i) for i in range(1000)}) == 1000
    assert encode_keys(np.array([1]))  # the codec module's other half stays importable from tierstore.io
