"""The layers import only downwards: job runner -> engine -> model -> kernels (connectors beside the job
runner). Read from the source, so a lazy import inside a function counts too."""
import ast
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# folder -> the batchrun packages it must never import
FORBIDDEN = {
    "batchrun/models": ("batchrun.engine", "batchrun.job"),
    "batchrun/engine": ("batchrun.job",),
    "kernels": ("batchrun.engine", "batchrun.models", "batchrun.job"),
    "connectors": ("batchrun.engine", "batchrun.models", "batchrun.job"),
}


def imports(path: str) -> list[tuple[int, str]]:
    tree = ast.parse(open(path).read(), path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
    return out


@pytest.mark.parametrize("folder", list(FORBIDDEN))
def test_no_import_from_a_higher_layer(folder):
    bad = []
    for root, _, files in os.walk(os.path.join(REPO, folder)):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                bad += [f"{os.path.relpath(path, REPO)}:{line} imports {mod}" for line, mod in imports(path)
                        if mod.startswith(FORBIDDEN[folder])]
    assert not bad, bad
