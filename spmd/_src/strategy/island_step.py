"""DiLoCo's compiled programs: every island's inner step at once, and the synchronisation."""

from __future__ import annotations

import collections
import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from spmd._src.clusters.hang_watch import SHARED as _SHARED
from spmd._src.clusters.hang_watch import STEPS as _STEPS
from spmd._src.errors import ConfigurationError, ContextError, message, received
from spmd._src.explain import explain_traced
from spmd._src.placement import batch_sharding, conform, put_batch
from spmd._src.strategy import nnx_state
from spmd._src.strategy.islands import (
    ISLAND,
    DiLoCoState,
    IslandsExplanation,
    crossing,
    fragment_tree,
)
from spmd._src.strategy.replica import Island, in_replica_context, island_context
from spmd._src.strategy.step import CPU_MAX_IN_FLIGHT, STEP_IN_RUN, _split_output
from spmd._src.strategy.step_checks import LastAgreed
from spmd._src.strategy.step_records import signature, spans_processes
from spmd._src.topologies import check_runnable

if TYPE_CHECKING:
    from spmd._src.strategy.diloco import DiLoCo

__all__ = ["IslandStep", "explain_islands"]

P = PartitionSpec


class IslandStep:
    """Your step run by every island at once, with the sync every H calls; see `DiLoCo.step`.

    Attributes:
      strategy: the `DiLoCo` strategy.
      fn: your step function.
      gather_metrics: whether metrics come back replicated (an all-gather
        across islands each step) rather than sharded over islands.
    """

    def __init__(self, strategy: DiLoCo, fn: Callable[..., Any], *, gather_metrics: bool):
        self.strategy = strategy
        self.fn = fn
        self.gather_metrics = gather_metrics
        self._programs: dict[Any, _Programs] = {}
        self._last: tuple[Any, int] | None = None  # (the state returned last, its step)
        self._in_flight: collections.deque[jax.Array] = collections.deque()
        self._on_cpu = strategy.mesh.devices.flat[0].platform == "cpu"
        self._agreed = LastAgreed()  # with several processes: the batch signature
        functools.update_wrapper(self, fn)

    def __call__(self, state: DiLoCoState, *data: Any, **kwargs: Any) -> Any:
        _STEPS[0] += 1  # progress, which the hang watch publishes, as `Step` counts it
        _SHARED[0] += self.strategy._spans_processes
        if in_replica_context():
            raise ContextError(message(*STEP_IN_RUN))
        check_runnable(self.strategy, "Calling a step")
        if kwargs:
            raise ConfigurationError(
                message(
                    "A DiLoCo step takes the state and the batch arrays, positionally.",
                    received(keyword_arguments=sorted(kwargs)),
                    "close over constants (functools.partial) or pass them as batch arrays.",
                )
            )
        if jax.process_count() > 1 and spans_processes(self.strategy.mesh):
            # a batch wrong on one process is an error on every one
            leaves, data_def = jax.tree.flatten(data)
            key = (data_def, signature(leaves))
            if self._agreed.differs(key):
                self._agreed.agree(self.fn, data, key)
        position = self.position(state)
        data = self._place(data)
        programs = self.programs(state, data)
        state, metrics, done = programs.inner(state, data)
        self._bound_in_flight(done)
        position += 1
        for fragment in self.strategy.due(position):
            state = programs.sync[fragment](state)
        self._last = (state, position)
        return state if programs.returns == "state" else (state, *metrics)

    def _bound_in_flight(self, done: jax.Array) -> None:
        """On CPU, waits for the oldest call once `CPU_MAX_IN_FLIGHT` are queued: XLA:CPU's
        simulated devices share one thread pool, and many queued programs' collectives
        can starve each other's rendezvous and abort the process (as `Step` does)."""
        if not self._on_cpu:
            return
        self._in_flight.append(done)
        if len(self._in_flight) > CPU_MAX_IN_FLIGHT:
            self._in_flight.popleft().block_until_ready()

    def position(self, state: DiLoCoState) -> int:
        """The inner steps `state` has taken: known for the state the last call
        returned, else read from the device (once, after init or a restore)."""
        if not isinstance(state, DiLoCoState):
            raise ConfigurationError(
                message(
                    "A DiLoCo step takes the DiLoCoState that strategy.init (or a restore) made: "
                    "every island holds its own copy of your state.",
                    received(state=type(state).__name__),
                    "make the state with strategy.init(create_fn, key), or from existing "
                    "objects (an NNX model and optimizer, a pytree) with "
                    "state = strategy.put((model, optimizer)); the step then gets them as "
                    "objects in each island: state, loss = step(state, x, y).",
                )
            )
        if self._last is not None and state is self._last[0]:
            return self._last[1]
        leaves = jax.tree.leaves(state)
        if any(isinstance(x, jax.Array) and x.is_deleted() for x in leaves):
            raise ConfigurationError(
                message(
                    "A DiLoCo step donates its state: an earlier call used up this one.",
                    received(state="a DiLoCoState whose arrays were donated to an earlier call"),
                    "pass the state the last call returned: state, metrics = step(state, x, y).",
                )
            )
        islands = {np.shape(x)[0] if np.ndim(x) else None for x in jax.tree.leaves(state.islands)}
        if islands != {self.strategy.islands}:
            raise ConfigurationError(
                message(
                    f"This strategy's state holds {self.strategy.islands} islands (the leading "
                    "axis of every leaf of state.islands).",
                    received(leading_sizes=sorted(islands, key=str)),
                    "make the state with this strategy's init, or restore a checkpoint of "
                    "another island count with strategy.restore(manager, create_fn, key, "
                    "islands=saved_count).",
                )
            )
        step = state.step
        if isinstance(step, jax.Array):
            step = step.addressable_shards[0].data
        return int(np.asarray(step))

    def _place(self, data: tuple) -> tuple:
        """The batch as global arrays split over islands first, then an island's replicas."""
        synchronous = self.strategy.synchronous
        synchronous.check_batch(data)
        mesh, axes = synchronous.mesh, synchronous.batch_axes
        if jax.process_count() > 1:  # host data is every process's global value
            return put_batch(mesh, axes, data)
        return jax.tree.map(lambda x: conform(x, batch_sharding(mesh, axes, np.ndim(x))), data)

    def programs(self, state: DiLoCoState, data: tuple) -> _Programs:
        """The compiled programs for this state structure and batch form."""
        key = (jax.tree.structure(state), jax.tree.structure(data))
        key += (tuple(np.ndim(x) for x in jax.tree.leaves(data)),)
        found = self._programs.get(key)
        if found is None:
            found = self._programs[key] = _Programs(self, state, data)
        return found


class _Programs:
    """The jitted inner program and one sync program per fragment, for one state structure."""

    def __init__(self, step: IslandStep, state: DiLoCoState, data: tuple):
        strategy = step.strategy
        self.strategy, self.fn, self.gather = strategy, step.fn, step.gather_metrics
        self.returns: str | None = None
        self.sharding = strategy.state_sharding(state)
        batch = jax.tree.map(lambda x: strategy.synchronous.batch_sharding(np.ndim(x)), data)
        self.inner = jax.jit(self._inner, in_shardings=(self.sharding, batch), donate_argnums=(0,))
        positions, _ = strategy._params_of(jax.tree.structure(state.islands))
        fragments = strategy.fragment_leaves(len(positions))
        self.spread = [
            _spread(p.spec, x.shape, strategy.mesh)
            for p, x in zip(
                jax.tree.leaves(self.sharding.params), jax.tree.leaves(state.params), strict=True
            )
        ]
        self.sync = [
            jax.jit(
                functools.partial(self._sync, positions, frag, f),
                in_shardings=(self.sharding,),
                out_shardings=self.sharding,
                donate_argnums=(0,),
            )
            for f, frag in enumerate(fragments)
        ]

    def _inner(self, state: DiLoCoState, data: tuple) -> tuple[DiLoCoState, tuple, jax.Array]:
        strategy, k = self.strategy, self.strategy.islands
        # A 0-d leaf is replicated, as a step replicates it: every island sees it whole.
        split = jax.tree.map(
            lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]) if np.ndim(x) else x, data
        )
        specs = jax.tree.map(lambda x: P(ISLAND) if np.ndim(x) else P(), data)

        rows = {x.shape[0] // k for x in jax.tree.leaves(data) if np.ndim(x)}
        island = Island(strategy, k, min(rows) if rows else None)

        graphdef = strategy.graphdef(state)

        def per_island(islands: Any, batch: tuple) -> tuple[Any, tuple]:
            one = jax.tree.map(lambda x: x[0], islands)
            batch = jax.tree.map(lambda x: x[0] if np.ndim(x) else x, batch)
            live = one if graphdef is None else nnx_state.merge(graphdef, one)
            with island_context(island):  # the per-replica quantities are the island's
                out = self.fn(live, *batch)
            if graphdef is None:
                returns, new, metrics = _split_output(out, one, True)
            else:  # NNX objects updated in place: their arrays are the new state
                returns, new, metrics = "tuple", _nnx_arrays(graphdef, live), (out,)
            self.returns = returns
            return jax.tree.map(lambda x: x[None], (new, metrics))

        with strategy.layout.context(traced=True):
            islands, metrics = jax.shard_map(
                per_island,
                mesh=strategy.mesh,
                in_specs=(P(ISLAND), specs),
                out_specs=(P(ISLAND), P(ISLAND)),
                axis_names=frozenset({ISLAND}),
                check_vma=False,
            )(state.islands, split)
        new = state._replace(islands=islands, step=state.step + 1)
        new = jax.lax.with_sharding_constraint(new, self.sharding)
        where = P() if self.gather else P(ISLAND)
        metrics = jax.tree.map(
            lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(strategy.mesh, where)),
            metrics,
        )
        return new, metrics, jnp.zeros((), jnp.int8)  # a handle on 'this call finished'

    def _constrain(self, x: jax.Array, leaf: int, *outer: str) -> jax.Array:
        """Parameter `leaf` (or its per-island stack, `outer` = island) split as `_spread` says."""
        spec = PartitionSpec(*outer, *self.spread[leaf])
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.strategy.mesh, spec))

    def _sync(self, positions: tuple, fragment: tuple, index: int, state: DiLoCoState):
        """Averages one fragment's deltas over islands, steps the outer optimizer,
        and restarts every island's copy of the fragment from the new global values."""
        k = self.strategy.islands
        leaves, treedef = jax.tree.flatten(state.islands)
        params, params_def = jax.tree.flatten(state.params)
        current = [params[j] for j in fragment]
        local = [leaves[positions[j]] for j in fragment]
        # The outer gradient: global - island, averaged over islands by one all-reduce
        # that each device of an island runs on its own part of every leaf (`_spread`).
        grads = [
            self._constrain(jnp.mean(self._constrain(g[None] - x, j, ISLAND), axis=0), j)
            for j, g, x in zip(fragment, current, local, strict=True)
        ]
        # The outer optimizer sees the parameters' own tree (other fragments masked).
        current = fragment_tree(params_def, current, fragment)
        grads = fragment_tree(params_def, grads, fragment)
        updates, outer = self.strategy.outer_optimizer.update(grads, state.outer[index], current)
        new = jax.tree.leaves(optax.apply_updates(current, updates))
        for j, value in zip(fragment, new, strict=True):
            params[j] = value
            leaves[positions[j]] = jnp.broadcast_to(value, (k, *value.shape))
        outers = tuple(outer if i == index else o for i, o in enumerate(state.outer))
        return DiLoCoState(
            params_def.unflatten(params), outers, treedef.unflatten(leaves), state.step
        )


def _nnx_arrays(graphdef: Any, live: Any) -> Any:
    """The arrays of an island's NNX objects after its step, which kept their graph."""
    new_graphdef, new = nnx_state.split(live)
    if new_graphdef != graphdef:
        raise ConfigurationError(
            message(
                "A DiLoCo step over flax NNX objects keeps their structure: every island "
                "holds the same arrays, stacked.",
                received(changed="an attribute rebound, or a Variable added or removed"),
                "create every Variable in the module's __init__ (no lazy init, no sow "
                "kept in the state), and set flags outside the step.",
            )
        )
    return new


def _spread(spec: PartitionSpec, shape: tuple[int, ...], mesh: Any) -> PartitionSpec:
    """A leaf's spec inside an island, also split over the island's axes it leaves free.

    The sync's all-reduce across islands then carries 1/n of the leaf from each
    of an island's n devices (XLA gathers the result back inside the island),
    not the whole leaf from every device. The free axes go on the leaf's
    largest dimension they divide, the outermost dropped until one does.
    """
    used = {a for entry in spec if entry for a in (entry if isinstance(entry, tuple) else (entry,))}
    free = [a for a in mesh.axis_names if a not in used | {ISLAND} and mesh.shape[a] > 1]
    entries = list(spec) + [None] * (len(shape) - len(spec))
    while free:
        size = math.prod(mesh.shape[a] for a in free)
        dims = [i for i, e in enumerate(entries) if e is None and shape[i] % size == 0]
        if dims:
            entries[max(dims, key=lambda i: shape[i])] = tuple(free)
            break
        free = free[1:]
    return PartitionSpec(*entries)


def explain_islands(step: IslandStep, state: Any, *data: Any) -> IslandsExplanation:
    """What `step`'s programs cost, and the bytes that cross between islands (see `DiLoCo.explain`)."""
    strategy = step.strategy
    strategy.synchronous.check_batch(data)  # the islands' and replicas' split, as a step checks
    sizes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), data)
    batches = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=strategy.synchronous.batch_sharding(len(x.shape))
        ),
        sizes,
    )
    sized = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s),
        state,
        strategy.state_sharding(state),
    )
    programs = _Programs(step, sized, batches)
    name, devices = repr(strategy), list(strategy.mesh.devices.flat)
    inner = explain_traced(name, programs.inner.trace(sized, batches), sized, batches, devices)
    sync = tuple(explain_traced(name, p.trace(sized), sized, (), devices) for p in programs.sync)
    user = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), sized.islands)
    user = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        user,
        strategy.synchronous.state_sharding(user),
    )
    synchronous = strategy.synchronous.explain(step.fn, user, *sizes)
    islands = strategy.islands
    sync_crossing: dict[str, Any] = {}
    for report in sync:
        for kind, c in crossing(report.hlo, islands, devices).items():
            old = sync_crossing.get(kind)
            sync_crossing[kind] = (
                c if old is None else type(c)(kind, old.count + c.count, old.bytes + c.bytes)
            )
    return IslandsExplanation(
        inner=inner,
        sync=sync,
        synchronous=synchronous,
        sync_every=strategy.sync_every,
        inner_crossing=crossing(inner.hlo, islands, devices),
        sync_crossing=sync_crossing,
        synchronous_crossing=crossing(synchronous.hlo, islands, devices),
    )
