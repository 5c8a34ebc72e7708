"""CUDA state must not cross a fork (issue 47, cause 6): the launcher's ranks are forked from a
fork server that imports its preload modules first, and a process forked after CUDA was
initialised cannot use CUDA ("Cannot re-initialize CUDA in forked subprocess": every GPU test
failed so on the first GPU run). ``torch.cuda.is_available()`` alone initialises the driver.

There is no CUDA here, so the fork server is emulated as it runs: a fresh interpreter, the
launcher's environment, the parent's sys.path, then ``__import__`` of each module of every
preload list the project hands the launcher (the launcher's own, the test harness's, the main
job's, the selftest's), in order, with every torch.cuda entry point that initialises CUDA made
to raise. A module that touches CUDA at import fails this test, naming the module and the line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.no_delay_pass("no stream or twin op")

TESTS = Path(__file__).resolve().parent

# What the fork server's interpreter runs: the guard first, then the preload as forkserver.main
# does it (ImportError is skipped there too, so it is recorded, not raised).
_EMULATE = r"""
import json, sys, traceback
import torch
import torch.cuda

touched = []

def _guard(name):
    def refuse(*args, **kwargs):
        stack = [f for f in traceback.extract_stack()[:-1] if "torch/" not in f.filename]
        where = f"{stack[-1].filename}:{stack[-1].lineno}" if stack else "?"
        touched.append({"call": f"torch.cuda.{name}", "at": where, "module": current[0]})
        raise RuntimeError(f"CUDA touched in the fork server: torch.cuda.{name} at {where}")
    return refuse

for name in ("is_available", "device_count", "init", "_lazy_init", "current_device",
             "set_device", "get_device_capability", "get_device_properties", "get_device_name",
             "synchronize", "mem_get_info", "current_stream", "default_stream",
             "is_bf16_supported", "get_arch_list"):
    if hasattr(torch.cuda, name):
        setattr(torch.cuda, name, _guard(name))
for name in ("_cuda_getDeviceCount", "_cuda_init"):
    if hasattr(torch._C, name):
        setattr(torch._C, name, _guard(name))

current = [None]
failed = []
for modname in json.loads(sys.argv[1]):
    current[0] = modname
    try:
        __import__(modname)
    except ImportError as exc:
        failed.append([modname, repr(exc)])
    except Exception as exc:
        failed.append([modname, repr(exc)])
print(json.dumps({"touched": touched, "failed": failed}))
"""


def _preload_lists() -> dict[str, list[str]]:
    import harness
    from overlap.dist import launch
    from overlap.selftest import runner
    from overlap.train import elastic

    base = list(launch._PRELOAD)
    return {"launch": base, "harness": base + list(harness._PRELOAD),
            "main job": base + list(elastic._PRELOAD + elastic._PRELOAD_CHECKPOINT),
            "selftest": base + list(runner.preload_for("cpu"))}


def _emulate(modules: list[str], env: dict[str, str]) -> dict:
    run = subprocess.run([sys.executable, "-c", _EMULATE, json.dumps(modules)], env=env,
                         capture_output=True, text=True, timeout=300, cwd=TESTS.parent)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("triton_env", ["inherited", "unset"])
def test_no_preload_module_initialises_cuda(triton_env):
    """``inherited``: the launcher process imported overlap first, so TRITON_INTERPRET is set
    (the usual case); ``unset``: a launcher that did not (overlap decides at import)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    if triton_env == "unset":
        env.pop("TRITON_INTERPRET", None)
    problems = {}
    for name, modules in _preload_lists().items():
        got = _emulate(modules, env)
        if got["touched"] or got["failed"]:
            problems[name] = got
    assert not problems, json.dumps(problems, indent=1)


def test_the_guard_sees_a_module_that_touches_cuda(tmp_path):
    """The emulation is not blind: a preload module that asks for CUDA at import is named."""
    (tmp_path / "touches_cuda_at_import.py").write_text(
        "import torch\nHAS_GPU = torch.cuda.is_available()\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))
    got = _emulate(["torch", "touches_cuda_at_import"], env)
    assert [t["module"] for t in got["touched"]] == ["touches_cuda_at_import"], got
    assert got["touched"][0]["at"].endswith("touches_cuda_at_import.py:2"), got
