"""Where a result came from: the code, the libraries, the machine and the command.

Every ``summary.json`` (``splitfed run``, ``splitfed launch``) carries
``provenance()``: splitfed's version, the git commit of the source tree when splitfed runs
from a checkout (and whether it had uncommitted changes), a digest of the package's own
files (``source``: the code that ran, with or without git), the versions of Python, PyTorch
and numpy, torch's thread count and CPU kernel set (they decide the last bits of float
results), the platform and the command line, and ``plugins``: each plugin module the process
imported (``--plugin``, a config's ``plugins``, installed entry points) with a digest of
its files, so that a plugin's changed code, like splitfed's, makes a finished run stale.
Two results can be compared, or a finished run reused, only when their provenance says
the same code made them.
"""

from __future__ import annotations

import functools
import hashlib
import platform
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

import splitfed


@functools.lru_cache(maxsize=1)
def git_commit() -> tuple[str | None, bool | None]:
    """(commit, dirty) of the checkout splitfed is imported from; (None, None) when it is
    not a git checkout (an installed wheel) or git is unavailable."""
    root = Path(splitfed.__file__).resolve().parent.parent.parent
    if not (root / ".git").exists():
        return None, None
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"],
                                capture_output=True, text=True, timeout=10)
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                 "--untracked-files=no", "--", "src"],
                                capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None, None
    if commit.returncode != 0:
        return None, None
    return commit.stdout.strip(), bool(status.stdout.strip()) if status.returncode == 0 else None


#: the package files whose bytes make up the source digest (code, shipped configs, catalog)
SOURCE_SUFFIXES = (".py", ".yaml", ".json")


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """SHA-256 (hex) of the files of the imported splitfed package (``SOURCE_SUFFIXES``),
    each hashed with its path relative to the package, in sorted order: the same code gives
    the same digest on any machine, from a checkout, a copy without git metadata or an
    installed wheel; any change to the code or a shipped config changes it."""
    return tree_digest(Path(splitfed.__file__).resolve().parent)


def tree_digest(root: Path, suffixes: tuple[str, ...] = SOURCE_SUFFIXES) -> str:
    """The digest :func:`source_digest` takes of the package, of any directory ``root``
    (its files whose names end in one of ``suffixes``)."""
    h = hashlib.sha256()
    files = sorted(p for p in root.rglob("*") if p.suffix in suffixes
                   and p.is_file() and "__pycache__" not in p.parts)
    for p in files:
        h.update(p.relative_to(root).as_posix().encode() + b"\0")
        h.update(p.read_bytes() + b"\0")
    return h.hexdigest()


def plugin_digests() -> dict[str, str]:
    """``{module: digest}`` of the plugins imported so far
    (:data:`splitfed.origins.LOADED_PLUGINS`): a package's files as
    :func:`tree_digest` takes them, a single module's file, and with either the files of
    the helper modules its source imports from its own directory, and those their
    sources import from it in turn (:func:`_helpers`);
    ``"unknown"`` where the module has no file (built in memory)."""
    from splitfed.origins import LOADED_PLUGINS

    out = {}
    for name in LOADED_PLUGINS:
        module = sys.modules.get(name)
        digest = _module_digest(module) if module is not None else "unknown"
        helpers = _helpers(module) if module is not None and digest != "unknown" else []
        if helpers:
            h = hashlib.sha256(digest.encode())
            for path in helpers:
                try:
                    body = (tree_digest(path, (".py",)).encode() if path.is_dir()
                            else path.read_bytes())
                except OSError:
                    body = b"unreadable"
                h.update(path.name.encode() + b"\0" + body + b"\0")
            digest = h.hexdigest()
        out[name] = digest
    return out


def _helpers(module) -> list[Path]:
    """The files of the top-level modules that the plugin ``module``'s source imports
    (``import x``, ``from x import y``; read from the source, so every process finds the
    same ones whatever it imported before) and that lie beside it: in a single module's
    directory, or a package's parent directory, e.g. ``lab_helpers.py`` beside
    ``lab.py``, or a helper package's directory (its ``.py`` files count); and, the same
    way, the modules beside it that those helpers import, and so on (each once, so helpers
    that import each other end). None when that directory is an installation's
    site-packages (an installed plugin's neighbours are other distributions)."""
    paths = list(getattr(module, "__path__", None) or [])
    file = getattr(module, "__file__", None)
    try:
        own = Path(paths[0]).resolve() if paths else Path(file).resolve()
    except (TypeError, OSError):
        return []
    root = own.parent
    if root.name in ("site-packages", "dist-packages"):
        return []
    names: set[str] = set()
    found: dict[str, list[Path]] = {}
    todo = [own]
    while todo:
        for name in _imported_names(todo.pop()) - names:
            names.add(name)
            found[name] = [c for c in (root / f"{name}.py", root / name)
                           if c != own and (c.is_file() or c.is_dir())]
            todo.extend(found[name])
    return [path for name in sorted(found) for path in found[name]]


def _imported_names(path: Path) -> set[str]:
    """The top-level module names that the source of ``path`` imports (``import x``,
    ``from x import y``; not relative imports): a module's file, or every ``.py`` file
    under a package's directory; an unreadable or unparsable file imports nothing."""
    import ast

    sources = sorted(path.rglob("*.py")) if path.is_dir() else [path]
    names: set[str] = set()
    for source in sources:
        try:
            tree = ast.parse(source.read_bytes())
        except (OSError, SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names


def _module_digest(module) -> str:
    try:
        paths = list(getattr(module, "__path__", None) or [])
        if paths:                                   # a package: all of its files
            return tree_digest(Path(paths[0]).resolve())
        file = getattr(module, "__file__", None)
        if file:
            return hashlib.sha256(Path(file).read_bytes()).hexdigest()
    except OSError:
        pass
    return "unknown"


def cpu_capability() -> str:
    """The CPU kernels PyTorch dispatches to here (``AVX2``, ``AVX512``, ``DEFAULT``...)."""
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # noqa: BLE001 - an older or a non-x86 build
        return "unknown"


#: a URI's user information (``scheme://user:password@``), which :func:`redact` hides
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/@\s'\"]+@")


def redact(text: str) -> str:
    """``text`` with the user and password of each URI in it written ``***``
    (``http://me:token@host`` -> ``http://***@host``): what a command line or a config
    value says about a store, without its credentials."""
    return _USERINFO.sub(r"\1***@", text)


def provenance(command: list[str] | None = None) -> dict:
    """The provenance record (see the module doc); ``command`` defaults to ``sys.argv``,
    its URIs' credentials hidden (:func:`redact`)."""
    commit, dirty = git_commit()
    argv = sys.argv if command is None else command
    return {"splitfed": splitfed.__version__, "commit": commit, "dirty": dirty,
            "source": source_digest(), "plugins": plugin_digests(),
            "python": platform.python_version(), "torch": torch.__version__,
            "numpy": np.__version__, "threads": torch.get_num_threads(),
            "cpu_capability": cpu_capability(), "platform": platform.platform(),
            "command": redact(" ".join([Path(argv[0]).name, *argv[1:]])) if argv else None}
