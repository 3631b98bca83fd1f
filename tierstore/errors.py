"""tierstore's errors: ``TierstoreError``, the base of every error tierstore raises on
purpose, and the kinds of mistake its subclasses name.

Each class also derives from the builtin the error always was (a BadIdsError is a
ValueError, an UnknownTableError a KeyError), so ``except ValueError`` and the like
catch it as before; ``except TierstoreError`` catches all of them and tells
tierstore's deliberate errors from bugs, as the ``tierstore`` command does.

This module imports nothing, so every package (io/, eviction/, metrics/ and the
subsystems above them) can raise these. Errors of one subsystem live with it
(StoreLockedError and StoreCorruptError in tierstore.io.errors, ProtocolError in
tierstore.daemon.wire, ...) and derive from TierstoreError too."""


class TierstoreError(Exception):
    """An error tierstore raises on purpose: bad input, a damaged or busy store, a peer
    that failed. Each subclass also keeps a builtin base (ValueError, RuntimeError,
    OSError, ...), so ``except ValueError`` and the like catch it as before; ``except
    tierstore.TierstoreError`` catches all of them."""


class SettingError(TierstoreError, ValueError):
    """A setting or argument with a bad value: out of range, not one of the choices, or
    contradicting another setting or what the store holds."""


class BadValuesError(TierstoreError, ValueError):
    """Values, rows, offsets or weights whose shape, length or content does not fit
    the table or the ids they go with."""


class BadIdsError(TierstoreError, ValueError):
    """Ids that are not a 1-D array of values, or not sorted and unique where that is asked."""


class IdRangeError(TierstoreError, IndexError):
    """An id outside its table: negative, or not below the table's ``num_rows``."""


class ArgumentTypeError(TierstoreError, TypeError):
    """An argument of the wrong type or dtype (a list where a TableSpec is needed,
    float ids, integer values)."""


class UnknownTableError(TierstoreError, KeyError):
    """A table name the store, collection, trace or plan does not have."""


class WriteRefusedError(TierstoreError, PermissionError):
    """A write refused: the store or daemon client is readonly, or the rows are not
    claimed by this client (or are claimed by another)."""


class StateError(TierstoreError, RuntimeError):
    """A call that does not fit the state it is made in: torch.distributed not
    initialized, a daemon already serving the socket, no file descriptors left."""


class StoreClosedError(StateError):
    """A call on a store, client, trace recorder or metrics object that was closed."""


class UnsupportedError(TierstoreError, RuntimeError):
    """An operation tierstore does not do for this object: torch.export or TorchScript
    of a tiered module, a checkpoint of a meta-device collection, a copy of a sharded table."""


class FormatError(TierstoreError, ValueError):
    """A file or serialized object that is not in a format this tierstore reads: a trace
    that is not one or whose arrays disagree, a store of another format version, a
    damaged sketch or checkpoint chain."""


class PathExistsError(TierstoreError, FileExistsError):
    """A path to create (a checkpoint, a restore, a socket) that exists already."""


class PathNotFoundError(TierstoreError, FileNotFoundError):
    """A path to read (a trace, an export, a checkpoint, a socket's directory) that is not there, or is not what was asked for."""


class MissingDependencyError(TierstoreError, ImportError):
    """An optional dependency a call needs (FBGEMM for ``kernels="fbgemm"``) that is not installed."""


class WaitTimeoutError(TierstoreError, TimeoutError):
    """A wait that ran out of time: a prefetch not done after ``timeout`` seconds."""


def kind(error: BaseException) -> str:
    """The name a message quoting ``error`` gives its type: for the classes of this
    module, the builtin each was before it had a class (ValueError for a SettingError),
    so such messages read as they always did; else the error's own class name."""
    cls = type(error)
    if cls.__module__ == __name__:
        cls = next(c for c in cls.__mro__ if c.__module__ == "builtins")
    return cls.__name__


__all__ = ["ArgumentTypeError", "BadIdsError", "BadValuesError", "FormatError", "IdRangeError", "MissingDependencyError", "PathExistsError",
           "PathNotFoundError", "SettingError", "StateError", "StoreClosedError", "TierstoreError",
           "UnknownTableError", "UnsupportedError", "WaitTimeoutError", "WriteRefusedError"]
