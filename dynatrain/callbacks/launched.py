"""The callbacks Lightning adds to every Trainer from dynatrain's ``lightning.pytorch.callbacks_factory`` entry point.

In a worker of torchrun's ``dynatrain`` rendezvous backend, a node that arrives must be admitted and one that gets
SIGTERM must leave at a step boundary, whether or not the script has an `ElasticCallback`: such a Trainer gets one
(which stands down where the script brought its own). Everywhere else the list is empty and nothing is imported.
"""

from __future__ import annotations


def launcher_callbacks() -> list:
    from dynatrain.elastic.rendezvous import launched_by_rendezvous

    if not launched_by_rendezvous():
        return []
    from dynatrain.callbacks.rescale import ElasticCallback

    return [ElasticCallback.for_launcher()]
