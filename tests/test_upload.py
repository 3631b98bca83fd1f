"""Rows going up to the HBM tier (tierstore.engine.upload): from pinned staging buffers that
take turns, on a side stream on a GPU; the steps resolved ahead train the same bits."""
from __future__ import annotations

import pytest
import torch

import tierstore
from tierstore import LookaheadLoader, TieredEmbeddingBag
from tierstore.engine.upload import Upload

N, DIM = 200, 4


def test_staging_buffers_take_turns_and_stay_within_their_size():
    up = Upload(torch.device("cpu"), staged=True, staged_bytes=16 * 10 * 4)
    assert up.stream is None  # the CPU: no stream, plain copies
    g = torch.Generator().manual_seed(0)
    outs, pointers = [], []
    for n in (3, 5, 2, 4, 20, 6):  # 20 rows of 10 floats are 800 bytes: over a buffer's 640
        rows = torch.randn(n, 10, generator=g)
        out = up(rows)
        assert torch.equal(out, rows) and out.data_ptr() != rows.data_ptr()
        outs.append((out, rows.clone()))
        pointers.append([None if b is None else b.data_ptr() for b in up._buffers])
    assert all(torch.equal(out, rows) for out, rows in outs)  # a buffer's reuse changes no earlier upload
    assert (up.uploads, up.bypassed) == (5, 1)
    assert all(p == pointers[1] for p in pointers[1:])  # each buffer allocated once (twice a first need), then reused
    assert up.pinned_bytes() <= 2 * up.staged_bytes


def test_a_cpu_upload_hands_the_rows_over_as_they_are():
    rows = torch.randn(5, 3)
    up = Upload(torch.device("cpu"))
    assert not up.staged and up(rows) is rows and up.pinned_bytes() == 0


def _cached(path, device, **kw):
    return TieredEmbeddingBag(N, DIM, mode="sum", path=path, device=device, hbm_rows=70, ddr_rows=30,
                              optimizer=tierstore.optim.Adagrad(lr=0.1), **kw).resolve_ahead()


def _data(steps, seed=0, size=24):
    g = torch.Generator().manual_seed(seed)
    return [((torch.rand(size, generator=g) ** 3 * N).long(), torch.arange(0, size, 4), torch.randn(size // 4, DIM, generator=g))
            for _ in range(steps)]


def _train(m, batches, depth, device):
    for i, (ids, offsets) in enumerate(LookaheadLoader([b[:2] for b in batches], m, depth=depth)):
        m(ids, offsets).backward(batches[i][2].to(device))
    return m.store.read(m.table, torch.arange(N), with_state=True).cpu()


@pytest.mark.parametrize("depth", [0, 2])
def test_steps_resolved_through_staging_train_the_plain_copys_bits(tmp_path, depth):
    """The staging half on the CPU (forced: a CPU tier needs none): rows fetched from LMDB
    and the DDR tier go up through buffers of a few rows, some larger than a buffer."""
    batches = _data(10)
    staged = _cached(tmp_path / "s", "cpu")
    staged.store._shared.upload = Upload(torch.device("cpu"), staged=True, staged_bytes=8 * (DIM * 2) * 4)
    plain = _cached(tmp_path / "p", "cpu")
    assert torch.equal(_train(staged, batches, depth, "cpu"), _train(plain, batches, depth, "cpu"))
    up = staged.store._shared.upload
    assert up.uploads > 0 and up.bypassed > 0
    staged.store.close(), plain.store.close()  # now, not when the loader's references go, after tmp_path has


@pytest.mark.gpu
def test_uploads_on_a_side_stream_train_the_same_bits_at_every_depth(tmp_path):
    """On CUDA the misses go up on the side stream, the compute stream waiting on its events:
    the rows end the same bits at depths 0, 1 and 2 as every row held resident."""
    batches = _data(12)
    held = TieredEmbeddingBag(N, DIM, mode="sum", path=tmp_path / "h", device="cuda", hbm_rows=N,
                              optimizer=tierstore.optim.Adagrad(lr=0.1)).hold_resident()
    for ids, offsets, grad in batches:
        held(ids, offsets).backward(grad.cuda())
    want = held.store.read(held.table, torch.arange(N), with_state=True).cpu()
    for depth in (0, 1, 2):
        cached = _cached(tmp_path / f"c{depth}", "cuda")
        up = cached.store._shared.upload
        assert up.stream is not None and up.stream != torch.cuda.current_stream()
        assert torch.equal(_train(cached, batches, depth, "cuda"), want), depth
        assert up.uploads > 0 and up.pinned_bytes() > 0
        assert all(b is None or b.is_pinned() for b in up._buffers)
