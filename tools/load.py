"""Import a Python file of this checkout by its path. The tools run from tools/, so
the repository root is not on sys.path, and nothing is added to it."""

import importlib.util
import sys


def load_module(name, path):
    """Import the Python file `path` as module `name`."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
