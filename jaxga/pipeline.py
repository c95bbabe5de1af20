"""Pipeline parallelism: a stack of layers split into stages over a mesh axis, micro-batches
streamed through them, in one SPMD program: the checks and the public functions. A schedule
is a row of `SCHEDULES`, run as `jaxga.pipeline_schedules.pipelined` says."""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxga import collectives, meshes
from jaxga._checks import check_arity, check_bool, leading_size, positive_int
from jaxga._host_stacks import check_resident
from jaxga.loss import Mean
from jaxga.pipeline_schedules import SCHEDULES, Inputs, Schedule, Stages, checked_mean, pipelined
from jaxga.remat import Policy, stack_length


def pipeline_order(stacked_params: Any, stages: int, repeats: int = 1) -> Any:
    """The layer stack reordered so that stage ``s`` holds, contiguously, the layers it runs.

    Stage ``s`` runs chunks ``s, s + S, ...`` of ``L / (S · r)`` layers each; with
    ``repeats=1`` this is the stack as it is (docs/pipeline.md, the circular schedule).

    Args:
        stacked_params: a pytree of arrays with a leading layer axis L, in layer order.
        stages: S, the size of the stage axis.
        repeats: r, the chunks each stage holds (`pipeline_scan`'s ``repeats``).

    Returns:
        The same arrays, the layer axis reordered; `pipeline_scan` reads this order.

    Examples:
        >>> import jax.numpy as jnp, jaxga
        >>> jaxga.pipeline_order(jnp.arange(8), stages=2, repeats=2).tolist()
        [0, 1, 4, 5, 2, 3, 6, 7]
    """
    stages, repeats = positive_int(stages, "stages"), positive_int(repeats, "repeats")
    num_layers = stack_length(stacked_params)
    check_layers(num_layers, stages, repeats)

    def swap(p: jax.Array) -> jax.Array:  # [r, S, L / (S · r), ...] -> [S, r, ...]
        chunks = jnp.reshape(p, (repeats, stages, -1, *p.shape[1:]))
        return jnp.reshape(jnp.swapaxes(chunks, 0, 1), p.shape)

    def reorder(p: Any) -> jax.Array:  # no gather: on Explicit axes, the layout is kept
        where = jax.typeof(p).sharding
        if not meshes.is_explicit(where):
            return swap(jnp.asarray(p))
        with jax.sharding.use_abstract_mesh(getattr(where.mesh, "abstract_mesh", where.mesh)):
            return jax.sharding.auto_axes(swap, out_sharding=where.spec)(p)

    return jax.tree.map(reorder, stacked_params)


def check_layers(num_layers: int, stages: int, repeats: int) -> None:
    if num_layers % (stages * repeats):
        got = f"L={num_layers} layers for S={stages} stages × r={repeats} repeats"
        raise ValueError(f"`stacked_params` must hold a multiple of S · r layers; got {got}.")


def _stage_mesh(axis_name: str, stacked_params: Any, mesh: Any) -> tuple[str, Any]:
    """Whether the stage axis is ``"manual"`` here or to be ``"opened"`` (a `Route.kind`),
    and its mesh."""
    context = jax.sharding.get_abstract_mesh()
    inside = tuple(sorted(meshes.manual_axes(context), key=str))  # a shard_map's axes
    if inside and axis_name not in inside and meshes.devices(context, inside) == 1:
        raise ValueError(_NESTED_ON_ONE.format(axis=axis_name, inside=inside))
    route_kind = meshes.axis_kind(axis_name, context)
    if route_kind == "manual" or (route_kind and mesh is None):
        return route_kind, context
    if mesh is not None:
        if axis_name not in mesh.axis_names:
            got = f"{axis_name!r} is not an axis of `mesh` {mesh.axis_names}"
            raise ValueError(f"`axis_name`={got}.")
        return "opened", mesh
    seen = tuple(context.axis_names)  # the axes of the mesh here, or of the params'
    for leaf in jax.tree.leaves(stacked_params):  # Explicit axes: the type says
        typed = getattr(getattr(jax.typeof(leaf), "sharding", None), "mesh", None)
        if axis_name in getattr(typed, "axis_names", ()):
            return "opened", typed
        seen = seen or tuple(getattr(typed, "axis_names", ()))
    raise ValueError(
        f"`axis_name`={axis_name!r} is not an axis of the mesh here (axes {seen}): lay "
        "`stacked_params` out on a mesh with it (Explicit axes), call under "
        "jax.set_mesh(mesh), or pass `mesh`."
    )


_NESTED_ON_ONE = (
    "`axis_name`={axis!r}: a pipeline opened inside a shard_map over axes {inside} of one device, "
    "which XLA cannot partition (jaxga's loop over a batch axis of size 1): pass the train "
    "step pipeline_axis={axis!r} (the stages manual in its loop), or reduce_once=False "
    "(jaxga.value_and_grad: axis_name=()), its loop in jit's global view."
)


class Checked(NamedTuple):
    """A pipeline's arguments checked (`stages_of`): what `pipelined` takes before its inputs."""

    stages: Stages  # what every stage runs
    route_kind: str  # the stage axis ``"manual"`` here, or to be ``"opened"`` (`Route.kind`'s)
    mesh: Any  # the mesh of the stage axis
    stacked_params: Any  # the stack; one on no mesh put over an Explicit stage axis


def stages_of(
    layer_fn: Callable[..., Any],
    stacked_params: Any,
    *,
    num_microbatches: int,
    axis_name: str,
    policy: Policy,
    rng: Any,
    mesh: Any,
    repeats: int = 1,
    schedule: str = "gpipe",
    head_fn: Callable[..., Any] | None = None,
    embed_fn: Callable[..., Any] | None = None,
    stream: bool = False,
) -> Checked:
    """A pipeline's arguments checked: its `Stages`, whether the stage axis is
    ``"manual"`` here or to be ``"opened"``, the mesh, and the stack laid out on it."""
    repeats = positive_int(repeats, "repeats")
    _check_streamed(check_bool(stream, "stream"), stacked_params, schedule)
    names = tuple(n for n, row in SCHEDULES.items() if head_fn or not row.manual)
    if schedule in SCHEDULES and schedule not in names:
        raise ValueError(f"`schedule`={schedule!r} needs a loss head: call jaxga.pipeline_loss.")
    if schedule not in names:
        raise ValueError(f"`schedule` must be one of {names}; got {schedule!r}.")
    if repeats != 1 and not SCHEDULES[schedule].chunks:
        first, *others = [n for n in names if SCHEDULES[n].chunks]
        also = f" (or {', '.join(map(repr, others))})" if others else ""
        got = f"{repeats} needs schedule={first!r}; {schedule!r} runs one chunk{also}"
        raise ValueError(f"`repeats`={got}.")
    signature = "layer_fn(params_of_one_layer, x" + (", key) -> x" if rng is not None else ") -> x")
    check_arity(layer_fn, "layer_fn", 2 if rng is None else 3, signature)
    route_kind, mesh = _stage_mesh(axis_name, stacked_params, mesh)
    m = positive_int(num_microbatches, "num_microbatches")
    plan = Schedule(mesh.shape[axis_name], m, repeats, schedule)
    grouped = plan.manual and repeats > 1  # micro-batches go round in groups of S
    if m < plan.stages or (grouped and m % plan.stages):
        need = f"{'a multiple of' if grouped else 'at least'} the S={plan.stages} stages"
        raise ValueError(f"`num_microbatches`={m}; it must be {need} (and divide x's rows).")
    if route_kind == "manual":
        _check_split(stacked_params, axis_name)
    elif axis_name in meshes.explicit_axes(mesh):
        stacked_params = _laid_out(stacked_params, axis_name, mesh)
    layers = stack_length(stacked_params) * (plan.stages if route_kind == "manual" else 1)  # L
    check_layers(layers, plan.stages, repeats)
    stages = Stages(layer_fn, policy, plan, axis_name, head_fn, embed_fn, stream)
    return Checked(stages, route_kind, mesh, stacked_params)


def _check_streamed(stream: bool, stacked_params: Any, schedule: str) -> None:
    """A `ValueError` unless a stack in host memory is streamed, by a schedule that streams:
    one whose backward passes run in its ticks (`ScheduleRow.manual`: ``"1f1b"``,
    ``"interleaved_1f1b"``), adding each layer's gradient to its sum there."""
    row = SCHEDULES.get(schedule)
    if stream and row is not None and not row.manual:
        streams = " or ".join(repr(n) for n, r in SCHEDULES.items() if r.manual)
        want = f"schedule={streams} (its backward passes add each layer to its sum)"
        got = f"`stream`=True with schedule={schedule!r}"
        raise ValueError(f"{got}: not supported; expected {want}.")
    if not stream:
        fix = "call jaxga.pipeline_loss(..., stream=True) with schedule='1f1b' or "
        fix += "'interleaved_1f1b'"
        check_resident(stacked_params, fix)


def _check_split(stacked_params: Any, axis_name: str) -> None:
    """A `ValueError` unless, inside a ``shard_map`` over ``axis_name``, every stacked leaf
    varies over it (laid out over the stages), and the ``shard_map`` checks what varies."""
    if not collectives.varying_axes(collectives.varying(jnp.zeros(()), (axis_name,))):
        raise ValueError(_UNCHECKED.format(axis=axis_name))
    same = [
        jax.tree_util.keystr(path)
        for path, x in jax.tree_util.tree_leaves_with_path(stacked_params)
        if axis_name not in collectives.varying_axes(x)
    ]
    if same:
        fix = (
            f"lay the layer axis out over it: P({axis_name!r}) in your shard_map's in_specs, "
            "a train step's strategy specs, or the variables' sharding metadata"
        )
        more = f" (and {len(same) - 1} more)" if len(same) > 1 else ""
        got = f"`stacked_params`{same[0]}{more}"
        raise ValueError(f"{got} is the same on every stage of {axis_name!r}: {fix}.")


def _laid_out(stacked_params: Any, axis_name: str, mesh: Any) -> Any:
    """``stacked_params`` split over the Explicit stage axis ``axis_name`` of ``mesh``, as the
    ``shard_map`` over the stages takes it: a leaf on the device and on no mesh (a NumPy
    array, an uncommitted one) put there; any other leaf whose type does not split its
    layer axis over it is refused, by name (a `ValueError`)."""

    def placed(x: Any) -> Any:
        on_no_mesh = jax.typeof(x).sharding.mesh.empty
        if on_no_mesh and meshes.memory_space(x) != jax.memory.Space.Host:
            return jax.device_put(x, jax.NamedSharding(mesh, jax.P(axis_name)))
        return x

    stacked_params = jax.tree.map(placed, stacked_params)
    for path, x in jax.tree_util.tree_leaves_with_path(stacked_params):
        if axis_name not in meshes.layer_split(x):
            got = f"`stacked_params`{jax.tree_util.keystr(path)} is laid out as "
            got += f"{meshes.type_spec(x)}, its layers not split over the stages"
            fix = f"jax.device_put(stack, jax.NamedSharding(mesh, jax.P({axis_name!r})))"
            want = f"its layer axis split over the Explicit stage axis {axis_name!r}: {fix}"
            raise ValueError(f"{got}; expected {want} (memory_kind='pinned_host' to stream it).")
    return stacked_params


_UNCHECKED = (
    "`axis_name`={axis!r}: the pipeline runs inside a shard_map with check_vma=False "
    "(check_rep=False in older JAX), where jaxga cannot see which values are split over the "
    "stages, nor differentiate its collectives exactly: call jax.shard_map(..., "
    "check_vma=True) (the default), or call the pipeline in jit's global view."
)


def pipeline_scan(
    layer_fn: Callable[..., Any],
    stacked_params: Any,
    x: Any,
    *,
    num_microbatches: int,
    axis_name: str = "stage",
    schedule: str = "gpipe",
    repeats: int = 1,
    policy: Policy = "full",
    rng: jax.Array | None = None,
    mesh: jax.sharding.Mesh | None = None,
) -> Any:
    """``for p in stacked_params: x = layer_fn(p, x)``, its layers split into pipeline stages.

    The S devices of ``axis_name`` each run L / S of the layers, as
    [`remat_scan`][jaxga.remat_scan] with ``policy``; ``x``'s rows, split into m micro-batches
    (micro-batch ``i``: rows ``i, i + m, ...``), stream through them. Call it in jit's global
    view, inside jaxga's accumulation, or inside a ``shard_map`` over ``axis_name`` or others.
    The schedules, where values lie and why: docs/pipeline.md.

    Args:
        layer_fn: ``layer_fn(params_of_one_layer, x) -> x``, keeping ``x``'s shapes and
            dtypes; with ``rng``, ``layer_fn(params_of_one_layer, x, key)``.
        stacked_params: the layers' parameters, a leading layer axis L, in `pipeline_order`.
        x: the carry, an array or pytree of arrays with a leading batch axis.
        num_microbatches: m, at least S, dividing the batch.
        axis_name: the mesh axis of the stages.
        schedule: ``"gpipe"`` or ``"circular"``.
        repeats: r, the chunks of layers each stage holds (``"circular"``; 1 for ``"gpipe"``).
        policy: each layer's checkpoint policy, as for `remat_scan`.
        rng: a PRNG key: layer ``l`` on micro-batch ``i`` gets ``fold_in(fold_in(rng, i), l)``.
        mesh: the mesh, if neither the context (``jax.set_mesh``) nor the params' types say.

    Returns:
        The last layer's output, like ``x``: in jit's global view, the whole of it; inside
        a ``shard_map`` over ``axis_name``, on the last stage (the others get ``x`` back:
        run the head there; `jaxga.value_and_grad` reads a loss on the last stage).

    Examples:
        >>> import jax, jax.numpy as jnp, jaxga
        >>> mesh = jax.make_mesh((2,), ("stage",), devices=jax.devices()[:2])
        >>> stack = jnp.full((4, 3, 3), 0.1)  # 4 layers, 2 on each stage
        >>> w = jax.device_put(stack, jax.NamedSharding(mesh, jax.P("stage")))
        >>> def layer(w, x):
        ...     return jnp.tanh(x @ w)
        >>> def forward(w, x):
        ...     return jaxga.pipeline_scan(layer, w, x, num_microbatches=2)
        >>> y = jax.jit(forward)(w, jnp.ones((4, 3)))
        >>> bool(jnp.allclose(y, jaxga.remat_scan(layer, stack, jnp.ones((4, 3)))))
        True
    """
    options = {"num_microbatches": num_microbatches, "axis_name": axis_name, "policy": policy}
    options |= {"schedule": schedule, "repeats": repeats, "rng": rng, "mesh": mesh}
    checked = stages_of(layer_fn, stacked_params, **options)
    inputs = Inputs(checked.stacked_params, None, x, None, rng)
    return pipelined(checked.stages, checked.route_kind, checked.mesh, inputs)


def pipeline_loss(
    layer_fn: Callable[..., Any],
    head_fn: Callable[..., Any],
    params: tuple[Any, Any],
    x: Any,
    targets: Any,
    *,
    num_microbatches: int,
    axis_name: str = "stage",
    schedule: str = "1f1b",
    repeats: int = 1,
    policy: Policy = "full",
    rng: jax.Array | None = None,
    mesh: jax.sharding.Mesh | None = None,
    embed_fn: Callable[..., Any] | None = None,
    stream: bool = False,
) -> Mean:
    """The loss of a pipelined layer stack: ``head_fn`` on `pipeline_scan`'s output, summed.

    ``"gpipe"`` and ``"circular"`` run `pipeline_scan`, then ``head_fn`` on the whole batch;
    ``"1f1b"`` and ``"interleaved_1f1b"`` run each micro-batch's loss and backward pass in
    the ticks (docs/pipeline.md): differentiate the returned `Mean`'s total, or return it
    from a loss given to [`jaxga.value_and_grad`][jaxga.value_and_grad].

    Args:
        layer_fn: as for `pipeline_scan`.
        head_fn: ``head_fn(head_params, y, targets) -> jaxga.Mean`` on the last layer's
            output ``y`` (the head and the loss: e.g. `jaxga.token_cross_entropy`).
        params: ``(stacked_params, head_params)``: the layers' parameters (in
            `pipeline_order`, laid out over the stages) and the head's (on every stage).
        x: the first layer's input, a leading batch axis.
        targets: what ``head_fn`` compares with, a leading batch axis (labels, a mask).
        num_microbatches: m, at least S, dividing the batch.
        axis_name: the mesh axis of the stages.
        schedule: ``"gpipe"``, ``"circular"`` (with ``repeats``), ``"1f1b"`` or
            ``"interleaved_1f1b"`` (with ``repeats``).
        repeats: as for `pipeline_scan`; 1 for ``"gpipe"`` and ``"1f1b"``.
        policy: as for `pipeline_scan`.
        rng: as for `pipeline_scan`.
        mesh: as for `pipeline_scan`.
        embed_fn: ``embed_fn(embed_params, x) -> the first layer's input``, or ``None``
            (``x`` is that input). Given, ``params`` is ``(stacked_params, head_params,
            embed_params)``, the 1F1B schedules run it per micro-batch on stage 0, and ``x``
            is not differentiated (token ids, say).
        stream: the stack may live in host memory (``pinned_host``, laid out over the
            stages): each stage fetches its layers one at a time, as
            ``remat_scan(stream=True)``, and its backward passes add each layer's gradient
            to a sum kept where the stack lies; with ``"1f1b"`` or ``"interleaved_1f1b"``.
            The resident pipeline's loss and gradients, to float32 rounding
            (docs/streaming.md, "A pipeline's stages").

    Returns:
        A `jaxga.Mean`: the totals and counts of every micro-batch, summed (by the 1F1B
        schedules, in the dtype of ``head_fn``'s total, at least float32). Inside a
        ``shard_map`` over ``axis_name``: with ``"1f1b"`` and ``"interleaved_1f1b"``, that
        on every stage (a ``psum`` over the stages, after the ticks); with ``"gpipe"`` and
        ``"circular"``, that on the last stage alone, and on the others ``head_fn`` of what
        `pipeline_scan` returns there (the stage's input): no collective over the stages.
        `jaxga.value_and_grad` reads the last stage's, once; elsewhere, read it there.

    Examples:
        >>> import jax, jax.numpy as jnp, jaxga
        >>> mesh = jax.make_mesh((2,), ("stage",), devices=jax.devices()[:2])
        >>> stack = jnp.full((4, 3, 3), 0.1)
        >>> w = jax.device_put(stack, jax.NamedSharding(mesh, jax.P("stage")))
        >>> def layer(w, x):
        ...     return jnp.tanh(x @ w)
        >>> def head(v, y, t):
        ...     return jaxga.Mean.of((y @ v - t) ** 2)
        >>> x, t, v = jnp.ones((8, 3)), jnp.zeros(8), jnp.ones(3)
        >>> def total(params):
        ...     return jaxga.pipeline_loss(layer, head, params, x, t, num_microbatches=4).total
        >>> grads, _ = jax.jit(jax.grad(total))((w, v))
        >>> def plain(w):
        ...     return head(v, jaxga.remat_scan(layer, w, x), t).total
        >>> bool(jnp.allclose(grads, jax.grad(plain)(stack), rtol=1e-5))
        True
    """
    check_arity(head_fn, "head_fn", 3, "head_fn(head_params, y, targets) -> jaxga.Mean")
    stacked_params, head_params, embed_params = _parts(params, embed_fn)
    rows = {name: leading_size(v, name, "batch") for name, v in (("x", x), ("targets", targets))}
    if len(set(rows.values()) - {None}) > 1:
        raise ValueError(f"`x` and `targets` must have as many rows; got {rows}.")
    options = {"num_microbatches": num_microbatches, "axis_name": axis_name, "policy": policy}
    options |= {"schedule": schedule, "repeats": repeats, "rng": rng, "mesh": mesh}
    scanned = schedule in SCHEDULES and not SCHEDULES[schedule].manual  # the head after it
    heads = {} if scanned else {"head_fn": head_fn, "embed_fn": embed_fn}
    checked = stages_of(layer_fn, stacked_params, **heads, **options, stream=stream)
    stacked_params = checked.stacked_params
    if scanned:
        x = x if embed_fn is None else embed_fn(embed_params, x)
        inputs = Inputs(stacked_params, None, x, None, rng)
        y = pipelined(checked.stages, checked.route_kind, checked.mesh, inputs)
        return checked_mean(head_fn, head_params, y, targets)
    inputs = Inputs(stacked_params, head_params, x, targets, rng, embed=embed_params)
    return pipelined(checked.stages, checked.route_kind, checked.mesh, inputs)


def _parts(params: Any, embed_fn: Callable[..., Any] | None) -> tuple[Any, Any, Any]:
    """``pipeline_loss``'s ``params`` as ``(stacked, head, embed)`` (``embed`` None without
    ``embed_fn``), or a `TypeError` naming what they must be."""
    want = "a pair (stacked_params, head_params)"
    if embed_fn is not None:
        check_arity(embed_fn, "embed_fn", 2, "embed_fn(embed_params, x) -> x")
        want = "a triple (stacked_params, head_params, embed_params) with `embed_fn`"
    size, sequence = 2 if embed_fn is None else 3, isinstance(params, tuple | list)
    if not (sequence and len(params) == size):
        got = f"a {type(params).__name__}" + (f" of length {len(params)}" if sequence else "")
        raise TypeError(f"`params` must be {want}; got {got}.")
    return (*params, None) if embed_fn is None else tuple(params)
