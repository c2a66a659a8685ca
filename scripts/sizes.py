#!/usr/bin/env python3
"""Source files and functions of `crates/*/src` past their size limits: a file over 650
lines, a function over 110 (the aim is ~600 and ~100; a flat table may run longer and is
named in ALLOWED). Exits 1 when something is over.

    scripts/sizes.py          # what is over, then the ten longest functions
"""
import os
import re
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
FILE_LIMIT, FN_LIMIT = 650, 110
# (file, function) pairs that are one flat table.
ALLOWED = set()
FN = re.compile(r"^\s*(pub(\([\w:]+\))?\s+)?(const\s+)?(async\s+)?(unsafe\s+)?(extern \"C\"\s+)?fn\s+(\w+)")
STRING = re.compile(r'"(\\.|[^"\\])*"')
CHAR = re.compile(r"b?'(\\.|[^'\\])'")


def code(line):
    """`line` without strings, char literals and comments (braces in them do not count)."""
    return STRING.sub('""', CHAR.sub("' '", line)).split("//")[0]


def functions(lines):
    """(name, first line, length) of each function with a body."""
    for i, line in enumerate(lines):
        m = FN.match(line)
        if not m:
            continue
        depth, started = 0, False
        for j in range(i, len(lines)):
            c = code(lines[j])
            if not started and c.rstrip().endswith(";") and "{" not in c:
                break
            for ch in c:
                if ch == "{":
                    depth, started = depth + 1, True
                elif ch == "}":
                    depth -= 1
            if started and depth <= 0:
                yield m.group(7), i + 1, j - i + 1
                break


def main():
    over, longest = [], []
    for crate in sorted(os.listdir(os.path.join(ROOT, "crates"))):
        src = os.path.join(ROOT, "crates", crate, "src")
        for d, _, files in os.walk(src):
            for f in sorted(files):
                if not f.endswith(".rs"):
                    continue
                path = os.path.join(d, f)
                rel = os.path.relpath(path, ROOT)
                with open(path) as fh:
                    lines = fh.read().split("\n")
                if len(lines) > FILE_LIMIT:
                    over.append(f"{rel}: {len(lines)} lines")
                for name, at, n in functions(lines):
                    longest.append((n, f"{rel}:{at} {name}"))
                    if n > FN_LIMIT and (rel, name) not in ALLOWED:
                        over.append(f"{rel}:{at} fn {name}: {n} lines")
    for o in over:
        print("over:", o)
    print("longest functions:")
    for n, where in sorted(longest, reverse=True)[:10]:
        print(f"  {n:4} {where}")
    sys.exit(1 if over else 0)


if __name__ == "__main__":
    main()
