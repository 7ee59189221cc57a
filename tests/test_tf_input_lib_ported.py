"""A slice of TensorFlow's tensorflow/python/distribute/input_lib_test.py, kept to TF's numbers.

TF runs each case on two replicas (a GPU and a CPU); here two simulated CPU
devices. TF's datasets become lists of numpy global batches, `select_replica(r,
x)` becomes the rows replica r holds. A deliberate difference is an xfail whose
reason cites docs/migration.md ("Input: where spmd differs on purpose").
"""

import jax
import numpy as np
import pytest

import spmd

DIFFERS = "docs/migration.md, Input: where spmd differs on purpose"


@pytest.fixture(scope="module")
def two():
    return spmd.MirroredStrategy(jax.devices()[:2])


def per_replica(x) -> list[list]:
    """`[select_replica(r, x) for r in replicas]`: each device's rows, in replica order."""
    shards = sorted(x.addressable_shards, key=lambda s: s.index[0].start or 0)
    return [np.asarray(s.data).tolist() for s in shards]


def batches(values, size, drop_remainder=False):
    """`tf.data.Dataset.from_tensor_slices(values).batch(size, drop_remainder)`."""
    values = np.asarray(values)
    stop = len(values) - len(values) % size if drop_remainder else len(values)
    return [values[i : i + size] for i in range(0, stop, size)]


def test_one_device_iterable_iterator():
    """testIterableIterator: for i, element in enumerate(iter(dist)): element == i."""
    one = spmd.OneDeviceStrategy()
    for i, element in enumerate(iter(one.distribute_dataset(batches(range(10), 1)))):
        assert np.asarray(element).tolist() == [i]


@pytest.mark.cpu_mesh
@pytest.mark.parametrize("make", ["dataset", "input_fn"])
def test_batch_splitting(two, make):
    """testBatchSplitting (split_batch_by=2): each global batch of 10 split 5 + 5."""
    data = batches(range(100), 10)
    if make == "dataset":
        dist = two.distribute_dataset(data)
    else:  # each pipeline batches by its own share: here the only pipeline, 10 rows

        def dataset_fn(ctx):
            return batches(range(100), ctx.get_per_pipeline_batch_size(10))

        dist = two.distribute_datasets_from_function(dataset_fn)
    expected = [[list(range(i, i + 5)), list(range(i + 5, i + 10))] for i in range(0, 100, 10)]
    assert [per_replica(x) for x in dist] == expected
    assert [per_replica(x) for x in dist] == expected  # a second pass gives the same


@pytest.mark.cpu_mesh
def test_tuple_dataset(two):
    """testTupleDataset: zip(range(10), range(10) ** 2), a global batch of 2 per step."""
    squares = np.arange(10) ** 2
    data = [(a, b) for a, b in zip(batches(range(10), 2), batches(squares, 2), strict=True)]
    got = []
    for xs, ys in two.distribute_dataset(data):
        got.append([(a[0], b[0]) for a, b in zip(per_replica(xs), per_replica(ys), strict=True)])
    assert got == [[(i, i**2), (i + 1, (i + 1) ** 2)] for i in range(0, 10, 2)]


@pytest.mark.cpu_mesh
def test_uneven_dataset_batches_drop_remainder(two):
    """testUnevenDatasetBatches, drop_remainder=True: range(9) by 4 over 2 replicas."""
    dist = two.distribute_dataset(batches(range(9), 4, drop_remainder=True))
    assert [per_replica(x) for x in dist] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert dist.num_batches is None  # an iterable: not known before reading


@pytest.mark.xfail(
    strict=True, raises=AssertionError, reason=f"a partial batch is padded with a mask; {DIFFERS}"
)
def test_uneven_dataset_batches_keep_remainder(two):
    """testUnevenDatasetBatches, drop_remainder=False: TF's last step is [[8], []]."""
    options = spmd.InputOptions(remainder="pad")
    dist = two.distribute_dataset(batches(range(9), 4), options)
    got = [per_replica(x[0] if isinstance(x, spmd.PaddedBatch) else x) for x in dist]
    assert got == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8], []]]


@pytest.mark.cpu_mesh
def test_uneven_dataset_batches_padded_count_every_example_once(two):
    """What spmd gives instead of [[8], []]: [8] padded, a mask that counts it once."""
    options = spmd.InputOptions(remainder="pad")
    dist = two.distribute_dataset(batches(range(9), 4), options)
    *_, (last, mask) = list(dist)
    assert per_replica(last) == [[8, 8], [8, 8]] and per_replica(mask) == [[1, 0], [0, 0]]


@pytest.mark.xfail(
    strict=True, raises=spmd.BatchError, reason=f"elements are global batches; {DIFFERS}"
)
def test_two_devices_unbatched_elements(two):
    """testTwoDevicesOneGPUOneCPU: range(10) unbatched, one element per replica per step."""
    dist = two.distribute_dataset(list(np.arange(10)))
    assert [per_replica(x) for x in dist] == [[i, i + 1] for i in range(0, 10, 2)]


@pytest.mark.cpu_mesh
@pytest.mark.parametrize("drop_remainder, total", [(True, 200.0), (False, 310.0)])
def test_dense_part_of_ragged_sparse(two, drop_remainder, total):
    """testRaggedSparse, its dense tensors: 20 rows, global batch 8, the first batch's
    replicas and the sum over every batch (200 without the partial batch, 310 with it)."""
    row_lengths = np.arange(20) % 4
    dense = np.zeros((20, 3), np.float32)
    for i, n in enumerate(row_lengths):
        dense[i, :n] = i
    ds = two.make_numpy_dataset({"dense": dense}, 8, drop_remainder=drop_remainder)
    elements = list(two.distribute_dataset(ds))
    first = elements[0] if drop_remainder else elements[0][0]
    assert per_replica(first["dense"]) == [
        [[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [2.0, 2.0, 0.0], [3.0, 3.0, 3.0]],
        [[0.0, 0.0, 0.0], [5.0, 0.0, 0.0], [6.0, 6.0, 0.0], [7.0, 7.0, 7.0]],
    ]
    if drop_remainder:
        sums = [float(np.asarray(e["dense"]).sum()) for e in elements]
    else:  # the padded rows weigh 0
        sums = [float((np.asarray(b["dense"]).sum(1) * np.asarray(m)).sum()) for b, m in elements]
    assert sum(sums) == total
