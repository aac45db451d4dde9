"""host/omp.py: a model load warns once where torch was imported before sluice with libgomp's spinning default,
and nowhere else (each case in a fresh interpreter: the check runs at `import sluice`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CODE = """
import logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
{first}
import sluice
from sluice.host import omp
print("torch_first", omp.TORCH_FIRST)
omp.warn_torch_first()
omp.warn_torch_first()
"""


def _run(first: str, **env_over) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(env_over)
    return subprocess.run([sys.executable, "-c", CODE.format(first=first)], env=env, capture_output=True, text=True,
                          check=True, timeout=120).stdout


@pytest.mark.parametrize("first,env,warns", [
    ("import torch", {}, True),
    ("", {}, False),  # sluice first: it set the policy before torch loaded libgomp
    ("import torch", {"OMP_WAIT_POLICY": "ACTIVE"}, False),  # the user chose a policy
    ("import torch", {"GOMP_SPINCOUNT": "0"}, False),
])
def test_warns_once_only_where_torch_came_first_with_the_default(first, env, warns):
    out = _run(first, **env)
    assert f"torch_first {warns}" in out
    assert out.count("torch was imported before sluice") == (1 if warns else 0)
