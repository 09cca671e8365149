"""Which GPU a process that Lightning runs on one device takes: its own, not every joiner on GPU 0."""

from __future__ import annotations


def own_device(device: int | None, env) -> str | None:
    """The value of ``CUDA_VISIBLE_DEVICES`` that leaves this process its own GPU: ``device`` (else ``$LOCAL_RANK``)
    as an index among the GPUs visible now. None where nothing picks one (no flag, no local rank): the process then
    sees what it sees. Lightning runs a joining process on one device, the first it sees; without this, every joiner
    of a host would share GPU 0."""
    if device is None:
        local = env.get("LOCAL_RANK")
        if local is None or not local.strip():
            return None
        device = int(local)
    if device < 0:
        raise SystemExit(f"dynatrain join: --device {device}: give a GPU index (0, 1, ...)")
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None or not visible.strip():
        return str(device)
    ids = [d.strip() for d in visible.split(",") if d.strip()]
    if device >= len(ids):
        raise SystemExit(f"dynatrain join: device {device} is not among the {len(ids)} visible GPUs "
                         f"(CUDA_VISIBLE_DEVICES={visible}): give --device 0 to {len(ids) - 1}")
    return ids[device]
