from dynatrain.callbacks.rescale import ElasticCallback
from dynatrain.callbacks.progress import StepPrinter
from dynatrain.callbacks.snapshot import Snapshot
from dynatrain.callbacks.switch_log import SwitchLog, format_switch_table, plot_loss_with_switches

__all__ = [
    "ElasticCallback", "Snapshot", "StepPrinter", "SwitchLog", "format_switch_table", "plot_loss_with_switches",
]
