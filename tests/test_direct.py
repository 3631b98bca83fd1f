"""io.direct: O_DIRECT reads through io_uring return the file's bytes, and a store reading
through them returns the rows the page-cache path does."""
import threading

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import tierstore
from tierstore.io import direct
from tierstore.store import StoreConfig

PAGE = direct.PAGE


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("direct") / "data.bin"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 64 * PAGE, dtype=np.uint8).tobytes())
    reader, why = direct.open_reader(path)
    if reader is None:
        pytest.skip(f"this system refuses direct reads: {why}")
    reader.close()
    return path


@settings(max_examples=60, deadline=None)
@given(width=st.integers(1, 3 * PAGE), seed=st.integers(0, 2**31), n=st.integers(0, 40), depth=st.sampled_from([1, 3, 256]),
       registered=st.booleans())
def test_reads_equal_the_files_bytes(data_file, width, seed, n, depth, registered):
    """Any width (crossing pages or not), any offsets, in batches smaller than the call; a
    second call starts where the first left the ring (its submission queue wraps). Rings
    whose buffer and file the kernel refused to register read the same."""
    raw = np.frombuffer(data_file.read_bytes(), dtype=np.uint8)
    offsets = np.random.default_rng(seed).integers(0, len(raw) - width + 1, n)
    with pytest.MonkeyPatch.context() as patch:
        if not registered:
            patch.setattr(direct, "_REGISTER_BUFFERS", -1)  # an opcode every kernel refuses (EINVAL)
        reader = direct.DirectReader(data_file, depth=depth, nbytes=max(depth, 2) * 4 * PAGE)
        reader.read(offsets[:0], width, np.empty((0, width), dtype=np.uint8))  # its ring, made here
    assert reader._ring().fixed == registered
    try:
        out = np.full((n, width), 7, dtype=np.uint8)
        half = n // 2 + 1
        reader.read(offsets[:half], width, out[:half])
        reader.read(offsets[half:], width, out[half:])
    finally:
        reader.close()
    expected = raw[offsets[:, None] + np.arange(width)] if n else out
    assert np.array_equal(out, expected)


def test_threads_read_at_once_each_on_its_own_ring(data_file):
    raw = np.frombuffer(data_file.read_bytes(), dtype=np.uint8)
    reader = direct.DirectReader(data_file)
    bad = []

    def work(seed):
        rng = np.random.default_rng(seed)
        for _ in range(20):
            offsets = rng.integers(0, len(raw) - 300, 700)
            out = np.empty((700, 300), dtype=np.uint8)
            reader.read(offsets, 300, out)
            bad.append(not np.array_equal(out, raw[offsets[:, None] + np.arange(300)]))

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    reader.close()
    assert bad and not any(bad)


def test_a_kernel_refusing_the_setup_flags_gets_a_plain_ring(data_file, monkeypatch):
    monkeypatch.setattr(direct, "_SETUP_DEFER_TASKRUN", 1 << 31)  # a flag no kernel knows: EINVAL
    reader = direct.DirectReader(data_file)
    try:
        out = np.empty((3, 100), dtype=np.uint8)
        reader.read(np.array([0, 5000, 70000]), 100, out)
        raw = data_file.read_bytes()
        assert [bytes(r) for r in out] == [raw[0:100], raw[5000:5100], raw[70000:70100]]
    finally:
        reader.close()


def test_a_read_past_the_end_fails_naming_it(data_file):
    reader = direct.DirectReader(data_file)
    try:
        with pytest.raises(OSError, match="short read: 0 of 4096 bytes at offset 524288"):
            reader.read(np.array([128 * PAGE]), 16, np.empty((1, 16), dtype=np.uint8))
        out = np.empty((1, 16), dtype=np.uint8)  # the reader goes on working
        reader.read(np.array([5]), 16, out)
        assert out.tobytes() == data_file.read_bytes()[5:21]
    finally:
        reader.close()


def test_a_filesystem_refusing_o_direct_is_named(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError(22, "Invalid argument")
    monkeypatch.setattr(direct.os, "open", refuse)
    reader, why = direct.open_reader(tmp_path / "data.mdb")
    assert reader is None and why.startswith("O_DIRECT is refused for") and "Invalid argument" in why


@pytest.mark.parametrize("direct_reads", [True, False])
def test_a_store_reads_the_same_rows_either_way(tmp_path, direct_reads, data_file):
    """Written, rewritten (newest copy in a later segment), flushed and not, reopened: the
    rows read with direct reads on equal those read through LMDB's map."""
    rng = np.random.default_rng(1)
    spec = tierstore.TableSpec("t", 5000, 24)  # 96-byte rows: some cross a page
    path = tmp_path / "store"
    config = StoreConfig(hbm_rows=0, ddr_rows=0, device="cpu", direct_reads=direct_reads)
    ids = np.arange(5000)
    rows = rng.standard_normal((5000, 24)).astype(np.float32)
    with tierstore.TieredStore(path, [spec], config=config) as store:
        assert store.stats()["read_path"] == ("io_uring O_DIRECT reads (direct_reads=True)" if direct_reads
                                              else "LMDB's map (direct_reads=False)")
        store.write("t", ids, rows)
        store.flush()
        again = np.unique(rng.integers(0, 5000, 1500))
        rows[again] = rng.standard_normal((len(again), 24)).astype(np.float32)
        store.write("t", again, rows[again])  # not flushed: read back from the write-back queue or the log
        asked = rng.permutation(5000)[:3000]
        assert np.array_equal(store.read("t", asked).numpy(), rows[asked])
        store.flush()
        assert np.array_equal(store.read("t", asked).numpy(), rows[asked])
    with tierstore.TieredStore(path, [spec], config=config) as store:
        assert np.array_equal(store.read("t", ids).numpy(), rows)


@pytest.mark.parametrize("direct_reads", [True, False], ids=["direct", "map"])
def test_prefetch_threads_pause_for_the_trainer_only_when_they_read_through_the_map(tmp_path, monkeypatch, direct_reads, data_file):
    """Reading through the map, a thread's copy faults pages in holding the GIL, so the
    threads wait while the trainer is in the store; reading directly they wait on the disk
    without it, and do not. The prefetched rows are the same either way."""
    import tierstore.engine.prefetch as prefetch
    pauses = []
    real = prefetch.read_rows_async
    monkeypatch.setattr(prefetch, "read_rows_async", lambda *a, **k: (pauses.append(a[7]), real(*a, **k))[1])
    spec = tierstore.TableSpec("t", 5000, 16)
    rows = np.random.default_rng(3).standard_normal((5000, 16)).astype(np.float32)
    with tierstore.TieredStore(tmp_path / "s", [spec], ddr_rows=100, device="cpu", direct_reads=direct_reads,
                               prefetch=tierstore.PrefetchConfig(sync_read_us=0)) as store:
        store.write("t", np.arange(5000), rows)
        store.flush()
        wanted = np.arange(0, 5000, 7)
        store.prefetch("t", wanted).wait(30)
        assert np.array_equal(store.read("t", wanted).numpy(), rows[wanted])
    assert pauses and all((p is None) == direct_reads for p in pauses)


def test_left_to_itself_a_store_reads_directly_only_where_its_budget_cannot_cache_the_rows(tmp_path, data_file):
    spec = tierstore.TableSpec("t", 200_000, 64)  # 51 MB of rows
    cases = [({}, "LMDB's map (no memory_budget: the page cache may keep every row)"),
             ({"memory_budget": "256MiB"}, "LMDB's map (the tables' rows (48.8 MiB) fit the budget's page-cache share (64.0 MiB))"),
             ({"memory_budget": "64MiB"}, "io_uring O_DIRECT reads (the tables' rows (48.8 MiB) exceed the budget's page-cache share (10.7 MiB))")]
    for kwargs, said in cases:
        with tierstore.TieredStore(tmp_path / "s", [spec], device="cpu", **kwargs) as store:
            assert store.stats()["read_path"] == said


def test_where_the_system_refuses_direct_reads_the_store_reads_through_the_map_and_says_why(tmp_path, monkeypatch):
    from tierstore.io import lmdb_env
    monkeypatch.setattr(lmdb_env, "open_reader", lambda file: (None, f"io_uring reads of {file} are refused (Operation not permitted)"))
    spec = tierstore.TableSpec("t", 1000, 8)
    rows = np.random.default_rng(2).standard_normal((1000, 8)).astype(np.float32)
    with tierstore.TieredStore(tmp_path / "s", [spec], device="cpu", direct_reads=True) as store:
        store.write("t", np.arange(1000), rows)
        store.flush()
        assert store.stats()["read_path"] == (f"LMDB's map (direct_reads=True; io_uring reads of {tmp_path / 's' / 'data.mdb'} "
                                              "are refused (Operation not permitted))")
        assert np.array_equal(store.read("t", np.arange(1000)).numpy(), rows)


def test_a_bad_direct_reads_value_is_refused_naming_the_choices(tmp_path):
    with pytest.raises(ValueError, match=r"direct_reads must be True, False or None \(None: when a memory_budget cannot "
                                         r"cache the tables' rows\), got 'yes'"):
        tierstore.TieredStore(tmp_path / "s", [tierstore.TableSpec("t", 10, 4)], device="cpu", direct_reads="yes")
    assert not (tmp_path / "s").exists()  # refused before anything was created
