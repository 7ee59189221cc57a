"""The compiled train step: `Strategy.step`'s program, its cache and its fast path."""

from __future__ import annotations

import collections
import functools
import operator
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from spmd._src.clusters.hang_watch import SHARED as _SHARED
from spmd._src.clusters.hang_watch import STEPS as _STEPS
from spmd._src.errors import ConfigurationError, ContextError, message, received, warn
from spmd._src.placement import conform_all, on_device, placed, put_batch, to_memory
from spmd._src.rules import path_str
from spmd._src.strategy import nnx_state
from spmd._src.strategy import step_checks as checks
from spmd._src.strategy.offload import streamed
from spmd._src.strategy.replica import in_replica_context
from spmd._src.strategy.state_placement import place_state
from spmd._src.strategy.step_layout import check_layout
from spmd._src.strategy.step_records import IS_DELETED as _IS_DELETED
from spmd._src.strategy.step_records import Call as _Call
from spmd._src.strategy.step_records import Hot as _Hot
from spmd._src.strategy.step_records import Outcome as _Outcome
from spmd._src.strategy.step_records import Program as _Program
from spmd._src.strategy.step_records import Traced as _Traced
from spmd._src.strategy.step_records import any_deleted as _any_deleted
from spmd._src.strategy.step_records import flatten as _flatten
from spmd._src.strategy.step_records import hot as _hot
from spmd._src.strategy.step_records import multiprocess as _multiprocess
from spmd._src.strategy.step_records import signature as _signature
from spmd._src.strategy.step_records import spans_processes
from spmd._src.topologies import check_runnable

if TYPE_CHECKING:
    from spmd._src.strategy.base import Strategy

__all__ = ["CPU_MAX_IN_FLIGHT", "Step"]

_UNBOUND_AXIS = re.compile(r"unbound axis name: ([^\s.,]+)")
_MISSING_AXIS = re.compile(r"Resource axis: (\S+) of (.+) is not found in mesh")
CPU_MAX_IN_FLIGHT = 4  # steps queued on the CPU backend before the oldest is waited for
STEP_CACHE_SIZE = 32  # programs one Step keeps (per state structure, data ranks, statics)
_HAS_GRAPH: dict[Any, bool] = {}  # state structure -> holds NNX objects (bounded)
_HAS_GRAPH_SIZE = 256

_MISS = object()  # the fast path does not apply: take the checked one
STEP_IN_RUN = (
    "A step is called from the cross-replica context (outside strategy.run): it "
    "compiles its own program over the global batch.",
    "Received: a step called inside a replica function of strategy.run",
    "call the step outside strategy.run, or, inside the replica function, compute "
    "directly (use spmd.get_replica_context().all_reduce for the collectives).",
)
AMBIGUOUS_SCALAR_STATE = (
    "A step whose state is scalars only must return (state, metrics): a bare scalar "
    "return could be the new state or a loss.",
    "Received: a step returning scalars of the state's structure, not a tuple",
    "return `new_state, loss` (or `new_state, {}`), e.g. `return w - lr * g, loss`.",
)


class Step:
    """A train step compiled with its strategy's shardings; see `Strategy.step`.

    One compiled program per state structure and data shapes; `cache_size()`
    says how many exist, so tests can check that a loop compiles once.

    A call takes one of three paths, cheapest first:

    1. `_run_plain`, one process and a pytree state: the state is the one the
       last call returned (the same leaf objects, none deleted) and the batch
       has the same form; nothing is checked again, the program runs.
    2. The hot path (`self._hot`): the same, for an NNX state (split once and
       reused while only the step has touched it) or several processes, or
       static keyword arguments; still no checks.
    3. `_call`: anything else. Split the state, check every argument
       (`step_checks`), with several processes agree on a batch signature that
       differs from the previous call's, find or compile the program
       (`_program`, `_compile`), place the state, run, and remember what the
       next call needs for paths 1 and 2 (`_run`).
    """

    def __init__(
        self,
        strategy: Strategy,
        fn: Callable,
        *,
        donate: bool | None,
        static_argnames,
        batch_axis: int = 0,
        compare_batch_every: int = checks.COMPARE_BATCH_EVERY,
    ):
        self.strategy = strategy
        self.fn = fn
        self.donate = donate
        self.static_argnames = static_argnames
        self.batch_axis = batch_axis
        self.compare_batch_every = compare_batch_every
        self._compiled: dict[Any, _Program] = {}
        self._in_flight: collections.deque[jax.Array] = collections.deque()
        self._on_cpu = strategy.mesh.devices.flat[0].platform == "cpu"
        self._hot: _Hot | None = None
        self._agreed = checks.LastAgreed()  # with several processes: the batch signature
        self._tag = object()  # names this step's flax update context
        self._shared = strategy._spans_processes
        functools.update_wrapper(self, fn)

    def __call__(self, state: Any, *data: Any, **kwargs: Any) -> Any:
        _STEPS[0] += 1  # progress, which the hang watch publishes (clusters/hang_watch.py)
        _SHARED[0] += self._shared
        if in_replica_context():
            raise ContextError(message(*STEP_IN_RUN))
        hot = self._hot
        if hot is not None and hot.plain and state is hot.state and not kwargs:
            result = self._run_plain(hot, state, data)
            if result is not _MISS:
                return result
        if hot is not None and hot.holds(state) and self._static_of(kwargs) == hot.static:
            # The state the last call returned, not donated elsewhere since, and
            # a batch of the same form. (A leaf replaced in place in that state
            # reaches the program as it is: jit dispatches on the leaves.)
            leaves, data_def = _flatten(data)
            if (
                data_def == hot.data_def
                and _signature(leaves) == hot.signature
                and not _any_deleted(hot.state_leaves)
            ):
                if self._shared:
                    self._compare_on_schedule(data)
                pure = hot.flat_state if hot.binding is None else hot.binding.arrays
                call = _Call(
                    state, pure, leaves, data_def, {}, hot.static, hot.binding, hot.signature
                )
                return self._run(call, hot.program)
        with nnx_state.updating(self._tag):  # flax's bookkeeping, as in nnx.jit
            return self._call(state, data, kwargs)

    def _call(self, state: Any, data: tuple, kwargs: dict) -> Any:
        """A call off the fast path: split, check, find or build the program, run it."""
        check_runnable(self.strategy, "Calling a step")
        leaves, data_def = jax.tree.flatten(data)
        if _multiprocess() and spans_processes(self.strategy.mesh):
            # first: a batch wrong on one process is an error on every one
            self._agree_on(data, data_def, leaves, kwargs)
        graphdef, pure, dynamic, program, fresh = self._program(state, data, kwargs)
        binding = None if graphdef is None else nnx_state.Binding(state, pure)
        if fresh:
            # A first state often comes unplaced (numpy, one device): place it, so
            # that the states the step returns hit the same compiled program.
            pure = place_state(pure, self.strategy.state_sharding(pure))
        else:
            check_layout(self.strategy, pure, program.state_shardings, binding is not None)
        pure = jax.tree.leaves(pure)  # the state goes in as its flat list of arrays
        if not fresh:  # arrays on one device or in another memory: where the program takes them
            pure = placed(pure, program.state_shardings)
        static = self._static_of(kwargs) if not dynamic else None
        return self._run(_Call(state, pure, leaves, data_def, dynamic, static, binding), program)

    def _agree_on(self, data: tuple, data_def: Any, leaves: list, kwargs: dict) -> None:
        """With several processes, every call whose batch signature differs from the
        previous call's is checked with every other process first
        (`step_checks.LastAgreed`); calls with the same signature cost a comparison,
        and every `compare_batch_every`-th of them compares the batch's values
        (`_compare_on_schedule`).

        The signature holds the keyword arguments too: static values by value,
        traced ones by shape and dtype, and those that are host values (a Python
        number, a numpy array: `lr=0.1`) by value, agreed again whenever one changes
        (a schedule's new rate each call is a round trip each call). A keyword
        jax.Array's value is not fetched to compare: every process passes the same
        (docs/multihost.md). With it the processes compare a fingerprint of each
        batch argument's host values (numpy arrays: each process's is the global
        batch), unless `compare_batch_every` is 0; which leaves are jax.Arrays is
        part of the signature."""
        static = {k: v for k, v in kwargs.items() if k in self.static_argnames}
        dynamic = {k: v for k, v in kwargs.items() if k not in static}
        dynamic_leaves, dynamic_def = jax.tree.flatten(dynamic)
        key = (
            data_def,
            _signature(leaves),
            tuple(isinstance(x, jax.Array) for x in leaves),
            dynamic_def,
            _signature(dynamic_leaves),
            tuple(map(checks.host_value, dynamic_leaves)),
            checks.static_key(static),
        )
        if not self._agreed.differs(key):
            self._compare_on_schedule(data)
            return
        self._hot = None  # the fast path is for the signature agreed on last only
        values = checks.host_prints(data, self._names(data)) if self.compare_batch_every else None
        self._agreed.agree(self.fn, data, key, dynamic, static, values=values)

    def _compare_on_schedule(self, data: tuple) -> None:
        """Every `compare_batch_every`-th call since the processes last compared their
        batches, compares the fingerprints of its host values (`step_checks.host_prints`)
        with every process: processes passing different numpy batches of one shape
        would otherwise train on a mix of them. None to compare (jax.Arrays only, or
        `compare_batch_every=0`): nothing is exchanged."""
        if not self._agreed.due(self.compare_batch_every):
            return
        values = checks.host_prints(data, self._names(data))
        if values:  # the same on every process: which leaves are host is agreed on
            checks.agree_on_values(values)

    def _names(self, data: tuple) -> list[str]:
        """The data arguments' names, as errors show them."""
        return checks.data_names(self.fn, len(data)) or [f"argument {i}" for i in range(len(data))]

    def _run_plain(self, hot: _Hot, state: Any, data: tuple) -> Any:
        """The fast path of a pytree state on one process, inlined: the state the last
        call returned (its structure and every leaf the same objects, none deleted) and
        a batch of the same form run the same program; else `_MISS`.

        The deleted leaves are looked for on every call: jit given a donated array
        of a multi-device state can crash the process (seen on XLA:CPU, 8 devices)
        rather than raise.
        """
        leaves, treedef = _flatten(state)
        if (
            treedef != hot.state_def
            or not all(map(operator.is_, leaves, hot.flat_state))
            or any(map(_IS_DELETED, leaves))
        ):
            return _MISS
        batch, data_def = _flatten(data)
        if data_def != hot.data_def or _signature(batch) != hot.signature:
            return _MISS
        program = hot.program
        moved = conform_all(batch, program.data_shardings)
        if moved is not batch:  # else the batch goes in as it came
            data = data_def.unflatten(moved)
        new_leaves, out, done = program.compiled(leaves, data, {})
        self._bound_in_flight(out if done is None else done)
        new_state = hot.state_def.unflatten(new_leaves)
        hot.state, hot.state_leaves, hot.flat_state = new_state, new_leaves, new_leaves
        return new_state if program.traced.value.returns == "state" else (new_state, *out)

    def _static_of(self, kwargs: dict) -> tuple | None:
        """The cache key of keyword arguments that are all static, else None."""
        if not kwargs:
            return ()
        if any(k not in self.static_argnames for k in kwargs):
            return None
        try:
            return checks.static_key(kwargs)
        except ConfigurationError:
            return None

    def _run(self, call: _Call, program: _Program) -> Any:
        """Calls the program and remembers what it returned for the next call's fast path.

        In a steady loop the state passed in is the one the last call returned,
        none of its arrays deleted, the batch has the same shapes and dtypes and the
        keyword arguments are the same static values (`call.static`, None when some
        are not static): then nothing is checked again (`_hot`), which keeps
        the Python cost per step flat. NNX state (`call.binding`) is split once and
        reused while nothing but the step has touched it.
        """
        state, leaves, binding = call.state, call.leaves, call.binding
        if _multiprocess():
            strategy = self.strategy  # host data is every process's global value
            data = put_batch(
                strategy.mesh,
                strategy.batch_axes,
                jax.tree.unflatten(call.data_def, leaves),
                self.batch_axis,
            )
        else:  # arrays placed elsewhere (one device, another mesh) move to the batch layout
            data = jax.tree.unflatten(call.data_def, conform_all(leaves, program.data_shardings))
        try:
            new_leaves, out, done = program.compiled(call.pure, data, call.kwargs)
        except RuntimeError as error:  # lowering reads the constants the function closed over
            if "has been deleted" not in str(error):
                raise
            raise ConfigurationError(_deleted_read(self.fn, str(error))) from error
        self._bound_in_flight(out if done is None else done)
        traced = program.traced.value  # set by the trace, which the call above ran if new
        reshaped = binding is not None and not traced.same_graph
        if reshaped:  # the step changed the objects' structure: update them as nnx.jit does
            new_pure = jax.tree.unflatten(traced.state_def, new_leaves)
            nnx_state.merge_back(self._tag, traced.graphdef, new_pure)
            result, next_state = out, state
        elif binding is not None:
            binding.write(new_leaves)
            result, next_state = out, state
        elif traced.returns == "metrics":
            result, next_state = out, state
        else:
            new_pure = jax.tree.unflatten(traced.state_def, new_leaves)
            result = next_state = new_pure
            if traced.returns != "state":
                result = (new_pure, *out)
        hot = self._hot
        if call.static is None or reshaped or (binding is not None and not binding.usable):
            self._hot = None
        elif call.signature is not None and binding is None and next_state is not state:
            # The fast path again (same program, batch form and statics): only the
            # state moves on, rebuilt from these leaves.
            hot.state, hot.state_leaves, hot.flat_state = next_state, new_leaves, new_leaves
        else:
            self._hot = _hot(call, program, next_state, new_leaves, traced.state_def)
        return result

    def lower(self, state: Any, *data: Any, **kwargs: Any) -> tuple[jax.stages.Lowered, Any]:
        """Lowers the step for these arguments without running it.

        Arguments may be abstract (`jax.ShapeDtypeStruct`, e.g. from
        `strategy.abstract_state`), so nothing is allocated.

        Returns:
          (the `jax.stages.Lowered` program, the state's pure pytree of arrays).
        """
        traced, pure = self.trace(state, *data, **kwargs)
        return traced.lower(), pure

    def trace(self, state: Any, *data: Any, **kwargs: Any) -> tuple[jax.stages.Traced, Any]:
        """Traces the step for these arguments without running it (`lower` goes on from here).

        Returns:
          (the `jax.stages.Traced` program, whose `.jaxpr` is the step as JAX
          sees it, the state's pure pytree of arrays).
        """
        with nnx_state.updating(self._tag):
            graphdef, pure, dynamic, program, _ = self._program(state, data, kwargs)
            return program.compiled.trace(jax.tree.leaves(pure), data, dynamic), pure

    def _program(self, state: Any, data: tuple, kwargs: dict):
        """Finds or builds the program for these arguments, after checking them.

        The steady-state cost is one flatten of the state and a dict lookup:
        whether a state structure holds NNX objects is decided once per structure.

        Returns:
          (graphdef, pure state, non-static kwargs, the `_Program`, fresh).
        """
        static = {k: v for k, v in kwargs.items() if k in self.static_argnames}
        dynamic = {k: v for k, v in kwargs.items() if k not in static}
        state_leaves, state_def = jax.tree.flatten(state)
        graph = _HAS_GRAPH.get(state_def)
        if graph is None:
            if len(_HAS_GRAPH) >= _HAS_GRAPH_SIZE:
                _HAS_GRAPH.clear()
            graph = _HAS_GRAPH[state_def] = nnx_state.has_graph(state)
        if graph:
            graphdef, pure = nnx_state.split(state, self._tag)
            state_leaves, state_def = jax.tree.flatten(pure)
        else:
            graphdef, pure = None, state
        donate = self.donates(graphdef is not None)
        checks.check_arguments(
            self.strategy, pure, state_leaves, data, dynamic, self.batch_axis, donate, self.fn
        )
        key = (
            _graph_key(graphdef),
            state_def,
            tuple(map(_leaf_key, state_leaves)),
            jax.tree.structure(data),
            tuple(np.ndim(x) for x in jax.tree.leaves(data)),
            jax.tree.structure(dynamic),
            checks.static_key(static),
        )
        program = self._compiled.pop(key, None)  # re-inserted last: least recently used first
        fresh = program is None
        if fresh:
            program = self._compile(graphdef, pure, data, dynamic, static)
        self._compiled[key] = program
        while len(self._compiled) > STEP_CACHE_SIZE:  # the least recently built goes
            self._compiled.pop(next(iter(self._compiled)))
        return graphdef, pure, dynamic, program, fresh

    def _bound_in_flight(self, done: Any) -> None:
        """On CPU, waits for the oldest step once `CPU_MAX_IN_FLIGHT` are queued.

        XLA:CPU runs the simulated devices' collectives on a shared thread
        pool; with many steps queued their rendezvous can starve each other
        and abort the process (seen with 8 devices on 2 cores). A short queue
        keeps the overlap of host and device work and avoids it.

        Args:
          done: a call's outputs that say it finished: its metrics (their first
            array) or, for a step that returns none, the program's own scalar.
        """
        if not self._on_cpu:
            return
        queue = self._in_flight
        queue.append(done)
        if len(queue) > CPU_MAX_IN_FLIGHT:
            oldest = jax.tree.leaves(queue.popleft())[0]
            if oldest.is_deleted():  # deleted, or fed back as state and donated: not
                # a sign it ran. This call's own handle is alive: wait for all of them.
                oldest = jax.tree.leaves(queue[-1])[0]
                queue.clear()
            oldest.block_until_ready()

    def cache_size(self) -> int:
        """How many programs this step has compiled, over every state structure.

        Counted from the step's traces (jit compiles once per trace), not from
        jit's dispatch cache, which can hold two entries for one program (a
        typed PRNG key in a multi-device state) without compiling it again.
        """
        return sum(program.traced.traces for program in self._compiled.values())

    def donates(self, nnx_state_: bool) -> bool:
        """Whether the program donates its state: `donate`, or by default pytrees only.

        NNX state is not donated by default, as under `nnx.jit`: a clone of the
        model (`nnx.clone`, an EMA teacher) shares its arrays. A host-placed
        state is never donated: its buffers are host memory (donating them
        frees no device memory), and on a GPU a host read of one (np.asarray,
        a metric, a checkpoint) leaves a zero-copy view that makes donating it
        an XLA error. With placement="offload_optimizer" this says whether the
        leaves in device memory are donated; those in host memory never are.
        """
        if self.strategy.placement == "host":
            return False
        return (not nnx_state_) if self.donate is None else bool(self.donate)

    def _compile(self, graphdef, pure, data, kwargs, static) -> _Program:
        """Builds the jitted program for one state structure, data form and statics.

        The program is `jax.jit` of `traced_step` with the strategy's shardings
        for the state (its flat list of arrays) and the batch, the state donated
        unless the step says otherwise. `traced_step` calls the user's function
        (merging and splitting NNX objects around it), constrains the metrics
        replicated and the new state to its layout (and memory kind), and records
        in `_Outcome` what the trace found: what the function returns, the new
        state's structure, and whether an NNX graph changed. With the optimizer
        offloaded, its leaves stream through the device (`offload.streamed`) and
        the program takes and returns the state as two lists (`_Split`).
        """
        strategy = self.strategy
        state_sharding = strategy.state_sharding(pure)
        host = [s.memory_kind == "pinned_host" for s in jax.tree.leaves(state_sharding)]
        offloads = strategy.placement == "offload_optimizer" and any(host)
        moves = strategy.placement == "host" or offloads
        axis = self.batch_axis
        data_sharding = jax.tree.map(lambda x: strategy.batch_sharding(np.ndim(x), axis), data)
        kwargs_sharding = jax.tree.map(lambda _: strategy.replicated, kwargs)
        traced = _Outcome()
        fn, tag, donate = self.fn, self._tag, self.donates(graphdef is not None)
        if strategy.placement == "offload_optimizer" and not any(host) and donate:
            warn(_nothing_offloaded(pure))

        in_def = jax.tree.structure(state_sharding)

        def body(leaves, data, kwargs):
            pure_state = in_def.unflatten(leaves)
            if moves:
                pure_state = to_memory(pure_state, state_sharding, "device")
            new_sharding, new_graphdef, same_graph = state_sharding, None, True
            if graphdef is None:
                out = _call(strategy, fn, pure_state, data, kwargs, static)
                returns, new_state, out = _split_output(out, pure_state, donate)
            else:
                live = nnx_state.inner_merge(tag, graphdef, pure_state)
                out = _call(strategy, fn, live, data, kwargs, static)
                returns = None
                new_graphdef, new_state, same_graph = nnx_state.inner_split(tag, graphdef, live)
                # A Variable whose value grew (sow's tuple: one entry more each
                # call) keeps the graph but not the arrays' structure.
                same_graph = same_graph and (
                    jax.tree.structure(new_state) == jax.tree.structure(pure_state)
                )
                if not same_graph:  # Variables added inside the step get their layout
                    new_sharding = strategy.state_sharding(new_state)
            out = jax.lax.with_sharding_constraint(
                out, jax.tree.map(lambda _: strategy.replicated, out)
            )
            if returns == "metrics":  # the state is only read: nothing to copy back
                traced.value = _Traced(returns, None)
                return None, out, _done(out)
            new_state = jax.lax.with_sharding_constraint(new_state, on_device(new_sharding))
            if moves:
                new_state = to_memory(new_state, new_sharding, "pinned_host")
            # Flat leaves out: the caller rebuilds the tree once and keeps the
            # leaves for the next call's donation check, with no flatten.
            new_leaves, state_def = jax.tree.flatten(new_state)
            traced.value = _Traced(returns, state_def, new_graphdef, same_graph)
            return new_leaves, out, _done(out)

        @strategy.context(traced=True)
        def traced_step(leaves, data, kwargs):
            traced.traces += 1
            # Offloaded, the optimizer's leaves stream through the device, group by group.
            return (streamed(body, host) if offloads else body)(leaves, data, kwargs)

        flat_shardings = jax.tree.leaves(state_sharding)
        if offloads:
            compiled = _Split(
                traced_step, flat_shardings, host, data_sharding, kwargs_sharding, donate
            )
        else:
            # The state travels as its flat list of arrays: jit flattens a list in a
            # fraction of a nested pytree's time, and the fast path has the leaves.
            compiled = jax.jit(
                traced_step,
                in_shardings=(flat_shardings, data_sharding, kwargs_sharding),
                donate_argnums=(0,) if donate else (),
            )
        return _Program(compiled, jax.tree.leaves(data_sharding), flat_shardings, traced)


class _Split:
    """A program whose state goes in and comes out as two lists: the leaves in device
    memory (donated as the step says) and those in host memory (never donated).

    The device leaves come out first, in their order, so that jax pairs each
    donated buffer with the new value of its own leaf: with the outputs' memory
    kinds unknown to jit, a donated device buffer paired with a host output of
    the same shape (Adam's moment of that parameter) would be an XLA error.
    """

    def __init__(self, fn, shardings, host, data_sharding, kwargs_sharding, donate: bool):
        self.device = [i for i, h in enumerate(host) if not h]
        self.host = [i for i, h in enumerate(host) if h]
        self.out_host: list[bool] = []  # each new leaf in host memory; set by the trace

        def split(device, hosted, data, kwargs):
            leaves = [None] * len(host)
            for i, leaf in zip(self.device + self.host, [*device, *hosted], strict=True):
                leaves[i] = leaf
            new_leaves, out, done = fn(leaves, data, kwargs)
            if new_leaves is None:
                return None, None, out, done
            self.out_host = [
                jax.typeof(x).memory_space == jax.memory.Space.Host for x in new_leaves
            ]
            device_out = [x for x, h in zip(new_leaves, self.out_host, strict=True) if not h]
            host_out = [x for x, h in zip(new_leaves, self.out_host, strict=True) if h]
            return device_out, host_out, out, done

        self.jitted = jax.jit(
            split,
            in_shardings=(
                [shardings[i] for i in self.device],
                [shardings[i] for i in self.host],
                data_sharding,
                kwargs_sharding,
            ),
            donate_argnums=(0,) if donate else (),
        )

    def _args(self, leaves: list) -> tuple[list, list]:
        return [leaves[i] for i in self.device], [leaves[i] for i in self.host]

    def __call__(self, leaves: list, data: Any, kwargs: dict) -> tuple:
        device_out, host_out, out, done = self.jitted(*self._args(leaves), data, kwargs)
        if device_out is None:
            return None, out, done
        device, hosted = iter(device_out), iter(host_out)
        return [next(hosted) if h else next(device) for h in self.out_host], out, done

    def trace(self, leaves: list, data: Any, kwargs: dict) -> jax.stages.Traced:
        return self.jitted.trace(*self._args(leaves), data, kwargs)


def _nothing_offloaded(pure: Any) -> str:
    paths = [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(pure)[0]]
    return message(
        "placement='offload_optimizer' keeps the optimizer state in host memory: the leaves "
        "under an 'opt_state' entry or inside an optax state, or those its offload= regexes "
        "name. This training step's state has none, so every leaf stays in device memory.",
        received(state_paths=paths[:6] + (["..."] if len(paths) > 6 else [])),
        "name the optimizer's leaves, e.g. "
        "spmd.Strategy(..., placement='offload_optimizer', offload=r'opt/.*').",
    )


def _call(strategy: Strategy, fn: Callable, state: Any, data: tuple, kwargs: dict, static: dict):
    """Calls the user's step function under trace; a constraint naming a mesh axis the
    strategy's mesh lacks, or an array it reads that a donation deleted, is a
    ConfigurationError that says how to write it."""
    try:
        return fn(state, *data, **kwargs, **static)
    except RuntimeError as error:
        if "has been deleted" not in str(error):
            raise
        raise ConfigurationError(_deleted_read(fn, str(error))) from error
    except NameError as error:
        found = _UNBOUND_AXIS.search(str(error))
        if found is None:
            raise
        raise ConfigurationError(
            message(
                "A step is the global view: the batch is one array and XLA inserts the "
                "all-reduces, so its code names no axis for a collective (pmap-era "
                "lax.pmean(x, 'batch') or nn.BatchNorm(axis_name='batch') have none to bind).",
                received(axis_name=found.group(1), batch_axes=tuple(strategy.batch_axes)),
                "remove the axis name (a mean over the global batch is jnp.mean; "
                "nn.BatchNorm() with no axis_name already normalizes over the whole batch), or "
                "keep the per-replica code and run it with strategy.run(fn, args=..., "
                f"axis_name={found.group(1)!r}), where that name means every replica.",
            )
        ) from error
    except ValueError as error:
        found = _MISSING_AXIS.search(str(error))
        if found is None:
            raise
        axis, spec = found.groups()
        raise ConfigurationError(
            message(
                "Model code constrains a value with mesh axis names "
                "(jax.lax.with_sharding_constraint) that this strategy's mesh does not have.",
                received(axis=axis, constraint=spec, mesh_axes=strategy.mesh.axis_names),
                "write the constraint with logical names, e.g. "
                "nn.with_logical_constraint(y, ('batch', 'mlp')) (flax.linen) mapped by the "
                "strategy's logical_axis_rules (names it does not map are replicated on named "
                f"strategies), or use a Strategy whose mesh has the axis '{axis}', e.g. "
                f"spmd.Strategy(spmd.make_mesh({{{axis!r}: -1, ...}}), ...).",
            )
        ) from error


def _deleted_read(fn: Callable, error: str) -> str:
    """The error for a step function that reads an array deleted by a donation."""
    names = checks.deleted_closure(fn)
    return message(
        "A step's function reads only arrays that are alive: one donated to a step (a "
        "pytree state is donated by default) was deleted, its memory reused for that "
        "step's result, and a function that closes over it (or reads it as a global) "
        "finds nothing there when it is traced.",
        received(deleted=names or "an array the function reads", jax_error=error),
        "pass the array as an argument (in the state, or as a keyword argument) rather "
        "than closing over it; close over a copy that is never donated "
        "(w_fixed = jnp.array(w)); or build the step that donated it with "
        "@strategy.step(donate=False).",
    )


def _done(out: Any) -> jax.Array | None:
    """A handle on 'this call finished' for a step that returns no metrics, else None.

    A step's metrics are that handle already (`Step._bound_in_flight`): one
    output fewer per call, which a dispatch-bound step feels.
    """
    return None if jax.tree.leaves(out) else jnp.zeros((), jnp.int8)


def _graph_key(graphdef: Any) -> Any:
    """An NNX graphdef as a cache key; one holding unhashable static data (a plain
    dict attribute) by a snapshot of its repr, so that a changed value is a new key."""
    try:
        hash(graphdef)
    except TypeError:
        return (type(graphdef), repr(graphdef))
    return graphdef


def _leaf_key(x: Any) -> tuple:
    """What of a state leaf decides its layout: shape and dtype."""
    dtype = getattr(x, "dtype", None)
    return (np.shape(x), dtype if dtype is not None else type(x))


def _split_output(out: Any, state: Any, donate: bool) -> tuple[str, Any, Any]:
    """Separates the new state from the rest of what a pure step returned.

    A new state has the input state's structure and each leaf's shape and
    dtype; anything else is not taken for one (a loss returned by a step whose
    state is one array is not the new state).

    Returns:
      ("state", state, ()) when the step returned the state alone,
      ("tuple", state, rest) when it returned (state, *rest), or
      ("metrics", None, out) when a step that does not donate its state
      returned something else: it only reads the state (evaluation).

    Raises:
      ConfigurationError: the return is ambiguous (one scalar array as the
        state and a bare return) or, for a donating step, holds no new state.
    """
    if isinstance(out, tuple) and out and _like(out[0], state):
        return "tuple", out[0], tuple(out[1:])
    if _like(out, state):
        if not isinstance(out, tuple) and all(np.ndim(x) == 0 for x in jax.tree.leaves(state)):
            raise ConfigurationError(message(*AMBIGUOUS_SCALAR_STATE))
        return "state", out, ()
    if not donate:
        return "metrics", None, out
    raise ConfigurationError(
        message(
            "A step that donates its state must return the new state, or (state, metrics, ...) "
            "with the state first and of the same structure, shapes and dtypes as the input "
            "state; otherwise the donated state would be lost.",
            received(returned=_avals(out), state=_avals(state)),
            "return `state, metrics` from the step, or use @strategy.step(donate=False) for a "
            "step that only reads the state (evaluation, prediction).",
        )
    )


def _like(out: Any, state: Any) -> bool:
    """Whether `out` has `state`'s structure and every leaf's shape and dtype."""
    if jax.tree.structure(out) != jax.tree.structure(state):
        return False
    return all(
        np.shape(a) == np.shape(b) and jnp.result_type(a) == jnp.result_type(b)
        for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(state), strict=True)
    )


def _avals(tree: Any) -> Any:
    return jax.tree.map(lambda x: f"{jnp.result_type(x)}{list(np.shape(x))}", tree)
