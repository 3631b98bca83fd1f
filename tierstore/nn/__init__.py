"""The torch modules whose weights live in a TieredStore: TieredEmbeddingBag (``bag.py``, the
torch.nn.EmbeddingBag contract), TieredEmbeddingBagCollection (``collection.py``) and what every
store-backed module shares (``common.py``: the store it reads, torch.compile, fx, export and script)."""
from tierstore.training.bags import BagIndexError, BagOffsetsError, BagTypeError, EmbeddingBagConfig
# the shared parts: tierstore.torchrec and tierstore.distributed import them from here
from tierstore.nn.common import ScriptRefusal, as_leaf, module_store, outside_graphs, refuse_export  # noqa: F401
from tierstore.nn.bag import TieredEmbeddingBag, forward_group  # noqa: F401
from tierstore.nn.collection import TieredEmbeddingBagCollection, feature_parts  # noqa: F401

__all__ = [
    "BagIndexError",
    "BagOffsetsError",
    "BagTypeError",
    "EmbeddingBagConfig",
    "TieredEmbeddingBag",
    "TieredEmbeddingBagCollection",
]
