"""The Python package's shape: no import cycle between its modules (each
imports only modules below it), and a typed public surface (py.typed, every
public function and method annotated) that type checkers can rely on."""

import ast
import inspect
import os
import sys

from _support import SRC  # noqa: E402 (exits 77, skipped, without torch)

PKG = os.path.join(SRC, "python", "ferry")


def imports_of(path):
    """The package modules a module imports, wherever in it (function-level
    imports are how a cycle hides)."""
    out = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:
                out.add(node.module.split(".")[0])
            elif node.level == 1:
                out.update(a.name for a in node.names)
            elif node.level == 0 and node.module and node.module.startswith("ferry."):
                out.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[1] for a in node.names if a.name.startswith("ferry."))
    return out


def test_no_import_cycle():
    mods = {f[:-3] for f in os.listdir(PKG) if f.endswith(".py")}
    graph = {m: imports_of(os.path.join(PKG, m + ".py")) & mods for m in mods}
    graph.pop("__init__")  # the package imports its modules; none imports it back
    for m, deps in graph.items():
        assert "__init__" not in deps, m
    state = {}

    def visit(m, path):
        if state.get(m) == "done":
            return
        assert state.get(m) != "open", "import cycle: " + " -> ".join(path + [m])
        state[m] = "open"
        for d in sorted(graph.get(m, ())):
            visit(d, path + [m])
        state[m] = "done"

    for m in sorted(graph):
        visit(m, [])


def unannotated(fn, owner):
    sig = inspect.signature(fn)
    missing = [p.name for p in sig.parameters.values()
               if p.name not in ("self", "cls") and p.annotation is inspect.Parameter.empty]
    if sig.return_annotation is inspect.Signature.empty and fn.__name__ != "__init__":
        missing.append("return")
    return ["%s(%s)" % (owner, m) for m in missing]


def test_public_surface_is_annotated():
    import ferry

    assert os.path.isfile(os.path.join(PKG, "py.typed"))
    bad = []
    for name in ferry.__all__:
        obj = getattr(ferry, name)
        if inspect.isclass(obj):
            if issubclass(obj, BaseException) or obj.__module__.startswith("collections"):
                continue
            for mname, m in vars(obj).items():
                if mname.startswith("_") and mname != "__init__":
                    continue
                if isinstance(m, property):
                    m = m.fget
                elif isinstance(m, (classmethod, staticmethod)):
                    m = m.__func__
                if inspect.isfunction(m):
                    bad += unannotated(m, "%s.%s" % (name, mname))
        elif inspect.isfunction(obj):
            bad += unannotated(obj, name)
    assert not bad, "public API without type hints: " + ", ".join(bad)


def main():
    test_no_import_cycle()
    test_public_surface_is_annotated()
    print("ok")


if __name__ == "__main__":
    sys.exit(main())
