#!/usr/bin/env python3
"""Fails when a crate's modules import each other in a circle.

Each crate is a stack of layers: a module imports only from modules below it, never one that
imports it back. Two levels are checked, from the `crate::` and `super::` paths in each
file's code (comments and `#[cfg(test)]` blocks and `tests/` folders left out: tests drive
the whole stack):
- the crate's top-level modules (a folder is one module), and
- inside each folder, its files (`mod.rs` is the folder's face and may use its files).

Usage: scripts/check-layers.py <crate src dir>...   (make lint runs it on every crate)
"""
import os
import re
import sys

PATH = re.compile(r"\b(crate|super)::((?:[a-z_][a-z0-9_]*::)*[a-z_][a-z0-9_]*)")


def module_of(root: str, path: str) -> list[str]:
    parts = os.path.relpath(path, root)[:-3].split(os.sep)
    if parts[-1] in ("mod", "lib", "main"):
        parts = parts[:-1]
    return parts


def code_of(path: str) -> str:
    text = open(path, encoding="utf-8").read()
    # A test module at the end of a file, and comment lines, import nothing of the crate's.
    text = re.split(r"#\[cfg\(test\)\]\s*mod\s+\w+\s*\{", text)[0]
    return "\n".join(l for l in text.splitlines() if not l.strip().startswith("//"))


def edges_of(root: str) -> dict[tuple[str, ...], set[tuple[str, ...]]]:
    """module -> modules it names, each as a path from the crate root."""
    edges: dict[tuple[str, ...], set[tuple[str, ...]]] = {}
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != "tests"]
        for name in files:
            if not name.endswith(".rs") or name == "tests.rs":
                continue
            path = os.path.join(folder, name)
            me = module_of(root, path)
            for kind, rest in PATH.findall(code_of(path)):
                segments = rest.split("::")
                if kind == "crate":
                    target = segments
                else:  # super:: from a file is its folder; from mod.rs, the folder's parent
                    target = me[:-1] + segments
                edges.setdefault(tuple(me), set()).add(tuple(target))
    return edges


def cycles(nodes: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in nodes.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in list(nodes):
        if v not in index:
            visit(v)
    return found


def check(root: str) -> list[str]:
    edges = edges_of(root)
    problems = []
    # Top level: a folder is one module.
    top: dict[str, set[str]] = {}
    for me, targets in edges.items():
        if not me:
            continue
        for t in targets:
            if t and t[0] != me[0]:
                top.setdefault(me[0], set()).add(t[0])
    for c in cycles(top):
        problems.append(f"{root}: top-level modules import each other: {' <-> '.join(c)}")
    # Inside each folder: its files, the folder's mod.rs left out.
    folders: dict[tuple[str, ...], dict[str, set[str]]] = {}
    for me, targets in edges.items():
        if len(me) < 2:
            continue
        folder, file = me[:-1], me[-1]
        for t in targets:
            if len(t) > len(folder) and t[: len(folder)] == folder and t[len(folder)] != file:
                sibling = t[len(folder)]
                if (*folder, sibling) in edges or os.path.exists(
                    os.path.join(root, *folder, sibling + ".rs")
                ):
                    folders.setdefault(folder, {}).setdefault(file, set()).add(sibling)
    for folder, graph in folders.items():
        for c in cycles(graph):
            where = "/".join(folder)
            problems.append(f"{root}: files of {where}/ import each other: {' <-> '.join(c)}")
    return problems


def main() -> int:
    problems = [p for root in sys.argv[1:] for p in check(root)]
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
