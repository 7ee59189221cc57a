"""spmd._src.validate: one check per kind of number, used by every module, with errors that teach."""

import math

import numpy as np
import pytest

import spmd
import spmd.partitioners
from spmd._src.errors import ClusterError, ConfigurationError
from spmd._src.validate import integer, non_negative_int, positive_int, positive_number


@pytest.mark.parametrize("value", [1, 7, np.int32(3), np.int64(2)])
def test_positive_int_accepts_python_and_numpy_ints_as_int(value):
    out = positive_int(value, "steps")
    assert out == int(value) and type(out) is int


@pytest.mark.parametrize("value", [0, -1, True, False, np.bool_(True), 2.0, 1.5, "3", None])
def test_positive_int_rejects_with_expected_received_fix(value):
    with pytest.raises(ConfigurationError) as info:
        positive_int(value, "steps", fix="pass steps=1 or more.")
    expected, got, fix = str(info.value).splitlines()
    assert expected == "steps must be a positive integer (>= 1)."
    assert got.startswith(f"Received: steps={value!r}")
    assert fix == "To fix: pass steps=1 or more."


def test_a_bool_or_integral_float_is_named_as_such():
    with pytest.raises(ConfigurationError, match=r"a bool is not a number here"):
        positive_int(True, "steps")
    with pytest.raises(ConfigurationError, match=r"a float; pass the int"):
        positive_int(4.0, "steps")


def test_bounds_and_error_class():
    assert non_negative_int(0, "index") == 0
    assert integer(2, "index", low=0, high=3) == 2
    with pytest.raises(ClusterError, match=r"index must be an integer in 0 \.\. 2\."):
        integer(3, "index", low=0, high=3, error=ClusterError)
    with pytest.raises(
        ConfigurationError, match=r"retries must be a non-negative integer \(>= 0\)"
    ):
        non_negative_int(-1, "retries")


@pytest.mark.parametrize("value", [0, -1.0, math.nan, math.inf, True, "30"])
def test_positive_number_rejects_nan_inf_bool_and_non_positive(value):
    with pytest.raises(ConfigurationError, match=r"timeout must be a number of seconds > 0"):
        positive_number(value, "timeout")
    assert positive_number(np.float32(0.5), "timeout") == 0.5


# The modules use it: inputs they used to take (a bool for a count, NaN for seconds) are errors.


def test_partitioner_counts_reject_a_bool():
    with pytest.raises(ConfigurationError, match=r"FixedShardsPartitioner.num_shards must be"):
        spmd.partitioners.FixedShardsPartitioner(num_shards=True)


def test_mesh_axis_sizes_reject_a_bool():
    with pytest.raises(ConfigurationError, match=r"Mesh axis sizes must be positive integers"):
        spmd.make_mesh({"data": True})


def test_callback_save_freq_rejects_a_bool():
    with pytest.raises(ConfigurationError, match=r"ModelCheckpoint.save_freq must be"):
        spmd.callbacks.ModelCheckpoint("/tmp/unused", save_freq=True)


def test_input_options_host_timeout_rejects_nan():
    with pytest.raises(ConfigurationError, match=r"host_timeout must be a number of seconds"):
        spmd.InputOptions(host_timeout=math.nan)


def test_checkpoint_manager_rejects_nan_timeout_and_bool_counts(tmp_path):
    with pytest.raises(ConfigurationError, match=r"coordination_timeout must be"):
        spmd.CheckpointManager(tmp_path, coordination_timeout=math.nan)
    with pytest.raises(ConfigurationError, match=r"save_interval_steps must be a positive integer"):
        spmd.CheckpointManager(tmp_path, save_interval_steps=True)
