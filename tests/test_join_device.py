"""`dynatrain join` gives the process its own GPU, as torchrun gives its workers theirs."""

import pytest

from dynatrain.cli.devices import own_device


def test_the_local_rank_picks_the_gpu_when_no_flag_does():
    assert own_device(None, {"LOCAL_RANK": "3"}) == "3"
    assert own_device(None, {}) is None  # nothing picks one: the process sees what it sees


def test_the_flag_picks_among_the_visible_gpus():
    assert own_device(1, {"LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "4,5,6"}) == "5"
    assert own_device(None, {"LOCAL_RANK": "2", "CUDA_VISIBLE_DEVICES": "4, 5, 6"}) == "6"


def test_a_device_that_is_not_visible_is_refused_with_the_range():
    with pytest.raises(SystemExit, match=r"not among the 2 visible GPUs.*--device 0 to 1"):
        own_device(2, {"CUDA_VISIBLE_DEVICES": "0,1"})
    with pytest.raises(SystemExit, match="give a GPU index"):
        own_device(-1, {})
