"""Logger defaults for clusters without a W&B login: offline unless the user asks for online."""

from __future__ import annotations

import os

from lightning.pytorch.loggers import WandbLogger as _LightningWandbLogger


class WandbLogger(_LightningWandbLogger):
    """Lightning's WandbLogger, offline by default.

    ``offline=None`` follows ``WANDB_MODE``: only ``WANDB_MODE=online`` logs to the server, so a job never
    stops at a login prompt. ``save_dir`` is passed explicitly because the default ``"."`` wins over ``WANDB_DIR``.
    """

    def __init__(self, save_dir: str = "runs", project: str = "dynatrain", offline: bool | None = None, **kwargs):
        if offline is None:
            offline = os.environ.get("WANDB_MODE", "offline").lower() != "online"
        os.makedirs(save_dir, exist_ok=True)
        kwargs.setdefault("log_model", False)
        super().__init__(save_dir=save_dir, project=project, offline=offline, **kwargs)
        if kwargs.get("anonymous") is None:
            # Lightning always passes the key, and wandb warns that it has no effect whenever it is present.
            self._wandb_init.pop("anonymous", None)
