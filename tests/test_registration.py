import subprocess
import sys

from lightning.pytorch.strategies import StrategyRegistry


def test_importing_dynatrain_registers_the_strategy():
    import dynatrain

    assert "dynatrain" in StrategyRegistry
    assert StrategyRegistry["dynatrain"]["strategy"] is dynatrain.DynaTrainStrategy


def test_trainer_accepts_strategy_name_in_a_fresh_process():
    code = (
        "import dynatrain, lightning.pytorch as pl\n"
        "t = pl.Trainer(strategy='dynatrain', accelerator='cpu', devices=2, logger=False)\n"
        "assert type(t.strategy).__name__ == 'DynaTrainStrategy', type(t.strategy)\n"
        "assert t.strategy.num_processes == 2\n"
        "import importlib; importlib.reload(dynatrain)\n"  # a second import must not raise
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_strategy_rejects_bad_layout_early():
    import pytest

    from dynatrain import DynaTrainStrategy

    with pytest.raises(ValueError, match="cannot parse"):
        DynaTrainStrategy(parallel="dp=2")
    with pytest.raises(ValueError, match="param_dtype"):
        DynaTrainStrategy(parallelism={"param_dtype": "int8"})


def test_the_pure_layers_import_without_lightning_and_lightning_imported_later_still_gets_the_strategy():
    code = (
        "import sys, dynatrain.planner, dynatrain.vps\n"
        "assert 'lightning' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)[:20]\n"
        "import lightning.pytorch as pl\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "assert StrategyRegistry['dynatrain']['strategy'] is dynatrain.DynaTrainStrategy\n"
        "t = pl.Trainer(strategy='dynatrain', accelerator='cpu', devices=1, logger=False)\n"
        "assert type(t.strategy).__name__ == 'DynaTrainStrategy'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
