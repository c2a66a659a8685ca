#!/usr/bin/env python3
"""The import graph of each crate's source files: which file uses which (through `crate::`,
`super::` and `self::` paths and a module's own submodules), and the circles in it (strongly
connected components of more than one file). Exits 1 when there is a circle.

    scripts/import-graph.py            # every crate: files in circles, one circle per line
    scripts/import-graph.py --edges    # also every edge of each circle
"""
import os
import re
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
PATH = re.compile(r"\b(crate|super|self)((?:::\w+)+(?:::\*)?|::\*)")
GROUP = re.compile(r"\b(crate|super|self)((?:::\w+)*)::\{([^;]*?)\};", re.S)
COMMENT = re.compile(r"//[^\n]*")


def modules(src):
    """Module path (tuple) -> file, for every .rs file under `src`."""
    out = {}
    for d, _, files in os.walk(src):
        for f in files:
            if not f.endswith(".rs"):
                continue
            rel = os.path.relpath(os.path.join(d, f), src)[:-3].split(os.sep)
            if rel[-1] in ("mod", "lib", "main"):
                rel = rel[:-1]
            out[tuple(rel)] = os.path.join(d, f)
    return out


def expand_groups(text):
    """`crate::a::{b::X, c}` as `crate::a::b::X crate::a::c` (one level of nesting)."""
    def one(m):
        head = m.group(1) + m.group(2)
        parts = [p.strip() for p in re.split(r",(?![^{]*\})", m.group(3)) if p.strip()]
        return " ".join(f"{head}::{p.split(' as ')[0]}" for p in parts if p != "self") + ";"
    return GROUP.sub(one, text)


def inline_modules(text):
    """(name, start, end) of each inline `mod name { ... }` block, outermost first."""
    spans = []
    for m in re.finditer(r"\bmod (\w+)\s*\{", text):
        depth, i = 1, m.end()
        while depth and i < len(text):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        spans.append((m.group(1), m.start(), i))
    return spans


def resolve(mods, base, kind, rest):
    """The module a path names: the longest known module prefix."""
    if kind == "crate":
        start = ()
    elif kind == "super":
        start = base[:-1]
        while rest and rest[0] == "super":
            start, rest = start[:-1], rest[1:]
    else:
        start = base
    full = start + tuple(rest)
    for n in range(len(full), -1, -1):
        if full[:n] in mods:
            return full[:n]
    return None


def graph(src):
    mods = modules(src)
    edges = {m: set() for m in mods}
    for m, path in mods.items():
        text = expand_groups(COMMENT.sub("", open(path).read()))
        # Tests inside a file are the file's own; their imports do not shape the layers.
        text = text.split("#[cfg(test)]")[0]
        spans = inline_modules(text)
        for hit in PATH.finditer(text):
            kind, rest = hit.group(1), hit.group(2)
            # Inside an inline `mod x { ... }`, paths are relative to that module.
            base = m + tuple(name for name, a, b in spans if a <= hit.start() < b)
            target = resolve(mods, base, kind, rest.strip(":").split("::"))
            if target is not None and target != m:
                edges[m].add(target)
        # A module's own submodules used by name (`cpu::ops::f`, `use ops::X`).
        for child in (c for c in mods if len(c) == len(m) + 1 and c[:-1] == m):
            if re.search(rf"(?<![\w:]){child[-1]}::", text):
                edges[m].add(child)
    return mods, edges


def circles(edges):
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in edges:
        if v not in index:
            visit(v)
    return out


def name(m):
    return "::".join(m) or "lib"


def main():
    show_edges = "--edges" in sys.argv
    found = False
    crates = os.path.join(ROOT, "crates")
    for c in sorted(os.listdir(crates)):
        src = os.path.join(crates, c, "src")
        if not os.path.isdir(src):
            continue
        mods, edges = graph(src)
        comps = circles(edges)
        n_edges = sum(len(e) for e in edges.values())
        print(f"{c}: {len(mods)} files, {n_edges} imports, "
              f"{sum(len(x) for x in comps)} files in {len(comps)} circle(s)")
        for comp in comps:
            found = True
            print("  circle: " + ", ".join(name(m) for m in comp))
            if show_edges:
                inside = set(comp)
                for m in comp:
                    for t in sorted(edges[m] & inside):
                        print(f"    {name(m)} -> {name(t)}")
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
