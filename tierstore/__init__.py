"""tierstore: embedding tables in a memory hierarchy (HBM, DDR, LMDB on SSD).

The names below load on first use (PEP 562), so that ``import tierstore`` and the
``tierstore`` command's ``--help`` and ``--version`` do not wait for torch."""
from __future__ import annotations

from typing import TYPE_CHECKING

from tierstore.io.errors import StoreCorruptError, StoreLockedError

from tierstore.errors import TierstoreError
from tierstore.lazy import exports

# public name -> the module that defines it
_LAZY = {
    "RowInit": "spec", "TableSpec": "spec",
    "StoreConfig": "store", "TieredStore": "store", "restore": "store",
    "optim": None,
    "TieredEmbeddingBag": "nn", "TieredEmbeddingBagCollection": "nn",
    "LookaheadLoader": "engine.loader", "PrefetchConfig": "engine.prefetch", "PrefetchTicket": "engine.prefetch",
    "open_store": "daemon.client",
    "EmbeddingStore": "engine.interface",
    "DaemonBusyError": "daemon.wire",
    "export": "serving.export",
    "ServingEmbeddingBag": "serving.store", "ServingEmbeddingBagCollection": "serving.store", "ServingStore": "serving.store",
}

if TYPE_CHECKING:  # what type checkers and the API reference see
    from tierstore import optim
    from tierstore.daemon.client import open_store
    from tierstore.daemon.wire import DaemonBusyError
    from tierstore.engine.interface import EmbeddingStore
    from tierstore.nn import TieredEmbeddingBag, TieredEmbeddingBagCollection
    from tierstore.engine.loader import LookaheadLoader
    from tierstore.engine.prefetch import PrefetchConfig, PrefetchTicket
    from tierstore.serving.store import ServingEmbeddingBag, ServingEmbeddingBagCollection, ServingStore
    from tierstore.serving.export import export
    from tierstore.spec import RowInit, TableSpec
    from tierstore.store import StoreConfig, TieredStore, restore

__all__ = ["StoreCorruptError", "StoreLockedError", "TierstoreError", *_LAZY]
__version__ = "0.1.0"

__getattr__, __dir__ = exports(globals(), _LAZY, modules=True)
