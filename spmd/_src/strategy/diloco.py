"""DiLoCo: islands that train on their own for H steps, then average their deltas (local SGD)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from spmd._src.errors import CheckpointError, ConfigurationError, ContextError, message, received
from spmd._src.strategy import nnx_state, per_replica
from spmd._src.strategy.base import Strategy, bind_static
from spmd._src.strategy.island_step import IslandStep, explain_islands
from spmd._src.strategy.islands import ISLAND, DiLoCoState, fragment_tree, island_strategies
from spmd._src.strategy.replica import ReduceOp, current_island, running_strategy
from spmd._src.strategy.state_placement import place_state
from spmd._src.topologies import check_runnable, eager_refused
from spmd._src.validate import positive_int

__all__ = ["DiLoCo", "DiLoCoState"]

P = PartitionSpec


class DiLoCo:
    """Islands of devices that train apart for H steps, then average: DiLoCo (local SGD).

    The mesh gets an outermost `island` axis (islands split across processes
    first). Each island holds its own copy of your state and runs your unchanged
    step with the inner strategy's layout (data parallel, FSDP, tensor parallel
    inside the island) and no collective across islands. Every `sync_every`
    steps one program averages the islands' parameter deltas (outer gradient =
    global params - island params, averaged over islands), applies the outer
    optimizer to the global parameters, and restarts every island from them
    (each island keeps its own inner optimizer state).

    Args:
      inner: one island's layout: None (data parallel over an island's devices),
        a `spmd.Strategy` over every device, whose outermost batch axes are cut
        into islands (`spmd.MultiWorkerMirroredStrategy()`: one island per
        process), or a mapping of one island's mesh axes ({"data": -1, "model": 2},
        with `rules` and `batch_axes`).
      islands: how many islands.
      sync_every: H, inner steps between synchronisations.
      outer_optimizer: an optax transform applied to the averaged outer gradient;
        SGD with Nesterov momentum (lr 0.7, momentum 0.9) by default, as the paper.
      params: which part of your state is averaged: a '/'-separated path of keys
        or attributes ("params", "model/params"), or a function state -> that
        part (`lambda s: s` for a state that is parameters only). The rest of the
        state (optimizer state, counters) stays per island.
      fragments: Streaming DiLoCo: the parameters are cut into this many
        fragments (contiguous runs of leaves, equal in count); fragment f
        synchronises at steps f*H/fragments (mod H), so one sync moves 1/fragments
        of the parameters. 1 (default) synchronises them all at once.
      devices, rules, batch_axes, logical_axis_rules: with `inner` a mapping:
        the devices (all by default), state rules, batch axes and logical axis
        rules inside an island, as `spmd.Strategy` takes them.

    Example:
      >>> strategy = spmd.DiLoCo(islands=2, sync_every=50)
      >>> state = strategy.init(create_state, jax.random.key(0))
      >>> step = strategy.step(train_step)          # train_step(state, x, y) -> (state, metrics)
      >>> state, metrics = step(state, x, y)        # syncs every 50th call
      >>> params = strategy.global_params(state)    # for evaluation
    """

    def __init__(
        self,
        inner: Strategy | Mapping[str, int] | None = None,
        islands: int = 2,
        sync_every: int = 50,
        outer_optimizer: optax.GradientTransformation | None = None,
        *,
        params: str | Callable[[Any], Any] = "params",
        fragments: int = 1,
        devices: Sequence[Any] | None = None,
        rules: Sequence[Any] = (),
        batch_axes: Sequence[str] | None = None,
        logical_axis_rules: Sequence[Any] = (),
    ):
        self.islands = positive_int(islands, "islands")
        self.sync_every = positive_int(sync_every, "sync_every")
        self.fragments = positive_int(fragments, "fragments")
        if self.fragments > self.sync_every:
            raise ConfigurationError(
                message(
                    "fragments must not exceed sync_every: each fragment syncs at its own "
                    "step of every H.",
                    received(fragments=fragments, sync_every=sync_every),
                    f"pass fragments <= {self.sync_every}.",
                )
            )
        if outer_optimizer is None:
            outer_optimizer = optax.sgd(0.7, momentum=0.9, nesterov=True)
        if not hasattr(outer_optimizer, "init") or not hasattr(outer_optimizer, "update"):
            raise ConfigurationError(
                message(
                    "outer_optimizer is an optax GradientTransformation.",
                    received(outer_optimizer=outer_optimizer),
                    "pass e.g. optax.sgd(0.7, momentum=0.9, nesterov=True).",
                )
            )
        self.outer_optimizer = outer_optimizer
        if not (callable(params) or isinstance(params, str)):
            raise ConfigurationError(
                message(
                    "params is a '/'-separated path into the state or a function state -> params.",
                    received(params=params),
                    'pass e.g. params="params" or params=lambda state: state.params.',
                )
            )
        self.params = params
        self._get_params = params if callable(params) else _path_getter(params)
        self.layout, self.synchronous = island_strategies(
            inner,
            self.islands,
            devices=devices,
            rules=rules,
            batch_axes=batch_axes,
            logical_axis_rules=logical_axis_rules,
        )
        if self.layout.placement != "device":
            raise ConfigurationError(
                message(
                    "DiLoCo keeps the islands' states in device memory.",
                    received(placement=self.layout.placement),
                    "use an inner strategy with placement='device'.",
                )
            )
        self._positions: dict[Any, tuple] = {}
        # The NNX graph of a state made from flax NNX objects, by its arrays' structure:
        # islands hold the arrays; each island's step merges them into the objects again.
        self._graphs: dict[Any, Any] = {}

    # -- what the strategy is -------------------------------------------------

    @property
    def mesh(self) -> jax.sharding.Mesh:
        """Every device, axes `("island", *one island's axes)`."""
        return self.layout.mesh

    @functools.cached_property
    def _spans_processes(self) -> bool:
        """Whether the mesh holds devices of several processes (as `Strategy`'s)."""
        return len({d.process_index for d in self.mesh.devices.flat}) > 1

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The axes a global batch is split over: `island` first, then an island's batch axes."""
        return tuple(self.synchronous.batch_axes)

    @property
    def num_replicas_in_sync(self) -> int:
        """Data-parallel replicas over all islands: islands x replicas per island.

        What a global batch is split over (it must divide by it). Inside a
        step, where each island is a data-parallel job of its own, the
        replicas in sync are one island's: reading this there is an error
        that says to read `replicas_per_island`.

        Raises:
          ContextError: read while a step of this strategy (with several
            islands) is traced.
        """
        island = current_island()
        if island is not None and island.strategy is self and island.islands > 1:
            raise ContextError(
                message(
                    "Inside a spmd.DiLoCo step each island is a data-parallel job of its own: "
                    "its replicas in sync are the island's, not the "
                    f"{self.synchronous.num_replicas_in_sync} over all islands that "
                    "num_replicas_in_sync counts (what a global batch splits over).",
                    received(
                        num_replicas_in_sync=self.synchronous.num_replicas_in_sync,
                        islands=self.islands,
                        replicas_per_island=self.replicas_per_island,
                    ),
                    "read strategy.replicas_per_island inside the step (or "
                    "spmd.get_replica_context().num_replicas_in_sync inside strategy.run); "
                    "a loss over the island's batch is "
                    "spmd.compute_average_loss(per_example_loss).",
                )
            )
        return self.synchronous.num_replicas_in_sync

    @property
    def replicas_per_island(self) -> int:
        """Data-parallel replicas in one island: the replicas each island's step syncs over."""
        return self.layout.num_replicas_in_sync

    def __repr__(self) -> str:
        mesh = ", ".join(f"{k}={v}" for k, v in self.mesh.shape.items())
        return (
            f"DiLoCo(mesh=({mesh}), islands={self.islands}, sync_every={self.sync_every}, "
            f"fragments={self.fragments})"
        )

    @contextlib.contextmanager
    def scope(self) -> Iterator[DiLoCo]:
        """Makes this the current strategy (`spmd.get_strategy()`) and sets the mesh."""
        with running_strategy(self), self.synchronous.context(), eager_refused(self):
            yield self

    # -- the state ------------------------------------------------------------

    def init(self, create_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> DiLoCoState:
        """Creates the DiLoCo state: every island starts from `create_fn(*args)`.

        `create_fn` runs under jit, as for `Strategy.init`, and returns your state:
        a pytree, or flax NNX objects (a module and its `nnx.Optimizer`), whose
        arrays the islands hold (their `nnx.Param`s averaged, unless `params`
        says otherwise) and which each island's step gets as objects again.
        Nothing is made whole on one device.

        Returns:
          A `DiLoCoState`, placed: islands sharded over the `island` axis.
        """
        check_runnable(self, "init")
        create_fn, args = bind_static(create_fn, args)
        make = functools.partial(self._make, create_fn, kwargs)
        with self.layout.context():
            abstract = jax.eval_shape(make, *args)
            return jax.jit(make, out_shardings=self.state_sharding(abstract))(*args)

    def put(self, state: Any) -> DiLoCoState:
        """Places a state: a `DiLoCoState` (restored, remembered) as `init` lays it out, or
        your own state (a pytree of arrays), from which every island starts, as `init`.

        Returns:
          A `DiLoCoState`, placed.
        """
        check_runnable(self, "put")
        if isinstance(state, DiLoCoState):
            return place_state(state, self.state_sharding(state))
        return self.init(lambda user: user, self.synchronous.put(self._pure(state)))

    @property
    def placement(self) -> str:
        """Where the state lives between steps: "device" (islands keep it in device memory)."""
        return self.layout.placement

    def abstract_state(
        self, create_fn: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> DiLoCoState:
        """The state `init` would make, as `ShapeDtypeStruct`s with shardings (a restore target)."""
        create_fn, args = bind_static(create_fn, args)
        make = functools.partial(self._make, create_fn, kwargs)
        with self.layout.context():
            abstract = jax.eval_shape(make, *args)
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            abstract,
            self.state_sharding(abstract),
        )

    def _make(self, create_fn: Callable, kwargs: dict, *args: Any) -> DiLoCoState:
        user = self._pure(create_fn(*args, **kwargs))
        leaves, treedef = jax.tree.flatten(user)
        positions, params_def = self._params_of(treedef)
        params = [leaves[p] for p in positions]
        integers = [str(jnp.result_type(x)) for x in params if not _inexact(x)]
        if integers:
            raise ConfigurationError(
                message(
                    "The parameters DiLoCo averages are floating point arrays.",
                    received(params=self.params, non_float_dtypes=integers),
                    "point params at the model's weights only (counters and keys stay in "
                    "the rest of the state, per island).",
                )
            )
        outer = tuple(
            self._outer_init(fragment_tree(params_def, [params[j] for j in frag], frag))
            for frag in self.fragment_leaves(len(positions))
        )
        islands = jax.tree.map(self._per_island, user)
        return DiLoCoState(params_def.unflatten(params), outer, islands, jnp.zeros((), jnp.int32))

    def _outer_init(self, params: Any) -> Any:
        """The outer optimizer's state for one fragment's parameters; its update is traced
        once here, so that one needing more than (updates, state, params) fails at init,
        not at the first sync hours later."""
        state = self.outer_optimizer.init(params)
        try:
            jax.eval_shape(self.outer_optimizer.update, params, state, params)
        except TypeError as error:
            raise ConfigurationError(
                message(
                    "DiLoCo calls outer_optimizer.update(outer_gradient, state, params) with "
                    "nothing else.",
                    received(outer_optimizer=self.outer_optimizer, error=error),
                    "pass an outer optimizer that needs no extra arguments (a transform "
                    "such as optax.contrib.reduce_on_plateau needs value=, which a sync "
                    "does not have).",
                )
            ) from error
        return state

    def _pure(self, user: Any) -> Any:
        """`user`'s arrays: of flax NNX objects (a module, an optimizer, a tuple of them)
        their `nnx.split` state, whose graph is kept for the step to merge them again."""
        graphdef, pure = nnx_state.split(user)
        if graphdef is not None:
            self._graphs[jax.tree.structure(pure)] = graphdef
        return pure

    def graphdef(self, state: DiLoCoState) -> Any:
        """The NNX graph of a state made from flax NNX objects (None for a pytree state)."""
        return self._graphs.get(jax.tree.structure(state.islands))

    def _per_island(self, x: Any) -> Any:
        """A leaf copied to every island; a typed PRNG key folded with the island's index,
        so that islands draw their own random numbers (dropout masks, noise)."""
        if isinstance(x, jax.Array | jax.ShapeDtypeStruct) and jax.dtypes.issubdtype(
            x.dtype, jax.dtypes.prng_key
        ):
            return jax.vmap(lambda i: jax.random.fold_in(x, i))(jnp.arange(self.islands))
        return jnp.broadcast_to(x, (self.islands, *jnp.shape(x)))

    def _params_of(self, treedef: Any) -> tuple[tuple[int, ...], Any]:
        """Which leaves of a state of this structure are parameters, and their tree."""
        found = self._positions.get(treedef)
        if found is None:
            labels = treedef.unflatten([_Label(i) for i in range(treedef.num_leaves)])
            get = self._get_params
            if treedef in self._graphs and self.params == "params":  # NNX: its nnx.Params
                get = _nnx_params
            try:
                part = get(labels)
            except (KeyError, AttributeError, TypeError, IndexError, ValueError) as error:
                raise ConfigurationError(
                    message(
                        "params names the part of the state DiLoCo averages across islands.",
                        received(params=self.params, state=treedef, error=error),
                        'pass params="<key>" naming the parameters (e.g. "params" for '
                        '{"params": ..., "opt": ...}), or params=lambda state: state for a '
                        "state that is parameters only.",
                    )
                ) from error
            picked, params_def = jax.tree.flatten(part)
            positions = [p.index for p in picked if isinstance(p, _Label)]
            if not picked or len(positions) != len(picked) or len(set(positions)) != len(picked):
                raise ConfigurationError(
                    message(
                        "params must pick leaves of the state itself (keys, attributes).",
                        received(params=self.params, picked=part),
                        "return a part of the state from the params function, unchanged.",
                    )
                )
            if len(positions) < self.fragments:
                raise ConfigurationError(
                    message(
                        "Each fragment holds at least one parameter leaf.",
                        received(fragments=self.fragments, parameter_leaves=len(positions)),
                        f"pass fragments <= {len(positions)}.",
                    )
                )
            found = self._positions[treedef] = (tuple(positions), params_def)
        return found

    def fragment_leaves(self, count: int) -> list[tuple[int, ...]]:
        """The parameter leaves (indices, in tree order) of each fragment."""
        return [tuple(int(i) for i in f) for f in np.array_split(np.arange(count), self.fragments)]

    def fragment_offset(self, fragment: int) -> int:
        """The inner step (mod H) after which a fragment synchronises."""
        return fragment * self.sync_every // self.fragments

    def due(self, position: int) -> list[int]:
        """The fragments that synchronise after inner step `position` (1 is the first)."""
        phase = position % self.sync_every
        return [f for f in range(self.fragments) if self.fragment_offset(f) == phase]

    def specs(self, state: DiLoCoState) -> DiLoCoState:
        """The `PartitionSpec` of every leaf of a DiLoCo state (arrays or abstract)."""
        user = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), state.islands)
        spec_tree = self.layout.state_spec(user)
        specs, treedef = jax.tree.flatten(spec_tree, is_leaf=lambda x: isinstance(x, P))
        for spec in specs:
            if any(ISLAND in (a if isinstance(a, tuple) else (a,)) for a in spec):
                raise ConfigurationError(
                    message(
                        f"A state rule of a DiLoCo island must not use the '{ISLAND}' axis: "
                        "each island holds its own copy.",
                        received(spec=spec),
                        "write the inner rules over one island's axes.",
                    )
                )
        positions, params_def = self._params_of(jax.tree.structure(state.islands))
        islands = treedef.unflatten([P(ISLAND, *s) for s in specs])
        params = [specs[p] for p in positions]
        outer = tuple(
            _outer_specs(self.outer_optimizer, o, params_def, params, frag)
            for o, frag in zip(state.outer, self.fragment_leaves(len(positions)), strict=True)
        )
        return DiLoCoState(params_def.unflatten(params), outer, islands, P())

    def state_sharding(self, state: DiLoCoState) -> DiLoCoState:
        """The `NamedSharding` of every leaf of a DiLoCo state."""
        if not isinstance(state, DiLoCoState):
            raise ConfigurationError(
                message(
                    "A DiLoCo strategy's state is the DiLoCoState its init() makes.",
                    received(state=type(state).__name__),
                    "make the state with strategy.init(create_fn, key).",
                )
            )
        return jax.tree.map(
            lambda s: NamedSharding(self.mesh, s),
            self.specs(state),
            is_leaf=lambda x: isinstance(x, P),
        )

    def global_params(self, state: DiLoCoState) -> Any:
        """The global parameters (as of the last synchronisation), for evaluation."""
        return state.params

    def global_state(self, state: DiLoCoState, island: int = 0) -> Any:
        """Your state with the global parameters, the rest taken from one island.

        Laid out as `synchronous` lays out your state: evaluate it with a step of
        `strategy.synchronous`, or save it as a plain model.
        """
        check_runnable(self, "global_state")
        island = _island_index(island, self.islands)
        leaves, treedef = jax.tree.flatten(state.islands)
        positions, _ = self._params_of(treedef)
        user = treedef.unflatten([jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in leaves])
        sharding = self.synchronous.state_sharding(user)

        def pick(state):
            out = [x[island] for x in jax.tree.leaves(state.islands)]
            for p, value in zip(positions, jax.tree.leaves(state.params), strict=True):
                out[p] = value
            return treedef.unflatten(out)

        return nnx_state.merge(self.graphdef(state), jax.jit(pick, out_shardings=sharding)(state))

    # -- batches --------------------------------------------------------------

    def distribute_dataset(self, dataset: Any, options: Any = None) -> Any:
        """Global batches as global jax.Arrays, split over islands first (see `Strategy`)."""
        return self.synchronous.distribute_dataset(dataset, options)

    def distribute_datasets_from_function(self, dataset_fn: Callable, options: Any = None) -> Any:
        """Each process's batches from `dataset_fn(spmd.InputContext)` (see `Strategy`)."""
        return self.synchronous.distribute_datasets_from_function(dataset_fn, options)

    # -- the step -------------------------------------------------------------

    def step(self, fn: Callable | None = None, /, *, gather_metrics: bool = False) -> Any:
        """Compiles your unchanged step for the islands: `@strategy.step`.

        `fn(state, *batch)` returns `(state, metrics)` (or the state alone), as
        for `Strategy.step`. Each call runs every island's step at once, each on
        its slice of the global batch (islands first), with no collective across
        islands; after every H-th call (counted by the state's `step`) the
        synchronisation program runs too.

        Args:
          fn: the step function.
          gather_metrics: False (default): the metrics come back with a leading
            island axis, sharded over islands (no communication; `.mean()` reads
            them anywhere). True: replicated on every device, which costs an
            all-gather across islands each step.

        Returns:
          An `IslandStep`: `state, metrics = step(state, *batch)`.
        """
        if not isinstance(gather_metrics, bool):
            raise ConfigurationError(
                message(
                    "gather_metrics is a bool.",
                    received(gather_metrics=gather_metrics),
                    "pass gather_metrics=True or False.",
                )
            )
        if fn is None:
            return lambda f: IslandStep(self, f, gather_metrics=gather_metrics)
        return IslandStep(self, fn, gather_metrics=gather_metrics)

    # -- the per-replica view, inside a step ----------------------------------

    def run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: dict | None = None,
        axis_name: str | None = None,
    ) -> Any:
        """Runs `fn` once per replica of the island, inside a step (`Strategy.run`'s view).

        Each island is a data-parallel job of its own, and a step is what runs
        on every island: call `run` inside your step function, where it splits
        the island's batch over the island's replicas and
        `spmd.get_replica_context()` (ids, `all_reduce`) spans the island only.
        `strategy.reduce` then combines over the island's replicas.

        Args:
          fn, args, kwargs, axis_name: as `Strategy.run` takes them (the state
            goes in `kwargs`, replicated; positional arguments are split).

        Returns:
          `fn`'s result structure with a `spmd.PerReplica` at each leaf, one
          value per replica of the island.

        Raises:
          ContextError: called outside a step of this strategy.

        Example:
          >>> @strategy.step
          ... def train_step(state, x, y):
          ...     loss, grads = strategy.run(replica_fn, args=(x, y),
          ...                                kwargs={"params": state["params"]})
          ...     grads = strategy.reduce("SUM", grads)
          ...     ...
        """
        self._in_step("run")
        return per_replica.run(self.layout, fn, args, kwargs, axis_name, current=self)

    def reduce(self, op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        """Combines per-replica values of `run` over the island's replicas, inside a step.

        Args, Returns: as `Strategy.reduce`.

        Raises:
          ContextError: called outside a step of this strategy.
        """
        self._in_step("reduce")
        return per_replica.reduce(ReduceOp.parse(op), value, axis, self.layout)

    def gather(self, value: Any, axis: int = 0) -> Any:
        """Concatenates the island's replicas' values of `run` along `axis`, inside a step.

        Raises:
          ContextError: called outside a step of this strategy.
        """
        self._in_step("gather")
        return per_replica.gather(value, axis, self.layout)

    def _in_step(self, method: str) -> None:
        """Refuses the per-replica view outside a step: no program runs every island else."""
        island = current_island()
        if island is not None and island.strategy is self:
            return
        raise ContextError(
            message(
                f"DiLoCo's {method} is the per-replica view of one island, inside a step: each "
                "island is a data-parallel job of its own, and a step (strategy.step) is the "
                "program that runs every island at once and syncs them every H calls.",
                received(called=f"strategy.{method}", where="outside a step of this strategy"),
                "move the per-replica code into your step function, "
                "@strategy.step def train_step(state, x, y): losses, grads = "
                "strategy.run(replica_fn, args=(x, y), kwargs={'params': state['params']}); "
                "grads = strategy.reduce('SUM', grads); ..., and call the step from the loop "
                "(or from the function coordinator.schedule runs).",
            )
        )

    def explain(self, step_fn: Callable | Any, state: DiLoCoState, *data: Any) -> Any:
        """Compiles the inner, sync and synchronous programs; reports bytes across islands.

        Returns:
          An `IslandsExplanation`: per program costs (`spmd.Explanation`s), the
          collectives that cross between islands, and the bytes per step against
          synchronous training on the same mesh (`ratio`: 1/H).
        """
        step = step_fn if isinstance(step_fn, IslandStep) else self.step(step_fn)
        return explain_islands(step, state, *data)

    # -- checkpoints ----------------------------------------------------------

    def _check_saved_islands(
        self, manager: Any, step: int | None, saved: int, islands: int | None
    ) -> None:
        """Raises a `CheckpointError` saying which `islands=` to pass where the checkpoint
        holds another island count than `saved` (this strategy's when `islands` is None)."""
        found = _saved_islands(manager, step)
        if found is None or found == saved:
            return
        raise CheckpointError(
            message(
                f"DiLoCo's restore reads the checkpoint with the island count it was saved "
                f"with: this one holds {found} islands (the leading axis of state.islands), "
                f"and restore was told {saved}"
                + (" (this strategy's, as islands= was not passed)." if islands is None else "."),
                received(
                    step=step if step is not None else manager.latest_step(),
                    saved_islands=found,
                    islands=islands,
                    strategy_islands=self.islands,
                ),
                f"pass islands={found}: strategy.restore(manager, create_fn, ..., "
                f"islands={found}) restores it into this strategy's {self.islands} islands"
                + (
                    " (each restarting from the global parameters; the inner steps since "
                    "the last sync are dropped)."
                    if found != self.islands
                    else "."
                ),
            )
        )

    def restore(
        self,
        manager: Any,
        create_fn: Callable[..., Any],
        *args: Any,
        step: int | None = None,
        data: Any = None,
        islands: int | None = None,
        **kwargs: Any,
    ) -> DiLoCoState:
        """Restores a DiLoCo checkpoint, saved with this or another island count.

        With the same island count this is `manager.restore(step,
        target=strategy.abstract_state(create_fn, *args))`. With another
        (`islands=` the saved count) the global parameters, outer optimizer
        state and step are restored as saved, and every island restarts from
        the global parameters, its other leaves (inner optimizer state) taken
        from saved island `i % saved`: the inner steps since the last
        synchronisation are dropped (save at multiples of H to lose none). With
        fewer islands, the saved islands `islands ..` are dropped (nothing is
        averaged); with more, a typed PRNG key of a new island `i >= saved` is
        saved island `i % saved`'s folded with `i`, so no two islands draw the
        same random numbers.

        Args:
          manager: a `spmd.CheckpointManager`.
          create_fn, *args, **kwargs: make your state, as for `init` (only shapes used).
          step: the checkpoint's step; the latest by default.
          data: an iterator or dict whose position is restored too.
          islands: the island count the checkpoint was saved with (this one's by default).

        Raises:
          CheckpointError: the checkpoint holds another island count than
            `islands` (the message says which to pass), or `manager.restore`'s.
        """
        check_runnable(self, "restore")
        saved = self.islands if islands is None else positive_int(islands, "islands")
        self._check_saved_islands(manager, step, saved, islands)
        target = self.abstract_state(create_fn, *args, **kwargs)
        if saved == self.islands:
            return manager.restore(step, target=target, data=data)
        spread = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(
                (saved, *x.shape[1:]), x.dtype, sharding=NamedSharding(self.mesh, P(None, *s[1:]))
            ),
            target.islands,
            self.specs(target).islands,
            is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct),
        )
        restored = manager.restore(step, target=target._replace(islands=spread), data=data)
        positions, _ = self._params_of(jax.tree.structure(target.islands))
        order = np.arange(self.islands) % saved

        def reseed(state):
            out = [_regrow(x, order, saved) for x in jax.tree.leaves(state.islands)]
            for p, value in zip(positions, jax.tree.leaves(state.params), strict=True):
                out[p] = jnp.broadcast_to(value, (self.islands, *value.shape))
            return state._replace(
                islands=jax.tree.unflatten(jax.tree.structure(state.islands), out)
            )

        return jax.jit(reseed, out_shardings=self.state_sharding(target))(restored)


def _saved_islands(manager: Any, step: int | None) -> int | None:
    """The island count a DiLoCo checkpoint was saved with (the leading size of its
    `islands` arrays), read from its metadata; None where it does not tell."""
    arrays = manager.saved_arrays(step)
    sizes = {
        shape[0] for path, (shape, _) in arrays.items() if path.startswith("islands/") and shape
    }
    return sizes.pop() if len(sizes) == 1 else None


def _regrow(x: jax.Array, order: np.ndarray, saved: int) -> jax.Array:
    """Island `i`'s leaf from saved island `order[i]`; a typed PRNG key of an island
    the checkpoint did not have (`i >= saved`) folded with `i`, as `init` folds them."""
    x = x[order]
    if len(order) <= saved or not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return x
    fresh = jax.vmap(jax.random.fold_in)(x[saved:], jnp.arange(saved, len(order)))
    return jnp.concatenate([x[:saved], fresh])


class _Label:
    """A state leaf's index, standing in for the leaf to find which leaves `params` picks."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


def _inexact(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _nnx_params(state: Any) -> Any:
    """The `nnx.Param` variables of an NNX state: what DiLoCo averages by default."""
    return nnx.filter_state(state, nnx.Param)


def _path_getter(path: str) -> Callable[[Any], Any]:
    keys = [k for k in path.split("/") if k]

    def get(state: Any) -> Any:
        for key in keys:
            state = state[key] if isinstance(state, Mapping) else getattr(state, key)
        return state

    return get


def _outer_specs(
    outer_optimizer: Any,
    outer_state: Any,
    params_def: Any,
    specs: Sequence[P],
    fragment: tuple[int, ...],
) -> Any:
    """The outer optimizer state's specs: a parameter's spec where the state mirrors it."""
    labels = fragment_tree(params_def, fragment, fragment)
    try:
        return optax.tree_map_params(
            outer_optimizer,
            lambda _, i: specs[i],
            outer_state,
            labels,
            transform_non_params=lambda _: P(),
            is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct | jax.Array),
        )
    except (ValueError, TypeError):  # an optimizer optax cannot map: replicate its state
        return jax.tree.map(lambda _: P(), outer_state)


def _island_index(island: Any, islands: int) -> int:
    if not isinstance(island, int | np.integer) or not 0 <= island < islands:
        raise ConfigurationError(
            message(
                f"island is an index 0 .. {islands - 1}.",
                received(island=island),
                "pass e.g. island=0.",
            )
        )
    return int(island)
