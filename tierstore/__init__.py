"""tierstore: embedding tables in a memory hierarchy (HBM, DDR, LMDB on SSD)."""
from tierstore.io import StoreCorruptError, StoreLockedError

from .spec import RowInit, TableSpec
from .store import StoreConfig, TieredStore
from . import optim
from .nn import TieredEmbeddingBag, TieredEmbeddingBagCollection
from .prefetch import LookaheadLoader, PrefetchConfig, PrefetchTicket

__all__ = ["RowInit", "StoreConfig", "StoreCorruptError", "StoreLockedError", "TableSpec", "TieredStore"]
__all__ += ["TieredEmbeddingBag", "TieredEmbeddingBagCollection", "optim"]
__all__ += ["LookaheadLoader", "PrefetchConfig", "PrefetchTicket"]
__version__ = "0.1.0"
