"""The Strategy value: a mesh, state rules, batch axes and a placement."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, overload

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from spmd._src.data.dataset import (
    distribute_dataset,
    distribute_datasets_from_function,
    make_numpy_dataset,
)
from spmd._src.errors import BatchError, ConfigurationError, ScopeError, message, received
from spmd._src.explain import explain
from spmd._src.logical import LogicalRules, check_rules, flax_context
from spmd._src.placement import batch_sharding, put_batch
from spmd._src.rules import Rule, is_key, path_str, resolve_sources, resolve_specs
from spmd._src.strategy import nnx_state, per_replica, step_checks
from spmd._src.strategy.checks import (
    check_batch_axis,
    check_donate,
    check_host_memory,
    check_rule,
    check_rules_list,
    static_names,
    warn_if_one_process_of_many,
)
from spmd._src.strategy.offload import check_offload, offloaded
from spmd._src.strategy.replica import (
    ReduceOp,
    current_strategy,
    in_cross_replica_context,
    running_strategy,
)
from spmd._src.strategy.state_placement import own_buffers, place_state
from spmd._src.strategy.step import CPU_MAX_IN_FLIGHT, Step
from spmd._src.strategy.step_checks import COMPARE_BATCH_EVERY
from spmd._src.strategy.step_records import spans_processes
from spmd._src.topologies import check_runnable, eager_refused
from spmd._src.validate import non_negative_int

if TYPE_CHECKING:
    from spmd._src.data.dataset import DistributedDataset, InputContext, InputOptions, NumpyDataset

__all__ = [
    "CPU_MAX_IN_FLIGHT",
    "ScopeError",
    "Step",
    "Strategy",
    "check_sizes",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
]

Placement = Literal["device", "host", "offload_optimizer"]


# The memory kind of the state between steps; with "offload_optimizer", that of the
# leaves it keeps on the devices (the optimizer's are in pinned_host).
_MEMORY_KIND = {"device": "device", "host": "pinned_host", "offload_optimizer": "device"}


def check_sizes(data: Any, name: str = "batch") -> None:
    """Raises where a leaf of a batch has a negative size, which only an abstract batch
    (`jax.ShapeDtypeStruct`) can have.

    Raises:
      BatchError: naming each such leaf (its path under `name`) and its shape.
    """
    if all(min(np.shape(x), default=0) >= 0 for x in jax.tree.leaves(data)):
        return  # every call's path: the paths are read only to name what is wrong
    negative = {
        f"{name}{jax.tree_util.keystr(path)}": tuple(np.shape(x))
        for path, x in jax.tree_util.tree_flatten_with_path(data)[0]
        if min(np.shape(x), default=0) < 0
    }
    raise BatchError(
        message(
            "Every size of a batch leaf's shape is 0 or more (the global batch's shape).",
            received(negative_shapes=negative),
            "give the global batch's own shape, e.g. "
            "jax.ShapeDtypeStruct((1024, 2048), jnp.int32).",
        )
    )


@dataclass(frozen=True)
class Strategy:
    """How a program is spread over devices: a mesh, state rules, batch axes, placement.

    Every named strategy (`MirroredStrategy`, `ParameterServerStrategy`, ...)
    is a constructor of this value; build one directly for any other layout.

    Attributes:
      mesh: the devices, as a `jax.sharding.Mesh` with named axes.
      rules: ordered (regex, spec) rules over '/'-joined state paths; the first
        match wins. A spec is a `PartitionSpec`, None (replicate) or a
        partitioner from `spmd.partitioners`. A leaf no rule or flax annotation
        lays out keeps the sharding it arrives with (an unboxed linen state, as
        MaxText's `setup_initial_state` returns it), read by its mesh axis
        names; a leaf sharded over axes this mesh lacks is an error; the rest
        are replicated. (The named strategies lay every leaf out their own way.)
      batch_axes: the mesh axes the leading axis of every batch is split over;
        their devices are the data-parallel replicas. The first axis by default.
      placement: where the state lives between steps: "device" memory;
        "host" memory (`pinned_host`), the whole state moved to the devices
        at the start of each step; or "offload_optimizer": the optimizer's
        leaves in `pinned_host` and the rest on the devices, each optimizer
        leaf moved in where the update needs it and back out as soon as it is
        updated, so that the device holds a slice of the optimizer state at a
        time (see docs/guide.md). Typed PRNG key arrays (e.g. an `nnx.Rngs`
        or Dropout's key in the state), which jax cannot keep in
        `pinned_host`, stay in device memory, as do scalars with
        "offload_optimizer".
      strict: if True, a state leaf that no rule or annotation covers is an error.
      name: shown in reprs and by `spmd env`.
      logical_axis_rules: (logical name, mesh axes or None) pairs that map the
        names of flax annotations (`nnx.with_partitioning`, linen's
        `nn.with_logical_partitioning` boxes) to mesh axes; a name equal to a
        mesh axis maps to it. Names neither mapped nor mesh axes are an error
        listing them all (the named strategies replicate them instead); a rule
        `(spmd.logical.REST, None)` replicates every name the others do not map.
      offload: with placement="offload_optimizer", the leaves to keep in host
        memory: a regex or a non-empty list of regexes over '/'-joined state paths,
        matched as a rule's regex (the whole path or a '/'-suffix of it), e.g.
        `r"opt/.*"`, or `r"opt/.*/nu/.*"` for Adam's second moment alone. None: the optimizer state, found as the
        leaves under an `opt_state` entry (spmd.Trainer's state, flax's
        TrainState, `nnx.Optimizer`) or inside an optax state (`tx.init(...)`
        anywhere in a pytree state).

    Example:
      >>> strategy = spmd.Strategy(
      ...     mesh=spmd.make_mesh({"data": -1, "model": 2}),
      ...     rules=[(r".*/kernel", P(None, "model"))],
      ...     batch_axes=("data",))
      >>> offloaded = spmd.Strategy(spmd.make_mesh({"fsdp": -1}), rules=fsdp_rules,
      ...     placement="offload_optimizer")  # Adam's moments in host memory
    """

    mesh: Mesh
    rules: Sequence[Rule] = ()
    batch_axes: Sequence[str] | None = None
    placement: Placement = "device"
    strict: bool = False
    name: str = "Strategy"
    logical_axis_rules: LogicalRules = ()
    offload: str | Sequence[str] | None = None
    _replicate_unmapped: bool = field(default=False, repr=False)

    def __post_init__(self):
        if not isinstance(self.mesh, Mesh):
            raise ConfigurationError(
                message(
                    "A Strategy is built on a jax.sharding.Mesh.",
                    received(mesh=self.mesh, type=type(self.mesh).__name__),
                    'pass spmd.make_mesh({"data": -1}) (or jax.make_mesh), or use a named '
                    "strategy such as spmd.MirroredStrategy().",
                )
            )
        object.__setattr__(self, "rules", check_rules_list(self.rules))
        rules = check_rules(self.logical_axis_rules, self.mesh)
        object.__setattr__(self, "logical_axis_rules", rules)
        axes = self.mesh.axis_names[:1] if self.batch_axes is None else self.batch_axes
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        object.__setattr__(self, "batch_axes", axes)
        unknown = [a for a in axes if a not in self.mesh.shape]
        if unknown or len(set(axes)) != len(axes):
            raise ConfigurationError(
                message(
                    "batch_axes must name axes of the mesh.",
                    received(batch_axes=axes, mesh_axes=self.mesh.axis_names),
                    f"choose among {self.mesh.axis_names}, each at most once.",
                )
            )
        for rule in self.rules:
            check_rule(rule, self.mesh)
        step_checks.register(self)
        if self.placement not in _MEMORY_KIND:
            raise ConfigurationError(
                message(
                    f"placement is one of {tuple(_MEMORY_KIND)}.",
                    received(placement=self.placement),
                    'pass placement="device", "host" or "offload_optimizer".',
                )
            )
        object.__setattr__(self, "offload", check_offload(self.offload, self.placement) or None)
        if self.placement != "device":
            check_host_memory(self.mesh, self.placement)
        warn_if_one_process_of_many(self.mesh, self.name)

    # -- what the strategy is -------------------------------------------------

    @property
    def num_replicas_in_sync(self) -> int:
        """The number of data-parallel replicas: the size of the batch axes, over all hosts."""
        return math.prod(self.mesh.shape[a] for a in self.batch_axes)

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        """Every device of the mesh, in mesh order."""
        return tuple(self.mesh.devices.flat)

    @property
    def memory_kind(self) -> str:
        """The memory kind the state lives in between steps ("device" or "pinned_host").

        With placement="offload_optimizer", that of the leaves kept on the
        devices; `state_sharding` gives each leaf's own.
        """
        return _MEMORY_KIND[self.placement]

    def __repr__(self) -> str:
        mesh = ", ".join(f"{k}={v}" for k, v in self.mesh.shape.items())
        return f"{self.name}(mesh=({mesh}), batch_axes={self.batch_axes}, placement={self.placement!r})"

    # -- scope ----------------------------------------------------------------

    @contextlib.contextmanager
    def scope(self) -> Iterator[Strategy]:
        """Makes this the current strategy (`spmd.get_strategy()`) and sets the mesh context.

        Raises:
          ConfigurationError: another strategy's scope is already open, or
            (on an abstract `spmd.topology`) code inside ran a computation
            eagerly: build the state with `abstract_state` or `nnx.eval_shape`.
        """
        current = current_strategy()
        if current is not None and current != self:
            raise ScopeError(
                message(
                    "Strategy scopes do not nest: one strategy at a time.",
                    received(open_scope=current, new_scope=self),
                    "leave the open scope before entering another strategy's scope.",
                )
            )
        with running_strategy(self), self.context(), eager_refused(self):
            yield self

    @contextlib.contextmanager
    def context(self, *, traced: bool = False) -> Iterator[None]:
        """The mesh and flax's context, as model code runs in `init` and in a step.

        The mesh is set (`jax.set_mesh`; its abstract mesh when `traced`, inside
        jit), flax's logical axis rules are the strategy's, and flax variables
        are created unplaced: the strategy lays them out by its rules and their
        annotations.
        """
        mesh = (
            jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh)
            if traced
            else jax.set_mesh(self.mesh)
        )
        with mesh, flax_context(self.logical_axis_rules):
            yield

    # -- state ----------------------------------------------------------------

    def state_spec(self, tree: Any, *, sources: bool = False) -> Any:
        """The `PartitionSpec` of every leaf of a state (arrays or `ShapeDtypeStruct`s).

        Args:
          tree: the state, or flax NNX objects (whose annotations are read).
          sources: if True, each leaf is a record with `.spec` and `.source`
            instead: the spec and where it came from ("rule '<regex>'",
            "annotation (...)", "partitioner (rule '<regex>')", "placed sharding"
            or "default").
        """
        pure = nnx_state.pure(tree)
        shard_axes = tuple((a, self.mesh.shape[a]) for a in reversed(self.batch_axes))
        options = {
            "shard_axes": shard_axes,
            "logical_axis_rules": self.logical_axis_rules,
            "replicate_unmapped": self._replicate_unmapped,
            "keep_placed": self._keeps_placed,
        }
        if sources:
            return resolve_sources(pure, self.rules, self.mesh, **options)
        return resolve_specs(pure, self.rules, self.mesh, strict=self.strict, **options)

    def state_sharding(self, tree: Any) -> Any:
        """The `NamedSharding` of every leaf of a state, with the strategy's memory kind.

        Args:
          tree: a pytree of arrays or `ShapeDtypeStruct`s, or flax NNX objects
            (the result then mirrors `nnx.state(tree)`).

        Returns:
          A pytree of `NamedSharding`.
        """
        pure = nnx_state.pure(tree)
        leaves, treedef = jax.tree.flatten(pure)
        specs = treedef.flatten_up_to(self.state_spec(pure))
        kinds = self._memory_kinds(pure, leaves)
        return treedef.unflatten(
            [NamedSharding(self.mesh, s, memory_kind=k) for s, k in zip(specs, kinds, strict=True)]
        )

    @property
    def _keeps_placed(self) -> bool:
        """Whether a leaf no rule or annotation lays out keeps the sharding it carries.

        A `Strategy` built directly does; a named strategy (`MirroredStrategy`,
        `ParameterServerStrategy`, ...) lays every leaf out by its own policy.
        """
        return not self._replicate_unmapped

    def _memory_kinds(self, pure: Any, leaves: list) -> list[str]:
        """Each leaf's memory kind: the placement's; PRNG keys (refused by `pinned_host`)
        stay on device; with "offload_optimizer", the offloaded leaves are in `pinned_host`."""
        if self.placement == "offload_optimizer":
            host = offloaded(pure, self.offload or ())
            return ["pinned_host" if h else "device" for h in host]
        if self.placement == "host":
            return ["device" if is_key(leaf) else "pinned_host" for leaf in leaves]
        return ["device"] * len(leaves)

    def put(self, tree: Any) -> Any:
        """Places an existing state per the rules. NNX objects are updated in place.

        Leaves are laid out as `state_spec` says: by a rule, a flax annotation
        (linen boxes included) or a partitioner; on a `Strategy` built directly,
        a leaf none of them covers keeps the sharding it carries (the unboxed
        state MaxText's `setup_initial_state` returns keeps its layout), always
        in the strategy's memory kind.

        With several processes, a leaf each process holds whole (numpy data, or
        an array on its own devices, as a model built outside `scope()` has) is
        taken as the global value; the processes check, by fingerprint, that
        they hold the same (a `ConfigurationError` naming the leaf if not).

        Every placed leaf owns its device memory: leaves that would share a
        buffer (one array at two paths, e.g. `{"params": p, "ema": p}`, or an
        optimizer state whose `init` returns the parameters) are each given a
        copy, so that a step can donate the state.

        Like `jax.device_put`, a placed leaf may keep the buffer of the leaf it
        came from (an array already laid out so, or the shard of a replicated
        layout on the array's own device): a step that donates the placed
        state then deletes that input array too. Place a copy
        (`jax.tree.map(jnp.copy, tree)`) to keep using the input.

        Raises:
          ConfigurationError: a leaf is not an array or number of a numeric
            dtype (a string, an object), a leaf none of them covers is sharded
            over mesh axes this strategy's mesh lacks, or the processes hold
            different values of a leaf they each hold whole.
        """
        check_runnable(self, "put")
        pure = nnx_state.pure(tree)
        step_checks.check_leaf_types(self, pure)
        placed = place_state(pure, self.state_sharding(pure))
        return nnx_state.replace(tree, placed)

    def init(self, create_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Creates a state in place: `create_fn` runs under jit, its leaves come out sharded.

        No leaf is ever materialised whole on one device: the compiler creates
        each shard where it lives.

        Args:
          create_fn: builds the state (a pytree, or flax NNX objects) from `args`.
            Flax linen boxes in it (`nn.LogicallyPartitioned`) are kept and
            lay their leaves out.
          *args: passed to `create_fn`: arrays (e.g. a PRNG key) traced; an
            argument that is not one (a linen Module, an optax transformation)
            as it is, as `jax.jit`'s `static_argnums` would pass it.
          **kwargs: passed to `create_fn` as Python values, fixed at trace time.

        Returns:
          The state, placed per the strategy's rules; each leaf owns its device
          memory (a value `create_fn` returns at two paths is copied, as `put` does).

        Raises:
          ConfigurationError: `create_fn` returns a leaf that is not an array or
            number (a name, a config), naming its path.
        """
        check_runnable(self, "init")
        create_fn, args = bind_static(create_fn, args)
        graph, pure_create = _pure_create(self, create_fn, kwargs)
        with self.context():
            abstract = self._trace_create(pure_create, args)
            out = jax.jit(pure_create, out_shardings=self.state_sharding(abstract))(*args)
        leaves, treedef = jax.tree.flatten(out)  # an argument returned twice: one buffer
        return nnx_state.merge(graph["def"], treedef.unflatten(own_buffers(leaves)))

    def abstract_state(self, create_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """The state `init(create_fn, ...)` would make, as `ShapeDtypeStruct`s with shardings.

        Nothing is computed or allocated. Use it as a checkpoint restore target
        or to read a strategy's layout before paying for it. NNX objects come
        back as abstract NNX objects.
        """
        create_fn, args = bind_static(create_fn, args)
        graph, pure_create = _pure_create(self, create_fn, kwargs)
        with self.context():
            abstract = self._trace_create(pure_create, args)
        placed = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            abstract,
            self.state_sharding(abstract),
        )
        return nnx_state.merge(graph["def"], placed)

    def _trace_create(self, pure_create: Callable[..., Any], args: tuple) -> Any:
        """The abstract state `pure_create` makes; no layout its boxes asked for is lost.

        A leaf that comes straight out of a sharding constraint that shards it
        (`create_fn` unboxed flax linen boxes itself: `nn.meta.unbox` constrains
        each leaf to its box's layout) carries that layout, which a `Strategy`
        built directly keeps where no rule or annotation lays the leaf out.

        Raises:
          ConfigurationError: on a named strategy, such a leaf would come out
            replicated (no rule or annotation lays it out).
        """
        closed, abstract = jax.make_jaxpr(pure_create, return_shape=True)(*args)
        asked = _constrained_outputs(closed.jaxpr)
        if not asked:
            return abstract
        if self._keeps_placed:
            leaves, treedef = jax.tree.flatten(abstract)
            for index, spec in asked.items():
                sharding = NamedSharding(self.mesh, spec)
                leaf = leaves[index]
                leaves[index] = jax.ShapeDtypeStruct(
                    leaf.shape, leaf.dtype, sharding=sharding, weak_type=leaf.weak_type
                )
            return treedef.unflatten(leaves)
        flat = jax.tree_util.tree_flatten_with_path(abstract)[0]
        layouts = jax.tree.leaves(self.state_spec(abstract, sources=True))
        for index, spec in asked.items():
            if layouts[index].source == "default":
                raise ConfigurationError(
                    message(
                        f"{self.name} lays a state leaf out by a rule or a flax annotation; "
                        "this one comes out of create_fn through a sharding constraint (what "
                        "nn.meta.unbox applies to a linen box it unboxes), which it does not "
                        "keep, so it would come out replicated.",
                        received(leaf=path_str(flat[index][0]), unboxed_constraint=spec),
                        "return the boxed state from create_fn (spmd keeps the boxes, and "
                        "flax's apply reads through them), add a rule for the path, or use "
                        "spmd.Strategy(mesh, ...), which keeps the layout an unboxed leaf "
                        "comes with.",
                    )
                )
        return abstract

    # -- batches --------------------------------------------------------------

    def batch_sharding(self, ndim: int = 1, axis: int = 0) -> NamedSharding:
        """The sharding of a batch leaf of rank `ndim`: its batch `axis` over the batch axes.

        `axis` is 0 for plain batches, 1 for K batches stacked for one call.
        """
        # One object per (mesh, batch axes, ndim, axis), from placement's one cache:
        # the placed batches carry the very sharding the step's program expects,
        # which its fast path checks by identity.
        return batch_sharding(self.mesh, self.batch_axes, ndim, axis)

    @functools.cached_property
    def _spans_processes(self) -> bool:
        """Whether the mesh holds devices of several processes (its steps' collectives wait
        for each of them): what the hang watch's `SHARED` counts."""
        return spans_processes(self.mesh)

    @functools.cached_property
    def replicated(self) -> NamedSharding:
        """A sharding that keeps one full copy on every device of the mesh."""
        return NamedSharding(self.mesh, PartitionSpec())

    def check_batch(self, data: Any, axis: int = 0, names: Sequence[str] | None = None) -> None:
        """Checks that every batch leaf splits evenly over the replicas along `axis`.

        Args:
          data: the batch: a pytree, or a tuple of a program's data arguments.
          axis: the batch axis.
          names: the names of `data`'s entries (a step's own argument names),
            which an error about their sizes uses.

        Raises:
          BatchError: leading sizes differ between leaves, or do not divide by
            `num_replicas_in_sync`.
        """
        check_sizes(data)
        sizes = {np.shape(x)[axis] for x in jax.tree.leaves(data) if np.ndim(x) > axis}
        if 0 in sizes:
            raise BatchError(
                message(
                    "A batch holds at least one example (a loss over no rows is NaN).",
                    received(leading_sizes=sorted(sizes), axis=axis),
                    "skip empty batches before the step (an input pipeline with "
                    "drop_remainder, or `if len(x):`).",
                )
            )
        if len(sizes) > 1:
            raise BatchError(_ragged_batch_message(data, axis, names, sizes))
        if sizes and (size := sizes.pop()) % self.num_replicas_in_sync:
            raise BatchError(
                message(
                    f"The global batch must split evenly over the {self.num_replicas_in_sync} "
                    "replicas.",
                    received(
                        global_batch_size=size, num_replicas_in_sync=self.num_replicas_in_sync
                    ),
                    f"use a global batch size that is a multiple of {self.num_replicas_in_sync} "
                    f"(e.g. {_round_up(size, self.num_replicas_in_sync)}), or drop/pad the last batch.",
                )
            )

    def distribute_batch(self, batch: Any, axis: int = 0) -> Any:
        """Makes a global batch (numpy or jax) into global jax.Arrays split over the replicas.

        With several processes every process passes the same global batch and
        each places only the rows its devices hold.

        Args:
          batch: a pytree of arrays whose `axis` is the global batch.
          axis: the batch axis (1 for K batches stacked for one call).
        """
        check_runnable(self, "distribute_batch")
        self.check_batch(batch, axis)
        return put_batch(self.mesh, self.batch_axes, batch, axis)

    def distribute_dataset(
        self, dataset: Iterable[Any], options: InputOptions | None = None
    ) -> DistributedDataset:
        """Each global batch of `dataset` as global jax.Arrays over the replicas.

        Returns a `spmd.DistributedDataset`; `options` is a `spmd.InputOptions`
        (sharding policy, padding, prefetch). See docs/input.md.
        """
        check_runnable(self, "distribute_dataset")
        return distribute_dataset(self, dataset, options)

    def distribute_datasets_from_function(
        self,
        dataset_fn: Callable[[InputContext], Iterable[Any]],
        options: InputOptions | None = None,
    ) -> DistributedDataset:
        """Each process's batches from `dataset_fn(spmd.InputContext)`, as global jax.Arrays.

        `dataset_fn` builds this process's pipeline, reading its own share of the
        data (`input_pipeline_id` of `num_input_pipelines`) in batches of
        `ctx.get_per_pipeline_batch_size(global_batch_size)` rows. See
        docs/input.md.
        """
        check_runnable(self, "distribute_datasets_from_function")
        return distribute_datasets_from_function(self, dataset_fn, options)

    def make_numpy_dataset(
        self,
        arrays: Any,
        batch_size: int,
        *,
        shuffle: bool = False,
        seed: int = 0,
        drop_remainder: bool = True,
    ) -> NumpyDataset:
        """In-memory arrays as a `spmd.NumpyDataset` of global batches, for `distribute_dataset`.

        See docs/input.md.
        """

        return make_numpy_dataset(
            self, arrays, batch_size, shuffle=shuffle, seed=seed, drop_remainder=drop_remainder
        )

    # -- the step -------------------------------------------------------------

    @overload
    def step(self, fn: Callable[..., Any], /) -> Step: ...

    @overload
    def step(
        self,
        *,
        donate: bool | None = None,
        static_argnames: Sequence[str] = (),
        batch_axis: int = 0,
        compare_batch_every: int = COMPARE_BATCH_EVERY,
    ) -> Callable[[Callable[..., Any]], Step]: ...

    def step(
        self,
        fn=None,
        /,
        *,
        donate=None,
        static_argnames=(),
        batch_axis=0,
        compare_batch_every=COMPARE_BATCH_EVERY,
    ):
        """Compiles a train step with the strategy's shardings: `@strategy.step`.

        The first argument is the state: placed by the rules, donated (a pytree
        state by default; NNX state only with `donate=True`) and returned in the
        same layout. Every other positional
        argument is data, split along its leading axis over the batch axes.
        Keyword arguments are replicated (static if named in `static_argnames`).
        Everything the step returns besides the state comes back replicated.
        NNX objects in the state are updated in place, as `nnx.jit` does.

        Args:
          fn: `fn(state, *data, **kwargs)`, returning `(state, metrics)`, the
            state alone, or (for NNX state updated in place) the metrics.
          donate: let XLA reuse the input state's buffers for the output. None
            (default): a pytree state is donated, NNX state is not (as `nnx.jit`:
            an `nnx.clone` of the model shares its arrays); True donates both.
          static_argnames: keyword arguments that are compile-time constants: a
            name or a sequence of names, as `jax.jit` takes them.
          batch_axis: the axis of the data split over the replicas: 0, or 1 when
            the data holds several batches stacked for one call (a scan).
          compare_batch_every: with several processes, a numpy batch is each
            process's claim to be the whole global batch; the processes compare
            a fingerprint of it at each new batch signature and every this many
            calls in between (1: every call; 0: never). A mismatch is a
            `BatchError` on every process. jax.Arrays are not compared.

        Returns:
          A `Step`, callable like `fn`. Used bare or with arguments.

        Raises:
          ConfigurationError: `donate` is not a bool, a static name is not a
            string, `batch_axis` is not 0 or 1, or `compare_batch_every` is not
            an integer >= 0.
        """
        options = {
            "donate": check_donate(donate),
            "static_argnames": static_names(static_argnames),
            "batch_axis": check_batch_axis(batch_axis),
            "compare_batch_every": non_negative_int(
                compare_batch_every,
                "compare_batch_every",
                fix="pass compare_batch_every=1 to compare every call's batch across "
                f"processes, 0 never to, or leave the default ({COMPARE_BATCH_EVERY}).",
            ),
        }
        if fn is None:
            return lambda f: Step(self, f, **options)
        return Step(self, fn, **options)

    def explain(self, step_fn: Callable[..., Any] | Step, state: Any, *data: Any, **kwargs: Any):
        """Compiles a step without running it and reports its cost per device.

        Bytes of state, batch and temporaries, the collectives XLA inserted
        (count and bytes of each kind) and the FLOPs XLA estimates, so that a
        strategy can be chosen before paying for it.

        Args:
          step_fn: a step function, or a `Step` from `strategy.step`.
          state: the state, placed or abstract (`strategy.abstract_state(...)`).
          *data: batches, as arrays or `jax.ShapeDtypeStruct`s of the global batch.
          **kwargs: the step's keyword arguments.

        Returns:
          An `spmd.Explanation`; `print()` it for a table.

        Example:
          >>> print(strategy.explain(train_step, strategy.abstract_state(create, key), x, y))
        """

        if isinstance(step_fn, Step):
            step = (
                step_fn
                if step_fn.strategy == self
                else self.step(
                    step_fn.fn,
                    donate=step_fn.donate,
                    static_argnames=step_fn.static_argnames,
                    batch_axis=step_fn.batch_axis,
                )
            )
        else:
            step = self.step(step_fn)
        return explain(step, state, *data, **kwargs)

    # -- the per-replica view -------------------------------------------------

    def run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: dict | None = None,
        axis_name: str | None = None,
    ):
        """Runs `fn` once per replica, each on its slice of the data (`shard_map`).

        Positional arguments are split along their leading axis over the
        replicas, and a `PerReplica` gives each replica its own value; keyword
        arguments are replicated. A value that is not an array or a number (a
        bool, a string, a function) reaches `fn` as it is, a compile-time
        constant, as tf.distribute passes Python values. With several processes
        a call whose argument signature differs from the previous call's agrees
        on it with every process first, as a step does. Inside `fn`, `spmd.get_replica_context()`
        gives the replica's id and collectives, `spmd.get_strategy()` is this
        strategy and `spmd.in_cross_replica_context()` is False. Works eagerly
        and inside a step. One program is compiled per function code and
        captured values, so `run(lambda ...)` in a loop compiles once.

        Args:
          fn: `fn(*replica_args, **kwargs)`, returning a pytree of arrays.
          args: the distributed arguments.
          kwargs: replicated arguments.
          axis_name: a name of your own for the replicas, as `jax.pmap`'s
            `axis_name`: collectives in `fn` over it (`lax.psum(x, "batch")`,
            `lax.pmean`, `lax.axis_index`, `nn.BatchNorm(axis_name="batch")`)
            run over every replica, so a pmap program ports with no edit.
            None: the strategy's batch axes, which `get_replica_context()`'s
            collectives use either way.

        Returns:
          `fn`'s result structure with a `PerReplica` at each leaf, as
          tf.distribute returns it: `a, b = strategy.run(fn, ...)` works.

        Raises:
          ConfigurationError: a Python value passed to `fn` is not hashable.
          BatchError: with several processes, their argument signatures differ.

        Example:
          >>> loss, grads = strategy.run(replica_fn, args=(x, y))
          >>> strategy.reduce("SUM", loss)
        """
        if not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((args, kwargs))):
            check_runnable(self, "strategy.run")  # eager; inside a step it is compiled with it
        return per_replica.run(self, fn, args, kwargs, axis_name)

    def reduce(self, op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        """Combines per-replica values over the replicas.

        Args:
          op: "SUM" or "MEAN" (or MAX, MIN).
          value: a `PerReplica`, or a structure (tuple, dict, ...) of them, as
            `run` returns. A plain value in one process is already global and
            only reduced along `axis`; with several processes a plain value is
            this process's own and is reduced over the processes, as
            tf.distribute's MultiWorkerMirroredStrategy does (`reduce("SUM",
            1.0)` on 2 workers is 2.0).
          axis: None reduces across replicas only; an int (negative counts
            from the end) also reduces along that axis of each replica's value
            (MEAN then averages over every element of the global batch, as
            tf.distribute does).

        Returns:
          The reduced value, in `value`'s structure.

        Raises:
          ConfigurationError: `op` is unknown, or `axis` is not an axis of the values.
          BatchError: with several processes, their plain values differ in shape
            or dtype (on every process, checked by one small all-gather).
        """
        return per_replica.reduce(ReduceOp.parse(op), value, axis, self)

    def local_results(self, value: Any) -> tuple[Any, ...]:
        """The values of this process's replicas, one per local replica, in replica order.

        `value` may be a `PerReplica` or a structure of them; each item of the
        result has that structure. A plain value gives `(value,)`.
        """
        return per_replica.local_results(value)

    experimental_local_results = local_results

    def gather(self, value: Any, axis: int = 0) -> Any:
        """Concatenates every replica's value along `axis` (a structure of them too).

        With several processes the result is replicated, so every process can
        read it (`np.asarray`), as it can a `reduce`'s.
        """
        return per_replica.gather(value, axis, self)


def _ragged_batch_message(data: Any, axis: int, names: Sequence[str] | None, sizes: set) -> str:
    """Says which of a program's arguments have which batch sizes, by their own names."""
    entries = list(data) if isinstance(data, tuple | list) else [data]
    if names is None or len(names) != len(entries):
        names = [f"argument {i}" for i in range(len(entries))]
    by_name = {
        name: sorted({np.shape(x)[axis] for x in jax.tree.leaves(entry) if np.ndim(x) > axis})
        for name, entry in zip(names, entries, strict=True)
    }
    by_name = {name: s[0] if len(s) == 1 else s for name, s in by_name.items() if s}
    shown = list(by_name) if len(by_name) > 1 else ["every leaf"]
    return message(
        "Every batch array must have the same leading (batch) size.",
        # An argument called `leading_sizes` shows its own sizes under its name.
        received(**{"leading_sizes": sorted(sizes), **{str(k): v for k, v in by_name.items()}}),
        f"make {' and '.join(shown) if len(shown) <= 2 else ', '.join(shown)} the same length; "
        "pass arrays that are not batches by keyword, where they are replicated.",
    )


def _constrained_outputs(jaxpr: Any) -> dict[int, PartitionSpec]:
    """Outputs of a traced function that come straight out of a sharding constraint that
    shards something (what `nn.meta.unbox` of a linen box applies), by output index."""
    specs = {}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "sharding_constraint":
            spec = getattr(eqn.params["sharding"], "spec", PartitionSpec())
            if any(entry is not None for entry in spec):
                specs[id(eqn.outvars[0])] = spec
    return {i: specs[id(v)] for i, v in enumerate(jaxpr.outvars) if id(v) in specs}


def _pure_create(
    strategy: Strategy, create_fn: Callable[..., Any], kwargs: dict
) -> tuple[dict, Callable]:
    """`create_fn` as a function of arrays only; its NNX graph, once traced, in graph["def"].

    A leaf it returns that is not an array (a name, a config) is a
    ConfigurationError naming its path (`step_checks.check_leaf_types`)."""
    graph: dict = {}

    def pure_create(*args: Any) -> Any:
        graph["def"], pure = nnx_state.split(create_fn(*args, **kwargs))
        step_checks.check_leaf_types(strategy, pure)
        return pure

    return graph, pure_create


def bind_static(create_fn: Callable[..., Any], args: tuple) -> tuple[Callable[..., Any], tuple]:
    """`create_fn` with its positional arguments that are not arrays bound in place.

    `init(create, key, model, tx)` (flax's guide: `jax.jit(init_fn, static_argnums=...)`)
    passes a linen Module or an optax transformation as it is, as a static
    argument; the arrays among `args` (a PRNG key, a sample batch) stay traced.
    An argument is an array when every leaf of it is an array, a number or a
    `jax.ShapeDtypeStruct`.

    Returns:
      (a function of the traced arguments, the traced arguments).
    """
    static = {i: a for i, a in enumerate(args) if not _all_arrays(a)}
    if not static:
        return create_fn, tuple(args)
    traced = tuple(a for i, a in enumerate(args) if i not in static)
    count = len(args)

    def bound(*arrays: Any, **kwargs: Any) -> Any:
        it = iter(arrays)
        return create_fn(*(static[i] if i in static else next(it) for i in range(count)), **kwargs)

    return bound, traced


def _all_arrays(value: Any) -> bool:
    return all(
        isinstance(
            x, jax.Array | jax.ShapeDtypeStruct | np.ndarray | np.generic | int | float | complex
        )
        for x in jax.tree.leaves(value)
    )


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@functools.cache
def _default_strategy() -> Strategy:
    device = jax.local_devices()[0]
    mesh = Mesh(np.asarray([device], dtype=object), ("replica",))
    return Strategy(mesh, batch_axes=(), name="DefaultStrategy", _replicate_unmapped=True)


def get_strategy() -> Strategy:
    """The strategy of the innermost open `scope()` (or running `run`), else the default.

    The default strategy is plain `jax.jit` on the default device: one replica,
    nothing split, nothing sharded.
    """
    return current_strategy() or _default_strategy()


def has_strategy() -> bool:
    """Whether a (non-default) strategy's scope is open, or its `run` is running."""
    return current_strategy() is not None
