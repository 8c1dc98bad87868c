"""Every argument a public docstring documents is one its function takes."""

import importlib
import inspect
import re

MODULES = ["graphattn.functional", "graphattn.nn", "graphattn.graphs", "graphattn.pe",
           "graphattn.datasets"]


def documented_arguments(doc: str) -> list[str]:
    """The names of the entries of a Google-style ``Args:`` section (``a, b (int): ...`` names
    two)."""
    lines = doc.expandtabs().splitlines()
    names = []
    for i, line in enumerate(lines):
        if line.strip() not in ("Args:", "Arguments:"):
            continue
        base, item = len(line) - len(line.lstrip()), None
        for entry in lines[i + 1:]:
            if not entry.strip():
                continue
            indent = len(entry) - len(entry.lstrip())
            if indent <= base:
                break
            item = indent if item is None else item
            match = re.match(r"\s*([\w*, ]+?)\s*[(:]", entry)
            if indent == item and match:
                names += [name.strip().lstrip("*") for name in match.group(1).split(",")]
    return names


def test_the_parser_reads_an_args_section():
    doc = """Text.

    Args:
        x (Tensor): the input,
            on two lines.
        axes, base: as elsewhere.
        **kwargs: passed on.

    Returns:
        y (Tensor): not an argument.
    """
    assert documented_arguments(doc) == ["x", "axes", "base", "kwargs"]


def _public_callables():
    seen = set()
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or id(obj) in seen:
                continue
            seen.add(id(obj))
            if inspect.isfunction(obj) and obj.__module__.startswith("graphattn"):
                yield f"{module_name}.{name}", obj, obj.__doc__
            elif inspect.isclass(obj) and obj.__module__.startswith("graphattn"):
                yield f"{module_name}.{name}", obj.__init__, obj.__doc__
                for method_name, method in vars(obj).items():
                    function = getattr(method, "__func__", method)
                    if inspect.isfunction(function) and not method_name.startswith("_"):
                        yield f"{module_name}.{name}.{method_name}", function, function.__doc__


def test_documented_arguments_exist():
    wrong, checked = [], 0
    for name, function, doc in _public_callables():
        parameters = inspect.signature(function).parameters
        if not doc or any(p.kind == p.VAR_KEYWORD for p in parameters.values()):
            continue
        for argument in documented_arguments(doc):
            checked += 1
            if argument not in parameters:
                wrong.append(f"{name}: {argument}")
    assert checked > 300
    assert not wrong, f"documented but not taken: {wrong}"
