"""`tierstore prefetchd` under clients that are well-formed but greedy: many claimed
row ranges, many large prefetch hints. A real daemon process over its real Unix
socket and a real LMDB store, as in test_daemon.py."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from tierstore.daemon import wire
from test_daemon import (Daemon, _embedded, _hello, _status, attach, attach_once_released,  # noqa: F401 (fixtures)
                         no_daemon_outlives_its_test, raw_conn, sockdir, store_path)


def test_many_range_claims_are_indexed_capped_and_other_clients_are_answered_meanwhile(store_path, sockdir):
    k, n = 3, 20_000  # checked pairwise, the second HELLO alone held the daemon's lock for ~20 s
    d = Daemon(store_path, sockdir / "d.sock", "--max-claims", str(n))
    reader = attach(d, store_path, readonly=True, timeout=20)

    def claims(j: int) -> list:  # interleaved: every range of one client borders the others'
        return [("item", k * i + j, k * i + j + 1) for i in range(n)]

    with ThreadPoolExecutor(k) as pool:
        futures = [pool.submit(attach, d, store_path, claim=claims(j), client=f"ranges-{j}", timeout=20) for j in range(k)]
        reads = []
        while True:  # another client's 3-row reads are answered while the HELLOs are checked (within its own timeout)
            reads.append(reader.read("user", [3, 4, 5]))
            if all(f.done() for f in futures):
                break
        clients = [f.result() for f in futures]
    assert all(torch.equal(r, torch.full((3, 8), 0.5)) for r in reads)
    assert sorted(c["n_claims"] for c in reader.daemon_stats()["clients"]) == [0, n, n, n]

    # the index answers as the pairwise check did: writes inside a client's claims only, holders named
    clients[0].write("item", [0, 3, 3 * (n - 1)], np.ones((3, 4), np.float32))
    with pytest.raises(PermissionError, match=r"no write claim on row 4 of table 'item'; it is claimed by client 'ranges-1'"):
        clients[0].write("item", [3, 4], np.ones((2, 4), np.float32))
    with pytest.raises(PermissionError, match=r"rows \[5, 6\) of table 'item' by client 'ranges-2' \(pid \d+\); "
                                              r"rows \[30, 31\) of table 'item' by client 'ranges-0'.* and 2 more overlaps already"):
        attach(d, store_path, claim=[("item", 5, 8), *(("item", r, r + 1) for r in range(30, 35))])
    assert attach(d, store_path, claim=[("item", 3 * n, 3 * n + 9)]).claims == (("item", 3 * n, 3 * n + 9),)  # past them all: free

    # past the cap: refused whole, naming the cap and the fix; a HELLO of ~1 MB (the frame's text limit) included
    for many in (n + 1, 40_000):
        with pytest.raises(ValueError, match=rf"claims {many} row ranges; the daemon takes at most {n} per client "
                                             r"\(prefetchd --max-claims\): claim fewer, wider ranges"):
            attach(d, store_path, claim=[("item", 2 * i, 2 * i + 1) for i in range(many)], timeout=20)

    clients[1].close()  # its claims go, and only its
    c = attach_once_released(d, store_path, [("item", 1, 2), ("item", 4, 5)])
    with pytest.raises(PermissionError, match=r"write claim refused: rows \[8, 9\) of table 'item' by client 'ranges-2' \(pid \d+\) already"):
        attach(d, store_path, claim=[("item", 7, 9)])  # row 7 was ranges-1's
    c.write("item", [1, 4], np.full((2, 4), 2, np.float32))
    assert torch.equal(reader.read("item", [0, 1, 3, 4, 6]), torch.tensor([1, 2, 1, 2, 0], dtype=torch.float32)[:, None].expand(5, 4))
    for x in (c, clients[0], clients[2], reader):
        x.close()
    assert d.stop() == 0


def test_prefetch_hints_keep_the_daemons_memory_within_the_readme_bound(store_path, sockdir):
    inflight = 8 << 20
    d = Daemon(store_path, sockdir / "d.sock", "--max-inflight-mib", str(inflight >> 20), "--threads", "1")  # on a shared machine
    flood = attach(d, store_path, readonly=True, shm_bytes=0, client="flood")  # no segment: its pages are not the daemon's to bound
    modest = attach(d, store_path, readonly=True, shm_bytes=0, client="modest")
    flood.read("user", np.arange(10_000))
    flood.prefetch("item", np.arange(1000))  # the store's first-use allocations (staging, fetch threads), before the baseline
    modest.prefetch("item", np.arange(2000, 3000))
    modest.prefetch("item", np.arange(4000, 5000))
    Path(f"/proc/{d.proc.pid}/clear_refs").write_text("5")  # VmHWM restarts from the RSS now
    base = _status(d.proc.pid, "VmRSS")
    rng = np.random.default_rng(0)
    hinted = rng.integers(0, 1 << 40, 400_000)
    for _ in range(40):  # 3.2 MB of ids each: kept whole, 40 of them held 128 MB of ids
        flood.prefetch("item", rng.integers(0, 1 << 40, 400_000))
    flood.prefetch("item", hinted)
    peak = _status(d.proc.pid, "VmHWM") - base
    print(f"daemon RSS peak {peak >> 20} MiB above its {base >> 20} MiB baseline")
    assert peak <= 2 * inflight + (64 << 20), f"daemon RSS grew by {peak >> 20} MiB"  # the README's bound, its 64 MiB the slack

    # the hints kept fit half of --max-inflight-mib; the flood dropped its own oldest, not the modest client's
    held = {c["name"]: c for c in modest.daemon_stats()["clients"]}
    assert held["modest"]["hints"] == 2 and held["modest"]["hint_bytes"] == 2 * 1000 * 16
    assert 0 < held["flood"]["hint_bytes"] <= inflight // 2 - held["modest"]["hint_bytes"]

    # a hint larger than the daemon takes in one frame: the client splits it, a raw peer is told why
    limit = flood._max_hint_ids
    s = raw_conn(d.sock)
    _hello(s)
    wire.send_frame(s, wire.Frame(wire.PREFETCH, text="item", ids=np.arange(limit + 1, dtype=np.int64)))
    with pytest.raises(ValueError, match=rf"hint of {limit + 1} ids exceeds the daemon's {limit} ids per PREFETCH frame.*split it"):
        wire.raise_for(wire.recv_frame(s, wire.Limits()))
    s.close()
    got = modest.read("item", hinted[:5000], with_state=True)  # hints change where rows come from, never what they are
    flood.close()
    modest.close()
    assert d.stop() == 0
    with _embedded(store_path, readonly=True) as embedded:
        assert torch.equal(got, embedded.read("item", hinted[:5000], with_state=True))


def test_claim_index_finds_the_overlaps_and_holders_a_pairwise_check_finds():
    from tierstore.daemon.sessions import ClaimIndex

    rng = np.random.default_rng(5)
    for _ in range(50):
        cuts = np.unique(rng.integers(0, 400, 60))
        held = [(int(lo), int(hi)) for lo, hi in zip(cuts[:-1], cuts[1:]) if rng.random() < 0.6]
        owners = rng.integers(1, 4, len(held))
        index = ClaimIndex()
        for owner in (1, 2, 3):  # each client's ranges added as its HELLO adds them
            index.add(wire.range_array([r for r, o in zip(held, owners) if o == owner]), owner)
        if rng.random() < 0.3:
            index.remove(2)
            held, owners = [r for r, o in zip(held, owners) if o != 2], owners[owners != 2]
        cuts = np.unique(rng.integers(0, 420, 12))
        new = wire.range_array(list(zip(cuts[:-1:2], cuts[1::2])))
        which, at = index.overlaps(new)
        pairwise = [[j for j, (hlo, hhi) in enumerate(held) if lo < hhi and hlo < hi] for lo, hi in new.tolist()]
        assert which.tolist() == [i for i, js in enumerate(pairwise) if js]
        assert at.tolist() == [js[0] for js in pairwise if js]  # the first it overlaps, in row order
        for row in range(0, 420, 7):
            owner = next((int(o) for (lo, hi), o in zip(held, owners) if lo <= row < hi), None)
            assert index.holder(row) == owner
