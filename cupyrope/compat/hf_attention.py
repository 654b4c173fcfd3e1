"""Hugging Face attention forwards rewritten around one cupyrope call.

The attention layers of the Llama family project q and k, move the heads axis in front of the
tokens (``.view(hidden_shape).transpose(1, 2)``), in the QK-norm models normalise each head
(``self.q_norm`` / ``self.k_norm``: Qwen3 before the transpose, Gemma 3 after it; OLMo 2
normalises the whole projection before the view) and call
``apply_rotary_pos_emb(q, k, cos, sin)``. :func:`attention_form` reads the source of such a
``forward``; :meth:`AttentionForm.build` compiles a copy of it in which the rotation statement
calls a given function on the projections' own ``[B, S, H, D]`` views (the transposes of q and k
move after that call) and, for the fused build, on the projections before their norms, so that
one call normalises and rotates. Every other statement is the class's own code, compiled
against its own module's globals: the attention mask, KV cache, attention backend, sliding
window and soft-capping stay exactly as Hugging Face wrote them.

A forward that does not have exactly this shape is not rewritten (``attention_form`` returns
None): q and k must be assigned ``<expr>.transpose(1, 2)`` at the top level of the body, read by
nothing but (at most) their norm before the one ``apply_rotary_pos_emb(q, k, cos, sin)``
statement, with no decorator and no closure.
"""

from __future__ import annotations

import ast
import copy
import inspect
import textwrap
import types
from dataclasses import dataclass

# The module-level function the attention layers call, and the name the rewritten rotation
# statement calls instead (a closure variable of the compiled copy).
ROTARY = "apply_rotary_pos_emb"
CALL = "_cupyrope_rotate"


@dataclass(frozen=True)
class HeadsFirst:
    """How one of q and k reaches the rotation: the statement that assigns it
    ``<inner>.transpose(1, 2)`` (its index in the body), and its norm: the attribute of ``self``
    that normalises it (None: no norm) and where: ``"definition"`` (``self.norm(x).transpose(1,
    2)``, Qwen3), the index of a later ``x = self.norm(x)`` statement (Gemma 3), or
    ``"projection"``: an earlier ``x = self.norm(<projection>)`` statement (at
    ``projection_index``) normalises the whole projection before ``x.view(...)`` splits it into
    heads (OLMo 2)."""

    index: int
    norm: str | None
    norm_at: str | int | None
    projection_index: int | None = None


@dataclass(frozen=True)
class AttentionForm:
    """A ``forward`` whose rotation can be rewritten: its parsed definition, the names of q, k, cos
    and sin at the rotation statement (``rotation``: its index in the body) and how q and k
    reach it."""

    function: types.FunctionType
    tree: ast.FunctionDef
    filename: str
    rotation: int
    names: tuple[str, str, str, str]  # q, k, cos, sin
    q: HeadsFirst
    k: HeadsFirst

    @property
    def q_norm(self) -> str | None:
        return self.q.norm

    @property
    def k_norm(self) -> str | None:
        return self.k.norm

    @property
    def norms_after_transpose(self) -> bool:
        """Whether the layer normalises the heads after moving them (Gemma 3) rather than before
        (Qwen3); the norms of both are where they are for this to be one answer."""
        return isinstance(self.q.norm_at, int)

    @property
    def norms_over_projection(self) -> bool:
        """Whether the layer normalises the whole projections, all heads together (OLMo 2),
        rather than each head."""
        return self.q.norm_at == "projection"

    @property
    def can_fuse(self) -> bool:
        """Both q and k have a norm, at the same place (both in their definitions, both in
        statements after them, or both on the projections before the heads are split)."""
        def place(heads):
            return "after" if isinstance(heads.norm_at, int) else heads.norm_at

        return (self.q.norm is not None and self.k.norm is not None
                and place(self.q) == place(self.k))

    def projections(self, fused: bool) -> tuple[str, str] | None:
        """The attributes of ``self`` whose calls' outputs q and k are views of when they reach
        the rotation of :meth:`build`'s forward (``fused`` as there): ``self.<proj>(x).view(...)``
        (or ``.reshape``), or ``y = self.<proj>(x)`` then ``y.view(...)`` where the fused build
        drops the norm around the call (OLMo 2); None when either is anything else (a norm that
        stays the layer's own, another expression). cupyrope.compat.hf rotates such outputs where
        they are when the call is known to return a new tensor that nothing else holds."""
        names = tuple(self._projection(heads, fused) for heads in (self.q, self.k))
        return None if None in names else names

    def _projection(self, heads: HeadsFirst, fused: bool) -> str | None:
        body = self.tree.body
        self_name = self.tree.args.args[0].arg
        inner = body[heads.index].value.func.value  # <inner>.transpose(1, 2)
        if heads.norm is not None and not fused:
            return None  # the output of the layer's own norm reaches the rotation
        if heads.norm_at == "definition":
            inner = inner.args[0]  # self.norm(x) -> x
        if not (isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute)
                and inner.func.attr in ("view", "reshape")):
            return None
        source = inner.func.value
        if fused and heads.norm_at == "projection":
            statement = body[heads.projection_index]  # y = self.norm(self.<proj>(x))
            name = statement.targets[0].id
            if not (isinstance(source, ast.Name) and source.id == name) or any(
                    _mentions(s, name) for s in body[heads.projection_index + 1:heads.index]):
                return None
            return _self_call(statement.value.args[0], self_name)
        return _self_call(source, self_name)

    def build(self, rotate, *, fused: bool) -> types.FunctionType:
        """A copy of the forward whose rotation statement is ``q, k = rotate(self, q, k, cos,
        sin)``, then ``q = q.transpose(1, 2)`` and ``k = k.transpose(1, 2)``: q and k are the
        ``[B, S, H, D]`` projections (not transposed), ``rotate`` returns them rotated, still
        ``[B, S, H, D]``, and the layer's own transposes follow the call (so that the call is
        the rotation alone, and a layer makes as many views patched as not). ``fused``: q and k
        reach ``rotate`` before their norms, which ``rotate`` applies (only when
        :attr:`can_fuse`); otherwise the norms stay where the layer has them (a norm after the
        transpose then sees ``[B, S, H, D]``, which is the same per-head norm only for a norm
        over the last dim: the caller checks)."""
        if fused and not self.can_fuse:
            raise ValueError(f"{self.function.__qualname__}: q and k have no norms to fuse")
        tree = copy.deepcopy(self.tree)
        body = list(tree.body)
        dropped = set()
        for heads in (self.q, self.k):
            assignment = body[heads.index]
            inner = assignment.value.func.value  # <inner>.transpose(1, 2)
            if fused and heads.norm_at == "definition":
                inner = inner.args[0]  # self.norm(x) -> x
            elif fused and heads.norm_at == "projection":
                statement = body[heads.projection_index]  # x = self.norm(<projection>)
                statement.value = statement.value.args[0]
            elif fused:
                dropped.add(heads.norm_at)  # the statement x = self.norm(x)
            assignment.value = inner
        q, k, cos, sin = self.names
        self_name = tree.args.args[0].arg
        rotation = body[self.rotation]
        arguments = [ast.Name(name, ast.Load()) for name in (self_name, q, k, cos, sin)]
        rotation.value = ast.Call(func=ast.Name(CALL, ast.Load()), args=arguments, keywords=[])
        # The layer's own transposes, after the rotation: q = q.transpose(1, 2), then k's.
        transposes = [ast.copy_location(ast.Assign(
            targets=[ast.Name(name, ast.Store())],
            value=ast.Call(func=ast.Attribute(ast.Name(name, ast.Load()), "transpose", ast.Load()),
                           args=[ast.Constant(1), ast.Constant(2)], keywords=[])), rotation)
            for name in (q, k)]
        kept = []
        for i, statement in enumerate(body):
            if i not in dropped:
                kept.append(statement)
            if i == self.rotation:
                kept += transposes
        tree.body = kept
        return self._compile(tree, rotate)

    def _compile(self, tree: ast.FunctionDef, rotate) -> types.FunctionType:
        # Annotations are copied from the original rather than evaluated again.
        for arg in (*tree.args.posonlyargs, *tree.args.args, *tree.args.kwonlyargs,
                    tree.args.vararg, tree.args.kwarg):
            if arg is not None:
                arg.annotation = None
        tree.returns = None
        factory = ast.parse(f"def _cupyrope_factory({CALL}):\n    pass").body[0]
        factory.body = [tree, ast.Return(ast.Name(tree.name, ast.Load()))]
        module = ast.Module(body=[factory], type_ignores=[])
        ast.fix_missing_locations(module)
        code = compile(module, self.filename, "exec", dont_inherit=True)
        namespace: dict = {}
        exec(code, self.function.__globals__, namespace)  # the layer's own module's globals
        forward = namespace["_cupyrope_factory"](rotate)
        original = self.function
        forward.__defaults__ = original.__defaults__
        forward.__kwdefaults__ = original.__kwdefaults__
        forward.__annotations__ = dict(original.__annotations__)
        forward.__qualname__ = original.__qualname__
        forward.__module__ = original.__module__
        forward.__doc__ = original.__doc__
        forward.__wrapped__ = original
        return forward


_FORMS: dict = {}  # forward function -> its AttentionForm, or None


def attention_form(function) -> AttentionForm | None:
    """The :class:`AttentionForm` of an attention class's ``forward``, or None when it does not
    have the shape this module rewrites (memoised per function)."""
    try:
        return _FORMS[function]
    except (KeyError, TypeError):
        pass
    form = _read_form(function)
    try:
        _FORMS[function] = form
    except TypeError:  # unhashable: not a plain function anyway
        pass
    return form


def _read_form(function) -> AttentionForm | None:
    if not isinstance(function, types.FunctionType) or function.__code__.co_freevars:
        return None
    try:
        lines, first = inspect.getsourcelines(function)
        filename = inspect.getsourcefile(function) or function.__code__.co_filename
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError):
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.FunctionDef):
        return None
    definition = tree.body[0]
    if (definition.decorator_list or definition.name != function.__name__
            or not definition.args.args):
        return None
    ast.increment_lineno(tree, first - 1)  # tracebacks point at the layer's own source lines
    if any(isinstance(node, ast.Name) and node.id == CALL for node in ast.walk(definition)):
        return None
    self_name = definition.args.args[0].arg
    body = definition.body
    rotations = [i for i, statement in enumerate(body) if _rotation_names(statement)]
    mentions = sum(isinstance(node, ast.Name) and node.id == ROTARY
                   for node in ast.walk(definition))
    if len(rotations) != 1 or mentions != 1:
        return None
    names = _rotation_names(body[rotations[0]])
    if len(set(names)) != 4 or self_name in names:
        return None
    heads = [_heads_first(body, rotations[0], name, self_name) for name in names[:2]]
    if None in heads:
        return None
    return AttentionForm(function, definition, filename, rotations[0], names, heads[0], heads[1])


def _rotation_names(statement) -> tuple[str, str, str, str] | None:
    """(q, k, cos, sin) of a statement ``q, k = apply_rotary_pos_emb(q, k, cos, sin)``."""
    if not (isinstance(statement, ast.Assign) and len(statement.targets) == 1):
        return None
    target, call = statement.targets[0], statement.value
    if not (isinstance(target, ast.Tuple) and len(target.elts) == 2
            and all(isinstance(e, ast.Name) for e in target.elts)
            and isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
            and call.func.id == ROTARY and not call.keywords and len(call.args) == 4
            and all(isinstance(a, ast.Name) for a in call.args)):
        return None
    names = tuple(a.id for a in call.args)
    if (target.elts[0].id, target.elts[1].id) != names[:2]:
        return None
    return names


def _heads_first(body, rotation: int, name: str, self_name: str) -> HeadsFirst | None:
    """How ``name`` reaches the rotation statement (see :class:`HeadsFirst`), or None."""
    for index in range(rotation - 1, -1, -1):
        if _mentions(body[index], name):
            break
    else:
        return None
    # The last statement before the rotation that mentions the name: its norm, or its definition.
    norm, norm_at = None, None
    called = _self_call_on(body[index], name, self_name)
    if called is not None:
        norm, norm_at = called, index
        for index in range(index - 1, -1, -1):
            if _mentions(body[index], name):
                break
        else:
            return None
    definition = body[index]
    if not (isinstance(definition, ast.Assign) and len(definition.targets) == 1
            and isinstance(definition.targets[0], ast.Name) and definition.targets[0].id == name
            and _is_transpose_1_2(definition.value)):
        return None
    inner = definition.value.func.value
    wrapped = _self_call(inner, self_name)
    if wrapped is not None:
        if norm is not None:
            return None  # normalised twice: not a form this module knows
        norm, norm_at = wrapped, "definition"
    if norm is None and _is_view_of(inner, name):
        # x = self.norm(<projection>); ...; x = x.view(...).transpose(1, 2): the norm of the
        # whole projection, when that statement is the one that defines x
        for earlier in range(index - 1, -1, -1):
            if _mentions(body[earlier], name):
                norm = _projection_norm(body[earlier], name, self_name)
                if norm is not None:
                    return HeadsFirst(index, norm, "projection", projection_index=earlier)
                break
    return HeadsFirst(index, norm, norm_at)


def _is_view_of(node, name: str) -> bool:
    """Whether ``node`` is ``name.view(<one argument>)``."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "view" and isinstance(node.func.value, ast.Name)
            and node.func.value.id == name and len(node.args) == 1 and not node.keywords)


def _projection_norm(statement, name: str, self_name: str) -> str | None:
    """``attr`` of a statement ``name = self.attr(<expr not reading name>)``, else None."""
    if (isinstance(statement, ast.Assign) and len(statement.targets) == 1
            and isinstance(statement.targets[0], ast.Name) and statement.targets[0].id == name):
        attr = _self_call(statement.value, self_name)
        if attr is not None and not _mentions(statement.value, name):
            return attr
    return None


def _mentions(statement, name: str) -> bool:
    return any(isinstance(node, ast.Name) and node.id == name for node in ast.walk(statement))


def _is_transpose_1_2(node) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "transpose" and not node.keywords and len(node.args) == 2
            and all(isinstance(a, ast.Constant) and type(a.value) is int for a in node.args)
            and [a.value for a in node.args] == [1, 2])


def _self_call(node, self_name: str) -> str | None:
    """``attr`` of a call ``self.attr(x)`` (one positional argument), else None."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name) and node.func.value.id == self_name
            and len(node.args) == 1 and not node.keywords
            and not isinstance(node.args[0], ast.Starred)):
        return node.func.attr
    return None


def _self_call_on(statement, name: str, self_name: str) -> str | None:
    """``attr`` of a statement ``name = self.attr(name)``, else None."""
    if (isinstance(statement, ast.Assign) and len(statement.targets) == 1
            and isinstance(statement.targets[0], ast.Name) and statement.targets[0].id == name):
        attr = _self_call(statement.value, self_name)
        argument = statement.value.args[0] if attr is not None else None
        if isinstance(argument, ast.Name) and argument.id == name:
            return attr
    return None
