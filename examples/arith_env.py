"""A real (not simulated) environment for multi-turn rollouts: a calculator tool and a reward
that checks an arithmetic answer. Register it with a tool config (examples/arith_tools.toml):

    rollout-broker worker ... --tool-config examples/arith_tools.toml

and name it in a session: `metadata: {"tool": "calculator", "reward": "arith", "answer": 87}`.

The calculator reads the turn's output text, evaluates the last arithmetic expression in it
(numbers, + - * / and parentheses, nothing else is ever evaluated) and returns the value as the
next observation; a turn that says "ANSWER" ends the episode. The reward is 1.0 when the last
number in the final turn equals `metadata.answer`, else 0.0.
"""

from __future__ import annotations

import ast
import operator
import re

_EXPR = re.compile(r"[\d\s.()+\-*/]*\d[\d\s.()+\-*/]*")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.USub: operator.neg, ast.UAdd: operator.pos}


def evaluate(expression: str) -> float:
    """The value of an arithmetic expression; ValueError for anything else."""
    def walk(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return float(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")

    try:
        return walk(ast.parse(expression.strip(), mode="eval"))
    except (SyntaxError, ZeroDivisionError) as exc:
        raise ValueError(str(exc)) from None


def calculator(call: dict) -> dict:
    """Tool: evaluate the last arithmetic expression of the turn's output."""
    text = call.get("output_text", "")
    if "ANSWER" in text:
        return {"done": True}
    candidates = [m.group().strip() for m in _EXPR.finditer(text)]
    for expression in reversed([c for c in candidates if any(op in c for op in "+-*/")]):
        try:
            value = evaluate(expression)
        except ValueError:
            continue
        return {"observation_text": f"\ncalculator: {expression} = {value:g}\n"}
    return {"observation_text": f"\ncalculator: no expression in {text[-40:]!r}\n"}


def arith_reward(call: dict) -> float:
    """Reward: 1.0 when the final turn's last number equals metadata.answer."""
    texts = call.get("output_texts") or [""]
    numbers = _NUMBER.findall(texts[-1])
    answer = call.get("metadata", {}).get("answer")
    if not numbers or answer is None:
        return 0.0
    return 1.0 if abs(float(numbers[-1]) - float(answer)) < 1e-9 else 0.0
