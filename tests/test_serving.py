"""Serving: export to a serving store, quantized row-wise, and inference lookups
from its tiers. Real LMDB, real FBGEMM where installed, the CLI and a training writer in
subprocesses."""
from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
import time

import numpy as np
import pytest
import torch

import tierstore
from tierstore import RowInit, TableSpec, TieredStore
from tierstore.io import StoreCorruptError
from tierstore.io.serving_layout import RowFormat
from tierstore import ServingEmbeddingBag, ServingEmbeddingBagCollection, ServingStore, export

try:
    import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen
except ImportError:
    fbgemm_gpu = None
needs_fbgemm = pytest.mark.skipif(fbgemm_gpu is None, reason="needs FBGEMM (fbgemm-gpu-cpu) to compare with")

CLI = [sys.executable, "-W", "error", "-m", "tierstore.tools.cli"]
DTYPES = ("float32", "float16", "int8", "int4")
LEVELS = {"int8": 255, "int4": 15}


def trained_store(path, n=600, dim=16, seed=0, **spec_kw) -> np.ndarray:
    """A float32 training store of one table "t" (with optimizer state) whose every other
    row was written; returns every row as the store reads it."""
    rng = np.random.default_rng(seed)
    spec = TableSpec("t", n, dim, state_dim=dim, init=RowInit.normal(0, 0.1, seed=seed), **spec_kw)
    with TieredStore(path, tables=[spec], device="cpu") as s:
        ids = np.arange(0, n, 2)
        s.write("t", ids, np.concatenate([rng.normal(0, 1, (len(ids), dim)) * rng.uniform(0.01, 10, (len(ids), 1)),
                                          np.full((len(ids), dim), 7.0)], axis=1).astype(np.float32), with_state=True)
        return s.read("t", np.arange(n)).numpy()


def bound(x: np.ndarray, dtype: str) -> np.ndarray:
    """docs/serving.md's bound on |x - x̂| for each element of float32 rows x, in float64."""
    x = x.astype(np.float64)
    big = np.abs(x).max(axis=1, keepdims=True)
    if dtype == "float32":
        return np.zeros_like(x)
    if dtype == "float16":
        return np.broadcast_to(np.maximum(np.abs(x) * 2.0 ** -11, 2.0 ** -25), x.shape)
    lo, hi = x.min(axis=1, keepdims=True), x.max(axis=1, keepdims=True)
    scale = np.float16(np.float32(hi - np.float16(lo)) / LEVELS[dtype]).astype(np.float64)
    b = 0.5 * scale + 2.0 ** -11 * (2 * np.abs(lo) + (hi - lo)) + 2.0 ** -25 * LEVELS[dtype] + 2.0 ** -21 * big
    return np.broadcast_to(b, x.shape)


def bags(n_rows: int, seed: int, n_bags: int = 40):
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(0, 12, (n_bags,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(sizes, 0)])
    ids = torch.randint(0, n_rows, (int(offsets[-1]),), generator=g)
    return ids, offsets, torch.rand(len(ids), generator=g) * 2 - 0.5


# -- formats ---------------------------------------------------------------------------------

def edge_rows(dim: int) -> np.ndarray:
    rng = np.random.default_rng(1)
    rows = [rng.normal(0, 1, dim), np.full(dim, 0.3), np.zeros(dim), rng.uniform(1000, 1001, dim),
            rng.normal(0, 1e-6, dim), np.linspace(-65000, 65000, dim), rng.normal(-5, 1e-3, dim), rng.normal(0, 1e-30, dim)]
    return np.concatenate([np.stack(rows), rng.normal(0, 1, (300, dim)) * rng.uniform(1e-4, 100, (300, 1))]).astype(np.float32)


@needs_fbgemm
@pytest.mark.parametrize("dtype", ["int8", "int4"])
@pytest.mark.parametrize("dim", [4, 16, 36])
def test_quantized_rows_are_fbgemms_bit_for_bit(dtype, dim):
    x = edge_rows(dim)
    ours = RowFormat(dim, dtype).encode(x)
    theirs = torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(torch.from_numpy(x), {"int8": 8, "int4": 4}[dtype])
    assert np.array_equal(ours, theirs.numpy())


@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantized_rows_within_the_documented_bound(dtype):
    x = edge_rows(16)
    fmt = RowFormat(16, dtype)
    packed = fmt.encode(x)
    assert packed.shape == (len(x), {"float32": 64, "float16": 32, "int8": 20, "int4": 12}[dtype])
    err = np.abs(fmt.decode(packed).astype(np.float64) - x)
    assert (err <= bound(x, dtype)).all()


def test_int4_needs_an_even_dim():
    with pytest.raises(ValueError, match="even dim.*int8"):
        RowFormat(7, "int4")


# -- export --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_export_holds_weights_only_packed(tmp_path, dtype):
    full = trained_store(tmp_path / "train")
    path = export(tmp_path / "train", tmp_path / "serve", dtype=dtype)
    fmt = RowFormat(16, dtype)
    with ServingStore(path) as s:
        desc = s.meta["tables"][0]
        assert (desc["rows"], desc["row_bytes"], desc["dtype"]) == (300, fmt.row_bytes, dtype)
        got = s.rows("t", np.arange(600)).numpy()
    expected = fmt.decode(fmt.encode(full))  # written rows and initial ones alike
    assert np.array_equal(got, expected)
    # every serving row is the packed weights: no optimizer state (7.0) on disk
    data = (path / "data.mdb").stat().st_size
    assert data < (tmp_path / "train" / "data.mdb").stat().st_size


def test_a_table_with_no_rows_stored_exports(tmp_path):
    spec = TableSpec("empty", None, 4, init=RowInit.uniform(-1, 1))
    with TieredStore(tmp_path / "train", tables=[spec], device="cpu") as s:
        expected = s.read("empty", [3, 10**15]).numpy()
    with ServingStore(export(tmp_path / "train", tmp_path / "serve", dtype="float32")) as srv:
        assert srv.meta["tables"][0]["rows"] == 0
        assert np.array_equal(srv.rows("empty", [3, 10**15]).numpy(), expected)


def test_export_of_admission_ttl_and_half_tables_reads_as_the_store(tmp_path):
    specs = [TableSpec("ttl", 400, 8, init=RowInit.uniform(-1, 1, seed=3), ttl_steps=3),
             TableSpec("admit", 400, 8, init=RowInit.normal(0, 0.5), admit_after=2, state_dim=8),
             TableSpec("half", 400, 8, dtype="float16", init=RowInit.normal(0, 0.5)),
             TableSpec("l2", None, 8, init=RowInit.uniform(1, 2), evict_l2_below=0.5)]
    rng = np.random.default_rng(0)
    with TieredStore(tmp_path / "train", tables=specs, hbm_rows=50, device="cpu") as s:
        for name in ("ttl", "admit", "half"):
            for _ in range(2):
                s.read(name, np.arange(0, 200))
            s.write(name, np.arange(0, 200), rng.normal(0, 1, (200, 8)).astype(np.float32))
        s.write("l2", np.arange(10**12, 10**12 + 20), np.full((20, 8), 0.01, np.float32))  # below evict_l2_below
        s.write("l2", np.arange(5, 25), np.full((20, 8), 3.0, np.float32))
        for _ in range(4):  # rows 0..99 of "ttl" idle for 4 steps: read as initial again
            s.read("ttl", np.arange(100, 200))
        s.flush()
    with TieredStore(tmp_path / "train", readonly=True, device="cpu") as s:
        ids = {n: np.arange(400) for n in ("ttl", "admit", "half")} | {"l2": np.concatenate([np.arange(30), np.arange(10**12, 10**12 + 20)])}
        expected = {n: s.peek(n, i).numpy() for n, i in ids.items()}
    path = export(tmp_path / "train", tmp_path / "serve", dtype="float32")
    with ServingStore(path) as srv:
        rows = {t["name"]: t["rows"] for t in srv.meta["tables"]}
        for name, i in ids.items():
            assert np.array_equal(srv.rows(name, i).numpy(), expected[name]), name
    assert rows["ttl"] == 100  # the idle rows are left out: lookups give them their initial values
    assert rows["l2"] == 20


def test_export_while_a_writer_trains_is_one_snapshot(tmp_path):
    """A writer process rewrites every row to its step number, step after step; each export
    holds one step's rows, and the writer is never stopped (it steps on meanwhile)."""
    trained_store(tmp_path / "train", n=2000)
    script = textwrap.dedent(f"""
        import sys, numpy as np, tierstore
        with tierstore.TieredStore({str(tmp_path / 'train')!r}, device="cpu") as s:
            step = 0
            while True:
                step += 1
                s.write("t", np.arange(2000), np.full((2000, 16), step, np.float32))
                s.flush()
                print(step, flush=True)
    """)
    writer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "1"
        seen = []
        for k in range(4):
            path = export(tmp_path / "train", tmp_path / f"serve{k}", dtype="float32")
            with ServingStore(path) as s:
                rows = s.rows("t", np.arange(2000)).numpy()
            assert len(np.unique(rows)) == 1, f"export {k} mixes steps {np.unique(rows)[:5]}"
            seen.append(float(rows[0, 0]))
            writer.stdout.readline()  # the writer stepped on after this export
        assert seen == sorted(seen) and seen[-1] > seen[0]
        assert writer.poll() is None
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()


def test_bad_exports_leave_nothing(tmp_path):
    trained_store(tmp_path / "train")
    dst = tmp_path / "serve"
    with pytest.raises(ValueError, match="dtype must be one of"):
        export(tmp_path / "train", dst, dtype="int3")
    with pytest.raises(KeyError, match=r"tables \['nope'\] are not in the store"):
        export(tmp_path / "train", dst, tables=["nope"])
    with pytest.raises(TypeError, match=r"pass \['t'\]"):
        export(tmp_path / "train", dst, tables="t")
    with pytest.raises(FileNotFoundError, match="no tierstore"):
        export(tmp_path / "missing", dst)
    with pytest.raises(FileNotFoundError, match="no tierstore"):  # the directories above DST it made go too
        export(tmp_path / "missing", tmp_path / "new" / "deeper" / "serve")
    with TieredStore(tmp_path / "bad", tables=[TableSpec("t", 10, 4), TableSpec("odd", 10, 3)], device="cpu") as s:
        s.write("t", [1, 2], np.array([[1, 2, np.inf, 0], [0, 0, 0, 1e6]], np.float32))
    with pytest.raises(ValueError, match="row 1 has a non-finite weight"):
        export(tmp_path / "bad", dst, tables=["t"], dtype="float32")
    with TieredStore(tmp_path / "bad") as s:
        s.write("t", [1], np.zeros((1, 4), np.float32))
    with pytest.raises(ValueError, match="row 2 has a weight beyond float16's range.*export it as float32"):
        export(tmp_path / "bad", dst, tables=["t"], dtype="int8")
    with pytest.raises(ValueError, match="even dim"):
        export(tmp_path / "bad", dst, dtype="int4")
    assert sorted(os.listdir(tmp_path)) == ["bad", "train"]
    export(tmp_path / "bad", dst, dtype="float32")
    with pytest.raises(FileExistsError, match="not an empty directory"):
        export(tmp_path / "train", dst)


FULL_DISK_EXPORT = """
import errno, os, subprocess, sys
from tierstore import export
from tierstore.tools.cli import main
train, disk, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
try:
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tierstore-test", disk], check=True, capture_output=True)
except (OSError, subprocess.CalledProcessError) as e:
    print("NO-MOUNT", getattr(e, "stderr", e))
    sys.exit(0)
dst = os.path.join(disk, "a", "b", "serve")  # a and b do not exist yet
try:
    export(train, dst, dtype="float32")
    print("EXPORTED")
except OSError as e:
    print("ERROR", type(e).__name__, e.errno, e.filename, "|", e)
except Exception as e:
    print("WRONG", type(e).__module__, type(e).__name__, e)
print("LEFT", sorted(os.listdir(disk)))
print("RC", main(["export", train, dst, "--dtype", "float32"]), flush=True)
print("LEFT", sorted(os.listdir(disk)))
subprocess.run(["mount", "-o", f"remount,size={4 * size}", disk], check=True)  # room for both
export(train, dst, dtype="float32")
print("THEN", sorted(os.listdir(disk)), sorted(os.listdir(dst)))
"""


def test_an_export_to_a_nearly_full_disk_is_enospc_naming_dst_and_leaves_nothing(tmp_path):
    """A real small disk (a tmpfs mounted in a user namespace of the child) with room for the
    snapshot of the training store but not for the serving store beside it: export() raises
    OSError ENOSPC naming DST, not LMDB's EIO; the command prints one line; neither leaves a
    file or a directory (not even DST's missing parents). With room the same export succeeds."""
    trained_store(tmp_path / "train", n=20000, dim=64)
    snap = TieredStore(tmp_path / "train", readonly=True, device="cpu")
    snap.checkpoint(tmp_path / "snap")
    snap.close()
    export(tmp_path / "train", tmp_path / "serve", dtype="float32")
    sizes = [(tmp_path / d / "data.mdb").stat().st_size for d in ("snap", "serve")]
    (tmp_path / "disk").mkdir()
    r = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", sys.executable, "-c", FULL_DISK_EXPORT,
                        str(tmp_path / "train"), str(tmp_path / "disk"), str(sizes[0] + sizes[1] // 2)],
                       capture_output=True, text=True, timeout=120)
    if (r.returncode and "unshare" in r.stderr) or "NO-MOUNT" in r.stdout:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {r.stderr.strip() or r.stdout.strip()}")
    assert r.returncode == 0, r.stderr[-3000:]
    dst = str(tmp_path / "disk" / "a" / "b" / "serve")
    assert f"ERROR DiskFullError {errno.ENOSPC} {dst} | [Errno {errno.ENOSPC}] disk full: could not write the serving store {dst}" \
        in r.stdout, r.stdout
    assert r.stdout.count("LEFT []") == 2, r.stdout
    assert "RC 2" in r.stdout and f"tierstore: error: {dst}: disk full: could not write the serving store" in r.stderr, r.stderr
    assert "THEN ['a'] ['data.mdb', 'lock.mdb']" in r.stdout, r.stdout


def test_a_damaged_serving_store_is_named(tmp_path):
    trained_store(tmp_path / "train")
    path = export(tmp_path / "train", tmp_path / "serve")
    with pytest.raises(StoreCorruptError, match="not a serving store"):
        ServingStore(tmp_path / "train")
    with open(path / "data.mdb", "r+b") as f:
        f.truncate(8192)
    with pytest.raises(StoreCorruptError, match="truncated"):
        ServingStore(path)


def test_cli_export(tmp_path):
    trained_store(tmp_path / "train")
    done = subprocess.run([*CLI, "export", str(tmp_path / "train"), str(tmp_path / "serve"), "--dtype", "int4", "--tables", "t"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "t: 300 rows of 12 bytes (int4, dim 16)" in done.stdout
    with ServingStore(tmp_path / "serve") as s:
        assert s.dtype("t") == "int4"
    bad = subprocess.run([*CLI, "export", str(tmp_path / "train"), str(tmp_path / "x"), "--tables", "u"], capture_output=True, text=True)
    assert bad.returncode == 2 and "tierstore: error:" in bad.stderr and "'u'" in bad.stderr


def test_stats_describes_a_serving_store(tmp_path, capsys):
    """`tierstore stats` on an export: a serving store, its version, source, tables with their
    dtype, row bytes and rows stored (from LMDB), in text and JSON; the training store's memory
    flags are refused for it. An LMDB environment tierstore did not write is still named so."""
    import json

    import lmdb

    from tierstore.tools.cli import main

    trained_store(tmp_path / "train")
    with TieredStore(tmp_path / "train") as s:
        s.write("t", [1], np.zeros((1, 16), np.float32))  # 301 rows written, 600 in the table
    export(tmp_path / "train", tmp_path / "serve", dtype="int4", version=7)
    done = subprocess.run([*CLI, "stats", str(tmp_path / "serve")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"serving store at {tmp_path / 'serve'} (serving format 1), version 7"), done.stdout
    assert f"from {tmp_path / 'train'}" in lines[1] and "in data.mdb" in lines[2], done.stdout
    assert lines[4].split() == ["t", "600", "16", "int4", "12", "301", "50.17%", "5.9", "KiB"], done.stdout
    assert main(["stats", str(tmp_path / "serve"), "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert (facts["kind"], facts["version"], facts["source"]) == ("serving store", 7, str(tmp_path / "train"))
    assert facts["tables"] == [{"name": "t", "num_rows": 600, "dim": 16, "dtype": "int4", "row_bytes": 12,
                                "rows_stored": 301, "payload_bytes": 301 * 20}]
    assert main(["stats", str(tmp_path / "serve"), "--memory-budget", "1GiB"]) == 2
    assert "is a serving store: --memory-budget" in capsys.readouterr().err
    with lmdb.open(str(tmp_path / "foreign")) as env, env.begin(write=True) as txn:
        txn.put(b"someone", b"else's data")
    assert main(["stats", str(tmp_path / "foreign")]) == 2
    assert "LMDB environment that tierstore did not write" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_exporting_a_dcp_checkpoint_says_to_load_it_into_a_store_first(tmp_path):
    """A torch.distributed.checkpoint directory is not a store: the export says so and how to
    get one (load it into a model's store and export that), instead of "missing data.mdb";
    the way it names works."""
    import torch.distributed.checkpoint as dcp

    m = tierstore.TieredEmbeddingBag(100, 8, path=tmp_path / "store", device="cpu")
    m.store.write("t0", np.arange(10), np.full((10, 8), 3.0, np.float32))
    dcp.save(m.state_dict(), checkpoint_id=tmp_path / "dcp")
    m.close()
    done = subprocess.run([*CLI, "export", str(tmp_path / "dcp"), str(tmp_path / "serve")], capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"tierstore: error: {tmp_path / 'dcp'} is a torch.distributed.checkpoint (DCP) checkpoint"), \
        done.stderr
    assert "torch.distributed.checkpoint.load(sd, checkpoint_id=DIR); model.load_state_dict(sd)" in done.stderr
    assert "tierstore.export(model.store, DST)" in done.stderr and "store.checkpoint(path)" in done.stderr
    with pytest.raises(FileNotFoundError, match="DCP"):
        export(tmp_path / "dcp", tmp_path / "serve")
    assert sorted(os.listdir(tmp_path)) == ["dcp", "store"]
    m = tierstore.TieredEmbeddingBag(100, 8, path=tmp_path / "fresh", device="cpu")
    sd = m.state_dict()
    dcp.load(sd, checkpoint_id=tmp_path / "dcp")
    m.load_state_dict(sd)
    export(m.store, tmp_path / "serve", dtype="float32")
    m.close()
    with ServingStore(tmp_path / "serve") as s:
        assert (s.rows("t0", np.arange(10)).numpy() == 3).all()


# -- lookups -----------------------------------------------------------------------------------

TIERS = [(0, 0), (40, 90), (1000, 0), (0, 1000)]


@pytest.mark.parametrize("kernel", ["fbgemm", "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hbm,ddr", TIERS)
def test_pooled_lookups_within_the_bound_of_float64(tmp_path, monkeypatch, dtype, hbm, ddr, kernel):
    if kernel == "torch":  # pooled as where FBGEMM is not installed
        monkeypatch.setattr(tierstore.serving.store.fbgemm, "installed", lambda: False)
    elif fbgemm_gpu is None:
        pytest.skip("needs FBGEMM (fbgemm-gpu-cpu) for its kernel")
    full = trained_store(tmp_path / "train")
    export(tmp_path / "train", tmp_path / "serve", dtype=dtype)
    err = bound(full, dtype)
    used = set()
    with ServingStore(tmp_path / "serve", hbm_rows=hbm, ddr_rows=ddr, device="cpu") as s:
        for seed in range(6):
            ids, offsets, psw = bags(600, seed)
            used |= set(ids.tolist())
            for mode, w in (("sum", psw), ("sum", None), ("mean", None)):
                got = s.lookup("t", ids, offsets, w, mode).double().numpy()
                weights = np.ones(len(ids)) if w is None else w.double().numpy()
                per = full[ids.numpy()].astype(np.float64) * weights[:, None]
                slack = err[ids.numpy()] * np.abs(weights)[:, None]
                sizes = np.diff(offsets.numpy())
                ref = np.add.reduceat(per, offsets[:-1].numpy(), axis=0) if len(per) else np.zeros((0, 16))
                tol = np.add.reduceat(slack + 2.0 ** -22 * np.abs(per) * max(sizes.max(), 1), offsets[:-1].numpy(), axis=0)
                ref[sizes == 0], tol[sizes == 0] = 0, 0
                if mode == "mean":
                    ref, tol = ref / np.maximum(sizes, 1)[:, None], tol / np.maximum(sizes, 1)[:, None]
                assert (np.abs(got - ref) <= tol + 1e-30).all(), (mode, np.abs(got - ref).max())
        st = s.stats()["t"]
    # DDR keeps the rows it sends up to HBM: it holds the rows read, as many as it has room for
    assert st["hbm_resident"] == min(hbm, len(used)) and st["ddr_resident"] == min(ddr, len(used))


def intnbit(rows: np.ndarray, dtype: str, mode: str) -> "IntNBitTableBatchedEmbeddingBagsCodegen":
    """FBGEMM's IntNBit TBE holding float32 rows quantized by FBGEMM's own quantizer."""
    ty = {"float32": SparseType.FP32, "float16": SparseType.FP16, "int8": SparseType.INT8, "int4": SparseType.INT4}[dtype]
    tbe = IntNBitTableBatchedEmbeddingBagsCodegen([("t", len(rows), rows.shape[1], ty, EmbeddingLocation.HOST)], device="cpu",
                                                  pooling_mode=PoolingMode.SUM if mode == "sum" else PoolingMode.MEAN,
                                                  output_dtype=SparseType.FP32)
    tbe.initialize_weights()
    (weights, scale_bias), = tbe.split_embedding_weights()
    x = torch.from_numpy(rows)
    if dtype in LEVELS:
        q = torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(x, 8 if dtype == "int8" else 4)
        weights.copy_(q[:, :-4])
        scale_bias.copy_(q[:, -4:])
    else:
        weights.copy_(x.to(getattr(torch, dtype)).view(torch.uint8))
    return tbe


@needs_fbgemm
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hbm,ddr", TIERS)
def test_lookups_equal_fbgemm_intnbit_bit_for_bit(tmp_path, dtype, hbm, ddr):
    full = trained_store(tmp_path / "train")
    export(tmp_path / "train", tmp_path / "serve", dtype=dtype)
    with ServingStore(tmp_path / "serve", hbm_rows=hbm, ddr_rows=ddr, device="cpu") as s:
        for mode in ("sum", "mean"):
            tbe = intnbit(full, dtype, mode)
            for seed in range(5):
                ids, offsets, psw = bags(600, seed)
                w = psw if mode == "sum" else None
                assert torch.equal(s.lookup("t", ids, offsets, w, mode), tbe(ids, offsets, w))


@pytest.mark.parametrize("hbm,ddr", TIERS)
def test_empty_lookups(tmp_path, hbm, ddr):
    trained_store(tmp_path / "train")
    with ServingStore(export(tmp_path / "train", tmp_path / "serve"), hbm_rows=hbm, ddr_rows=ddr, device="cpu") as s:
        assert torch.equal(s.lookup("t", torch.zeros(0, dtype=torch.int64), [0, 0, 0]), torch.zeros(2, 16))
        assert s.rows("t", []).shape == (0, 16)
        s.rows("t", [1, 2])  # then from a tier
        assert torch.equal(s.lookup("t", [], [0]), torch.zeros(0, 16))


def test_modules(tmp_path):
    full = trained_store(tmp_path / "train")
    export(tmp_path / "train", tmp_path / "serve", dtype="float32")
    ids, offsets, psw = bags(600, 0)
    ref = torch.nn.functional.embedding_bag(ids, torch.from_numpy(full), offsets[:-1], mode="sum", per_sample_weights=psw)
    bag = ServingEmbeddingBag.open(tmp_path / "serve", hbm_rows=100, device="cpu")
    torch.testing.assert_close(bag(ids, offsets[:-1], psw), ref)
    torch.testing.assert_close(bag(ids.view(-1, 1)), torch.from_numpy(full)[ids])
    bag.store.close()
    ebc = ServingEmbeddingBagCollection(tmp_path / "serve", mode="mean", include_last_offset=True, device="cpu")
    out = ebc({"t": (ids, offsets)})
    torch.testing.assert_close(out["t"], torch.nn.functional.embedding_bag(ids, torch.from_numpy(full), offsets, mode="mean",
                                                                           include_last_offset=True))
    with pytest.raises(KeyError, match="unknown table 'u'"):
        ebc({"u": (ids, offsets)})
    with pytest.raises(IndexError, match="id 600 out of range"):
        ebc({"t": (torch.tensor([600]), torch.tensor([0, 1]))})
    with pytest.raises(ValueError, match="per_sample_weights are only supported with mode='sum'"):
        ebc({"t": (ids, offsets, psw)})
    ebc.close()


# -- streaming updates ---------------------------------------------------------------------------

from tierstore.serving.stream import DeltaCorruptError, Publisher, Replica  # noqa: E402


def test_replica_follows_published_deltas(tmp_path):
    spec = TableSpec("t", 500, 8, state_dim=8, init=RowInit.normal(0, 0.1))
    rng = np.random.default_rng(0)
    with TieredStore(tmp_path / "train", tables=[spec], hbm_rows=64, device="cpu") as store:
        pub = Publisher(store, tmp_path / "pub", dtype="float32")
        replica = Replica(tmp_path / "pub", hbm_rows=100, ddr_rows=100, device="cpu")
        replica.rows("t", np.arange(500))  # rows resident in the replica's tiers are updated in place
        for step in range(1, 5):
            ids = rng.choice(500, 120, replace=False)
            store.write("t", ids, rng.normal(0, 1, (120, 8)).astype(np.float32))
            store.read("t", rng.choice(500, 100, replace=False))  # evicts dirty rows: written back, not flushed
            assert pub.publish() == step
            assert replica.poll() == step
            assert np.array_equal(replica.rows("t", np.arange(500)).numpy(), store.read("t", np.arange(500)).numpy())
        m = replica.metrics()
        assert (m["version"], m["published_version"], m["lag_versions"], m["lag_seconds"]) == (4, 4, 0, 0.0)
        assert m["rows_applied"] == pub.rows_published > 0
        # a replica opened later starts from the export and applies every delta
        late = Replica(tmp_path / "pub", device="cpu")
        assert late.version == 4 and np.array_equal(late.rows("t", np.arange(500)).numpy(), store.read("t", np.arange(500)).numpy())
        late.close()
        replica.close()


@contextlib.contextmanager
def published(tmp_path, dtype: str, hbm_rows: int):
    """A store of one table of 100 x 8, its Publisher, and a Replica following it."""
    with TieredStore(tmp_path / "train", tables=[TableSpec("t", 100, 8)], device="cpu") as store:
        pub = Publisher(store, tmp_path / "pub", dtype=dtype)
        replica = Replica(tmp_path / "pub", hbm_rows=hbm_rows, device="cpu")
        try:
            yield store, pub, replica
        finally:
            replica.close()


def test_a_damaged_delta_is_refused_and_the_version_kept(tmp_path):
    with published(tmp_path, "int8", hbm_rows=10) as (store, pub, replica):
        store.write("t", np.arange(100), np.ones((100, 8), np.float32))
        pub.publish()
        assert replica.poll() == 1
        store.write("t", np.arange(100), np.full((100, 8), 2.0, np.float32))
        pub.publish()
        delta = tmp_path / "pub" / "delta-00000002.bin"
        whole = delta.read_bytes()
        for damage in (whole[:-100], whole[:20], whole[:300] + bytes([whole[300] ^ 1]) + whole[301:], b""):
            delta.write_bytes(damage)
            with pytest.raises(DeltaCorruptError, match="delta-00000002.bin is damaged"):
                replica.poll()
            assert replica.version == 1
            assert (replica.rows("t", np.arange(100)).numpy() == 1).all()
        delta.write_bytes(whole)
        assert replica.poll() == 2 and (replica.rows("t", np.arange(100)).numpy() == 2).all()


def test_a_replica_behind_a_compaction_catches_up_from_the_export(tmp_path):
    with published(tmp_path, "float32", hbm_rows=100) as (store, pub, replica):
        for k in range(1, 4):
            store.write("t", [k], np.full((1, 8), k, np.float32))
            pub.publish()
        assert pub.compact() == 3
        assert sorted(p.name for p in (tmp_path / "pub").iterdir()) == ["export-00000003"]
        store.write("t", [9], np.full((1, 8), 9, np.float32))
        pub.publish()
        assert replica.poll() == 4
        assert np.array_equal(replica.rows("t", [1, 2, 3, 9]).numpy()[:, 0], [1, 2, 3, 9])


PUBLISHER = """
import sys, numpy as np, tierstore
from tierstore.serving.stream import Publisher
with tierstore.TieredStore(sys.argv[1], tables=[tierstore.TableSpec("t", 3000, 8)], hbm_rows=500, device="cpu") as store:
    pub = Publisher(store, sys.argv[2], dtype="int8")
    k = 0
    while True:
        k += 1
        store.write("t", np.arange(3000), np.full((3000, 8), k % 50, np.float32))
        print(pub.publish(), flush=True)
"""

READER = """
import os, sys, threading, numpy as np, torch
from tierstore.serving.stream import Replica
replica = Replica(sys.argv[1], hbm_rows=1000, ddr_rows=1000, device="cpu")
done = threading.Event()

def follow():  # applies deltas while the main thread looks up
    while not done.is_set():
        replica.poll()

threading.Thread(target=follow, daemon=True).start()
print("ready", replica.version, flush=True)
ids, offsets = torch.arange(3000), torch.tensor([0, 3000])
versions = set()
while True:
    stop = os.path.exists(sys.argv[2])  # the publisher is gone: serve until all it left is applied
    rows = replica.rows("t", ids).numpy()
    assert len(np.unique(rows)) == 1, f"a lookup mixed versions: {np.unique(rows)}"
    mean = replica.lookup("t", ids, offsets, mode="mean").numpy()
    assert len(np.unique(mean)) == 1, f"a lookup mixed versions: {np.unique(mean)}"
    versions.add(float(rows[0, 0]))
    if stop and replica.metrics()["lag_versions"] == 0:
        break
done.set()
print(len(versions), replica.version, flush=True)
"""


def first_line(proc) -> str:
    """The child's first line, read a byte at a time: readline() may buffer the lines after it,
    and communicate() reads the pipe itself, so it would never see them."""
    line = b""
    while not line.endswith(b"\n") and (byte := os.read(proc.stdout.fileno(), 1)):
        line += byte
    return line.decode()


def test_replicas_never_see_a_mix_of_versions(tmp_path):
    """A publisher process rewrites every row each step and publishes; a replica process
    applies deltas while looking every row up, each lookup one version (all rows equal). The
    publisher is killed (SIGKILL) mid-run: the replica ends on the last version it published whole.
    A second replica is killed (SIGKILL) while it applies deltas, and one started after both
    kills catches up to that same last version: a kill on either side leaves the published
    directory whole."""
    stop = tmp_path / "stop"
    publisher = subprocess.Popen([sys.executable, "-c", PUBLISHER, str(tmp_path / "train"), str(tmp_path / "pub")],
                                 stdout=subprocess.PIPE, text=True)
    readers = []
    try:
        assert publisher.stdout.readline().strip() == "1"
        def reader():
            return subprocess.Popen([sys.executable, "-c", READER, str(tmp_path / "pub"), str(stop)], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
        readers = [reader(), reader()]
        ready = [first_line(r).split() for r in readers]
        assert [x[0] for x in ready] == ["ready"] * 2, readers[0].stderr.read()[-2000:]
        while int(publisher.stdout.readline()) < max(int(x[1]) for x in ready) + 4:  # replicas look up while these come
            pass
        killed = readers.pop()
        killed.send_signal(signal.SIGKILL)
        killed.communicate()
        publisher.send_signal(signal.SIGKILL)
        publisher.wait()
        stop.touch()
        readers.append(reader())
        assert first_line(readers[-1]).startswith("ready")  # it may print its last line at once
        last = max(int(p.name[6:14]) for p in (tmp_path / "pub").iterdir() if p.name.startswith("delta-"))
        seen = []
        for r in readers:
            out, err = r.communicate(timeout=300)
            assert r.returncode == 0, err[-2000:]
            n, version = map(int, out.split())
            assert version == last
            seen.append(n)
        assert max(seen) > 1  # the first replica served several versions while deltas came
    finally:
        for p in (publisher, *readers):
            if p.poll() is None:
                p.kill()


@pytest.mark.gpu
def test_cuda_tiers_serve_the_same_rows(tmp_path, monkeypatch):
    """HBM tier on the GPU, DDR on the host: the same dequantized rows as the CPU store, and
    pooled bags as torch pools them there (FBGEMM's CPU build has no CUDA kernel)."""
    trained_store(tmp_path / "train")
    export(tmp_path / "train", tmp_path / "serve", dtype="int8")
    monkeypatch.setattr(tierstore.serving.store.fbgemm, "installed", lambda: False)
    with ServingStore(tmp_path / "serve", hbm_rows=40, ddr_rows=90, device="cuda") as gpu, \
            ServingStore(tmp_path / "serve", device="cpu") as cpu:
        for seed in range(4):
            ids, offsets, psw = bags(600, seed)
            torch.testing.assert_close(gpu.lookup("t", ids, offsets, psw).cpu(), cpu.lookup("t", ids, offsets, psw))
        assert torch.equal(gpu.rows("t", np.arange(600)).cpu(), cpu.rows("t", np.arange(600)))
        assert gpu.stats()["t"]["hbm_resident"] == 40


def test_concurrent_polls_apply_each_delta_once_in_order(tmp_path, monkeypatch):
    """Two threads poll; the first stalls reading its delta (injected latency) while the
    second would apply the later ones: the stalled delta must not land after them."""
    import threading

    import tierstore.serving.stream as stream

    with published(tmp_path, "float32", hbm_rows=100) as (store, pub, replica):
        for k in range(1, 4):
            store.write("t", np.arange(100), np.full((100, 8), k, np.float32))
            pub.publish()
        real, stalled = stream.decode_delta, threading.Event()

        def slow_first(path):
            if not stalled.is_set():
                stalled.set()
                got = real(path)
                time.sleep(0.5)
                return got
            return real(path)
        monkeypatch.setattr(stream, "decode_delta", slow_first)
        first = threading.Thread(target=replica.poll)
        first.start()
        stalled.wait()
        replica.poll()
        first.join()
        assert replica.version == 3 and (replica.rows("t", np.arange(100)).numpy() == 3).all()
        assert replica.metrics()["rows_applied"] == 300


def _sharded_rank(rank: int, world: int, init_method: str, out: str) -> None:
    import datetime

    import torch.distributed as dist

    import test_distributed as td

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    td.train_sharded(rank, world, Path(out) / "train", "sgd", checkpoint=Path(out) / "ckpt")
    dist.destroy_process_group()


def test_export_of_a_sharded_checkpoint_is_the_whole_tables(tmp_path):
    """Two gloo ranks train tables sharded by rows, by hash, whole and by columns
    (tests/test_distributed.py's plan) and checkpoint; the export of the checkpoint serves
    the rows a single process trained on the same global batches (bit for bit, float32)."""
    import torch.multiprocessing as mp

    import test_distributed as td

    mp.spawn(_sharded_rank, args=(2, td.rendezvous(tmp_path), str(tmp_path)), nprocs=2, join=True)
    _, expected = td.train_single(tmp_path / "single", 2, "sgd")
    with ServingStore(export(tmp_path / "ckpt", tmp_path / "serve", dtype="float32")) as srv:
        assert {t["name"] for t in srv.meta["tables"]} == set(td.CHECK_IDS)
        for name, ids in td.CHECK_IDS.items():
            dim = srv.tables[name].dim
            assert torch.equal(srv.rows(name, ids), expected[name][:, :dim]), name
