"""``TierstoreError``, the base of every error class tierstore defines.

Each error keeps the builtin base it had (a StoreCorruptError is still a
RuntimeError), so callers catching builtins are unaffected; catch TierstoreError to
tell tierstore's deliberate errors from bugs, as the ``tierstore`` command does.
The class is defined in tierstore.io.errors so that io/ stays a leaf that imports
nothing above it."""
from tierstore.io.errors import TierstoreError

__all__ = ["TierstoreError"]
