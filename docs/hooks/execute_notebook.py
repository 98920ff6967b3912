"""Execute one jupytext notebook script headless and write the executed ``.ipynb``.

``python docs/hooks/execute_notebook.py SCRIPT OUT.ipynb`` — run by the docs hook, one process
per notebook. As ``tests/test_notebooks.py`` does: a kernel that runs *this* interpreter (a
kernelspec written to a temporary directory), ``SIMKIT_FAST=1``, ``MPLBACKEND=Agg``, the
script's directory as the working directory, errors not allowed, a per-cell timeout.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

CELL_TIMEOUT_S = 600
KERNEL_NAME = "simkit-docs-python"


def main(script: str, out: str) -> None:
    import jupytext
    import nbformat
    from ipykernel.kernelspec import write_kernel_spec
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager
    from nbclient import NotebookClient

    script_path = Path(script).resolve()
    with tempfile.TemporaryDirectory() as kernels:
        spec_dir = Path(write_kernel_spec())
        shutil.copytree(spec_dir, Path(kernels) / KERNEL_NAME)
        shutil.rmtree(spec_dir, ignore_errors=True)
        ksm = KernelSpecManager(kernel_dirs=[kernels], ensure_native_kernel=False)
        nb = jupytext.read(script_path)
        km = AsyncKernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=ksm)
        client = NotebookClient(
            nb,
            km=km,
            timeout=CELL_TIMEOUT_S,
            allow_errors=False,
            resources={"metadata": {"path": str(script_path.parent)}},
        )
        env = dict(os.environ, SIMKIT_FAST="1", MPLBACKEND="Agg", PYTHONHASHSEED="0")
        client.execute(env=env, cleanup_kc=True)
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3 (ipykernel)",
        "language": "python",
    }
    out_path = Path(out)
    tmp = out_path.with_name(f".{out_path.name}.tmp")
    nbformat.write(nb, tmp)
    os.replace(tmp, out_path)


if __name__ == "__main__":
    main(*sys.argv[1:3])
