#!/usr/bin/env python3
"""Layers point one way: fails when a package includes or links a package above it.

Usage: check_layers.py REPO_ROOT   (ctest runs it as the test `layers`)

LAYERS is the one table of packages, lowest first. A C++ file (.h, .cc, .cu, .cuh) of a package
may #include "..." files of its own package and of the packages before it; a CMake target of a
package may link (target_link_libraries) targets of its own package and of the packages before it.
Every folder under server/, kernels/ and client/ must belong to a package of the table, so a new
folder is placed in the order when it is added. Tests (tests/) may include and link anything.
"""
import os
import re
import sys

# (package, folders it is made of), lowest first. Each folder holds its subfolders, except those
# that another entry names (server/ is the commands: main.cc and the *_command files).
LAYERS = [
    ("kernels", ["kernels"]),
    ("base", ["server/base"]),
    ("proto", ["proto"]),
    ("checkpoint", ["server/checkpoint"]),
    ("compute", ["server/compute"]),
    ("store", ["server/store"]),
    ("job", ["server/job"]),
    ("tokenizer", ["server/tokenizer"]),
    ("fixture", ["server/fixture"]),
    ("model", ["server/model"]),
    ("calibration", ["server/calibration"]),
    ("evaluation", ["server/evaluation"]),
    ("pipeline", ["server/pipeline"]),
    ("metrics", ["server/metrics"]),
    ("scheduler", ["server/scheduler"]),
    ("api", ["server/api"]),
    ("ops", ["server/ops"]),
    ("commands", ["server"]),
    ("client", ["client"]),
]
# Generated headers: include path prefix -> package.
GENERATED = {"quantd/v1/": "proto"}
CHECKED_ROOTS = ["kernels", "server", "client", "proto"]
SOURCE_EXTS = (".h", ".cc", ".cu", ".cuh")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
TARGET_DEF = re.compile(r"\badd_(?:library|executable)\(\s*([A-Za-z0-9_]+)")
LINK = re.compile(r"\btarget_link_libraries\(\s*([A-Za-z0-9_]+)([^)]*)\)", re.S)

FLOOR = {name: i for i, (name, _) in enumerate(LAYERS)}
FOLDERS = sorted(((folder, name) for name, folders in LAYERS for folder in folders),
                 key=lambda entry: -len(entry[0]))


def package_of(path):
    """The package of a repository path (a file or a folder), or None."""
    for folder, name in FOLDERS:
        if path == folder or path.startswith(folder + "/"):
            return name
    for prefix, name in GENERATED.items():
        if path.startswith(prefix):
            return name
    return None


def check_includes(root, errors):
    for top in CHECKED_ROOTS:
        for dirpath, _, files in os.walk(os.path.join(root, top)):
            rel_dir = os.path.relpath(dirpath, root)
            if package_of(rel_dir) is None:
                errors.append(f"{rel_dir}/: in no package of tests/check_layers.py LAYERS")
                continue
            for f in sorted(files):
                if not f.endswith(SOURCE_EXTS):
                    continue
                rel = os.path.join(rel_dir, f)
                pkg = package_of(rel)
                with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as fh:
                    text = fh.read()
                for m in INCLUDE.finditer(text):
                    inc = m.group(1)
                    dep = package_of(inc)
                    if dep is None or FLOOR[dep] <= FLOOR[pkg]:
                        continue
                    line = text.count("\n", 0, m.start()) + 1
                    errors.append(f"{rel}:{line}: includes {inc}: {pkg} may not include {dep}, "
                                  f"a package above it")


def check_links(root, errors):
    targets = {}  # CMake target -> package
    links = []  # (CMakeLists path, target, linked items)
    for top in CHECKED_ROOTS:
        for dirpath, _, files in os.walk(os.path.join(root, top)):
            if "CMakeLists.txt" not in files:
                continue
            rel = os.path.relpath(os.path.join(dirpath, "CMakeLists.txt"), root)
            pkg = package_of(os.path.relpath(dirpath, root))
            with open(os.path.join(root, rel), encoding="utf-8") as fh:
                text = re.sub(r"#[^\n]*", "", fh.read())
            for m in TARGET_DEF.finditer(text):
                targets[m.group(1)] = pkg
            for m in LINK.finditer(text):
                links.append((rel, m.group(1), m.group(2).split()))
    for rel, target, items in links:
        pkg = targets.get(target)
        if pkg is None:
            continue
        for item in items:
            dep = targets.get(item)
            if dep is not None and FLOOR[dep] > FLOOR[pkg]:
                errors.append(f"{rel}: {target} links {item}: {pkg} may not link {dep}, "
                              f"a package above it")


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..")
    errors = []
    check_includes(root, errors)
    check_links(root, errors)
    for e in errors:
        print(e)
    if errors:
        print(f"{len(errors)} layering violations; the order is LAYERS in tests/check_layers.py")
        return 1
    print("layers: " + " < ".join(name for name, _ in LAYERS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
