"""One stage's executables on its mesh: forward, backward (with accumulation), update.

For a :class:`~.split.StageProgram` ``f(params, batch, inputs) -> (outputs, loss)``:

- **forward** ``(params, batch, inputs) -> (outputs, loss, residuals)`` runs ``jax.vjp``
  of ``f`` with respect to the parameters and the floating-point inputs. The vjp is
  a pytree of the forward's residuals, returned from the jitted forward and kept
  until the micro-batch's backward, so the backward does not recompute the forward.
  Many residuals are parameters (a matmul's backward reads its weight), and a jitted
  function returns a copy of every input it returns: so the forward returns only
  the residuals it computed (:class:`Residuals`, which remembers where the
  parameters go) and the backward takes the parameters again. No micro-batch in
  flight holds a copy of the weights. When
  the plan says ``rematerialize``, ``f`` runs as a chain of its layers
  (:mod:`.remat`): the residuals are then each layer's inputs, and the backward
  recomputes one layer at a time.
- **backward** ``(params, residuals, cotangents, accumulators) -> (accumulators,
  input_grads, done)`` applies the vjp and adds the parameter gradients to float32
  accumulators (donated, so the sum is in place). The residuals are not donated: XLA
  lets a donated buffer become an output of the same shape, never a temporary, and
  the driver drops its reference as it calls the backward, so they are freed when it
  finishes either way. The step's first backward gets ``None`` and makes the
  accumulators from its own gradients (a compiled variant of its own): nothing is
  held from one step to the next that plain JAX would not hold, and no executable
  of zeros runs. ``done`` is a scalar that is ready when the backward is:
  the accumulators are donated to the next backward, so a watcher that stamps the
  backward's completion (:mod:`.driver`) waits on it instead. An accumulator has
  its parameter's sharding, so on a data-parallel mesh every backward would
  all-reduce its micro-batch's gradients: B all-reduces per step, where the planner
  (like Alpa) charges one. GSPMD cannot pass a partial sum between executables
  (JAX 0.10's ``unreduced`` types need Explicit mesh axes; these meshes are Auto).
  So a stage whose parameters are all replicated, with more than one micro-batch,
  runs **grouped** (:mod:`.grouped`): its forward takes a copy of every parameter per
  device (``prepare``, once per step), its accumulators are per device
  (``[devices, ...]``), and the update sums them: one reduction per step. A shared
  parameter's per-device sums are added up (``outgoing``) before they go home.
- **forward_backward** ``(params, batch, inputs, cotangents, accumulators) ->
  (outputs, loss, accumulators, input_grads, done)``: both in one executable, for a
  stage whose backward needs nothing from other stages (the last stage: its
  cotangent is the loss seed), which 1F1B runs back to back anyway. Its residuals
  never leave the executable: XLA fuses across the boundary and frees each one as the
  backward uses it, where a separate forward must write them all out and keep them
  until the backward reads them.
- **update** ``(params, opt_state, grads, received) -> (params, opt_state)`` is
  the optax update of the parameters this stage owns, with ``received`` the other
  stages' gradient sums of the shared ones.
- **backward_update** and **forward_backward_update**: the step's last backward (or
  the last stage's last forward and backward) and the update as one executable
  (:meth:`StageRuntime.finish_backward`, :meth:`StageRuntime.finish_forward_backward`),
  for a stage whose update needs nothing that arrives after its last backward
  (:func:`~.messages.fuses_update`) in a step without a loss scale to agree on. The
  last micro-batch's gradients go from the vjp through the sum into the optimizer
  without being written out as accumulators in between, and parameters, optimizer
  state and accumulators are donated, so the update works in place. It returns the
  sums of the shared parameters this stage reads but does not own, to send home.

Every one is ``jax.jit`` ed with ``NamedSharding`` s on the stage mesh: parameters as
the plan's ``param_shardings``, batch leaves as its ``batch_shardings``, activations
as its input/output shardings (matched by shape and dtype; the data-parallel default
where the plan has none), the outputs of the plan's pinned ops (matmuls, convolutions,
lookups: :mod:`.pinning`) constrained inside the forward to the ILP's shardings (their
cotangents inherit the constraint in the backward), and a weight-update-sharded parameter's accumulator and
optimizer state as :func:`~.meshes.weight_update_spec`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from alpajob.api.plan import SpecEntry, StagePlan
from alpajob.trainer_image.precision import all_finite
from alpajob.trainer_image.runtime.grouped import NotGroupable, grouped_stage_function
from alpajob.trainer_image.runtime.meshes import (
    batch_spec,
    fits,
    named,
    partition_spec,
    weight_update_spec,
)
from alpajob.trainer_image.runtime.remat import in_layers, layer_programs
from alpajob.trainer_image.runtime.split import (
    SplitProgram,
    StageProgram,
    ValueId,
    is_differentiable,
    stage_function,
)
from alpajob.trainer_image.step import init_optimizer_state


@jax.tree_util.register_pytree_node_class
class Residuals:
    """A micro-batch's vjp without the parameters among its residuals.

    ``fresh`` are the residuals the forward computed; ``layout`` says, per leaf of the
    vjp's pytree ``tree``, whether it is parameter ``i`` (``("param", i)``) or
    ``fresh[i]`` (``("fresh", i)``). The layout and tree are static (the pytree's aux
    data), so a backward compiled for them is reused step after step."""

    def __init__(self, fresh: list[Any], layout: tuple[tuple[str, int], ...], tree: Any) -> None:
        self.fresh, self.layout, self.tree = fresh, layout, tree

    @classmethod
    def of(cls, vjp: Any, params: Sequence[Any]) -> Residuals:
        """Split ``vjp`` (inside the forward's trace, where a parameter among the
        residuals is the parameter's own tracer)."""
        leaves, tree = jax.tree.flatten(vjp)
        position = {id(p): i for i, p in enumerate(params)}
        seen: dict[int, int] = {}  # a residual the vjp holds twice is returned once
        fresh: list[Any] = []
        layout = []
        for leaf in leaves:
            if id(leaf) in position:
                layout.append(("param", position[id(leaf)]))
                continue
            if id(leaf) not in seen:
                seen[id(leaf)] = len(fresh)
                fresh.append(leaf)
            layout.append(("fresh", seen[id(leaf)]))
        return cls(fresh, tuple(layout), tree)

    def vjp(self, params: Sequence[Any]) -> Any:
        """The vjp again, with ``params`` (the forward's) where the layout says."""
        leaves = [params[i] if kind == "param" else self.fresh[i] for kind, i in self.layout]
        return jax.tree.unflatten(self.tree, leaves)

    def tree_flatten(self) -> tuple[list[Any], tuple[Any, Any]]:
        return self.fresh, (self.layout, self.tree)

    @classmethod
    def tree_unflatten(cls, aux: tuple[Any, Any], children: Any) -> Residuals:
        return cls(list(children), *aux)


def _by_shape(specs: dict[str, list[SpecEntry]], avals: Sequence[Any], plan_shapes: dict[str, tuple]) -> list[PartitionSpec | None]:
    """Match the plan's activation specs (keyed by planner tensor) to ours by shape."""
    pool = dict(specs)
    out: list[PartitionSpec | None] = []
    for aval in avals:
        found = next((key for key in pool if plan_shapes.get(key) == tuple(aval.shape)), None)
        out.append(partition_spec(pool.pop(found)) if found is not None else None)
    return out


@dataclass
class StageRuntime:
    """A stage's mesh, shardings, executables, and its parameters and optimizer state."""

    index: int
    mesh: Mesh
    param_leaves: tuple[int, ...]  # every parameter leaf the stage reads
    leaf_names: dict[int, str]  # their pytree path names
    home_names: tuple[str, ...]  # names of the leaves it owns and updates
    param_sharding: dict[int, NamedSharding]
    acc_sharding: dict[int, NamedSharding]
    batch_sharding: list[NamedSharding]
    input_sharding: list[NamedSharding]
    output_sharding: list[NamedSharding]
    forward: Callable[..., Any]
    backward: Callable[..., Any]
    forward_backward: Callable[..., Any]
    update: Callable[..., Any]
    finite: Callable[[list[jax.Array]], jax.Array]  # are these accumulators all finite (fp16)
    init_opt: Callable[..., Any]
    zeros: Callable[[], list[jax.Array]]  # zeroed accumulators, one per parameter leaf it reads (fused.py's scan)
    diff_outputs: tuple[int, ...]  # positions in program.outputs that carry gradients
    diff_inputs: tuple[int, ...]  # positions in program.inputs that receive gradients
    groups: int = 0  # > 0: a grouped data-parallel stage (grouped.py) over this many devices
    prepare: Callable[[list[Any]], list[Any]] = list  # its parameters, as the forward takes them
    outgoing: Callable[[list[Any]], list[Any]] = list  # shared leaves' accumulators, summed to send
    backward_update: Callable[..., Any] | None = None  # the last backward and the update, one executable
    forward_backward_update: Callable[..., Any] | None = None  # the same with the forward (last stage)
    params: dict[str, jax.Array] = field(default_factory=dict)
    opt_state: Any = None

    def _others(self, params: Sequence[Any]) -> list[Any]:
        """What a fused update takes besides this stage's own parameters: a grouped
        stage's per-device copies (its forward's parameters), else the shared
        parameters it reads from their home stages (its own are donated, so they
        must not be passed twice)."""
        if self.groups:
            return list(params)
        return [p for k, p in zip(self.param_leaves, params, strict=True)
                if self.leaf_names[k] not in self.home_names]

    def finish_backward(self, params: Sequence[Any], residuals: Residuals, cotangents: list[Any],
                        acc: list[Any] | None, received: dict[str, list[jax.Array]]) -> tuple[list[Any], list[Any], Any]:
        """The step's last backward and the update in one executable (``params`` as
        the forward took them, ``received``: the shared parameters' gradient sums from
        their readers, by name). Updates :attr:`params` and :attr:`opt_state`;
        returns the sums of the shared parameters this stage reads to send home (in
        :func:`~.messages.shared_sends` order), the input gradients and ``done``."""
        assert self.backward_update is not None
        self.params, self.opt_state, away, input_grads, done = self.backward_update(
            self.params, self.opt_state, self._others(params), residuals, cotangents, acc, received)
        return away, input_grads, done

    def finish_forward_backward(self, params: Sequence[Any], batch: list[Any], inputs: list[Any],
                                cotangents: list[Any], acc: list[Any] | None,
                                received: dict[str, list[jax.Array]]) -> tuple[Any, Any, list[Any], list[Any], Any]:
        """:meth:`finish_backward` with the micro-batch's forward in the same
        executable (a stage that :func:`~.messages.fuses_forward_backward`); returns
        the outputs and loss as well."""
        assert self.forward_backward_update is not None
        outs, loss, self.params, self.opt_state, away, input_grads, done = self.forward_backward_update(
            self.params, self.opt_state, self._others(params), batch, inputs, cotangents, acc, received)
        return outs, loss, away, input_grads, done

    def apply_update(self, grads: dict[str, jax.Array], received: dict[str, list[jax.Array]],
                     inv_scale: float = 1.0) -> None:
        """Update the parameters and optimizer state this stage owns with its
        accumulated ``grads`` plus the gradient sums other stages sent it for shared
        parameters (``received``; both by name), times ``inv_scale`` (1 / the loss
        scale, :mod:`~alpajob.trainer_image.precision`)."""
        self.params, self.opt_state = self.update(
            self.params, self.opt_state, grads, received, jnp.float32(inv_scale))


def build_stage(
    split: SplitProgram,
    index: int,
    plan_stage: StagePlan,
    mesh: Mesh,
    names: Sequence[str],
    optimizer: optax.GradientTransformation,
    plan_shapes: dict[str, tuple],
    pins: Mapping[ValueId, list[SpecEntry]] | None = None,
) -> StageRuntime:
    """Compile-ready executables of stage ``index`` (jitted lazily, on first call).

    The stage runs grouped (:mod:`.grouped`) when it can and ``split.batch_dims`` is
    known (:func:`~.build.split_for_plan` finds it only with several micro-batches).

    ``pins`` (value id -> sharding, from :func:`~.pinning.stage_pins`) are the op
    outputs the forward constrains to the ILP's choice; a sharding that does not fit
    this stage's mesh (the trainer's stage cut moved the op) is left to GSPMD.
    """
    program = split.stages[index]
    avals = split.avals
    param_avals = [avals[split.param_ids[k]] for k in program.params]
    home = tuple(k for k in program.params if split.home[k] == index)
    wus = set(plan_stage.weight_update_sharded)

    param_sharding: dict[int, NamedSharding] = {}
    acc_sharding: dict[int, NamedSharding] = {}
    for leaf, aval in zip(program.params, param_avals, strict=True):
        spec = partition_spec(plan_stage.param_shardings.get(names[leaf], []))
        param_sharding[leaf] = named(mesh, spec, aval.shape)
        acc_spec = param_sharding[leaf].spec
        if names[leaf] in wus and leaf in home:
            acc_spec = weight_update_spec(acc_spec, aval.shape, mesh)
        acc_sharding[leaf] = named(mesh, acc_spec, aval.shape)

    batch_sharding = []
    for leaf in program.batch:
        aval = avals[split.batch_ids[leaf]]
        entries = plan_stage.batch_shardings.get(str(leaf))
        spec = partition_spec(entries) if entries is not None else batch_spec(aval.shape, mesh)
        batch_sharding.append(named(mesh, spec, aval.shape))

    def activation_shardings(vids: Sequence[int], specs: dict[str, list[SpecEntry]]) -> list[NamedSharding]:
        shapes = [avals[v] for v in vids]
        matched = _by_shape(specs, shapes, plan_shapes)
        return [
            named(mesh, spec if spec is not None else batch_spec(a.shape, mesh), a.shape)
            for spec, a in zip(matched, shapes, strict=True)
        ]

    input_sharding = activation_shardings(program.inputs, plan_stage.input_shardings)
    output_sharding = activation_shardings(program.outputs, plan_stage.output_shardings)
    diff_in = tuple(i for i, v in enumerate(program.inputs) if is_differentiable(avals[v]))
    diff_out = tuple(i for i, v in enumerate(program.outputs) if is_differentiable(avals[v]))
    constraints = {}
    for vid, entries in (pins or {}).items():
        spec = partition_spec(entries)
        if fits(spec, avals[vid].shape, mesh):
            constraints[vid] = NamedSharding(mesh, spec)
    replicated = NamedSharding(mesh, PartitionSpec())
    group = NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names)))  # a leading axis over every device
    layers = _remat_layers(split, program, plan_stage, names)
    run = _grouped_run(split, program, mesh, param_sharding, group, constraints, layers)
    groups = mesh.size if run is not None else 0
    if run is None:
        run = in_layers(lambda part: stage_function(split, part, constraints), split, program, layers)

    def forward(params: list[Any], batch: list[Any], inputs: list[Any]) -> tuple[Any, Any, Any]:
        def f(p: list[Any], diff_inputs: list[Any]) -> tuple[list[Any], list[Any]]:
            full = list(inputs)
            for pos, value in zip(diff_in, diff_inputs, strict=True):
                full[pos] = value
            outs, loss = run(p, batch, full)
            diff = [outs[i] for i in diff_out] + ([loss] if program.returns_loss else [])
            aux = [o for i, o in enumerate(outs) if i not in diff_out]
            return diff, aux

        params = list(params)
        diff, vjp, aux = jax.vjp(f, params, [inputs[i] for i in diff_in], has_aux=True)
        outs: list[Any] = [None] * len(program.outputs)
        for pos, value in zip(diff_out, diff, strict=False):
            outs[pos] = value
        rest = iter(aux)
        for pos in range(len(outs)):
            if pos not in diff_out:
                outs[pos] = next(rest)
        return outs, (diff[-1] if program.returns_loss else None), Residuals.of(vjp, params)

    def backward(params: list[Any], residuals: Residuals, cotangents: list[Any],
                 acc: list[Any] | None) -> tuple[list[Any], list[Any], Any]:
        param_grads, input_grads = residuals.vjp(params)(cotangents)
        grads32 = [g.astype(jnp.float32) for g in param_grads]
        new_acc = grads32 if acc is None else [a + g for a, g in zip(acc, grads32, strict=True)]
        return new_acc, input_grads, jnp.zeros((), jnp.int8)

    home_names = tuple(names[k] for k in home)
    param_dtypes = {names[k]: avals[split.param_ids[k]].dtype for k in home}
    home_acc = {names[k]: acc_sharding[k] for k in home}

    def update(params: dict[str, Any], opt_state: Any, grads: dict[str, Any],
               received: dict[str, list[Any]], inv_scale: jax.Array) -> tuple[Any, Any]:
        total = {}
        for n, g in grads.items():
            if groups:  # the one reduction of a grouped stage's gradients per step
                g = jax.lax.with_sharding_constraint(g.sum(0), home_acc[n])
            for other in received.get(n, []):
                g = g + other
            total[n] = (g * inv_scale).astype(param_dtypes[n])
        updates, new_state = optimizer.update(total, opt_state, params)
        return optax.apply_updates(params, updates), new_state

    def zeros() -> list[Any]:
        lead = (groups,) if groups else ()
        return [jnp.zeros(lead + tuple(a.shape), jnp.float32) for a in param_avals]

    home_param = {names[k]: param_sharding[k] for k in home}
    abstract = {names[k]: avals[split.param_ids[k]] for k in home}
    opt_abstract = jax.eval_shape(lambda p: init_optimizer_state(optimizer, p), abstract)
    opt_sharding = _opt_shardings(opt_abstract, home_acc, abstract, replicated)
    acc_list = [group if groups else acc_sharding[k] for k in program.params]
    grads_in = {names[k]: group if groups else acc_sharding[k] for k in home}
    readers = split.shared_params()
    received_in = {names[k]: [acc_sharding[k]] * len(readers[k]) for k in home if k in readers}
    forward_params = [group if groups else param_sharding[k] for k in program.params]
    loss_sharding = replicated if program.returns_loss else None
    away = [k for k in program.params if k not in home]

    jitted_forward = jax.jit(
        forward,
        in_shardings=(forward_params, batch_sharding, input_sharding),
        out_shardings=(output_sharding, loss_sharding, None),
    )
    jitted_backward = jax.jit(
        backward,
        out_shardings=(acc_list, [input_sharding[i] for i in diff_in], replicated),
        donate_argnums=(3,),
    )

    def forward_backward(params: list[Any], batch: list[Any], inputs: list[Any], cotangents: list[Any],
                         acc: list[Any] | None) -> tuple[Any, Any, list[Any], list[Any], Any]:
        outs, loss, residuals = jitted_forward(params, batch, inputs)  # inlined, shardings and all
        acc, input_grads, done = jitted_backward(params, residuals, cotangents, acc)
        return outs, loss, acc, input_grads, done

    jitted_update = jax.jit(
        update,
        in_shardings=(home_param, opt_sharding, grads_in, received_in, replicated),
        out_shardings=(home_param, opt_sharding),
        donate_argnums=(0, 1),
    )
    jitted_outgoing = jax.jit(
        lambda xs: [x.sum(0) for x in xs],
        out_shardings=[acc_sharding[k] for k in away],
    ) if groups and away else list

    def forward_params_of(own: dict[str, Any], others: list[Any]) -> list[Any]:
        """The forward's parameters from the stage's own and :meth:`StageRuntime._others`."""
        if groups:
            return others
        rest = iter(others)
        return [own[names[k]] if k in home else next(rest) for k in program.params]

    def update_from(own: dict[str, Any], opt_state: Any, acc: list[Any],
                    received: dict[str, list[Any]]) -> tuple[Any, Any, list[Any]]:
        grads = {names[k]: a for k, a in zip(program.params, acc, strict=True) if k in home}
        outgoing = jitted_outgoing([a for k, a in zip(program.params, acc, strict=True) if k not in home])
        new_params, new_state = jitted_update(own, opt_state, grads, received, jnp.float32(1.0))
        return new_params, new_state, outgoing

    def backward_update(own: dict[str, Any], opt_state: Any, others: list[Any], residuals: Residuals,
                        cotangents: list[Any], acc: list[Any] | None,
                        received: dict[str, list[Any]]) -> tuple[Any, ...]:
        acc, input_grads, done = jitted_backward(forward_params_of(own, others), residuals, cotangents, acc)
        new_params, new_state, outgoing = update_from(own, opt_state, acc, received)
        return new_params, new_state, outgoing, input_grads, done

    def forward_backward_update(own: dict[str, Any], opt_state: Any, others: list[Any], batch: list[Any],
                                inputs: list[Any], cotangents: list[Any], acc: list[Any] | None,
                                received: dict[str, list[Any]]) -> tuple[Any, ...]:
        params = forward_params_of(own, others)
        outs, loss, residuals = jitted_forward(params, batch, inputs)
        acc, input_grads, done = jitted_backward(params, residuals, cotangents, acc)
        new_params, new_state, outgoing = update_from(own, opt_state, acc, received)
        return outs, loss, new_params, new_state, outgoing, input_grads, done

    return StageRuntime(
        index=index,
        mesh=mesh,
        param_leaves=program.params,
        leaf_names={k: names[k] for k in program.params},
        home_names=home_names,
        param_sharding=param_sharding,
        acc_sharding=acc_sharding,
        batch_sharding=batch_sharding,
        input_sharding=input_sharding,
        output_sharding=output_sharding,
        forward=jitted_forward,
        backward=jitted_backward,
        forward_backward=jax.jit(forward_backward, donate_argnums=(4,)),
        backward_update=jax.jit(backward_update, donate_argnums=(0, 1, 5)),
        forward_backward_update=jax.jit(forward_backward_update, donate_argnums=(0, 1, 6)),
        update=jitted_update,
        finite=jax.jit(all_finite, out_shardings=replicated),
        init_opt=jax.jit(
            lambda p: init_optimizer_state(optimizer, p),
            in_shardings=(home_param,),
            out_shardings=opt_sharding,
        ),
        zeros=jax.jit(zeros, out_shardings=acc_list),
        diff_outputs=diff_out,
        diff_inputs=diff_in,
        groups=groups,
        prepare=jax.jit(
            lambda ps: [jnp.broadcast_to(p, (groups, *p.shape)) for p in ps],
            in_shardings=([param_sharding[k] for k in program.params],),
            out_shardings=forward_params,
        ) if groups else list,
        outgoing=jitted_outgoing,
    )


def _remat_layers(
    split: SplitProgram, program: StageProgram, plan_stage: StagePlan, names: Sequence[str]
) -> tuple[StageProgram, ...] | None:
    """The layers (or block parts, where the plan names them) a rematerialised stage
    recomputes one at a time (:mod:`.remat`); None if the plan does not
    rematerialise it."""
    if not plan_stage.rematerialize:
        return None
    parts = plan_stage.param_parts
    if parts:
        part_of = {leaf: parts[names[leaf]] for leaf in program.params if names[leaf] in parts}
        return layer_programs(split, program, part_of, max(parts.values()) + 1)
    first, end = plan_stage.layers
    layer_of = {leaf: plan_stage.param_layers[names[leaf]] - first
                for leaf in program.params if names[leaf] in plan_stage.param_layers}
    return layer_programs(split, program, layer_of, end - first)


def _grouped_run(
    split: SplitProgram,
    program: StageProgram,
    mesh: Mesh,
    param_sharding: Mapping[int, NamedSharding],
    group: NamedSharding,
    constraints: Mapping[ValueId, NamedSharding],
    layers: Sequence[StageProgram] | None,
) -> Callable[..., Any] | None:
    """The stage's grouped function (:mod:`.grouped`) if every parameter is
    replicated over its mesh (the batch is then split over every device, grouped)
    and the stage is groupable; else None. ``layers``: see :func:`_remat_layers`."""
    dims = split.batch_dims
    if dims is None or mesh.size == 1:
        return None
    if any(any(e is not None for e in param_sharding[k].spec) for k in program.params):
        return None
    if any(dims[split.batch_ids[leaf]] != 0 for leaf in program.batch):
        return None
    run = in_layers(lambda part: grouped_stage_function(split, part, dims, mesh.size, group, constraints),
                    split, program, layers)
    def abstract(vid: ValueId, lead: tuple[int, ...] = ()) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(lead + tuple(split.avals[vid].shape), split.avals[vid].dtype)

    params = [abstract(split.param_ids[k], (mesh.size,)) for k in program.params]
    batch = [abstract(split.batch_ids[k]) for k in program.batch]
    inputs = [abstract(v) for v in program.inputs]
    try:
        jax.eval_shape(run, params, batch, inputs)
    except NotGroupable:
        return None
    return run


def _opt_shardings(opt_abstract: Any, acc: dict[str, NamedSharding], params: dict[str, Any], replicated: NamedSharding) -> Any:
    """Optimizer-state shardings: a leaf mirroring parameter ``p`` (``mu/p``) as ``p``'s
    accumulator, anything else (Adam's step count) replicated."""

    def choose(path: Any, leaf: Any) -> NamedSharding:
        last = path[-1] if path else None
        name = getattr(last, "key", None)
        if name in acc and tuple(leaf.shape) == tuple(params[name].shape):
            return acc[name]
        return replicated

    return jax.tree_util.tree_map_with_path(choose, opt_abstract)
