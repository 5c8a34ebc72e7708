"""The one naming scheme for overlap's profiler ranges, shared by the writer and the reader.

The runtime names its ranges with the builders below, ``overlap-analyze`` reads them back with
``classify_range``; a comm range on the training thread holds only a launch or a wait:

    step:<n>                         one training step, the analyzer's unit of report
    comm_wait:<what>                 the host blocked on communication (a wait)
    comm:<what> / compute:<what>     communication / compute without a finer name
    <path>.<role>[<index>].<suffix>  a piece of an op: all_gather_matmul.chunked.comm[3].wait
        path   <op>.<backend>, pp.stage<s>, dp.grads, dp.params, quant.<op>
        role   comm; gemm, compute, F, B, I, W, quantize, dequantize (compute); fused
        index  optional, free text without ]; suffix optional: wait = a blocking wait
    gloo:*, nccl:*, c10d::*, record_param_comms: comm; aten::*: compute; ProfilerStep#<n>: step

The narrative (roles, device rows, examples): docs/design/profiling.md.
"""

from __future__ import annotations

import dataclasses
import re

from overlap.kernels import registry

__all__ = ["COMM", "COMPUTE", "FUSED", "STEP", "Kind", "Piece", "parse", "classify_range",
           "classify_kernel", "classify_memcpy", "is_project_range", "step_number", "step",
           "comm_wait", "comm", "compute", "chunk", "pp_action", "dp_bucket", "quant",
           "AXES", "OTHER", "TP_OPS", "axis_of", "is_fused_op"]

COMM, COMPUTE, FUSED, STEP = "comm", "compute", "fused", "step"

STEP_PREFIX, COMM_WAIT_PREFIX = "step:", "comm_wait:"
COMM_PREFIX, COMPUTE_PREFIX = "comm:", "compute:"
ROLES = {"comm": COMM, "gemm": COMPUTE, "compute": COMPUTE, "fused": FUSED, "F": COMPUTE,
         "B": COMPUTE, "I": COMPUTE, "W": COMPUTE, "quantize": COMPUTE, "dequantize": COMPUTE}
PP_ACTIONS = ("F", "B", "I", "W")
_THIRD_PARTY_COMM = ("gloo:", "nccl:", "c10d::", "record_param_comms")

# The kinds communication is reported by; a name's first part maps to one (moe is EP).
AXES = ("tp", "pp", "dp", "ep", "cp", "offload")
OTHER = "other"
_AXIS_OF_HEAD = {**{a: a for a in AXES}, "moe": "ep"}
# The fused comm+GEMM TP ops: their pieces are ``<op>[_backward].<backend>.<role>[..]``.
TP_OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")
_HEAD = re.compile(r"[A-Za-z0-9_]+")

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_PIECE = re.compile(rf"^(?P<path>{_IDENT}(?:\.{_IDENT})*)\.(?P<role>{'|'.join(ROLES)})"
                    rf"(?:\[(?P<index>[^\]]*)\])?(?:\.(?P<suffix>{_IDENT}))?$")
_STEP = re.compile(r"^(?:step:|ProfilerStep#)\s*(-?\d+)")


@dataclasses.dataclass(frozen=True, slots=True)
class Kind:
    """What a range or row is: ``kind`` is COMM, COMPUTE, FUSED or STEP; ``wait`` marks time
    spent blocked on a peer (a ``comm_wait:`` or ``.wait`` range, a signal-wait kernel)."""
    kind: str
    wait: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class Piece:
    path: str
    role: str
    index: str | None
    suffix: str | None


def parse(name: str) -> Piece | None:
    """The parts of a ``<path>.<role>[<index>].<suffix>`` name, or None."""
    m = _PIECE.match(name)
    if m is None:
        return None
    return Piece(m["path"], m["role"], m["index"], m["suffix"])


def step_number(name: str) -> int | None:
    m = _STEP.match(name)
    return int(m.group(1)) if m else None


def is_project_range(name: str) -> bool:
    """True for names this scheme defines (not PyTorch's own), used to label device rows."""
    return (name.startswith((COMM_WAIT_PREFIX, COMM_PREFIX, COMPUTE_PREFIX))
            or parse(name) is not None)


def classify_range(name: str) -> Kind | None:
    """The kind of a host range (NVTX or record_function) by name, or None if it is neither
    communication, compute nor a step (bookkeeping, Python frames, unknown names)."""
    if name.startswith(STEP_PREFIX) or name.startswith("ProfilerStep#"):
        return Kind(STEP)
    if name.startswith(COMM_WAIT_PREFIX):
        return Kind(COMM, wait=True)
    if name.startswith(COMM_PREFIX) or name.startswith(_THIRD_PARTY_COMM):
        return Kind(COMM)
    if name.startswith(COMPUTE_PREFIX) or name.startswith("aten::"):
        return Kind(COMPUTE)
    piece = parse(name)
    if piece is None:
        return None
    wait = piece.suffix == "wait"
    return Kind(COMM, wait=True) if wait else Kind(ROLES[piece.role])


def _tp_op(head: str) -> bool:
    return head.removesuffix("_backward") in TP_OPS


def is_fused_op(name: str) -> bool:
    """True for a piece of a fused TP op (``all_gather_matmul.chunked.gemm[0]``); the unfused
    backend's collectives are not fused."""
    piece = parse(name)
    if piece is None:
        return False
    head, _, backend = piece.path.partition(".")
    return _tp_op(head) and backend.split(".")[0] != "unfused"


def axis_of(name: str) -> str | None:
    """The axis a communication range names (one of AXES), or None when the name does not say
    (``gloo:*``, ``comm_wait:symm.wait``, ``pp.stage0.F[1]``): the reader then takes the axis of
    the range it is nested in. ``comm_wait:<axis>.<what>`` and ``comm:<axis>...`` name it by
    their first part; pieces by their path's first part when the piece is communication, and
    any piece of a TP op (tp) or of the MoE exchange (ep) names its op's axis."""
    for prefix in (COMM_WAIT_PREFIX, COMM_PREFIX):
        if name.startswith(prefix):
            m = _HEAD.match(name, len(prefix))
            head = m.group(0) if m else ""
            return "tp" if _tp_op(head) else _AXIS_OF_HEAD.get(head)
    piece = parse(name)
    if piece is None:
        return None
    head = piece.path.split(".")[0]
    if _tp_op(head):
        return "tp"
    if head == "moe":
        return "ep"
    if ROLES[piece.role] == COMM or piece.suffix == "wait":
        return _AXIS_OF_HEAD.get(head)
    return None


def is_nccl_kernel(name: str) -> bool:
    return "nccl" in name.lower()


def classify_kernel(name: str) -> Kind:
    """The kind of a device kernel: the registry first, then NCCL by name, else compute."""
    info = registry.lookup(name)
    if info is not None:
        return Kind(info.kind, wait=info.waits)
    return Kind(COMM) if is_nccl_kernel(name) else Kind(COMPUTE)


# CUPTI's CUpti_ActivityMemcpyKind, which nsys exports as copyKind (ENUM_CUDA_MEMCPY_OPER).
MEMCPY_KINDS = {0: "Unknown", 1: "HtoD", 2: "DtoH", 3: "HtoA", 4: "AtoH", 5: "AtoA", 6: "AtoD",
                7: "DtoA", 8: "DtoD", 9: "HtoH", 10: "PtoP", 11: "HtoD", 12: "DtoH", 13: "DtoD"}


def classify_memcpy(copy_kind: str, *, peer: bool, comm_stream: bool) -> Kind | None:
    """A copy row: ``copy_kind`` is "PtoP", "DtoD", "HtoD", ...; ``peer`` is True when source
    and destination devices differ. None means "not counted" (host<->device traffic)."""
    if copy_kind == "PtoP" or peer:
        return Kind(COMM)
    if copy_kind == "DtoD":
        return Kind(COMM) if comm_stream else Kind(COMPUTE)
    return None


# -- builders: the writer's side. Use these instead of formatting names by hand. ----------------

def step(n: int) -> str:
    return f"{STEP_PREFIX}{n}"


def comm_wait(what: str) -> str:
    return f"{COMM_WAIT_PREFIX}{what}"


def comm(what: str) -> str:
    return f"{COMM_PREFIX}{what}"


def compute(what: str) -> str:
    return f"{COMPUTE_PREFIX}{what}"


def chunk(op: str, backend: str, role: str, index: object = None, suffix: str | None = None) -> str:
    """``<op>.<backend>.<role>[<index>].<suffix>``, e.g. ``chunk("all_gather_matmul",
    "chunked", "comm", 3, "wait")``."""
    return _piece(f"{op}.{backend}", role, index, suffix)


def pp_action(action: str, *, stage: int, micro_batch: int) -> str:
    """A pipeline action: ``pp.stage<stage>.<F|B|I|W>[<micro_batch>]``."""
    if action not in PP_ACTIONS:
        raise ValueError(f"pp_action: action must be one of {PP_ACTIONS}, got {action!r}")
    return _piece(f"pp.stage{stage}", action, micro_batch, None)


def dp_bucket(what: str, bucket: int, *, wait: bool = False) -> str:
    """A data-parallel bucket's collective (``what``: "grads" or "params"):
    ``dp.<what>.comm[<bucket>]`` for the launch, ``....wait`` for the wait."""
    return _piece(f"dp.{what}", "comm", bucket, "wait" if wait else None)


def quant(kind: str, op: str, index: object = None) -> str:
    """``quant.<op>.<quantize|dequantize>[<index>]``."""
    if kind not in ("quantize", "dequantize"):
        raise ValueError(f"quant: kind must be 'quantize' or 'dequantize', got {kind!r}")
    return _piece(f"quant.{op}", kind, index, None)


def _piece(path: str, role: str, index: object, suffix: str | None) -> str:
    if role not in ROLES:
        raise ValueError(f"role must be one of {tuple(ROLES)}, got {role!r}")
    name = f"{path}.{role}" + ("" if index is None else f"[{index}]")
    name += "" if suffix is None else f".{suffix}"
    if parse(name) is None:
        raise ValueError(f"{name!r} does not follow the naming scheme (overlap/profile/names.py): "
                         "path parts must be identifiers and the index must not contain ']'")
    return name
