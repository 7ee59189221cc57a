"""Peer frameworks training bench's model in their own process; prints their seconds per step
as JSON, {"PEER MODEL": {"median", "min", "max"}}.

Usage: python bench/peers_worker.py PEER[,PEER...] MODEL[,MODEL...] STEPS [REPLICAS]
with PEER one of tf-loop, tf-fit, torch-ddp and MODEL cnn or tiny.

Each peer runs apart from JAX in a fresh process (TensorFlow or torch would compete
with JAX for the same cores in one): one (peer, model) a process in the full run;
`python -m bench --quick` runs every TensorFlow row in one process, one after another
(one TensorFlow start-up instead of four), on the same model, optimizer (SGD 0.01,
momentum 0.9), global batch (64) and number of replicas (8) as spmd's rows:
TensorFlow's MirroredStrategy over 8 logical CPU devices (a custom loop with
`strategy.run`, and Keras `fit`), torch DistributedDataParallel over gloo
with one process per replica.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GLOBAL_BATCH, LR, MOMENTUM, REPEATS = 64, 0.01, 0.9, 3


def _batch(model: str) -> tuple[np.ndarray, np.ndarray]:
    shape, classes = ((28, 28, 1), 10) if model == "cnn" else ((16,), 16)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(GLOBAL_BATCH, *shape)).astype(np.float32)
    return x, rng.integers(0, classes, size=GLOBAL_BATCH).astype(np.int32)


def _stats(samples: list[float]) -> dict:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples)}


def _timed(run, steps: int) -> dict:
    run(max(2, steps // 4))  # warm up: trace, compile
    samples = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        run(steps)
        samples.append((time.perf_counter() - start) / steps)
    return _stats(samples)


# -- TensorFlow MirroredStrategy -------------------------------------------------------------


@functools.cache  # TensorFlow's logical devices are set once, before its runtime starts
def _tf_strategy(replicas: int):
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * replicas
    )
    devices = [f"/cpu:{i}" for i in range(replicas)]
    return tf, tf.distribute.MirroredStrategy(
        devices, cross_device_ops=tf.distribute.ReductionToOneDevice()
    )


def _keras_layers(keras, model: str) -> list:
    if model == "cnn":
        return [
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ]
    return [keras.layers.Dense(16)]


def tf_loop(model: str, steps: int, replicas: int) -> dict:
    """A custom loop: `strategy.run` of a step that all-reduces its gradients, in a tf.function."""
    os.environ["KERAS_BACKEND"] = "tensorflow"
    tf, strategy = _tf_strategy(replicas)
    import keras

    x, y = _batch(model)
    with strategy.scope():
        net = keras.Sequential([keras.Input(x.shape[1:]), *_keras_layers(keras, model)])
        optimizer = keras.optimizers.SGD(LR, momentum=MOMENTUM)
    dataset = tf.data.Dataset.from_tensors((x, y)).repeat().prefetch(4)
    batches = iter(strategy.experimental_distribute_dataset(dataset))

    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            logits = net(xb, training=True)
            per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(yb, logits)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        grads = tape.gradient(loss, net.trainable_variables)
        optimizer.apply_gradients(zip(grads, net.trainable_variables, strict=True))
        return loss

    @tf.function
    def train(n):
        loss = tf.constant(0.0)
        for _ in tf.range(n):
            xb, yb = next(batches)
            per_replica = strategy.run(replica_step, args=(xb, yb))
            loss = strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)
        return loss

    return _timed(lambda n: float(train(tf.constant(n))), steps)


def tf_fit(model: str, steps: int, replicas: int) -> dict:
    """Keras `fit` (TensorFlow backend) under MirroredStrategy: one fit, whose first
    batches warm up (trace, compile) and whose next REPEATS spans of `steps` batches are
    timed, each from batch end to batch end (fit's per-call setup, ~0.6 s here, is paid
    once rather than once per span)."""
    os.environ["KERAS_BACKEND"] = "tensorflow"
    tf, strategy = _tf_strategy(replicas)
    import keras

    x, y = _batch(model)
    with strategy.scope():
        net = keras.Sequential([keras.Input(x.shape[1:]), *_keras_layers(keras, model)])
        net.compile(
            optimizer=keras.optimizers.SGD(LR, momentum=MOMENTUM),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    dataset = tf.data.Dataset.from_tensors((x, y)).repeat().prefetch(4)
    clock, warm = _BatchClock(keras), max(2, steps // 4)
    net.fit(dataset, steps_per_epoch=warm + REPEATS * steps, epochs=1, verbose=0, callbacks=[clock])
    ends = clock.ends[warm - 1 :]  # from the end of the last warm-up batch
    return _stats([(ends[(i + 1) * steps] - ends[i * steps]) / steps for i in range(REPEATS)])


def _BatchClock(keras):  # noqa: N802 - a class made once Keras is imported
    class BatchClock(keras.callbacks.Callback):
        """When each batch of a fit ends: a step's time without fit's per-call setup."""

        def on_train_begin(self, logs=None):
            self.ends = []

        def on_train_batch_end(self, batch, logs=None):
            self.ends.append(time.perf_counter())

    return BatchClock()


# -- torch DistributedDataParallel over gloo --------------------------------------------------


def _torch_net(torch, model: str):
    nn = torch.nn
    if model == "cnn":
        return nn.Sequential(
            nn.Conv2d(1, 32, 3), nn.ReLU(), nn.Flatten(), nn.Linear(26 * 26 * 32, 64), nn.ReLU(),
            nn.Linear(64, 10),
        )  # fmt: skip
    return nn.Linear(16, 16)


def _torch_rank(rank: int, replicas: int, port: int, model: str, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=replicas)
    torch.manual_seed(0)
    net = torch.nn.parallel.DistributedDataParallel(_torch_net(torch, model))
    optimizer = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    x, y = _batch(model)
    per = GLOBAL_BATCH // replicas
    xb = torch.from_numpy(x[rank * per : (rank + 1) * per])
    if model == "cnn":
        xb = xb.permute(0, 3, 1, 2).contiguous()  # NHWC -> NCHW
    yb = torch.from_numpy(y[rank * per : (rank + 1) * per]).long()
    loss_fn = torch.nn.CrossEntropyLoss()

    def run(n: int) -> None:
        for _ in range(n):
            optimizer.zero_grad(set_to_none=True)
            loss_fn(net(xb), yb).backward()  # DDP all-reduces (averages) the gradients
            optimizer.step()
        dist.barrier()

    result = _timed(run, steps)
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def torch_ddp(model: str, steps: int, replicas: int) -> dict:
    """One process per replica (DDP's model), gloo over loopback, one thread each."""
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_torch_rank, args=(replicas, port, model, steps, out), nprocs=replicas)
        return json.loads(Path(out).read_text())


PEERS = {"tf-loop": tf_loop, "tf-fit": tf_fit, "torch-ddp": torch_ddp}

if __name__ == "__main__":
    peers, models, steps = sys.argv[1].split(","), sys.argv[2].split(","), int(sys.argv[3])
    replicas = int(sys.argv[4]) if len(sys.argv) > 4 else 8
    found = {f"{p} {m}": PEERS[p](m, steps, replicas) for m in models for p in peers}
    print(json.dumps(found), flush=True)
    # TensorFlow's runtime can hang at interpreter exit after a MirroredStrategy loop and
    # fit in one process; the results are out, so end at once.
    os._exit(0)
