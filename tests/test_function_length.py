"""Every function in src/ fits on a screen: none is over MAX_LINES lines (its signature, docstring and body,
nested functions included), so a reader never scrolls through one job after another.

The house style aims at about 60 lines (split by job); this is the hard ceiling that fails the suite.
"""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
MAX_LINES = 100


def long_functions(source: str, path: str, limit: int = MAX_LINES) -> list[str]:
    """``["path:line name (n lines)", ...]`` for every function or method in ``source`` over ``limit`` lines."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            length = node.end_lineno - first + 1
            if length > limit:
                found.append(f"{path}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_function_in_src_is_over_the_limit():
    too_long = [
        hit
        for path in sorted(SRC.rglob("*.py"))
        for hit in long_functions(path.read_text(), path.relative_to(SRC.parent).as_posix())
    ]
    assert not too_long, f"functions over {MAX_LINES} lines; split them by job: {too_long}"


PLANTED = """\
def short():
    return 1


class A:
    @staticmethod
    def long():
        a = 1
        b = 2
        return a + b
"""


def test_the_check_names_a_long_function_and_counts_its_decorators():
    assert long_functions(PLANTED, "m.py", limit=4) == ["m.py:7 long (5 lines)"]
    assert long_functions(PLANTED, "m.py", limit=5) == []
