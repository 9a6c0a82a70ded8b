"""quant/ is imported by model/, pallas_kernels/ and serving/, so it must import none of them."""

import ast
import pathlib

import quant

FORBIDDEN = {"model", "serving", "pallas_kernels", "training"}


def test_quant_imports_no_other_kvfold_package():
    offenders = []
    for path in pathlib.Path(quant.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in FORBIDDEN]
    assert not offenders, offenders
    assert len(list(pathlib.Path(quant.__file__).parent.glob("*.py"))) >= 8
