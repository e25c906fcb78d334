"""The environments ladle ships (``training.rl.environment: NAME``): the calculator, as an environment and as an
agent program."""

from __future__ import annotations

import ast
import json
import operator

from ladle.assets.calculator import CALCULATE

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


CALCULATOR_TOOLS = [CALCULATE]
"""``Calculator``'s tool in OpenAI's shape, as ``ladle.agents.environments`` describes it (a test keeps them equal)."""


def calculator_agent(client, model: str, messages: list[dict], **columns) -> None:
    """The calculator's episode as an agent program writes it with the OpenAI SDK
    (``training.rl.environment: calculator-agent``): the tool offered, each call run here and its result sent back,
    until the model answers without a call. Its episodes are the ``calculator`` environment's, token for token;
    it returns no reward of its own (the run's rewards judge the episode). A reference for your own program."""
    messages, calc = list(messages), Calculator()
    while True:
        reply = client.chat.completions.create(model=model, messages=messages, tools=CALCULATOR_TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))  # the reply sent back as it came
        if not message.tool_calls or reply.choices[0].finish_reason == "length":
            return
        for call in message.tool_calls:
            try:
                result = calc.calculate(**json.loads(call.function.arguments))
            except (TypeError, ValueError) as exc:  # arguments that are not the tool's: the model reads why
                result = f"error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name, "content": result})


ENVIRONMENTS = {
    "calculator": "ladle.agents.builtin:Calculator",
    "calculator-agent": "ladle.agents.builtin:calculator_agent",
}
