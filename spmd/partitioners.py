"""Variable partitioners for `ParameterServerStrategy`, under tf.distribute's names."""

from spmd.rules import FixedShardsPartitioner as FixedShardsPartitioner
from spmd.rules import MaxSizePartitioner as MaxSizePartitioner
from spmd.rules import MinSizePartitioner as MinSizePartitioner
from spmd.rules import Partitioner as Partitioner

__all__ = ["FixedShardsPartitioner", "MaxSizePartitioner", "MinSizePartitioner", "Partitioner"]
