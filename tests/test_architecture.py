"""The architecture of docs/design.md holds (issue 13): layers are checked by import-linter
(`lint-imports`, contract in pyproject.toml, run by `make test`); this file checks the rest."""

from __future__ import annotations

import ast
import pathlib

import grimp
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LIB = sorted((ROOT / "dcp_datastates").rglob("*.py")) + sorted((ROOT / "cuda_ext").rglob("*.py"))
OPTIONAL = ("matplotlib", "torchtitan", "cuda", "zstandard")  # optional third-party packages may stay lazy


def test_no_import_cycle():
    g = grimp.build_graph("dcp_datastates", "cuda_ext", include_external_packages=False)
    face = {"dcp_datastates"}  # the package face imports everything and nothing imports it
    edges = {m: {i for i in g.find_modules_directly_imported_by(m) if i not in face}
             for m in g.modules if m not in face}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m):
        state[m] = 1
        path.append(m)
        for n in sorted(edges.get(m, ())):
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(n):] + [n]))
            if n not in state:
                visit(n)
        path.pop()
        state[m] = 2
    for m in sorted(edges):
        if m not in state:
            visit(m)


@pytest.mark.parametrize("path", LIB, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_imports_inside_functions(path):
    """Imports inside functions only keep an optional third-party package lazy."""
    tree = ast.parse(path.read_text())
    bad = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in ast.walk(fn):
                if isinstance(sub, ast.Import):
                    mods = [a.name for a in sub.names]
                elif isinstance(sub, ast.ImportFrom):
                    mods = ["." * sub.level + (sub.module or "")]
                else:
                    continue
                bad += [f"{path.name}:{sub.lineno} {m}" for m in mods if m.split(".")[0] not in OPTIONAL]
    assert not bad, bad


@pytest.mark.parametrize("path", LIB, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_frame_inspection_or_private_threading(path):
    text = path.read_text()
    for needle in ("_getframe", "f_locals", "_register_atexit"):
        assert needle not in text, f"{path.name} uses {needle}"


@pytest.mark.parametrize("path", LIB, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_class_over_350_lines(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            n = node.end_lineno - node.lineno + 1
            assert n <= 350, f"{path.name}: class {node.name} is {n} lines"


def test_writer_is_a_thin_adapter():
    """DataStatesWriter only adapts DCP's calls to the layers below (issue 13: under 300 lines)."""
    tree = ast.parse((ROOT / "dcp_datastates" / "save/writer.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DataStatesWriter")
    assert cls.end_lineno - cls.lineno + 1 < 300


def _package_module(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@pytest.mark.parametrize("path", LIB, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_private_name_crosses_modules(path):
    """A name beginning with ``_`` belongs to its module: no other module of the package imports it."""
    tree = ast.parse(path.read_text())
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] in
                                                 ("dcp_datastates", "cuda_ext")):
            bad += [f"{path.name}:{node.lineno} {a.name}" for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")]
    assert not bad, bad


def test_module_functions_do_not_write_a_writer_or_reader():
    """No module-level function takes the writer or reader and sets its fields: that work
    belongs to an object of its own (issue 34)."""
    bad = []
    for path in LIB:
        tree = ast.parse(path.read_text())
        for fn in tree.body:
            if not isinstance(fn, ast.FunctionDef):
                continue
            names = {a.arg for a in fn.args.args if a.annotation is not None
                     and any(k in ast.unparse(a.annotation) for k in ("DataStatesWriter", "DataStatesReader"))}
            for sub in ast.walk(fn):
                targets = sub.targets if isinstance(sub, ast.Assign) else \
                    [sub.target] if isinstance(sub, (ast.AugAssign, ast.AnnAssign)) else []
                for t in targets:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in names:
                        bad.append(f"{path.name}:{sub.lineno} {fn.name} sets {t.value.id}.{t.attr}")
    assert not bad, bad


def _calls(path: pathlib.Path, dotted: str) -> list[int]:
    tree = ast.parse(path.read_text())
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == dotted]


def test_one_fork_handler():
    """Process-wide state has one fork handler (``process_state``); modules register with it."""
    where = {str(p.relative_to(ROOT)): _calls(p, "os.register_at_fork") for p in LIB}
    assert {k: v for k, v in where.items() if v} == {"dcp_datastates/process_state.py": [where[
        "dcp_datastates/process_state.py"][0]]}


def test_one_check_of_the_process_group():
    """'Is there a process group' is asked in one helper (``process_state.group_up``)."""
    where = sorted(str(p.relative_to(ROOT)) for p in LIB if _calls(p, "dist.is_initialized"))
    assert where == ["dcp_datastates/process_state.py"]


# Process-wide state a forked child may keep as it is: registered types are the program's own;
# process_state's handlers and what they keep are the child's too; so is a framework's wrapping
PROCESS_STATE_KEPT_IN_CHILD = {"dcp_datastates/providers/registry.py", "dcp_datastates/process_state.py",
                               "dcp_datastates/integrations/accelerate.py"}


def _process_wide(path: pathlib.Path) -> list[str]:
    """Module-level registries and locks: an empty dict, list or set (filled as the process
    runs; a table written out in full is a constant), or a lock, condition or weak set
    (``threading.local`` is per thread: not counted)."""
    out = []
    for n in ast.parse(path.read_text()).body:
        if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
            name, value = n.targets[0].id, n.value
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.value is not None:
            name, value = n.target.id, n.value
        else:
            continue
        src = ast.unparse(value)
        if name != "__all__" and (src in ("{}", "[]", "set()", "dict()") or src.startswith(
                ("threading.Lock(", "threading.RLock(", "threading.Condition(", "weakref."))):
            out.append(name)
    return out


def test_every_process_wide_registry_says_what_a_forked_child_does():
    """A module that keeps process-wide objects (a registry, a lock a parent's thread may hold)
    registers what a forked child does with them (``process_state.in_child``)."""
    bad = {}
    # cuda_ext depends on nothing of ours: its handler is registered by the engine that uses it
    registered = {"cuda_ext/__init__.py"} if any("process_state.in_child(cuda_ext.after_fork_in_child)" in p.read_text()
                                                 for p in LIB) else set()
    for p in LIB:
        rel = str(p.relative_to(ROOT))
        held = _process_wide(p)
        if held and rel not in PROCESS_STATE_KEPT_IN_CHILD | registered and not _calls(p, "process_state.in_child") \
                and "@process_state.in_child" not in p.read_text():
            bad[rel] = held
    assert not bad, bad


# The modules that use torch.distributed's collectives themselves (docs/design.md lists them):
# replication, the cooperative load, the demo's launcher and the one helper of the rest.
COLLECTIVES = {"dcp_datastates/process_state.py", "dcp_datastates/load/cooperative.py",
               "dcp_datastates/cli_demo.py"}


def test_torch_distributed_only_where_the_design_says():
    bad = []
    for p in LIB:
        rel = str(p.relative_to(ROOT))
        for n in ast.walk(ast.parse(p.read_text())):
            mods = ([a.name for a in n.names] if isinstance(n, ast.Import) else
                    [f"{n.module}.{a.name}" for a in n.names] if isinstance(n, ast.ImportFrom) and n.module else [])
            if any(m in ("torch.distributed", "torch.distributed.distributed_c10d") for m in mods):
                if rel not in COLLECTIVES and not rel.startswith("dcp_datastates/replicas/"):
                    bad.append(f"{rel}:{n.lineno}")
    assert not bad, bad


def test_a_save_is_changed_only_by_itself():
    """Nothing outside ``RankSave`` sets a save's fields (``save.x = ...``)."""
    bad = []
    for p in LIB:
        if p.name == "rank_save.py":
            continue
        for n in ast.walk(ast.parse(p.read_text())):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AugAssign) else []
            for t in targets:
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "save":
                        bad.append(f"{p.name}:{n.lineno} save.{sub.attr}")
    assert not bad, bad


# Every place that commits a manifest, the one commit point's callers (docs/reliability.md):
# a save's first tier, a slower tier (per-rank manifests, and the coordinator's), a node's copy
# committed by replication, and the manifest a restore's repair places on a node.
MANIFEST_COMMITS = {"dcp_datastates/save/rank_save.py": 1, "dcp_datastates/tiers/persist.py": 2,
                    "dcp_datastates/replicas/work.py": 1, "dcp_datastates/replicas/moves.py": 1}


def test_manifests_are_committed_at_one_point():
    """Only ``tiers/commit.py`` writes a manifest (``StorageTier`` refuses one by any other way;
    only it and ``storage.py`` reach the seam's commit and rename), and these are its callers."""
    seam = {}
    for p in LIB:
        rel = str(p.relative_to(ROOT))
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("commit", "rename") \
                    and ast.unparse(n.func.value).endswith("backend"):
                seam.setdefault(rel, []).append(n.lineno)
    assert sorted(seam) == ["dcp_datastates/tiers/commit.py", "dcp_datastates/tiers/storage.py"], seam
    callers = {str(p.relative_to(ROOT)): len(_calls(p, "commit_manifest")) for p in LIB}
    assert {k: v for k, v in callers.items() if v} == MANIFEST_COMMITS


TESTS = sorted((ROOT / "tests").glob("test_*.py"))


def test_no_test_module_imports_another():
    """What tests share lives in support modules (``tests/README.md``), never in a test module."""
    bad = []
    for p in TESTS:
        for n in ast.walk(ast.parse(p.read_text())):
            mods = ([a.name for a in n.names] if isinstance(n, ast.Import) else
                    [n.module or ""] + [f"{n.module}.{a.name}" for a in n.names] if isinstance(n, ast.ImportFrom) else [])
            bad += [f"{p.name}:{n.lineno} {m}" for m in mods
                    if m.startswith("tests.test_") and m.split(".")[1] != p.stem]
    assert not bad, bad


@pytest.mark.parametrize("path", TESTS, ids=lambda p: p.name)
def test_no_test_file_over_800_lines(path):
    assert len(path.read_text().splitlines()) <= 800, path.name
