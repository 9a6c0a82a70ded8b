"""pallas_kernels/ modules share helpers through public names, and the TPU and GPU kernels
of an op do not import each other: each compiles for its own platform alone."""

import ast
import pathlib

import pallas_kernels

ROOT = pathlib.Path(pallas_kernels.__file__).parent


def _imports():
    """(file relative to pallas_kernels/, imported module, imported name) of every `from
    pallas_kernels... import name` below pallas_kernels/."""
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pallas_kernels"):
                for alias in node.names:
                    yield path.relative_to(ROOT).as_posix(), node.module, alias.name


def test_no_module_imports_another_modules_private_name():
    imports = list(_imports())
    assert len(imports) >= 40  # the walk found the package
    private = [f"{path}: from {module} import {name}" for path, module, name in imports
               if name.startswith("_")]
    assert not private, private


def test_gpu_and_tpu_kernels_do_not_import_each_other():
    crossed = [f"{path}: from {module} import {name}" for path, module, name in _imports()
               if {pathlib.Path(path).stem, module.rsplit(".", 1)[-1]} == {"kernel_gpu", "kernel_tpu"}]
    assert not crossed, crossed
