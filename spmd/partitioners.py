"""Variable partitioners for `ParameterServerStrategy`, under tf.distribute's names."""

from spmd._src.rules import FixedShardsPartitioner as FixedShardsPartitioner
from spmd._src.rules import MaxSizePartitioner as MaxSizePartitioner
from spmd._src.rules import MinSizePartitioner as MinSizePartitioner
from spmd._src.rules import Partitioner as Partitioner

__all__ = ["FixedShardsPartitioner", "MaxSizePartitioner", "MinSizePartitioner", "Partitioner"]
