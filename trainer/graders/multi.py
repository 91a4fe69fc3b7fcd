"""The multi grader: its named graders' rewards combined by ``calculate_output``.

The formula is parsed with :mod:`ast` into a whitelist and evaluated by walking it, never by ``eval``:
numbers, the graders' names, ``+ - * / **``, unary ``+ -``, parentheses, and calls of ``min``, ``max``,
``abs``, ``floor``, ``ceil``, ``exp``, ``sqrt``, ``log``. Anything else (attributes, subscripts, other
names or calls, keywords, strings) is a :class:`FormulaError` found at validation (``formula_parse_error``).
Arithmetic is in floats: a division by zero, a huge power, a log of zero or a result that is not a finite
number fails at grade time (``other_error``, the reason in ``scores["error"]``).
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable, Mapping
from typing import Any

from contract.graders import AnyGrader, MultiGrader
from trainer.graders.result import GraderErrors, GradeResult, merged_usage

FUNCTIONS: dict[str, Callable[..., float]] = {
    "min": min,
    "max": max,
    "abs": abs,
    "floor": math.floor,
    "ceil": math.ceil,
    "exp": math.exp,
    "sqrt": math.sqrt,
    "log": math.log,
}
_BINARY: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[float], float]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
#: The formula's nodes at most: its cost is known before it runs.
MAX_NODES = 1000


class FormulaError(Exception):
    """A formula outside the whitelist, or one that fails on these rewards."""


def parse(formula: str) -> ast.expr:
    """The formula's tree, every node checked against the whitelist (:class:`FormulaError` otherwise)."""
    try:
        tree = ast.parse(formula.strip(), mode="eval").body
    except (SyntaxError, RecursionError, MemoryError, ValueError) as err:
        raise FormulaError(f"not a formula: {getattr(err, 'msg', err)}") from None
    nodes = list(ast.walk(tree))
    if len(nodes) > MAX_NODES:
        raise FormulaError(f"the formula has {len(nodes)} parts, over the limit of {MAX_NODES}")
    for node in nodes:
        _check(node)
    return tree


def _check(node: ast.AST) -> None:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise FormulaError(f"{node.value!r} is not a number")
    elif isinstance(node, ast.Call):
        _check_call(node)
    elif isinstance(node, ast.BinOp):
        if type(node.op) not in _BINARY:
            raise FormulaError(f"the operator {type(node.op).__name__} is not allowed: use + - * / **")
    elif isinstance(node, ast.UnaryOp):
        if type(node.op) not in _UNARY:
            raise FormulaError("only unary + and - are allowed")
    elif not isinstance(node, ast.Name | ast.Load | ast.operator | ast.unaryop):
        raise FormulaError(f"{type(node).__name__} is not allowed in a formula")


def _check_call(node: ast.Call) -> None:
    if not (isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS) or node.keywords:
        raise FormulaError(f"only {', '.join(FUNCTIONS)} may be called, with plain arguments")
    if not node.args or any(isinstance(a, ast.Starred) for a in node.args):
        raise FormulaError(f"{node.func.id}() needs plain arguments")


def variables(tree: ast.expr) -> set[str]:
    """The names the formula reads (function names apart)."""
    called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and id(n) not in called}


def formula_errors(formula: str, names: set[str]) -> list[str]:
    """What is wrong with ``formula`` over graders named ``names``, before any sample."""
    try:
        unknown = sorted(variables(parse(formula)) - names)
    except FormulaError as err:
        return [str(err)]
    if unknown:
        return [
            f"{', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not a grader here: {sorted(names)}"
        ]
    return []


def evaluate(tree: ast.expr, values: Mapping[str, float]) -> float:
    """The formula's value on ``values`` (:class:`FormulaError` for arithmetic that fails)."""
    try:
        result = _value(tree, values)
    except (ArithmeticError, ValueError, TypeError) as err:
        raise FormulaError(f"the formula failed: {err}") from None
    if isinstance(result, complex) or not math.isfinite(result):
        raise FormulaError(f"the formula's value is not a finite number: {result}")
    return float(result)


def _value(node: ast.expr, values: Mapping[str, float]) -> float:
    if isinstance(node, ast.Constant):
        return float(node.value)  # type: ignore[arg-type]  # a number: parse() checked it
    if isinstance(node, ast.Name):
        if node.id not in values:
            raise ValueError(f"no grader named {node.id!r}")
        return float(values[node.id])
    if isinstance(node, ast.BinOp):
        return _BINARY[type(node.op)](_value(node.left, values), _value(node.right, values))
    if isinstance(node, ast.UnaryOp):
        return _UNARY[type(node.op)](_value(node.operand, values))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        return float(FUNCTIONS[node.func.id](*(_value(a, values) for a in node.args)))
    raise FormulaError(f"{type(node).__name__} is not allowed in a formula")


def grade_multi(grader: MultiGrader, grade_one: Callable[[AnyGrader], GradeResult]) -> GradeResult:
    """Each named grader through ``grade_one``, then the formula over their rewards."""
    results = {key: grade_one(sub) for key, sub in grader.graders.items()}
    errors = GraderErrors()
    for result in results.values():
        errors = errors.merged(result.errors)
    rewards = {key: result.reward for key, result in results.items()}
    usage = merged_usage(list(results.values()))
    scores: dict[str, Any] = {}
    try:
        reward = evaluate(parse(grader.calculate_output), rewards)
    except FormulaError as err:
        reward, scores["error"] = 0.0, str(err)
        errors = errors.merged(GraderErrors(other_error=True))
    total = sum(u.get("total_tokens", 0) for u in usage.values())
    return GradeResult(
        reward,
        grader.name,
        grader.type,
        errors,
        sub_rewards=rewards,
        scores=scores,
        token_usage=total if usage else None,
        usage_per_model=usage,
    )
