"""Convolutions put in the layout XLA:CPU's fast kernels take, by rewriting a traced program."""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core
from jax.extend.core import primitives

from jaxga import _checks

Option = bool | str  # True, False or "auto": on CPU backends only
OPTION_VALUES = (True, False, "auto")


class Layout(NamedTuple):
    """Axis permutations between one convolution's layout and the canonical one."""

    lhs: tuple[int, ...]  # the input's axes, in (batch, spatial..., feature) order
    rhs: tuple[int, ...]  # the kernel's axes, in (spatial..., in feature, out feature) order
    out: tuple[int, ...]  # the output's axes, in (batch, spatial..., feature) order


def canonical_dimension_numbers(ndim: int) -> lax.ConvDimensionNumbers:
    """The dimension numbers of an NHWC input, HWIO kernel and NHWC output of ``ndim`` axes.

    Args:
        ndim: the number of axes of the input, 3 for 1D convolutions, 4 for 2D, 5 for 3D.

    Returns:
        `lax.ConvDimensionNumbers`, as ``("NHWC", "HWIO", "NHWC")`` gives for ``ndim=4``.

    Examples:
        >>> import jaxga.convolution as c
        >>> c.canonical_dimension_numbers(4)
        ConvDimensionNumbers(lhs_spec=(0, 3, 1, 2), rhs_spec=(3, 2, 0, 1), out_spec=(0, 3, 1, 2))
    """
    spatial = tuple(range(1, ndim - 1))
    return lax.ConvDimensionNumbers(
        lhs_spec=(0, ndim - 1, *spatial),
        rhs_spec=(ndim - 1, ndim - 2, *range(ndim - 2)),
        out_spec=(0, ndim - 1, *spatial),
    )


def _layout(numbers: lax.ConvDimensionNumbers) -> Layout:
    lhs, rhs, out = numbers
    return Layout(
        lhs=(lhs[0], *lhs[2:], lhs[1]),
        rhs=(*rhs[2:], rhs[1], rhs[0]),
        out=(out[0], *out[2:], out[1]),
    )


def is_canonical(eqn: core.JaxprEqn) -> bool:
    """Whether a ``conv_general_dilated`` equation is already NHWC/HWIO/NHWC (or no conv)."""
    if eqn.primitive is not primitives.conv_general_dilated_p:
        return True
    numbers = eqn.params["dimension_numbers"]
    return tuple(numbers) == tuple(canonical_dimension_numbers(len(numbers.lhs_spec)))


def _transposed_aval(aval: Any, permutation: tuple[int, ...]) -> Any:
    shape = tuple(aval.shape[i] for i in permutation)
    sharding = getattr(aval, "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec is None or len(spec) != len(permutation):
        return aval.update(shape=shape)
    permuted = jax.sharding.PartitionSpec(*(spec[i] for i in permutation))
    return aval.update(shape=shape, sharding=sharding.update(spec=permuted))


def _transposed(
    eqn: core.JaxprEqn, x: Any, permutation: tuple[int, ...], *, into: Any = None
) -> tuple[Any, list]:
    """``x`` transposed by ``permutation`` into ``into`` (default: a new variable), and its
    equation with ``eqn``'s source and context; or ``x`` itself, no equation."""
    if permutation == tuple(range(len(permutation))):
        return x, []
    into = core.Var(_transposed_aval(x.aval, permutation)) if into is None else into
    params = {"permutation": permutation}
    transpose = core.new_jaxpr_eqn(
        [x], [into], primitives.transpose_p, params, core.no_effects, eqn.source_info, eqn.ctx
    )
    return into, [transpose]


def _rewrite_conv(eqn: core.JaxprEqn) -> list[core.JaxprEqn]:
    """Transposes in, the canonical convolution, a transpose out: the same values."""
    if is_canonical(eqn) or eqn.params.get("out_sharding") is not None:
        return [eqn]  # explicitly sharded outputs are left as they are
    lhs, rhs = eqn.invars
    (out,) = eqn.outvars
    layout = _layout(eqn.params["dimension_numbers"])
    lhs_t, lhs_eqns = _transposed(eqn, lhs, layout.lhs)
    rhs_t, rhs_eqns = _transposed(eqn, rhs, layout.rhs)
    back = tuple(layout.out.index(axis) for axis in range(len(layout.out)))
    out_t, _ = _transposed(eqn, out, layout.out)  # a new variable, or `out` itself
    _, out_eqns = _transposed(eqn, out_t, back, into=out)
    params = {**eqn.params, "dimension_numbers": canonical_dimension_numbers(len(layout.lhs))}
    conv = eqn.replace(invars=[lhs_t, rhs_t], outvars=[out_t], params=params)
    return [*lhs_eqns, *rhs_eqns, conv, *out_eqns]


def needs_rewrite(jaxpr: core.Jaxpr) -> bool:
    """Whether ``jaxpr`` or a jaxpr in its equations' parameters has a non-canonical conv."""
    return any(
        not is_canonical(eqn) or any(map(needs_rewrite, core.jaxprs_in_params(eqn.params)))
        for eqn in jaxpr.eqns
    )


def _rewrite_param(value: Any) -> Any:
    if isinstance(value, tuple):
        return tuple(map(_rewrite_param, value))
    if isinstance(value, core.ClosedJaxpr):
        return core.ClosedJaxpr(rewrite_jaxpr(value.jaxpr), value.consts)
    if isinstance(value, core.Jaxpr):
        return rewrite_jaxpr(value)
    return value


def rewrite_jaxpr(jaxpr: core.Jaxpr) -> core.Jaxpr:
    """``jaxpr`` with every convolution, in it and its sub-jaxprs, put in canonical form.

    Args:
        jaxpr: a `jax.extend.core.Jaxpr`, e.g. ``jax.make_jaxpr(f)(*args).jaxpr``.

    Returns:
        A `Jaxpr` of the same inputs and outputs (``jaxpr`` itself when nothing changes),
        each non-canonical ``conv_general_dilated`` replaced by transposes around an
        NHWC/HWIO/NHWC one; an explicitly sharded (``out_sharding``) one is left as it is.

    Examples:
        >>> import jax, jax.numpy as jnp, jaxga.convolution as c
        >>> x, w = jnp.ones((2, 3, 8, 8)), jnp.ones((4, 3, 3, 3))  # NCHW, OIHW
        >>> jaxpr = jax.make_jaxpr(jax.lax.conv, static_argnums=(2, 3))(x, w, (1, 1), "SAME").jaxpr
        >>> [e.primitive.name for e in c.rewrite_jaxpr(jaxpr).eqns]
        ['transpose', 'transpose', 'conv_general_dilated', 'transpose']
    """
    if not needs_rewrite(jaxpr):
        return jaxpr
    eqns = []
    for eqn in jaxpr.eqns:
        if any(True for _ in core.jaxprs_in_params(eqn.params)):
            params = {name: _rewrite_param(value) for name, value in eqn.params.items()}
            eqn = eqn.replace(params=params)
        eqns.extend(_rewrite_conv(eqn))
    return jaxpr.replace(eqns=eqns)


def canonical_convolutions(fun: Callable[..., Any]) -> Callable[..., Any]:
    """``fun`` traced with every convolution in the NHWC/HWIO/NHWC layout: the same values.

    ``fun`` is traced to a jaxpr (its arguments are traced, as by ``jax.jit``); each
    ``lax.conv_general_dilated`` in it, and in the jaxprs it calls (``jit``, ``scan``,
    ``cond``, ``while``, ``checkpoint``, custom derivatives), whose input, kernel or output
    is in another layout becomes a transpose of each operand, the convolution in that
    layout, and a transpose back. Apply it to a gradient (``jax.value_and_grad(loss)``): the
    rewritten program is evaluated, not differentiated again. Why and when: see
    ``docs/gpus.md`` (convolutions in a loop on a CPU).

    Args:
        fun: a function of pytrees of arrays, returning a pytree of arrays.

    Returns:
        A function like ``fun``, tracing ``fun`` once per call.

    Examples:
        >>> import jax, jax.numpy as jnp, jaxga
        >>> def loss(w, x):  # NCHW input, OIHW kernel
        ...     return jnp.sum(jax.lax.conv(x, w, (1, 1), "SAME") ** 2)
        >>> w, x = jnp.ones((4, 3, 3, 3)), jnp.ones((2, 3, 8, 8))
        >>> value, grad = jaxga.canonical_convolutions(jax.value_and_grad(loss))(w, x)
        >>> bool(jnp.allclose(grad, jax.grad(loss)(w, x)))
        True
    """
    _checks.check_callable(fun, "fun", "a function of arrays, e.g. jax.value_and_grad(loss)")

    @functools.wraps(fun)  # its name and __wrapped__: a jit of it is named as fun's
    def rewritten(*args: Any, **kwargs: Any) -> Any:
        closed, shapes = jax.make_jaxpr(fun, return_shape=True)(*args, **kwargs)
        closed = core.ClosedJaxpr(rewrite_jaxpr(closed.jaxpr), closed.consts)
        outs = core.jaxpr_as_fun(closed)(*jax.tree.leaves((args, kwargs)))
        outs = [  # a constant output comes back as a Python number: an array, as from `fun`
            jnp.asarray(out) if isinstance(var, core.Literal) else out
            for var, out in zip(closed.jaxpr.outvars, outs)
        ]
        return jax.tree.unflatten(jax.tree.structure(shapes), outs)

    return rewritten


def with_vjp(forward: Callable[..., Any], backward: Callable[..., Any]) -> Callable[..., Any]:
    """A function of positional pytrees whose reverse-mode derivative is given: a
    ``jax.custom_vjp`` (reverse mode only).

    Args:
        forward: ``(*args) -> (output, residuals)``.
        backward: ``(residuals, cotangent) -> cotangents``: a tuple, one per argument.

    Returns:
        ``(*args) -> output``, differentiated by ``backward``.

    Examples:
        >>> import jax, jaxga.convolution as c
        >>> def forward(x):
        ...     return x * x, x
        >>> def backward(x, dy):
        ...     return (2 * x * dy,)
        >>> float(jax.grad(c.with_vjp(forward, backward))(3.0))
        6.0
    """

    @jax.custom_vjp
    def run(*args: Any) -> Any:
        return forward(*args)[0]

    run.defvjp(forward, backward)
    return run


def _call(fun: Callable[..., Any], consts: tuple, args: tuple) -> Any:
    return fun(*args, *consts)


def _forward(fun: Callable[..., Any], consts: tuple, args: tuple) -> tuple[Any, Any]:
    return jax.vjp(functools.partial(_call, fun), consts, args)  # the vjp keeps the residuals


def _backward(vjp: Callable[..., Any], cotangent: Any) -> Any:
    return canonical_convolutions(vjp)(cotangent)


def canonical_backward(fun: Callable[..., Any]) -> Callable[..., Any]:
    """``fun`` with its convolutions, and those of its reverse-mode derivative, in canonical form.

    ``fun`` rewritten by [`canonical_convolutions`][jaxga.canonical_convolutions], and the
    derivative ``jax.vjp`` gives for it, residuals and all (``jax.checkpoint`` policies
    inside ``fun`` apply as before), with its backward program rewritten too. A
    ``jax.custom_vjp``: reverse mode only (``jax.jvp`` of it raises); values ``fun`` closes
    over are differentiated too (``jax.closure_convert``).

    Args:
        fun: a function of positional pytrees of arrays, returning a pytree of arrays.

    Returns:
        A function like ``fun``.

    Examples:
        >>> import jax, jax.numpy as jnp, jaxga.convolution as c
        >>> def loss(w, x):  # NCHW input, OIHW kernel
        ...     return jnp.sum(jax.lax.conv(x, w, (1, 1), "SAME") ** 2)
        >>> w, x = jnp.ones((4, 3, 3, 3)), jnp.ones((2, 3, 8, 8))
        >>> bool(jnp.allclose(jax.grad(c.canonical_backward(loss))(w, x), jax.grad(loss)(w, x)))
        True
    """

    @functools.wraps(fun)  # its name and __wrapped__: a jit of it is named as fun's
    def rewritten(*args: Any) -> Any:
        converted, consts = jax.closure_convert(canonical_convolutions(fun), *args)
        forward = functools.partial(_forward, converted)
        return with_vjp(forward, _backward)(tuple(consts), args)

    return rewritten


def check_option(value: Any, name: str = "canonical_convolutions") -> Option:
    """Returns ``value`` if it is a ``canonical_convolutions`` option; raises if not.

    Args:
        value: the option given: ``True``, ``False`` or ``"auto"``.
        name: the argument's name, for the error.

    Returns:
        ``value``; raises ``ValueError`` for anything else (``1`` and ``None`` included).

    Examples:
        >>> import jaxga.convolution as c
        >>> c.check_option("auto"), c.check_option(False)
        ('auto', False)
    """
    if not any(value is v or (isinstance(value, str) and value == v) for v in OPTION_VALUES):
        raise ValueError(f"`{name}` must be True, False or 'auto'; got {value!r}.")
    return value


def rewrites(option: Option, backend: str | None = None) -> bool:
    """Whether ``option`` rewrites convolutions: ``"auto"`` on CPU backends only.

    Args:
        option: ``True``, ``False`` or ``"auto"``.
        backend: the platform; default: ``jax.default_backend()``, the default device's at
            trace time, not the platform a program is later compiled for (a program
            lowered for another platform, or placed on CPU devices beside a GPU, is rewritten
            as the default backend says; pass ``True`` or ``False`` to choose).

    Returns:
        ``option`` if a bool, else whether ``backend`` is ``"cpu"``.

    Examples:
        >>> import jaxga.convolution as c
        >>> c.rewrites("auto", "cpu"), c.rewrites("auto", "gpu"), c.rewrites(False, "cpu")
        (True, False, False)
    """
    if isinstance(check_option(option), bool):
        return option
    return (backend or jax.default_backend()) == "cpu"
