"""The example notebook runs top to bottom in a real ipykernel, top-level await and all."""

from __future__ import annotations

import nbformat
import pytest
from nbclient import NotebookClient
from support.paths import REPO_ROOT

NOTEBOOK = REPO_ROOT / "examples" / "notebook.ipynb"


@pytest.mark.slow
def test_example_notebook_executes(shared_manager, monkeypatch):
    monkeypatch.setenv("LOOM_MANAGER_SOCKET", str(shared_manager.socket))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3").execute()
    outputs = "".join(
        out.get("text", "") for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs
    )
    assert "warm: True" in outputs
    assert "Paris" in outputs  # the streamed chat answer
    assert "'The capital of Italy is' ->" in outputs  # the LLM facade
    assert "(trio)" in outputs
