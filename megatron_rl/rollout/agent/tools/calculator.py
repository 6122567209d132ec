"""A calculator tool: arithmetic evaluated by walking the Python AST (never `eval`).

Accepted: int and float literals, + - * / // % **, unary + and -, parentheses. Anything else (names, calls,
attributes, comparisons, strings) is refused, and so is a non-finite result. Sizes are bounded so no expression
can stall the trainer: at most `MAX_CHARS` characters, integers of at most `MAX_BITS` bits (a power is refused
before it is computed when its result would exceed that).
"""

from __future__ import annotations

import ast
import math
import operator
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from megatron_rl.rollout.agent.tools.base import register_tool, string_argument

MAX_CHARS = 500
MAX_BITS = 4096

Number = int | float

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Number]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


class CalculatorError(ValueError):
    pass


def evaluate(expression: str) -> Number:
    """The value of an arithmetic expression; a CalculatorError (or ZeroDivisionError / OverflowError from the
    arithmetic itself) when it is not one or is too large."""
    if len(expression) > MAX_CHARS:
        raise CalculatorError(f"expression longer than {MAX_CHARS} characters")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SyntaxWarning)  # the model's text: an invalid literal is its error
            tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, RecursionError, MemoryError) as err:
        raise CalculatorError("not an arithmetic expression") from err
    except ValueError as err:  # a lone surrogate (UnicodeEncodeError), a null byte
        raise CalculatorError(f"not an arithmetic expression ({str(err).partition(':')[-1].strip() or err})") from err
    return _value(tree.body)


def _value(node: ast.expr) -> Number:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        operand = _value(node.operand)
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp):
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow):
            return _bounded(_power(left, right))
        if type(node.op) in _BINARY:
            return _bounded(_BINARY[type(node.op)](left, right))
    raise CalculatorError(f"unsupported: {ast.unparse(node)!r} (only numbers, + - * / // % ** and parentheses)")


def _power(base: Number, exponent: Number) -> Number:
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0:
        if max(abs(base).bit_length() - 1, 0) * exponent > MAX_BITS:  # lower bound of the result's bits
            raise CalculatorError(f"result larger than {MAX_BITS} bits")
    result = base**exponent
    if isinstance(result, complex):
        raise CalculatorError("complex result")
    return result


def _bounded(value: Number) -> Number:
    if isinstance(value, int) and value.bit_length() > MAX_BITS:
        raise CalculatorError(f"result larger than {MAX_BITS} bits")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result is not a finite number")
    return value


@register_tool("calculator")
class Calculator:
    name = "calculator"
    description = "Evaluate an arithmetic expression (numbers, + - * / // % ** and parentheses)."
    parameters = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "for example (12 + 7) * 3"}},
        "required": ["expression"],
    }

    def __call__(self, arguments: Mapping[str, Any]) -> str:
        expression = string_argument(arguments, "expression")
        if expression is None:
            return 'error: the calculator needs "expression" as a string'
        try:
            return str(evaluate(expression))
        except (ValueError, ArithmeticError) as err:  # CalculatorError is a ValueError
            return f"error: {err}"
