"""The checkout's folders are never top-level modules.

The repository's top-level folders (kernels/, engine/, cluster/, ...) are the product's
layout, installed as ``tandem.kernels``, ``tandem.engine``, ... (pyproject's package-dir
mapping). Each holds an ``__init__.py``, so wherever the checkout root is on ``sys.path``
they are also importable as ``kernels``, ``engine``, ...: names other distributions use
(transformers imports the PyPI package ``kernels``). The root gets onto ``sys.path`` in the
ordinary ways: ``python -m`` and ``python -c`` put the working directory first, pytest puts
the root there to import ``tests``, pytest-xdist hands it to its workers (and so to every
process they start) through ``PYTHONPATH``.

``install()`` runs when ``tandem`` is imported, so in every process tandem starts before
anything else of it: top-level imports of the layout's names skip the checkout root and a
working directory that holds such a folder, and find the installed package or nothing.
``python_argv()`` starts tandem's Python children with ``-P`` (no working directory on
their path) for the same reason, one step earlier.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys

# the repository's top-level package folders (pyproject.toml's package-dir)
LAYOUT = frozenset({"bench", "cluster", "decode", "engine", "gateway", "kernels", "kvtransfer", "prefill"})

_PACKAGE_DIR = os.path.dirname(os.path.realpath(__file__))


def checkout_root() -> str | None:
    """The checkout this tandem runs from (an editable install), or None (site-packages)."""
    root = os.path.dirname(_PACKAGE_DIR)
    return root if os.path.isfile(os.path.join(root, "pyproject.toml")) else None


def _holds_layout(directory: str) -> bool:
    return any(os.path.isfile(os.path.join(directory, name, "__init__.py")) for name in LAYOUT)


def shadowing_dirs() -> set[str]:
    """Real paths of the directories whose layout-named folders must not be top-level modules:
    the checkout root, and the working directory when it holds such a folder."""
    dirs = set()
    root = checkout_root()
    if root is not None:
        dirs.add(root)
    try:
        cwd = os.path.realpath(os.getcwd())
    except OSError:  # a working directory removed under us shadows nothing
        cwd = None
    if cwd is not None and _holds_layout(cwd):
        dirs.add(cwd)
    return dirs


def _real(entry: str) -> str:
    return os.path.realpath(entry or os.curdir)


def safe_path(path: list[str] | None = None) -> list[str]:
    """``path`` (sys.path by default) without the shadowing directories."""
    dirs = shadowing_dirs()
    return [entry for entry in (sys.path if path is None else path)
            if not isinstance(entry, str) or _real(entry) not in dirs]


class _LayoutSafePathFinder(importlib.machinery.PathFinder):
    """sys.path's finder, except that a layout name at the top level is looked up on the safe path."""

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if path is None and fullname in LAYOUT:
            path = safe_path()
        return super().find_spec(fullname, path, target)


def _shadowed(module) -> bool:
    origin = getattr(module, "__file__", None)
    if not origin:
        return False
    parent = os.path.dirname(os.path.dirname(os.path.realpath(origin)))
    return parent in shadowing_dirs()


def install() -> None:
    """Put the layout-safe finder in place of sys.path's (once), and forget a layout-named
    module something imported from the checkout before tandem was imported."""
    for i, finder in enumerate(sys.meta_path):
        if finder is _LayoutSafePathFinder:
            break
        if finder is importlib.machinery.PathFinder:
            sys.meta_path[i] = _LayoutSafePathFinder
            break
    for name in LAYOUT:
        module = sys.modules.get(name)
        if module is not None and _shadowed(module):
            for key in [key for key in sys.modules if key == name or key.startswith(name + ".")]:
                del sys.modules[key]


def python_argv(*args: str) -> list[str]:
    """The command line of a Python child: this interpreter with -P (the working directory is
    not put on its path), then ``args``."""
    return [sys.executable, "-P", *args]
