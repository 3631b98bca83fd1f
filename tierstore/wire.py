"""The path the manual once named, tierstore.wire.DaemonBusyError; the wire format is tierstore.daemon.wire."""
from tierstore.daemon.wire import DaemonBusyError  # noqa: F401
