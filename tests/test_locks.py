"""io.locks.SharedLock: readers side by side, a writer alone, a waiting writer before later readers."""
from __future__ import annotations

import threading

from tierstore.io.locks import SharedLock


def test_readers_hold_it_at_once():
    lock, both = SharedLock(), threading.Barrier(2, timeout=10)

    def read():
        with lock.shared():
            both.wait()  # BrokenBarrierError unless the other reader is inside too
    threads = [threading.Thread(target=read) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not both.broken


def test_a_writer_waits_for_the_readers_and_readers_after_it_wait_for_the_writer():
    lock, order = SharedLock(), []
    first_in, release_first = threading.Event(), threading.Event()

    def first_reader():
        with lock.shared():
            first_in.set()
            release_first.wait(10)
            order.append("first reader out")

    def writer():
        with lock:
            order.append("writer")

    def later_reader():
        with lock.shared():
            order.append("later reader")
    threads = [threading.Thread(target=first_reader)]
    threads[0].start()
    assert first_in.wait(10)
    threads.append(threading.Thread(target=writer))
    threads[1].start()
    while not lock._writers_waiting:  # the writer is waiting for the reader
        threading.Event().wait(0.001)
    threads.append(threading.Thread(target=later_reader))
    threads[2].start()
    threads[2].join(0.2)
    assert order == [], "a reader or the writer went in while the first reader held it and a writer waited"
    release_first.set()
    for t in threads:
        t.join(10)
    assert order == ["first reader out", "writer", "later reader"]


def test_a_writer_is_alone():
    lock, inside = SharedLock(), threading.Event()

    def read():
        with lock.shared():
            inside.set()
    with lock:
        t = threading.Thread(target=read)
        t.start()
        t.join(0.2)
        assert not inside.is_set(), "a reader went in while a writer held it"
    t.join(10)
    assert inside.is_set()
