"""Resource-change signals of one process: preemption, a control endpoint, a watched file, a scripted trace.

Each source turns what it hears into a :class:`ScaleRequest` (`request`). The asynchronous ones (a signal in
`preemption`, HTTP in `control`, a file in `file`) hand it to a :class:`SignalHub` (`hub`), which validates it,
keeps only the latest and lets the training loop take it at a step boundary. The scripted :class:`TraceSource`
(`trace`) is polled by optimizer step instead, so every rank sees the same entries at the same step without
talking to the others. `agreement` merges the ranks' pending requests into one that every rank acts on.

A bad request never raises into training: it is logged on the ``dynatrain.elastic`` logger and kept in
:attr:`SignalHub.rejected`. Only mistakes that can be fixed before training starts raise (a bad trace in a recipe,
a control server asked to listen beyond loopback without ``allow_remote``).

This layer sits above `dynatrain.elastic` and `dynatrain.engine` and below `dynatrain.callbacks`; it imports no
Lightning, and only `agreement` imports torch (the names below leave it out, so importing them does not).
"""

from dynatrain.signals.control_server import ControlServer, is_loopback
from dynatrain.signals.file import FileSource
from dynatrain.signals.hub import Rejection, SignalHub, Verdict
from dynatrain.signals.preemption import PreemptionSource
from dynatrain.signals.request import ScaleRequest, check_limits, describe_request, request_from_payload
from dynatrain.signals.trace import TraceSource

__all__ = [
    "ControlServer", "FileSource", "PreemptionSource", "Rejection", "ScaleRequest", "SignalHub", "TraceSource",
    "Verdict", "check_limits", "describe_request", "is_loopback", "request_from_payload",
]
