"""``tierstore bench scale``'s report: its figures as text (tools/bench_scale.py measures them)."""
from __future__ import annotations


def _f(x, fmt: str, none: str = "-") -> str:
    return none if x is None else format(x, fmt)


def print_report(res: dict) -> None:
    from tierstore.engine.memory import format_bytes

    t, fl = res["table"], res["floors"]
    disk, lm = fl["disk"], fl["lmdb"]
    declared = f", {t['declared']:,} declared" if t.get("declared", t["rows"]) != t["rows"] else ""
    print(f"\n== scale: {t['rows']:,} x {t['dim']} float32 rows{declared} ({format_bytes(t['table_bytes'])} of rows; data.mdb "
          f"{format_bytes(t['data_mdb_bytes'])}, {'reused' if t['reused'] else 'built in %.0f s' % t['build_s']}) at {t['path']}; "
          f"spare_space={t['spare_space']:g}, policy={t['policy']!r}")
    if t.get("aged_rows"):
        aged = t.get("aged")
        now = f"; {aged['rows']:,} of them before these runs, in {aged['seconds']:.0f} s" if aged else ""
        print(f"   aged: {t['aged_rows']:,} rows of random ids rewritten (--age-rows){now}")
    b = res["batch"]
    print(f"   step: {b['bags']} bags x {b['pooling']} ids, Zipf {b['zipf']}, SGD, {b['threads']} thread; "
          f"{b['timed_steps']} timed steps after {b['warmup']} untimed (--warmup)")
    print(f"   memory limit: {res['cgroup']}")
    print(f"   disk floor ({disk['tool']}): {_f(disk['iops_qd32'], ',.0f')} reads/s at depth 32, "
          f"{_f(disk['iops_qd1'], ',.0f')} at depth 1")
    print(f"   LMDB floor (py-lmdb alone, {lm['rows']:,} rows of a step; the table's layout: {lm['layout']}): get {_f(lm['get_cold_us'], '.1f')} us a row cold, "
          f"{_f(lm['get_warm_us'], '.1f')} us warm; put {_f(lm['put_us'], '.1f')} us")
    for name, label in (("fbgemm", "FBGEMM in memory (EmbeddingLocation.HOST, EXACT_SGD)"), ("dlrm", "DLRM demo model in memory")):
        m = res["in_memory"].get(name)
        if m:
            print(f"   {label}: p50 {m['p50_s'] * 1e3:.1f} ms, {m['lookups_per_s'] / 1e6:.2f} M lookups/s")
    if "skipped" in res["in_memory"]:
        print(f"   in-memory steps: skipped ({res['in_memory']['skipped']}); no ratio to them")
    elif "fbgemm" not in res["in_memory"]:
        print("   FBGEMM: not installed (pip install 'tierstore[fbgemm]'); no in-memory embedding step to compare")
    if res["dlrm"]:
        print(f"   DLRM: {res['dlrm']}")
    for r in res["runs"]:
        _print_run(r)


def _print_run(r: dict) -> None:
    from tierstore.engine.memory import format_bytes

    print(f"\n-- {'DLRM demo model' if r['kind'] == 'dlrm' else 'embedding step'}, budget {format_bytes(r['budget'])}, "
          f"depth {r['depth']}")
    limit = f"limit {format_bytes(r['limit'])} (RSS {format_bytes(r['rss_before'])} + budget + margin)" if "limit" in r else "no limit"
    fate = "OOM-KILLED" if r.get("oom_killed") else f"exit {r['exit']}"
    if r.get("oom_killed") and "mean_s" in r:
        fate += " after its timed steps (closing the store: its final flush)"
    print(f"   {fate}; {limit}; peak RSS {format_bytes(r.get('rss_peak'))}, cgroup peak {format_bytes(r.get('cgroup_peak'))}")
    if "charged_before" in r:
        held = lambda s: ", ".join(f"{k} {format_bytes(v)}" for k, v in s.items()) or "-"  # noqa: E731
        print(f"   charged to the group at its start {format_bytes(r['charged_before'])}; at its most anonymous memory: "
              f"{held(r['cgroup_at_most_anon'])}; last sampled: {held(r['cgroup_last'])}")
    if "mean_s" not in r:
        print(f"   no figures: {r.get('error', 'the run ended before its report')}")
        return
    hit = lambda x: "-" if x is None else f"{100 * x:.0f}%"  # noqa: E731
    print(f"   {r['lookups_per_s'] / 1e6:.3f} M lookups/s; step p50 / p90 / p99 {r['p50_s'] * 1e3:.0f} / {r['p90_s'] * 1e3:.0f} / "
          f"{r['p99_s'] * 1e3:.0f} ms (p99/p50 {r['p99_s'] / r['p50_s']:.1f}x); hit rate HBM {hit(r['hbm_hit'])}, DDR {hit(r['ddr_hit'])}")
    filling = " (none: the tier was still filling; more --warmup steps reach the steady state)" if not r["ddr_evictions"] else ""
    print(f"   DDR tier {hit(r['ddr_full_at_start'])} full at the first timed step; {r['ddr_evictions']:,} DDR evictions "
          f"while timed{filling}")
    print(f"   a step: {r['rows_read_per_step']:,.0f} rows read, {r['rows_written_per_step']:,.0f} written back; disk "
          f"{format_bytes(round(r['disk_read_bytes_per_step']))} read, {format_bytes(round(r['disk_written_bytes_per_step']))} "
          f"written; amplification read {_f(r['read_amp'], '.1f')}x, write {_f(r['write_amp'], '.1f')}x")
    print(f"   rows read through: {r.get('read_path', '-')}")
    print(f"   store's budgeted host memory {format_bytes(r['store_host_bytes'])}: "
          + ", ".join(f"{k} {format_bytes(v)}" for k, v in r["parts"].items() if v))
    used = r.get("parts_used", {})
    if used.get("row_index") is not None:
        print(f"   row index held {format_bytes(used['row_index'])} of its {format_bytes(r['parts']['row_index'])} at the end")
    stages = r.get("stage_ms_per_step", {})
    print("   a step's time in the store by stage (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in stages.items() if v >= 0.05))
    cpu = sorted(r.get("thread_cpu_ms_per_step", {}).items(), key=lambda kv: -kv[1])
    print("   CPU a step by thread (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in cpu if v >= 0.05))
    p = r.get("predicted")
    if p:
        got = r["ddr_since_open"]
        curve = f", LRU curve {p['curve']['misses']:,}" if "curve" in p else ""
        print(f"   capacity prediction from the run's trace ({r['ddr_rows']:,} DDR rows, {p['policy'].upper()}, "
              f"{p['seconds']:.1f} s): DDR misses replayed {p['replay']['misses']:,}{curve}; the store measured {got['misses']:,} "
              f"({'equal' if p['replay']['misses'] == got['misses'] else 'DIFFERENT'}); hits {p['replay']['hits']:,} / "
              f"{got['hits']:,}, evictions {p['replay']['evictions']:,} / {got['evictions']:,}")
    # no ratio to print without the in-memory step (FBGEMM not installed)
    vs = "x its in-memory step" if r["kind"] == "dlrm" else "x FBGEMM in memory"
    ratio = lambda x: "" if x is None else f" = {x:.1f}{vs}"  # noqa: E731
    print(f"   mean step {r['mean_s'] * 1e3:.0f} ms{ratio(r['x_in_memory'])}; {_f(r['x_disk_floor'], '.1f')}x the disk "
          f"floor ({_f(r['disk_floor_s'] and r['disk_floor_s'] * 1e3, '.1f')} ms: rows read / {_f(r.get('disk_iops_qd32'), ',.0f')} "
          f"reads/s at depth 32 as the run started); LMDB floor "
          f"{_f(r['lmdb_floor_s'] and r['lmdb_floor_s'] * 1e3, '.0f')} ms")
    if r.get("first_use_floor_s"):
        print(f"   rows no earlier step used: {r['first_use_rows_per_step']:,.0f} a step, which any cache that opens empty reads "
              f"from disk: {r['first_use_floor_s'] * 1e3:.0f} ms at depth 32{ratio(r['first_use_floor_x_in_memory'])} "
              "by themselves")
    if r.get("x_floor"):
        goal = " (goal <= 1.3x)" if r["kind"] == "dlrm" else ""
        print(f"   step / its floor max(in-memory step, disk time of the rows no earlier step used) = "
              f"{r['mean_s'] * 1e3:.0f} / {r['floor_s'] * 1e3:.0f} ms = {r['x_floor']:.2f}x{goal}")
