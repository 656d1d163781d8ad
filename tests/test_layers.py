"""Which package may import which, read from the code's own imports (every ``import``, at any depth).

The picture in ``ARCHITECTURE.md`` ("The cache seam") holds only while
nobody takes a shortcut across it, and a shortcut is one line anywhere in a
function. So the rules are checked on the syntax trees of the package, as
``tests/security/test_package_code.py`` checks them for pickle: a rule that
names a module nobody imports any more still passes, but one broken import
fails with the file and line.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kvtier"


def imports(source: str, here: str) -> list[tuple[int, str]]:
    """``(line, module)`` for every kvtier module the source of module ``here`` imports, relative ones resolved."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = here.rsplit(".", node.level)[0]
                base = f"{parent}.{base}" if base else parent
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{a.name}") for a in node.names]  # ``from kvtier import engine``
    return [(line, m) for line, m in found if m == "kvtier" or m.startswith("kvtier.")]


def imports_of(path: Path) -> list[tuple[int, str]]:
    return imports(path.read_text(), ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))


def files(under: str) -> list[Path]:
    root = PACKAGE / under
    return sorted(root.rglob("*.py")) if root.is_dir() else [root.with_suffix(".py")]


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


# (where, may import only these kvtier modules; None: any) and (where, must never import these)
ONLY = {
    "service/protocol": ("kvtier.stats",),  # the wire format owns its types; the stats tree is its message body
    "stats": (),  # ... and a leaf: no other core module reaches the socket through it
    "model": ("kvtier.model", "kvtier.errors", "kvtier.private"),  # weights, tokenizer, template: the bottom
    "web": ("kvtier.web", "kvtier.errors"),  # what both HTTP apps share holds neither
}
CACHE_INSIDE = ("kvtier.manager", "kvtier.service", "kvtier.fetch", "kvtier.promote", "kvtier.tierset")
"""The cache's implementations: above the seam only :mod:`kvtier.cache` is named."""

NEVER = {
    "engine": (*CACHE_INSIDE, "kvtier.server", "kvtier.route"),
    "server": (*CACHE_INSIDE, "kvtier.route"),
    "route": ("kvtier.engine", "kvtier.server", "kvtier.manager", "kvtier.tiers.disk", "kvtier.tiers.remote"),
    "connectors": (*CACHE_INSIDE, "kvtier.engine", "kvtier.server", "kvtier.route"),
    "keys": ("kvtier.engine", "kvtier.server", "kvtier.manager", "kvtier.service"),
}


@pytest.mark.parametrize("where", sorted(ONLY))
def test_a_package_imports_only_what_is_below_it(where: str) -> None:
    allowed = ONLY[where]
    broken = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {m}"
        for path in files(where)
        for line, m in imports_of(path)
        if not _within(m, allowed) and m != "kvtier"
    ]
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("where", sorted(NEVER))
def test_a_package_never_reaches_across_the_seam(where: str) -> None:
    banned = NEVER[where]
    broken = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {m}"
        for path in files(where)
        for line, m in imports_of(path)
        if _within(m, banned)
    ]
    assert not broken, "\n".join(broken)


def test_the_bench_harness_is_apart_from_the_product() -> None:
    """``kvtier bench`` is a command: its harness may use the product, never the other way round (only the
    CLI names it, lazily, to run one of its commands)."""
    broken = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {m}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if "bench" not in path.relative_to(PACKAGE).parts and path.name != "cli.py"
        for line, m in imports_of(path)
        if _within(m, ("kvtier.bench",))
    ]
    assert not broken, "\n".join(broken)


def test_the_reader_sees_imports_inside_functions_and_relative_ones() -> None:
    """The rules above mean something only if a shortcut in a function body is seen."""
    source = "import json\n\ndef f():\n    from kvtier.engine.runtime import load_model\n    from ..server import app\n"
    found = {m for _, m in imports(source, "kvtier.route.probe")}
    assert found == {"kvtier.engine.runtime", "kvtier.engine.runtime.load_model", "kvtier.server", "kvtier.server.app"}


def test_the_c_extensions_are_loaded_in_one_place() -> None:
    """``kvtier.extension`` alone imports them, so a missing build fails once, in one line, everywhere."""
    loaders = {
        f"{path.relative_to(PACKAGE.parent)}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line, m in imports_of(path)
        if m.startswith(("kvtier._native_kernels", "kvtier._native_io"))
    }
    assert {where.split(":")[0] for where in loaders} <= {"kvtier/extension.py"}, loaders
    assert 'importlib.import_module("kvtier._native' not in "".join(
        p.read_text() for p in PACKAGE.rglob("*.py") if p.name != "extension.py"
    )


FIRST_IMPORT = """
import importlib, pkgutil, sys
import kvtier
names = sorted(m.name for m in pkgutil.walk_packages(kvtier.__path__, "kvtier.") if ".\\x5fnative" not in m.name)
for name in names:
    for k in [k for k in sys.modules if k.startswith("kvtier") and not k.startswith("kvtier._native")]:
        del sys.modules[k]
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name and not err.name.startswith("kvtier"):
            continue  # an engine's own package (vllm, sglang, llama_cpp, zmq): its connector runs only there
        print(f"{name}: {err}")
    except Exception as err:
        print(f"{name}: {type(err).__name__}: {err}")
"""


def test_every_module_imports_when_it_is_the_first_one_imported() -> None:
    """A cycle between modules shows only in the order that enters it first (the engines' conftest found one)."""
    done = subprocess.run([sys.executable, "-c", FIRST_IMPORT], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and not done.stdout.strip(), done.stdout + done.stderr[-2000:]


CONNECTOR_IMPORTS = """
import sys
import kvtier.cache, kvtier.service.link
import kvtier.connectors.paged, kvtier.connectors.vllm_plan, kvtier.connectors.sglang_pages
import kvtier.connectors.llamacpp_format, kvtier.connectors.llamacpp_store
print(sorted(m for m in ("redis", "lmdb", "kvtier.manager", "kvtier.tiers.disk", "kvtier.tiers.remote", "kvtier.engine")
             if m in sys.modules))
"""


def test_a_connector_loads_the_seam_and_its_link_not_the_core() -> None:
    """Inside vLLM, SGLang or llama.cpp only the seam, the link and the connector's own modules load: no tier,
    no manager, no engine, neither redis nor lmdb (each engine's own modules need its venv; these do not)."""
    done = subprocess.run([sys.executable, "-c", CONNECTOR_IMPORTS], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr[-2000:]
