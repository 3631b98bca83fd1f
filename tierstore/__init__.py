"""tierstore: embedding tables in a memory hierarchy (HBM, DDR, LMDB on SSD)."""
from tierstore.io import StoreCorruptError, StoreLockedError

from .errors import TierstoreError
from .spec import RowInit, TableSpec
from .store import StoreConfig, TieredStore
from . import optim
from .nn import TieredEmbeddingBag, TieredEmbeddingBagCollection
from .prefetch import LookaheadLoader, PrefetchConfig, PrefetchTicket
from .daemon.client import open_store
from .interface import EmbeddingStore
from .daemon.wire import DaemonBusyError
from .serving_export import export
from .serving import ServingEmbeddingBag, ServingEmbeddingBagCollection, ServingStore

__all__ = ["RowInit", "StoreConfig", "StoreCorruptError", "StoreLockedError", "TableSpec", "TieredStore"]
__all__ += ["TierstoreError"]
__all__ += ["TieredEmbeddingBag", "TieredEmbeddingBagCollection", "optim"]
__all__ += ["LookaheadLoader", "PrefetchConfig", "PrefetchTicket"]
__all__ += ["DaemonBusyError", "EmbeddingStore", "open_store"]
__all__ += ["ServingEmbeddingBag", "ServingEmbeddingBagCollection", "ServingStore", "export"]
__version__ = "0.1.0"
