"""What the registry names for each kind (``build`` and ``parallelize_fn`` of its `ModelSpec`), each importing its
kind's module when called: the registry is read by the layout policy, which runs without torch. A kind's model
lives in its own module (`models.llama`, `models.moe`), its parallelisation in another (`models.parallelize_dense`,
`models.parallelize_moe`).
"""

from __future__ import annotations


def build_dense(config):
    """The dense decoder on the current device (the meta device under ``torch.device("meta")``)."""
    from dynatrain.models.llama import Transformer

    return Transformer(config)


def build_moe(config):
    """The mixture-of-experts decoder on the current device."""
    from dynatrain.models.moe import MoETransformer

    return MoETransformer(config)


def parallelize_dense(model, mesh, pcfg, options=None):
    """`models.parallelize_dense.parallelize_dense`."""
    from dynatrain.models import parallelize_dense as dense

    return dense.parallelize_dense(model, mesh, pcfg, options)


def parallelize_moe(model, mesh, pcfg, options=None):
    """`models.parallelize_moe.parallelize_moe`."""
    from dynatrain.models import parallelize_moe as moe

    return moe.parallelize_moe(model, mesh, pcfg, options)
