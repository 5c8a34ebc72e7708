"""Which torch and Triton overlap runs with, and what it says otherwise: a communicator refuses
an unsupported torch, and a Triton backend or kernel that cannot run here (Triton missing or
older than the kernels compile with), in one line naming the version found, the supported
range and what still works here; and "auto" never picks what cannot run here (TP: symmetric or
chunked; the quantized collectives: the CUDA kernels; MoE: the torch send). The versions are
monkeypatched: this machine has the newest of each."""

import importlib.util
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks

pytestmark = pytest.mark.no_delay_pass  # no stream or twin op for delays to reorder

OLD_TRITON, OLD_TORCH = "3.3.1", "2.10.0"


def _set_triton(monkeypatch, state: str) -> None:
    """``state``: a version string for triton.__version__, or "missing" (not installed)."""
    if state == "missing":
        real = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a: None if name == "triton" else real(name, *a))
    else:
        import triton

        monkeypatch.setattr(triton, "__version__", state)


def _one_line(msg: str, *parts: str) -> None:
    assert "\n" not in msg, msg
    for part in parts:
        assert part in msg, (part, msg)


# ---- TPComm ---------------------------------------------------------------------------------

def _build_tp(backend, triton_version=None, torch_version=None):
    import triton

    from overlap.tp import TPComm

    if triton_version:
        triton.__version__ = triton_version
    if torch_version:
        torch.__version__ = torch_version
    try:
        comm = TPComm(dist.group.WORLD, backend=backend)
    except (ValueError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    comm.close()
    return f"built {comm.backend}"


def test_tpcomm_refuses_a_triton_older_than_the_kernels_need():
    (msg,) = run_ranks(_build_tp, 1, "triton", OLD_TRITON)
    assert msg.startswith("ValueError: TPComm: backend='triton'"), msg
    _one_line(msg, f"Triton {OLD_TRITON}", ">= 3.4", "'auto'", "'symmetric'", "'chunked'",
              "'unfused'", "rank 0")


def test_tpcomm_builds_on_the_oldest_supported_triton():
    assert run_ranks(_build_tp, 1, "triton", "3.4.0") == ["built triton"]


def test_tpcomm_refuses_a_torch_older_than_supported():
    (msg,) = run_ranks(_build_tp, 1, "chunked", None, OLD_TORCH)
    assert msg.startswith("RuntimeError: TPComm:"), msg
    _one_line(msg, f"torch {OLD_TORCH}", ">= 2.11", "rank 0")


def _resolve(monkeypatch, backend, *, device, hosts):
    """TPComm._resolve on a communicator of len(hosts) ranks, the rank exchange faked."""
    from overlap.tp import comm as tpc

    comm = object.__new__(tpc.TPComm)
    comm.world, comm.rank, comm.chunks, comm.group = len(hosts), 0, len(hosts), None
    comm.device = torch.device(device)

    def all_gather_object(out, obj, group=None):
        for r, host in enumerate(hosts):
            out[r] = (obj[0], obj[1], host)

    monkeypatch.setattr(tpc.dist, "all_gather_object", all_gather_object)
    return comm._resolve(backend, " (rank 0 of group g)")


@pytest.mark.parametrize("triton_state, hosts, want", [
    ("3.9.0", ("a", "a"), "triton"), ("3.4.0", ("a", "b"), "triton"),
    (OLD_TRITON, ("a", "a"), "symmetric"), (OLD_TRITON, ("a", "b"), "chunked"),
    ("missing", ("a", "a"), "symmetric"), ("missing", ("a", "b"), "chunked")])
def test_auto_never_picks_a_triton_that_cannot_run(monkeypatch, triton_state, hosts, want):
    _set_triton(monkeypatch, triton_state)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert _resolve(monkeypatch, "auto", device="cuda", hosts=hosts) == want
    said = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
    if want == "triton":
        assert said == []
    else:  # on CUDA, saying why the fused kernels are not used
        assert len(said) == 1, said
        _one_line(said[0], "backend='auto'", f"'{want}'", ">= 3.4",
                  "not installed" if triton_state == "missing" else f"Triton {triton_state}")


def test_auto_on_cpu_never_looks_at_triton(monkeypatch):
    _set_triton(monkeypatch, OLD_TRITON)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _resolve(monkeypatch, "auto", device="cpu", hosts=("a", "a")) == "symmetric"


@pytest.mark.parametrize("triton_state", [OLD_TRITON, "missing"])
def test_explicit_triton_refused_before_the_rank_exchange(monkeypatch, triton_state):
    _set_triton(monkeypatch, triton_state)
    with pytest.raises(ValueError, match=r"backend='triton' cannot run here") as err:
        _resolve(monkeypatch, "triton", device="cuda", hosts=("a", "a"))
    _one_line(str(err.value), ">= 3.4", "'symmetric'", "'chunked'", "rank 0 of group g")


# ---- the quantized collectives' kernels and the MoE send ------------------------------------

@pytest.mark.parametrize("triton_state", [OLD_TRITON, "missing"])
def test_quant_auto_takes_the_cuda_kernels_when_triton_cannot_run(monkeypatch, triton_state):
    from overlap.comm.quant import kernels as qk

    _set_triton(monkeypatch, triton_state)
    qk.triton_available.cache_clear()
    try:
        assert qk.resolve_impl("auto", torch.device("cuda", 0)) == "cuda"
        with pytest.raises(ValueError, match="impl 'triton'") as err:
            qk.resolve_impl("triton", torch.device("cuda", 0))
        _one_line(str(err.value), ">= 3.4", "'cuda'")
    finally:
        monkeypatch.undo()
        qk.triton_available.cache_clear()
    assert qk.resolve_impl("auto", torch.device("cuda", 0)) == "triton"


def _build_ep(kernel, triton_version):
    import triton

    from overlap.moe import EPComm

    triton.__version__ = triton_version
    try:
        comm = EPComm(dist.group.WORLD, backend="symmetric", max_tokens=8, kernel=kernel)
    except ValueError as exc:
        return f"ValueError: {exc}"
    comm.close()
    return f"built {comm.kernel}"


def test_epcomm_refuses_an_old_triton_kernel_and_auto_takes_torch():
    refused, auto = run_ranks(_build_ep, 1, "triton", OLD_TRITON)[0], run_ranks(
        _build_ep, 1, "auto", OLD_TRITON)[0]
    assert refused.startswith("ValueError: EPComm: kernel='triton'"), refused
    _one_line(refused, f"Triton {OLD_TRITON}", ">= 3.4", "'torch'")
    assert auto == "built torch"


def test_importing_the_communicators_on_an_old_torch_names_it():
    """Below 2.11 torch has no torch._opaque_base: the import says so, not just the name."""
    code = ("import sys, torch; sys.modules['torch._opaque_base'] = None; "
            f"torch.__version__ = '{OLD_TORCH}'\n"
            "for mod in ('overlap.tp', 'overlap.cp'):\n"
            "    try:\n        __import__(mod)\n    except ImportError as exc:\n"
            "        print(exc)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 2, run.stdout + run.stderr
    for line, mod in zip(lines, ("overlap.tp", "overlap.cp")):
        _one_line(line, f"{mod}: torch {OLD_TORCH}", ">= 2.11")
