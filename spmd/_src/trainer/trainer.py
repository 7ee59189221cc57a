"""Keras-style training on any strategy: Trainer.fit, evaluate and predict."""

from __future__ import annotations

import inspect
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from spmd._src.errors import (
    ArgumentTypeError,
    BatchError,
    ConfigurationError,
    SpmdError,
    message,
    received,
    shown_as_public,
)
from spmd._src.placement import in_device_memory
from spmd._src.strategy.base import Strategy, get_strategy
from spmd._src.trainer import islands
from spmd._src.trainer.arguments import (
    check_keras_arguments,
    check_optimizer,
    check_strategy,
    check_verbose,
)
from spmd._src.trainer.batch_checks import BatchChecks
from spmd._src.trainer.callbacks import (
    BatchLogs,
    Callback,
    CallbackList,
    EpochLogger,
    History,
    ProgressBar,
    as_callbacks,
)
from spmd._src.trainer.class_weight import check_class_weight, with_class_weight
from spmd._src.trainer.data import (
    as_dataset,
    check_count,
    check_endless,
    check_lists,
    check_rows,
    host_first,
    is_arrays,
    is_bare_arrays,
    split_batch,
    train_args,
)
from spmd._src.trainer.losses import (
    Metric,
    resolve_loss,
    resolve_metrics,
)
from spmd._src.trainer.model import (
    NAN_LOSS,
    NAN_UPDATE,
    NAN_WEIGHT,
    WRITTEN,
    averages,
    cast,
    example_weights,
    first_nan,
    forward_failed,
    stack,
    wrap_model,
    written,
)

__all__ = ["NonFiniteLossError", "Trainer"]

_NAN_READ_S = 0.05  # fit reads the NaN flag at most this often between epochs' ends
_PRECISIONS = {None: None, "float32": None, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

_AMBIGUOUS_PREDICT = message(
    "predict reads a list of arrays with batch_size as a model's several inputs (as Keras "
    "does); without batch_size it could as well be a list of batches, so it is not guessed.",
    received(x="a list of arrays", batch_size=None),
    "for several inputs pass predict([x1, x2], batch_size=64); for batches of one input "
    "pass [(b,) for b in batches].",
)


class NonFiniteLossError(SpmdError, FloatingPointError):
    """`Trainer.fit` met a NaN or infinite loss, or an update that made a leaf of the train
    state so (raised unless `terminate_on_nan=False`)."""


shown_as_public(NonFiniteLossError)


def _non_finite_message(cause: int, epoch: int, batch_in_epoch: int, step: int, state: dict) -> str:
    """Names the step that went non-finite, and whether its loss or its update did (and
    then the leaf of `state` it made NaN or infinite)."""
    where = received(epoch=epoch, batch_in_epoch=batch_in_epoch, global_step=step)
    if cause >= NAN_UPDATE:
        leaves = written(state)
        if cause - NAN_UPDATE < len(leaves):
            path = leaves[cause - NAN_UPDATE][0]
            what = f"{WRITTEN[path.split('/', 1)[0]]} at '{path}'"
        else:  # a flag from a state of another structure
            what = "some of the state it writes"
        return message(
            "Every update leaves the train state finite: the parameters, the optimizer state "
            "and the model's other state (terminate_on_nan=True stops at the first step "
            "that does not, as Keras' TerminateOnNaN does).",
            where + f"; the loss at global_step={step} was finite, but the update it computed "
            f"made {what} NaN or infinite",
            "look for an infinite or huge gradient at that step's inputs (jnp.sqrt or jnp.log "
            "at 0, a division by a value that reaches 0; Adam's second moment squares the "
            "gradient, so one above ~1e19 overflows float32), or a learning rate too high; "
            "clip the gradients (optax.clip_by_global_norm); pass "
            "Trainer(terminate_on_nan=False) to train on regardless.",
        )
    if cause == NAN_WEIGHT:
        return message(
            "The loss is finite at every step (terminate_on_nan=True stops at the first "
            "that is not, as Keras' TerminateOnNaN does); it is sum(loss x sample_weight), so "
            "every sample weight is finite.",
            where + f"; the sample weights of global_step={step} hold a NaN or inf",
            "find it in the data's sample weights (np.isfinite(sample_weight).all()), or in "
            "class_weight, and replace or drop those examples; a weight of 0 leaves an "
            "example out.",
        )
    return message(
        "The loss is finite at every step (terminate_on_nan=True stops at the first "
        "that is not, as Keras' TerminateOnNaN does).",
        where,
        "look for labels outside the loss's range (a class id >= the number of "
        "outputs, or < 0), NaN or inf in the inputs or the sample weights, or a "
        "learning rate too high; pass Trainer(terminate_on_nan=False) to train on "
        "regardless.",
    )


class Trainer:
    """Keras-style fit / evaluate / predict of a flax model on any strategy.

    The step is one program compiled by XLA with the strategy's shardings;
    every process runs the same calls. Metrics are sums over real examples
    divided by their count, so padding never counts and evaluation is exact.

    Args:
      model: a flax `nnx.Module`, or a pair (init, apply) with init(key) ->
        params and apply(params, x) -> outputs.
      optimizer: an optax `GradientTransformation`.
      loss: a callable (outputs, labels) -> per-example loss, or a name:
        "sparse_categorical_crossentropy", "categorical_crossentropy",
        "binary_crossentropy" (these take logits), "mse", "mae".
      metrics: names ("accuracy", "mse", "mae") or `spmd.losses.Metric`s.
      strategy: where to train; the current strategy by default.
      steps_per_execution: batches run per compiled call (a scan): fewer
        dispatches where they dominate.
      grad_accum_steps: split each batch into this many microbatches and
        apply one update with their summed gradients (the same update as the
        whole batch, with less memory); a batch each replica's rows do not
        split into them is padded with masked rows.
      mixed_precision: "bfloat16" (or "float16") computes the forward and
        backward pass in that type; parameters and optimizer state stay float32.
      seed: the seed of an (init, apply) model's parameters and of shuffling.
      terminate_on_nan: stop `fit` with a `NonFiniteLossError` naming the
        epoch and step at the first batch whose loss is NaN or infinite, or
        whose update makes a leaf of the train state so (named too: a
        parameter, the optimizer state, the model's other state) (Keras'
        TerminateOnNaN, on by default); False trains on.
      rngs: for an NNX module whose `__call__` takes `rngs` (Dropout given
        its key at call time): the `nnx.Rngs` it is called with, advanced
        every step and carried in the train state; `nnx.Rngs(seed)` by default.

    Example:
      >>> trainer = spmd.Trainer(Net(nnx.Rngs(0)), optax.adam(1e-3),
      ...                        "sparse_categorical_crossentropy", strategy=strategy)
      >>> history = trainer.fit((x, y), batch_size=64, epochs=3, validation_data=(xv, yv))
    """

    def __init__(
        self,
        model: Any,
        optimizer: optax.GradientTransformation,
        loss: str | Callable,
        metrics: Sequence[str | Metric] = (),
        strategy: Strategy | None = None,
        *,
        steps_per_execution: int = 1,
        grad_accum_steps: int = 1,
        mixed_precision: str | None = None,
        seed: int = 0,
        terminate_on_nan: bool = True,
        rngs: nnx.Rngs | None = None,
    ) -> None:
        for name, value in (
            ("steps_per_execution", steps_per_execution),
            ("grad_accum_steps", grad_accum_steps),
        ):
            if not isinstance(value, int) or value < 1:
                raise ConfigurationError(
                    message(
                        f"{name} must be a positive integer.",
                        received(**{name: value}),
                        f"pass {name}=1 or more.",
                    )
                )
        if mixed_precision not in _PRECISIONS:
            raise ConfigurationError(
                message(
                    f"mixed_precision is one of {list(_PRECISIONS)}.",
                    received(mixed_precision=mixed_precision),
                    'pass mixed_precision="bfloat16" or None.',
                )
            )
        self.strategy = check_strategy(strategy or get_strategy())
        islands.check_options(self.strategy, steps_per_execution, grad_accum_steps)
        self.optimizer = check_optimizer(optimizer)
        self.loss_name, self.loss_fn = resolve_loss(loss)
        self.metrics = resolve_metrics(metrics, self.loss_name)
        self.steps_per_execution = steps_per_execution
        self.grad_accum_steps = grad_accum_steps
        self.compute_dtype = _PRECISIONS[mixed_precision]
        self.seed = seed
        self.terminate_on_nan = terminate_on_nan
        self._model = wrap_model(model, seed, rngs)
        self.state: Any = None
        self.epoch = 0
        self.iterations = 0  # batches trained, over every fit (BackupAndRestore restores it)
        self.stop_training = False
        self.dataset: Any = None
        self._steps: dict[str, Any] = {}
        self._epoch_start = 0
        self._iterator: Any = None  # fit's iterator over self.dataset, across epochs
        # This epoch's pass over the data has ended: fit read past its last batch, so the
        # data position is already the next pass's start (BackupAndRestore saves it).
        self._pass_ended = False
        self._fit_first = True
        self._checks = BatchChecks()
        self._nan_read = 0.0  # when fit last read the NaN flag (time.monotonic)

    # -- state ----------------------------------------------------------------

    def _initial_state(self) -> dict:
        params = self._model.params
        return {
            "params": params,
            "opt_state": self.optimizer.init(params),
            "rest": self._model.rest,
            "step": jnp.zeros((), jnp.int32),
            "metrics": self._zero_sums(),
            "nan_step": jnp.full((), -1, jnp.int32),  # the first step that went non-finite
            "nan_cause": jnp.zeros((), jnp.int32),  # its loss (NAN_LOSS) or its update's leaf
        }

    def _zero_sums(self) -> dict:
        names = ("count", "weight_sum", "loss", *(m.name for m in self.metrics))
        return {name: jnp.zeros((), jnp.float32) for name in names}

    def build(self) -> None:
        """Places the train state per the strategy (done by the first fit/evaluate/predict)."""
        if self.state is None:
            with self.strategy.scope():
                self.state = self.strategy.put(self._initial_state())

    @property
    def model(self) -> Any:
        """The NNX module, holding the trained parameters (or the params of an (init, apply) pair)."""
        if self.state is not None and self._model.module is not None:
            live = islands.single(self.state)
            live = {"params": live["params"], "rest": live["rest"]}
            if self.strategy.placement == "host":  # the module is for eager use: device memory
                live = jax.tree.map(in_device_memory, live)
            graph, rest = self._model.graph, live["rest"]
            if isinstance(graph, tuple):  # (module, rngs passed at call time)
                nnx.update(graph[0], live["params"], rest["model"])
                nnx.update(graph[1], rest["rngs"])
            else:
                nnx.update(graph, live["params"], rest)
        if self._model.module is not None:
            return self._model.module
        return self.entry("params") if self.state is not None else self._model.params

    def host_state(self) -> Any:
        """The whole train state as numpy arrays, gathered from every process (typed PRNG
        keys, e.g. a Dropout's, as key arrays over their gathered key data); a state this
        process holds whole (a strategy over its own devices) is read as it is."""
        from jax.experimental import multihost_utils

        leaves = jax.tree.leaves(self.state)
        if jax.process_count() == 1 or all(_addressable(a) for a in leaves):
            return jax.device_get(self.state)  # this process's strategy: nothing to gather
        data = jax.tree.map(lambda a: jax.random.key_data(a) if _is_key(a) else a, self.state)
        gathered = multihost_utils.process_allgather(data, tiled=True)
        return jax.tree.map(
            lambda a, g: (
                jax.random.wrap_key_data(g, impl=jax.random.key_impl(a)) if _is_key(a) else g
            ),
            self.state,
            gathered,
        )

    def load_state(self, tree: Any) -> None:
        """Replaces the train state (e.g. a restored or remembered one), placed per the strategy."""
        self.state = self.strategy.put(tree)

    def running_metrics(self) -> dict[str, float]:
        """The epoch's metrics so far (reads the devices: a sync)."""
        return averages(jax.device_get(self.entry("metrics")))

    def entry(self, name: str, default: Any = None) -> Any:
        """The train state's entry `name` ("params", "metrics", "step", ...) as one state
        holds it: on `spmd.DiLoCo`, the global parameters, the islands' metric sums,
        island 0's other entries."""
        return islands.entry(self.state, name, default)

    # -- the compiled steps ---------------------------------------------------

    def _forward(self, params, rest, x, training):
        if self.compute_dtype is not None:
            params, x = cast(params, self.compute_dtype), cast(x, self.compute_dtype)
        try:
            out, rest = self._model.apply(params, rest, x, training)
        except (TypeError, ValueError) as error:  # at trace time: shapes are all it knows
            if isinstance(error, SpmdError) or "shape" not in str(error).lower():
                raise
            raise BatchError(forward_failed(x, error)) from error
        return jax.tree.map(lambda o: o.astype(jnp.float32), out), rest

    def _sums(self, out, y, real, weights, per_example) -> dict:
        """Sums over the batch: the loss weighted, the metrics over the real examples."""
        sums = {
            "count": jnp.sum(real),
            "weight_sum": jnp.sum(weights),
            "loss": jnp.sum(per_example * weights),
        }
        for metric in self.metrics:  # Keras' `metrics`: sample weights weigh the loss only
            sums[metric.name] = jnp.sum(metric.fn(out, y) * real)
        return sums

    def _grads(self, params, rest, x, y, real, weights):
        def loss(params, rest, x, y, real, weights):
            out, rest = self._forward(params, rest, x, True)
            per = self.loss_fn(out, y)
            return jnp.sum(per * weights), (rest, self._sums(out, y, real, weights, per))

        grad_fn = jax.grad(loss, has_aux=True)
        m = self.grad_accum_steps
        if m == 1:
            grads, (rest, sums) = grad_fn(params, rest, x, y, real, weights)
            return grads, rest, sums

        def micro(a):  # rows r, r + m, r + 2m, ... : every replica gives each microbatch its share
            return a.reshape(a.shape[0] // m, m, *a.shape[1:]).swapaxes(0, 1)

        def body(carry, batch):
            grads, rest, sums = carry
            g, (rest, s) = grad_fn(params, rest, *batch)
            return (jax.tree.map(jnp.add, grads, g), rest, jax.tree.map(jnp.add, sums, s)), None

        zero = (jax.tree.map(jnp.zeros_like, params), rest, self._zero_sums())
        batches = jax.tree.map(micro, (x, y, real, weights))
        (grads, rest, sums), _ = jax.lax.scan(body, zero, batches)
        return grads, rest, sums

    def _train_step(self, state, x, y, w=None, mask=None):
        real, weights = example_weights(y, w, mask)
        grads, rest, sums = self._grads(state["params"], state["rest"], x, y, real, weights)
        # Keras' sum_over_batch_size: sum(loss * sample_weight) / the real examples
        grads = jax.tree.map(lambda g: g / jnp.maximum(sums["count"], 1.0), grads)
        updates, opt_state = self.optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        new = {"params": params, "opt_state": opt_state, "rest": rest}
        nan_step, nan_cause = first_nan(
            state, sums["loss"], new if self.terminate_on_nan else None, sums["weight_sum"]
        )
        return {
            "params": params,
            "opt_state": opt_state,
            "rest": rest,
            "step": state["step"] + 1,
            "metrics": jax.tree.map(jnp.add, state["metrics"], sums),
            "nan_step": nan_step,
            "nan_cause": nan_cause,
        }

    def _train_many(self, state, *batches):
        def body(state, batch):
            return self._train_step(state, *batch), None

        return jax.lax.scan(body, state, batches)[0]

    def _eval_step(self, state, x, y, w=None, mask=None):
        real, weights = example_weights(y, w, mask)
        out, _ = self._forward(state["params"], state["rest"], x, False)
        return self._sums(out, y, real, weights, self.loss_fn(out, y))

    def _predict_step(self, state, x, mask=None):
        """The outputs and the padding mask, replicated (as a step's outputs come back): every
        process holds every row, whichever process's devices computed it."""
        return self._forward(state["params"], state["rest"], x, False)[0], mask

    def _step(self, name: str):
        if name not in self._steps:
            s = self.strategy
            if name in ("eval", "predict"):  # DiLoCo: the global parameters, synchronously
                s = islands.synchronous(s)
            self._steps[name] = {
                "train": lambda: s.step(self._train_step),
                "many": lambda: s.step(self._train_many, batch_axis=1),
                "eval": lambda: s.step(self._eval_step, donate=False),
                "predict": lambda: s.step(self._predict_step, donate=False),
            }[name]()
        return self._steps[name]

    def _precheck(self, data: Any, batch_size, validation_data: Any, validation_batch_size) -> None:
        """Checks the training data's and validation data's first batch before any step runs."""
        for what, source, size in (
            ("fit", data, batch_size),
            ("validation_data", validation_data, validation_batch_size),
        ):
            batch = host_first(source, size, what)
            if batch is not None:
                self._check_batch(train_args(batch, what), what, first=True, placed=False)

    def _check_finite(self, wait: bool) -> None:
        """Raises if a step's loss was NaN/inf; reads the flag only once it is computed
        and at most every `_NAN_READ_S` (always at `wait`, the epoch's end), so the steps
        never wait for the check and a tiny step pays no transfer each. The flag holds
        the first non-finite step, so a later read still names it."""
        flag = self.entry("nan_step")
        if not self.terminate_on_nan or flag is None:
            return
        if not wait:  # a read is a host transfer: at most every _NAN_READ_S, once computed
            now = time.monotonic()
            if now - self._nan_read < _NAN_READ_S or not flag.is_ready():
                return
            self._nan_read = now
        step = int(jax.device_get(flag))
        if step >= 0:
            # The flag counts the state's steps, which need not be `iterations` (a
            # state trained elsewhere): the epoch began this epoch's batches ago.
            start = int(jax.device_get(self.entry("step"))) - (self.iterations - self._epoch_start)
            cause = int(jax.device_get(self.entry("nan_cause", NAN_LOSS)))
            written = {part: self.entry(part) for part in ("params", "opt_state", "rest")}
            raise NonFiniteLossError(
                _non_finite_message(cause, self.epoch, step - start, step, written)
            )

    def _evaluated_state(self) -> Any:
        """The state evaluate and predict read: on DiLoCo the global parameters (and
        island 0's other state), laid out by the synchronous strategy of its mesh."""
        if self.state is None or self.state is islands.single(self.state):
            return self.state
        return self.strategy.synchronous.put(islands.single(self.state))

    def _check_batch(self, batch: tuple, what: str, first: bool, placed: bool = True) -> None:
        """Checks a batch before it runs (see `BatchChecks.check`)."""
        self._checks.check(self, batch, what, first, placed)

    # -- data -----------------------------------------------------------------

    def _dataset(self, data: Any, batch_size: int | None, *, shuffle: bool, pad: bool, what: str):
        keep = (
            what == "fit" and is_arrays(data) and self._checks.keeps_partial(self, data, batch_size)
        )
        return as_dataset(
            islands.synchronous(self.strategy),  # DiLoCo: the batch split over islands first
            data,
            batch_size,
            shuffle=shuffle,
            pad=pad,
            seed=self.seed,
            what=what,
            microbatches=self.grad_accum_steps if what == "fit" else 1,
            keep_partial=keep,
        )

    # -- fit / evaluate / predict ---------------------------------------------

    def fit(
        self,
        data: Any = None,  # None: Keras' x=/y= keywords are named as such, not a TypeError
        batch_size: int | None = None,
        epochs: int = 1,
        steps_per_epoch: int | None = None,
        shuffle: bool = True,
        validation_data: Any = None,
        validation_batch_size: int | None = None,
        callbacks: Sequence[Callback] | Callback = (),
        verbose: int | str = "auto",
        initial_epoch: int = 0,
        class_weight: dict[int, float] | None = None,
        **keras: Any,
    ) -> History:
        """Trains for `epochs` epochs; returns the `History` of every epoch's metrics.

        Args:
          data: (x, y) arrays (or (x, y, sample_weight)) with `batch_size` the
            global batch (Keras' `x=`/`y=` keywords are an error saying so),
            the last partial batch trained on as Keras does
            (padded and masked; dropped, logged at WARNING, for a model whose
            training pass writes state); an iterable of such batches
            (re-iterable for several epochs); or a distributed dataset.
          batch_size: the global batch size, over every replica and process.
            One the replicas (times `grad_accum_steps`) do not split evenly is
            padded at its end with masked rows, which weigh nothing: the same
            update at any replica count (docs/trainer.md).
          epochs: the epoch to stop at (counting `initial_epoch`).
          steps_per_epoch: stop an epoch after this many batches.
          shuffle: a new order each epoch (arrays only), from the trainer's seed.
          validation_data: data for `evaluate` after each epoch (`val_*` logs).
          validation_batch_size: its batch size; `batch_size` by default.
          callbacks: `spmd.callbacks.Callback`s.
          verbose: 0 silent, 1 a progress bar, 2 a line per epoch; "auto" picks
            1 on a terminal, else 2. Only the chief prints.
          initial_epoch: the epoch to start from (BackupAndRestore sets it).
          class_weight: Keras' {class id: weight}: each example's sample weight
            (1 where the data has none) multiplied by its label's class weight
            (an id left out weighs 1.0); the metrics stay unweighted.
          **keras: none is taken; a Keras argument spmd does not take (e.g.
            `validation_split`, `sample_weight`, `workers`) is an error saying
            what to do instead.

        Returns:
          The `History`: `history.history["loss"]`, `["val_accuracy"]`, ...

        Raises:
          ArgumentTypeError: an argument fit does not take (Keras' named as such).
          ConfigurationError: `batch_size` beside a dataset, a tuple of four arrays.
          BatchError: data spmd cannot read as batches (unbatched, ragged), sample
            weights of another shape than (batch,).
        """
        check_keras_arguments("fit", keras, _FIT_ARGUMENTS)
        check_count("steps_per_epoch", steps_per_epoch, allow_none=True)
        check_count("epochs", epochs, allow_none=False)
        check_verbose(verbose)
        islands.check_batch_size(self.strategy, batch_size)
        callbacks = as_callbacks(callbacks)
        self.build()
        data = with_class_weight(data, check_class_weight(class_weight), "fit")
        self.dataset = self._dataset(data, batch_size, shuffle=shuffle, pad=False, what="fit")
        check_endless(self.dataset, steps_per_epoch)
        val_size = validation_batch_size
        if val_size is None and is_arrays(validation_data):
            val_size = batch_size
        val_data = None
        if validation_data is not None:  # made now: its errors come before the first step
            val_data = self._dataset(
                validation_data, val_size, shuffle=False, pad=True, what="validation_data"
            )
        self._precheck(data, batch_size, validation_data, val_size)
        for name, value in (("nan_step", -1), ("nan_cause", 0)):
            if self.entry(name) is not None:
                self.state = islands.reset(self.state, name, jnp.full((), value, jnp.int32))
        history = History()
        steps = steps_per_epoch or self.dataset.num_batches
        verbose = (1 if sys.stdout.isatty() else 2) if verbose == "auto" else verbose
        shown = [ProgressBar()] if verbose == 1 else [EpochLogger()] if verbose == 2 else []
        self._fit_callbacks = [history, *callbacks, *shown]  # BackupAndRestore backs theirs up
        hooks = CallbackList(
            self._fit_callbacks,
            self,
            {"epochs": epochs, "steps": steps, "verbose": verbose},
        )
        self.stop_training, self.epoch = False, initial_epoch
        try:
            self._fit_epochs(hooks, epochs, steps_per_epoch, val_data, data)
        except BaseException:
            try:  # the callbacks release their files and locks; the error is fit's
                hooks.on_train_abort()
            except Exception as error:  # noqa: BLE001 - never hide the error that stopped fit
                warnings.warn(f"a callback's on_train_abort failed: {error!r}", stacklevel=2)
            raise
        finally:
            self._close_iterator()
        return history

    def _fit_epochs(self, hooks, epochs: int, steps_per_epoch, val_data, data: Any) -> None:
        """Runs the epochs from `self.epoch` to `epochs` (or until stop_training)."""
        logs: dict = {}
        self._fit_first = True
        before, self._pass_ended = self.iterations, False
        hooks.on_train_begin({})
        # A backup (BackupAndRestore) taken at an epoch's last batch resumes in that
        # epoch with no batch left: its end (metrics, validation, hooks) still runs.
        # One taken after the pass ended (a last call of fewer than steps_per_execution
        # batches reads past the end) reads nothing more: its position is the next pass's.
        resumed = self.iterations != before
        while self.epoch < epochs and not self.stop_training:
            hooks.on_epoch_begin(self.epoch, {})
            self._epoch_start = self.iterations
            ran = 0 if self._pass_ended else self._run_epoch(hooks, steps_per_epoch)
            self._pass_ended = False
            if ran == 0 and not resumed:
                raise BatchError(
                    message(
                        f"Epoch {self.epoch} received no batch: the data ran out.",
                        received(epoch=self.epoch, data=type(data).__name__),
                        "pass arrays, a list or a dataset (each epoch iterates it anew), "
                        "or fewer epochs for a one-shot iterator.",
                    )
                )
            self._check_finite(wait=True)
            logs = self.running_metrics()
            self.state = islands.reset(self.state, "metrics", self._zero_sums())
            if val_data is not None:
                val = self._evaluate_dataset(val_data, "validation_data", hooks)
                logs.update({f"val_{k}": v for k, v in val.items()})
            hooks.on_epoch_end(self.epoch, logs)
            self.epoch += 1
            resumed = False
        hooks.on_train_end(logs)

    def _run_epoch(self, hooks: CallbackList, steps_per_epoch: int | None) -> int:
        """Runs one epoch's batches, K at a time; returns how many batches ran.

        Without `steps_per_epoch` an epoch is one pass over the data. With it,
        as in Keras, one iterator goes on across epochs (an epoch takes the
        next `steps_per_epoch` batches) and a new pass starts when it runs out.
        """
        k, ran, ended = self.steps_per_execution, 0, False
        while not ended and not self.stop_training:
            group = []
            while len(group) < k and (
                steps_per_epoch is None or ran + len(group) < steps_per_epoch
            ):
                batch = self._next_batch(cycle=steps_per_epoch is not None)
                if batch is None:
                    self._pass_ended = steps_per_epoch is None
                    break
                batch = train_args(batch, "fit")
                self._check_batch(batch, "fit", first=self._fit_first)
                self._fit_first = False
                group.append(batch)
            ended = len(group) < k
            if group:
                ran = self._run_group(hooks, group, ran)
        return ran

    def _next_batch(self, cycle: bool) -> Any:
        """The data's next batch; None at the end of a pass (unless `cycle`: a new pass)."""
        for _ in range(2):
            fresh = self._iterator is None
            if fresh:
                self._iterator = iter(self.dataset)
            batch = next(self._iterator, None)
            if batch is not None:
                return batch
            self._close_iterator()
            if fresh or not cycle:
                return None
        return None

    def _close_iterator(self) -> None:
        iterator, self._iterator = self._iterator, None
        if iterator is not None and hasattr(iterator, "close"):
            iterator.close()

    def _run_group(self, hooks: CallbackList, group: list[tuple], ran: int) -> int:
        hooks.on_train_batch_begin(ran, {})
        if len(group) == self.steps_per_execution > 1 and _one_form(group):
            stacked = stack(self.strategy, group)
            self.state = self._step("many")(self.state, *stacked)
        else:
            for batch in group:
                self.state = self._step("train")(self.state, *batch)
        ran += len(group)
        self.iterations += len(group)  # applied, whether or not the check below raises
        self._check_finite(wait=False)
        hooks.on_train_batch_end(ran - 1, BatchLogs(self.entry("metrics")))
        return ran

    def evaluate(
        self,
        data: Any = None,  # None: Keras' x=/y= keywords are named as such, not a TypeError
        batch_size: int | None = None,
        verbose: int = 0,
        callbacks: Sequence[Callback] | Callback = (),
        return_dict: bool = True,
        **keras: Any,
    ) -> dict[str, float]:
        """The loss and metrics over every example of `data`, each counted once.

        A last partial batch is padded and masked, so nothing is dropped and
        padding never counts; a distributed dataset that drops its last
        partial batch is an error. `verbose` is accepted for Keras compatibility.
        `callbacks` get Keras' hooks: `on_test_begin`, then per batch
        `on_test_batch_begin(i)` and `on_test_batch_end(i, logs)` (the metrics
        over batches 0..i; read from the devices only when some callback
        overrides that hook), then `on_test_end(logs)`.

        `return_dict` is Keras' (True is spmd's only form); other Keras
        arguments spmd does not take are errors saying what to do instead.

        Returns:
          {"loss": ..., "accuracy": ...}: the loss is sum(loss x sample_weight)
          over the real examples' count (Keras' sum_over_batch_size), each metric
          its mean over the real examples.

        Raises:
          BatchError: no example, a dropping dataset, or sample weights all 0 or
            one not finite.
          ArgumentTypeError: an argument evaluate does not take, return_dict=False.
        """
        check_keras_arguments("evaluate", keras, _EVALUATE_ARGUMENTS)
        _check_return_dict(return_dict)
        check_verbose(verbose)
        self.build()
        dataset = self._dataset(data, batch_size, shuffle=False, pad=True, what="evaluate")
        return self._evaluate_dataset(dataset, "evaluate", self._hooks(callbacks, dataset, verbose))

    def _hooks(self, callbacks: Sequence[Callback], dataset: Any, verbose: int) -> CallbackList:
        """The callbacks of an evaluate or predict: one epoch of the dataset's batches."""
        steps = getattr(dataset, "num_batches", None)
        return CallbackList(
            as_callbacks(callbacks), self, {"epochs": 1, "steps": steps, "verbose": verbose}
        )

    def _evaluate_dataset(self, dataset: Any, what: str, hooks: CallbackList) -> dict[str, float]:
        """Evaluates every batch of `dataset`, calling the test hooks as Keras does."""
        hooks.on_test_begin({})
        step, totals, state = self._step("eval"), None, self._evaluated_state()
        batch_logs = hooks.overrides("on_test_batch_end")  # else no per-batch read
        for index, batch in enumerate(dataset):
            hooks.on_test_batch_begin(index, {})
            batch = train_args(batch, what)
            self._check_batch(batch, what, first=totals is None)
            sums = step(state, *batch)
            totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
            hooks.on_test_batch_end(index, averages(jax.device_get(totals)) if batch_logs else {})
        logs = _evaluated(totals, dataset, what)
        hooks.on_test_end(logs)
        return logs

    def predict(
        self,
        x: Any,
        batch_size: int | None = None,
        callbacks: Sequence[Callback] | Callback = (),
        verbose: int | str = 0,
        **keras: Any,
    ) -> Any:
        """The model's outputs for every row of `x`, in input order, on every process.

        Args:
          x: an array of inputs (or a dict of named input arrays), or an
            iterable of batches: each an array of inputs, or a tuple
            `(x, y)` / `(x, y, sample_weight)` whose `x` is predicted. Only
            a `spmd.PaddedBatch` carries a padding mask. A list of
            arrays with `batch_size` is the model's several inputs (Keras);
            without it, an error (it could be a list of batches).
          batch_size: the global batch size (with arrays).
          callbacks: `spmd.callbacks.Callback`s, given Keras' hooks:
            `on_predict_begin`, then per batch `on_predict_batch_begin(i)` and
            `on_predict_batch_end(i, {"outputs": ...})` (the batch's real rows),
            then `on_predict_end`.
          verbose: accepted for Keras compatibility (predict prints nothing).
          **keras: none is taken; a Keras argument spmd does not take (e.g.
            `steps`, `workers`) is an error saying what to do instead.

        Returns:
          A numpy array with one row per input row (a pytree of them for a
          model with several outputs).

        Raises:
          ConfigurationError: a list of arrays without batch_size.
          ArgumentTypeError: an argument predict does not take.
        """
        check_keras_arguments("predict", keras, _PREDICT_ARGUMENTS)
        check_verbose(verbose)
        self.build()
        check_lists(x, "predict")
        if is_bare_arrays(x) and batch_size is None:
            raise ConfigurationError(_AMBIGUOUS_PREDICT)
        data = (list(x),) if is_bare_arrays(x) else (x,) if is_arrays((x,)) else x
        dataset = self._dataset(data, batch_size, shuffle=False, pad=True, what="predict")
        hooks = self._hooks(callbacks, dataset, verbose=0)
        hooks.on_predict_begin({})
        step, rows, state = self._step("predict"), [], self._evaluated_state()
        for index, batch in enumerate(dataset):
            hooks.on_predict_batch_begin(index, {})
            elements, mask = split_batch(batch)
            check_rows(elements[0], "predict")
            out, mask = jax.device_get(step(state, elements[0], mask))
            if mask is not None:  # a padded batch: keep the real rows
                keep = mask > 0
                out = jax.tree.map(lambda o, keep=keep: o[keep], out)
            rows.append(out)
            hooks.on_predict_batch_end(index, {"outputs": out})
        hooks.on_predict_end({})
        if not rows:
            return np.zeros((0,))
        return jax.tree.map(lambda *parts: np.concatenate(parts), *rows)


_FIT_ARGUMENTS = tuple(inspect.signature(Trainer.fit).parameters)[1:-1]
_EVALUATE_ARGUMENTS = tuple(inspect.signature(Trainer.evaluate).parameters)[1:-1]
_PREDICT_ARGUMENTS = tuple(inspect.signature(Trainer.predict).parameters)[1:-1]


def _check_return_dict(return_dict: Any) -> None:
    """Raises unless `return_dict` is True: evaluate returns a dict, never Keras' list.

    Raises:
      ArgumentTypeError: return_dict=False.
    """
    if return_dict is True:
        return
    raise ArgumentTypeError(
        message(
            "evaluate returns its metrics as a dict (Keras' return_dict=True), never as "
            "Keras' list, whose order would have to be guessed.",
            received(return_dict=return_dict),
            'drop return_dict, and read the values by name: logs["loss"], logs["accuracy"].',
        )
    )


def _evaluated(totals: Any, dataset: Any, what: str) -> dict[str, float]:
    """The metrics of an evaluation's summed `totals`; raises if nothing was summed."""
    if totals is None:
        raise BatchError(
            message(
                f"{what} received no batch.",
                received(data=type(dataset).__name__),
                "pass data with at least one example.",
            )
        )
    totals = jax.device_get(totals)
    if not np.isfinite(float(totals["weight_sum"])):
        raise BatchError(
            message(
                f"The sample weights given to {what} are finite: a NaN or inf weight makes "
                "the loss NaN, as fit stops at (NonFiniteLossError).",
                received(
                    examples=int(totals["count"]), sample_weight_sum=float(totals["weight_sum"])
                ),
                "find it in the data's sample weights (np.isfinite(sample_weight).all()) and "
                "give that example a finite weight, or 0 to leave it out.",
            )
        )
    if float(totals["weight_sum"]) == 0.0:
        raise BatchError(
            message(
                f"The sample weights given to {what} weigh at least one example: with "
                "every weight 0 there is no loss to report.",
                received(examples=int(totals["count"]), sample_weight_sum=0.0),
                "pass sample weights with at least one non-zero, or none.",
            )
        )
    return averages(totals)


def _one_form(group: list[tuple]) -> bool:
    """Whether a group's batches stack into one: each with a mask and sample weights, or
    each without (a padded batch among whole ones, from an iterable, runs by itself)."""
    return all(len({batch[i] is None for batch in group}) == 1 for i in range(len(group[0])))


def _addressable(leaf: Any) -> bool:
    """Whether this process holds the whole leaf (a process-local strategy's state, e.g.
    OneDeviceStrategy's under several processes), which gathering would repeat per process."""
    return not isinstance(leaf, jax.Array) or leaf.is_fully_addressable


def _is_key(leaf: Any) -> bool:
    """Whether a state leaf is a typed PRNG key array (no numpy form: gathered as key data)."""
    return isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)
