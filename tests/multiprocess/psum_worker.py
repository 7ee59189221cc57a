"""One process of a test cluster: joins it, all-reduces across processes, prints a JSON line.

Usage: python psum_worker.py [LOCAL_DEVICE_COUNT]  (default: from SPMD_DEVICES_PER_PROCESS)
"""

import dataclasses
import json
import sys

import spmd

info = spmd.initialize(local_device_count=int(sys.argv[1]) if len(sys.argv) > 1 else None)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

mesh = Mesh(np.array(jax.devices()), ("i",))
local = np.full((jax.local_device_count(),), info.process_index + 1.0, np.float32)
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("i")), local)
psum = jax.shard_map(lambda v: jax.lax.psum(v, "i"), mesh=mesh, in_specs=P("i"), out_specs=P())
total = float(np.asarray(jax.jit(psum)(x).addressable_data(0))[0])
result = {
    "info": dataclasses.asdict(info),
    "cluster_is_info": spmd.cluster() == info,
    "process_index": jax.process_index(),
    "process_count": jax.process_count(),
    "device_count": jax.device_count(),
    "local_device_count": jax.local_device_count(),
    "psum": total,
}
print("RESULT " + json.dumps(result), flush=True)
