"""tierstore: embedding tables in a memory hierarchy (HBM, DDR, LMDB on SSD)."""
from tierstore.io import StoreLockedError

from .spec import RowInit, TableSpec
from .store import StoreConfig, TieredStore

__all__ = ["RowInit", "StoreConfig", "StoreLockedError", "TableSpec", "TieredStore"]
__version__ = "0.1.0"
