"""notebooks/explore.ipynb runs top to bottom, headless, as a user's Jupyter would run it.

The kernel is this interpreter (the venv's python) through a kernelspec written for the test,
so no user- or system-level Jupyter set-up is needed or used. It sees two host devices, so the
notebook's tensor-parallel path (tp=2, all-reduces in the HLO) is the one exercised.
"""
import json
import re
import sys
from pathlib import Path

import pytest
from cpu_env import xla_flags

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

from jtp.demo import ensure_demo_checkpoint  # noqa: E402

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "explore.ipynb"
KERNEL = "jtp-test-python"


def test_notebook_is_stored_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)
    assert nb.metadata.kernelspec.name == "python3"


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("notebook")
    demo_dir = ensure_demo_checkpoint(tmp / "demo-qwen3")
    spec_dir = tmp / "jupyter" / "kernels" / KERNEL
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "jtp test kernel",
        "language": "python",
        # Replaces the tests' 8 forced devices (inherited from conftest's environment) with two.
        "env": {
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": xla_flags(2),
            "JTP_DEMO_DIR": str(demo_dir),
            "MPLBACKEND": "Agg",
        },
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))

    nb = nbformat.read(NOTEBOOK, as_version=4)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTER_PATH", str(tmp / "jupyter"))  # searched before any other kernelspec dir
        client = nbclient.NotebookClient(
            nb, kernel_name=KERNEL, timeout=300, resources={"metadata": {"path": str(NOTEBOOK.parent)}}
        )
        client.execute()  # raises CellExecutionError, with the cell and its traceback, on failure
    return nb


def text_of(cell) -> str:
    parts = []
    for out in cell.outputs:
        if out.output_type == "stream":
            parts.append(out.text)
        elif "text/plain" in out.get("data", {}):
            parts.append(out.data["text/plain"])
    return "".join(parts)


def test_every_cell_ran_without_error(executed):
    code = [c for c in executed.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code)
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, errors


def test_generation_cell_prints_text(executed):
    (cell,) = [c for c in executed.cells if "generate" in c.metadata.get("tags", [])]
    out = text_of(cell)
    generated = out.split("Hello, world", 1)[1].split("[finish_reason")[0]
    assert len(generated.split()) >= 5, out
    assert "\ufffd" not in out
    assert "chat:" in out


def test_shows_tp2_sharding_and_all_reduces(executed):
    out = "\n".join(text_of(c) for c in executed.cells if c.cell_type == "code")
    assert "tensor parallel size 2" in out
    assert "PartitionSpec" in out and "'tp'" in out
    # 2 per layer (o_proj, down_proj) + 1 for the vocab-parallel embedding lookup.
    found = re.search(r"(\d+) of them on \[tokens, hidden\] activations \(2 x \d+ layers \+ 1 = (\d+) expected", out)
    assert found and found[1] == found[2] and int(found[1]) > 0, out


def test_plots_latency_and_pool_usage(executed):
    code = [c for c in executed.cells if c.cell_type == "code"]
    images = [o for c in code for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) == 1
