"""The environments ladle ships (``training.rl.environment: NAME``)."""

from __future__ import annotations

import ast
import operator

OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}
LARGEST = 10**15  # results and operands past this are refused: arithmetic, not a way to make huge numbers
MAX_EXPRESSION_CHARS = 200


class Calculator:
    """Arithmetic the model cannot do in its head (``training.rl.environment: calculator``): one tool,
    ``calculate``, that evaluates + - * / and brackets over numbers. It parses the expression as arithmetic (a
    syntax tree of numbers and those operators only) and never runs it as code; a bad expression is answered
    with an error text the model can read, not an exception."""

    def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: Numbers with + - * / and brackets, e.g. "12 * (3 + 4)".
        """
        if len(expression) > MAX_EXPRESSION_CHARS:
            return f"error: the expression is over {MAX_EXPRESSION_CHARS} characters"
        try:
            value = evaluate(ast.parse(expression.strip(), mode="eval").body)
        except ZeroDivisionError:
            return "error: division by zero"
        except (SyntaxError, ValueError, TypeError) as exc:
            return f"error: {exc}" if str(exc) else "error: not an arithmetic expression"
        return number_text(value)


def evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return check(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        return check(OPERATORS[type(node.op)](evaluate(node.left), evaluate(node.right)))
    raise ValueError("only numbers, + - * / and brackets are allowed")


def check(value: float) -> float:
    if abs(value) > LARGEST:
        raise ValueError(f"a number beyond {LARGEST:.0e}")
    return value


def number_text(value: float) -> str:
    """A whole number without a decimal point, else at most 6 decimals without trailing zeros."""
    if float(value).is_integer():
        return str(int(value))
    return f"{value:.6f}".rstrip("0").rstrip(".")


ENVIRONMENTS = {"calculator": "ladle.agents.builtin:Calculator"}
