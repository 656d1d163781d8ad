"""No pickle, no eval/exec, no unsafe YAML anywhere in the kvtier package: the syntax tree of every file, checked.

Why a syntax tree and not grep: docstrings in the package say "never pickle"
(grep would flag them), while ``getattr(yaml, "load")`` or ``from pickle import
loads as l`` would slip past a plain text search of the call sites. Each rule
is shown to fire on a snippet first, so an empty result means something.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "kvtier"

# Modules whose loading runs code chosen by whoever wrote the bytes.
UNSAFE_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "jsonpickle", "shelve", "marshal", "joblib"}
UNSAFE_BUILTINS = {"eval", "exec", "compile", "__import__"}
SAFE_YAML = {"safe_load", "safe_load_all", "safe_dump", "safe_dump_all", "dump", "YAMLError", "SafeLoader"}
SAFE_LOADERS = {"SafeLoader", "CSafeLoader"}
UNSAFE_ATTRS = {"load", "load_all", "unsafe_load", "full_load", "loads"}  # by getattr: a loader in disguise


def _name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_name(node.value)}.{node.attr}"
    return "?"


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _yaml_call_is_safe(call: ast.Call, attr: str) -> bool:
    if attr in SAFE_YAML:
        return True
    loader = _keyword(call, "Loader") or (call.args[1] if attr in ("load", "load_all") and len(call.args) > 1 else None)
    return attr in ("load", "load_all") and loader is not None and _name(loader).split(".")[-1] in SAFE_LOADERS


def _call_findings(call: ast.Call) -> list[str]:
    func = _name(call.func)
    out = []
    if func in UNSAFE_BUILTINS or func in {f"builtins.{b}" for b in UNSAFE_BUILTINS}:
        out.append(f"{func}()")
    if func.startswith("yaml.") and not _yaml_call_is_safe(call, func.split(".", 1)[1]):
        out.append(f"{func}() without SafeLoader")
    attr = call.args[1] if func == "getattr" and len(call.args) > 1 else None
    if isinstance(attr, ast.Constant) and attr.value in UNSAFE_BUILTINS | UNSAFE_ATTRS:
        out.append(f"getattr(..., {attr.value!r})")
    if func == "torch.load" and not _is_true(_keyword(call, "weights_only")):
        out.append("torch.load() without weights_only=True (pickle)")
    if func in {"np.load", "numpy.load"} and _is_true(_keyword(call, "allow_pickle")):
        out.append("np.load(allow_pickle=True)")
    return out


def _is_true(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def findings(source: str) -> list[str]:
    """What the rules flag in ``source``, as ``"line: what"``."""
    out: list[str] = []
    for node in ast.walk(ast.parse(source)):
        found: list[str] = []
        if isinstance(node, ast.Import):
            found = [f"import {a.name}" for a in node.names if a.name.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module.split(".")[0] in UNSAFE_MODULES:
                found = [f"from {module} import ..."]
            elif module == "yaml":
                found = [f"from yaml import {a.name}" for a in node.names if a.name not in SAFE_YAML]
            elif module == "builtins":
                found = [f"from builtins import {a.name}" for a in node.names if a.name in UNSAFE_BUILTINS]
        elif isinstance(node, ast.Call):
            found = _call_findings(node)
        out += [f"{getattr(node, 'lineno', 0)}: {f}" for f in found]
    return out


@pytest.mark.parametrize(
    "snippet",
    [
        "import pickle",
        "import dill as d",
        "from pickle import loads as l",
        "from shelve import open",
        "eval('1')",
        "exec(code)",
        "builtins.exec(code)",
        "compile(src, 'f', 'exec')",
        "yaml.load(text)",
        "yaml.load(text, Loader=yaml.Loader)",
        "yaml.unsafe_load(text)",
        "yaml.full_load(text)",
        "from yaml import load",
        "getattr(yaml, 'load')(text)",
        "torch.load(path)",
        "np.load(path, allow_pickle=True)",
    ],
)
def test_each_rule_fires(snippet: str) -> None:
    assert findings(snippet), snippet


@pytest.mark.parametrize(
    "snippet",
    [
        "yaml.safe_load(text)",
        "yaml.safe_dump(tree)",
        "yaml.load(text, Loader=yaml.SafeLoader)",
        "re.compile('x')",
        "torch.load(path, weights_only=True)",
        '"""never pickle"""',
    ],
)
def test_safe_forms_pass(snippet: str) -> None:
    assert findings(snippet) == [], snippet


def test_the_package_has_no_pickle_eval_exec_or_unsafe_yaml() -> None:
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 50  # the whole package, not an empty glob
    bad = {str(f.relative_to(PACKAGE.parent)): found for f in files if (found := findings(f.read_text()))}
    assert bad == {}
