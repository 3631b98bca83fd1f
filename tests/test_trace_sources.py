"""Where traces come from: the modules' record_trace=, `tierstore trace synth`
saying and bounding what it writes, `tierstore capacity` saying what it will do before it starts."""
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import tierstore
from tierstore.trace import ARRAYS, Trace
from tierstore.tools.synth import SynthConfig, SynthTable, synth


def cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "tierstore.tools.cli", *args], capture_output=True, text=True,
                          timeout=240, cwd=cwd)


def _bags(rng, rows, n=6):
    ids = torch.from_numpy(rng.integers(0, rows, 3 * n))
    return ids, torch.arange(0, 3 * n, 3)


def test_the_bag_records_its_reads_as_a_trace(tmp_path):
    rng = np.random.default_rng(0)
    emb = tierstore.TieredEmbeddingBag(100, 4, mode="sum", path=tmp_path / "s", hbm_rows=8, ddr_rows=16,
                                       optimizer=tierstore.optim.SGD(lr=0.1), record_trace=tmp_path / "tr")
    read = []
    for _ in range(5):
        ids, offsets = _bags(rng, 100)
        emb(ids, offsets).sum().backward()
        read.append(sorted(set(ids.tolist())))
    emb.close()
    trace = Trace.load(tmp_path / "tr")
    assert trace.complete and [t.name for t in trace.tables] == ["t0"]
    # a forward is one read of the bags' ids; the backward reads nothing
    assert [sorted(set(ids.tolist())) for _, _, ids in trace.calls()] == read
    assert trace.n_steps == 5


def test_both_collections_record_their_reads(tmp_path):
    rng = np.random.default_rng(1)
    specs = [tierstore.TableSpec("a", 50, 4), tierstore.TableSpec("b", 70, 4)]
    ebc = tierstore.TieredEmbeddingBagCollection(specs, path=tmp_path / "s", ddr_rows=10,
                                                 optimizer=tierstore.optim.Adagrad(lr=0.1), record_trace=tmp_path / "tr")
    read = []
    for _ in range(3):
        features = {"a": _bags(rng, 50), "b": _bags(rng, 70)}
        out = ebc(features)
        sum(o.sum() for o in out.values()).backward()
        read += [(name, sorted(set(ids.tolist()))) for name, (ids, _) in features.items()]
    ebc.close()
    trace = Trace.load(tmp_path / "tr")
    assert [(t, sorted(set(ids.tolist()))) for _, t, ids in trace.calls()] == read and trace.n_steps == 3


def test_the_torchrec_collection_records_its_reads(tmp_path):
    pytest.importorskip("torchrec", reason="needs TorchRec (pip install -e '.[torchrec]')")
    from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
    from tierstore.torchrec import TieredEmbeddingBagCollection

    tables = [EmbeddingBagConfig(name="user", embedding_dim=4, num_embeddings=100, feature_names=["uid"])]
    ebc = TieredEmbeddingBagCollection(tables, path=tmp_path / "s", ddr_rows=10, record_trace=tmp_path / "tr")
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["uid"], values=torch.tensor([1, 2, 3, 4]), lengths=torch.tensor([2, 2]))
    with torch.no_grad():
        ebc(kjt)
    ebc.close()
    trace = Trace.load(tmp_path / "tr")
    assert [sorted(set(ids.tolist())) for _, _, ids in trace.calls()] == [[1, 2, 3, 4]]
    with pytest.raises(ValueError, match="nothing to record"):
        TieredEmbeddingBagCollection(tables, device="meta", record_trace=tmp_path / "tr2")


def test_a_module_on_an_open_store_refuses_record_trace_rather_than_ignore_it(tmp_path):
    with tierstore.TieredStore(tmp_path / "s", tables=[tierstore.TableSpec("t0", 10, 4)]) as store:
        with pytest.raises(ValueError, match=r"record_trace=.*TieredStore\(\.\.\., record_trace=PATH\)"):
            tierstore.TieredEmbeddingBag(10, 4, store=store, record_trace=tmp_path / "tr")
        with pytest.raises(ValueError, match="record_trace="):
            tierstore.TieredEmbeddingBagCollection([tierstore.TableSpec("t0", 10, 4)], store=store, record_trace=tmp_path / "tr")
    assert not (tmp_path / "tr").exists()


@pytest.mark.parametrize("cfg", [
    SynthConfig((SynthTable("a", 1000, None, 3.5), SynthTable("b", 50)), batch_size=7, steps=5),
    SynthConfig((SynthTable("u", 10**6, 1.2, 0.3),), batch_size=3, pooling=2.0, steps=9),  # a call of round(0.9) = 1 id
    SynthConfig(batch_size=64, pooling=16.6, steps=3),
])
def test_synth_knows_its_size_before_it_starts(cfg):
    from tierstore.tools.synth import trace_size

    trace = synth(cfg)
    assert trace_size(cfg) == (trace.n_accesses, sum(getattr(trace, name).nbytes for name in ARRAYS))


def test_trace_synth_says_what_it_will_write_and_refuses_more_than_max_bytes(tmp_path):
    args = ["trace", "synth", str(tmp_path / "t"), "--table", "u:100000:1.1:16", "--batch-size", "256", "--steps", "20"]
    r = cli(*args, "--max-bytes", "100KiB")
    assert r.returncode == 2 and not (tmp_path / "t").exists()
    assert "this trace would be 81,920 accesses in 20 calls, 640.4 KiB, over --max-bytes 100KiB; pass --max-bytes 1GiB" in r.stderr
    r = cli(*args)
    assert r.returncode == 0, r.stderr
    said, wrote = r.stdout.splitlines()
    assert said == f"writing {tmp_path / 't'}: 81,920 accesses in 20 calls, 640.4 KiB (held in memory while it is made)"
    assert wrote.startswith(f"wrote {tmp_path / 't'}: 81,920 accesses")
    on_disk = sum(f.stat().st_size for f in (tmp_path / "t").glob("*.npy"))
    assert 0 <= on_disk - 655_764 <= 4 * 256  # the arrays, and a .npy header each


def test_trace_synth_refuses_a_trace_larger_than_the_free_disk(tmp_path):
    """The free space is faked (a fault injected): a real full disk cannot be arranged in a test."""
    import shutil
    from types import SimpleNamespace
    from unittest import mock

    from tierstore.tools import cli as tcli

    with mock.patch.object(shutil, "disk_usage", return_value=SimpleNamespace(free=1000)):
        code = tcli.main(["trace", "synth", str(tmp_path / "t"), "--steps", "2", "--batch-size", "8"])
    assert code == 2 and not (tmp_path / "t").exists()


@pytest.fixture(scope="module")
def two_table_trace(tmp_path_factory):
    """One synthesized trace for every case below (a synth process per case cost seconds each)."""
    path = tmp_path_factory.mktemp("trace") / "t"
    r = cli("trace", "synth", str(path), "--table", "a:3000:1.1:4", "--table", "b:500:0.9:2", "--batch-size", "64",
            "--steps", "30")
    assert r.returncode == 0, r.stderr
    return path


@pytest.mark.parametrize("options,dedupes", [
    ([], True),
    (["--hbm-hit", "0.5", "--hit", "0.8", "--policies", "lfu,lookahead"], True),
    (["--shards", "0.5", "--compare", "--sizes", "10:100", "--sizes", "1%:5%", "--no-belady"], True),
    (["--shards", "0.5", "--policies", "", "--no-belady"], False),  # no exact pass: the ids are not deduplicated whole
])
def test_capacity_says_how_many_passes_it_will_make_before_the_first(two_table_trace, options, dedupes):
    r = cli("capacity", str(two_table_trace), "--progress", *options)
    assert r.returncode == 0, r.stderr
    first, *lines = r.stderr.splitlines()
    n = int(re.search(r"up to (\d+) passes", first).group(1))
    assert first.startswith("capacity: 11,520 accesses in 2 tables: ")
    assert sum(line.endswith(" s") and ", done in " in line for line in lines) == n  # every pass ends with its line
    # the ids are deduplicated per call before any exact pass, itself a pass that shows progress
    assert any(line.startswith("deduplicating ids: 11,520/11,520 ids") for line in lines) == dedupes


def test_deduplicating_a_trace_reports_every_id_to_its_progress_bar(tmp_path):
    from tierstore.capacity.trace_streams import build_streams

    counted = []

    class Bar:
        def __init__(self, total, desc):
            counted.append([desc, total, 0, False])

        def update(self, n):
            counted[-1][2] += n

        def close(self):
            counted[-1][3] = True

    # one table of long calls (a loop over calls), one of short ones (one sort)
    cfg = SynthConfig((SynthTable("long", 5000, None, 20.0), SynthTable("short", 300, None, 0.01)), batch_size=64, steps=10)
    trace = synth(cfg)
    build_streams(trace, progress=Bar)
    assert counted == [["deduplicating ids", trace.n_accesses, trace.n_accesses, True]]
