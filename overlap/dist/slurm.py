"""A SLURM job step (``srun``) as a launcher: its variables mapped onto torchrun's.

``adopt(tp=...)`` turns a step of >= 2 tasks into RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR and MASTER_PORT in ``os.environ``, so the torchrun path of a command runs unchanged.
Precedence: RANK, WORLD_SIZE and LOCAL_RANK already set (torchrun, or srun starting torchrun)
win and SLURM is ignored; else a step (SLURM_PROCID and SLURM_STEP_ID set: a batch script
without srun is none) of >= 2 tasks is used; else the command starts its own local processes.
Step variables (SLURM_STEP_*) win over the job's. Rendezvous host: MASTER_ADDR, else the first
node of the node list; port: MASTER_PORT, else the first of SLURM_STEP_RESV_PORTS, else
``default_port(job, step)``. Ranks must be SLURM's block layout (each node's tasks consecutive
ranks; ``rank = offset(SLURM_NODEID) + SLURM_LOCALID``) and tp must divide every node's task
count, so a TP group never leaves its node. Every inconsistency raises ``SlurmError`` naming
the variables, before any process group starts. Guide: docs/training.md, "SLURM".
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import zlib
from collections.abc import MutableMapping

from overlap.errors import OverlapError

__all__ = ["SlurmError", "SlurmStep", "expand_hostlist", "expand_tasks_per_node",
           "is_slurm_step", "read_step", "default_port", "adopt", "adopt_or_exit"]

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
_NTASKS = ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
_NNODES = ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
_NODELIST = ("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")
_TASKS_PER_NODE = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE")
_MAX_HOSTS = 1 << 20  # a typo such as node[1-999999999] must not expand into memory
PORT_BASE, PORT_SPAN = 15000, 15000  # unprivileged, below Linux's ephemeral range (32768+)


class SlurmError(OverlapError, ValueError):
    """SLURM's variables are missing, unparsable or inconsistent; the message names them."""


def _split_top(text: str, what: str) -> list[str]:
    """Split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            if depth:
                raise SlurmError(f"{what}: nested '[' at position {i}")
            depth = 1
        elif ch == "]":
            if not depth:
                raise SlurmError(f"{what}: ']' without '[' at position {i}")
            depth = 0
        elif ch == "," and not depth:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise SlurmError(f"{what}: unclosed '['")
    parts.append(text[start:])
    if any(not p for p in parts):
        raise SlurmError(f"{what}: empty entry (two commas in a row, or a trailing comma)")
    return parts


def _expand_ranges(group: str, what: str) -> list[str]:
    out: list[str] = []
    for part in group.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise SlurmError(f"{what}: {part!r} in [{group}] is not N or N-M")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise SlurmError(f"{what}: range {part!r} in [{group}] ends before it starts")
        if len(out) + hi - lo >= _MAX_HOSTS:
            raise SlurmError(f"{what}: [{group}] names more than {_MAX_HOSTS} hosts")
        width = len(m.group(1))  # zero padding follows the low bound: [08-10] -> 08 09 10
        out += [str(n).zfill(width) for n in range(lo, hi + 1)]
    return out


def expand_hostlist(text: str, *, what: str = "node list") -> list[str]:
    """SLURM's compressed host list as host names, in order: ``node[01-03,07]`` -> node01
    node02 node03 node07; ``a[1-2],b3``; ``rack[1-2]-n[1-2]`` -> rack1-n1 rack1-n2 rack2-n1
    rack2-n2 (the last bracket varies fastest). Raises SlurmError if it does not parse."""
    text = text.strip()
    if not text:
        raise SlurmError(f"{what} is empty")
    hosts: list[str] = []
    for item in _split_top(text, what):
        pieces = re.split(r"\[([^\]]*)\]", item)  # literal, group, literal, group, ..., literal
        literals, groups = pieces[0::2], pieces[1::2]
        for lit in literals:
            if not re.fullmatch(r"[A-Za-z0-9._-]*", lit):
                raise SlurmError(f"{what}: {item!r} has a character a host name cannot have")
        choices = [_expand_ranges(g, what) for g in groups]
        for combo in itertools.product(*choices):
            hosts.append(literals[0] + "".join(c + lit for c, lit in zip(combo, literals[1:])))
            if len(hosts) > _MAX_HOSTS:
                raise SlurmError(f"{what}: names more than {_MAX_HOSTS} hosts")
    return hosts


def expand_tasks_per_node(text: str, *, what: str = "tasks per node") -> list[int]:
    """SLURM's compressed per-node counts: ``2(x3),1`` -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in (text.strip().split(",") if text.strip() else [""]):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m or int(m.group(1)) < 1 or (m.group(2) and int(m.group(2)) < 1):
            raise SlurmError(f"{what}: {part!r} in {text!r} is not N or N(xK) with N, K >= 1")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def default_port(job_id: str | None, step_id: str | None) -> int:
    """The rendezvous port of a step without MASTER_PORT: in [15000, 30000), different for
    steps 0-14 of one job and for any two jobs whose ids differ by less than 1000."""
    job = int(job_id) if job_id and job_id.isdigit() else zlib.crc32((job_id or "").encode())
    step = int(step_id) if step_id and step_id.isdigit() else 0
    return PORT_BASE + (job % (PORT_SPAN // 15)) * 15 + step % 15


def is_slurm_step(environ: MutableMapping[str, str] | None = None) -> bool:
    """Whether this process is a task of an srun step (not the batch script itself)."""
    env = os.environ if environ is None else environ
    return "SLURM_PROCID" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SlurmStep:
    """One task of a step: its rank in SLURM's block layout and the step's rendezvous."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    nodes: tuple[str, ...]
    tasks_per_node: tuple[int, ...]
    master_addr: str
    master_port: int
    job_id: str | None = None
    step_id: str | None = None

    def torch_env(self) -> dict[str, str]:
        """torchrun's variables for this task."""
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": str(self.local_rank),
                "LOCAL_WORLD_SIZE": str(self.local_world_size),
                "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)}


def _first(env, names: tuple[str, ...]) -> tuple[str, str] | None:
    for name in names:
        if env.get(name, "").strip():
            return name, env[name].strip()
    return None


def _int(env, names: tuple[str, ...], *, low: int = 0) -> tuple[str, int]:
    found = _first(env, names)
    if found is None:
        raise SlurmError(f"SLURM step: none of {', '.join(names)} is set")
    name, text = found
    if not re.fullmatch(r"\d+", text) or int(text) < low:
        raise SlurmError(f"SLURM step: {name}={text!r} is not an integer >= {low}")
    return name, int(text)


def _port(env, step: tuple[str | None, str | None]) -> int:
    if env.get("MASTER_PORT", "").strip():
        text = env["MASTER_PORT"].strip()
        if not text.isdigit() or not 0 < int(text) < 65536:
            raise SlurmError(f"MASTER_PORT={text!r} is not a port number (1-65535)")
        return int(text)
    resv = env.get("SLURM_STEP_RESV_PORTS", "").strip()
    if resv:  # ports SLURM reserved for this step on its nodes: e.g. 12000-12015
        m = re.match(r"(\d+)", resv)
        if not m:
            raise SlurmError(f"SLURM_STEP_RESV_PORTS={resv!r} does not start with a port")
        return int(m.group(1))
    return default_port(*step)


def _check_block_layout(env, counts: list[int], tpn_name: str) -> None:
    dist_text = env.get("SLURM_DISTRIBUTION", "").strip()
    node_dist = dist_text.split(",")[0].split(":")[0]
    if node_dist.startswith("plane="):
        plane = node_dist[len("plane="):]
        ok = plane.isdigit() and int(plane) >= max(counts)
    else:
        ok = node_dist in ("", "*", "block") or (node_dist == "cyclic" and max(counts) == 1)
    if not ok and node_dist != "arbitrary":  # arbitrary: the per-task check below decides
        raise SlurmError(
            f"SLURM step: SLURM_DISTRIBUTION={dist_text!r} with {tpn_name}="
            f"{env.get(tpn_name, '')!r} does not give each node consecutive ranks; a TP group "
            "is consecutive ranks and must stay inside a node: srun --distribution=block "
            "(the default)")


def read_step(environ: MutableMapping[str, str] | None = None, *, tp: int | None = 1
              ) -> SlurmStep:
    """This task of the step from its SLURM variables; ``tp`` (None: no constraint) must
    divide every node's task count. Raises SlurmError naming the variables."""
    env = os.environ if environ is None else environ
    proc_name, procid = _int(env, ("SLURM_PROCID",))
    ntasks_name, ntasks = _int(env, _NTASKS, low=1)
    local_name, localid = _int(env, ("SLURM_LOCALID",))
    node_name, nodeid = _int(env, ("SLURM_NODEID",))
    found = _first(env, _NODELIST)
    if found is None:
        raise SlurmError(f"SLURM step: none of {', '.join(_NODELIST)} is set")
    list_name, list_text = found
    nodes = expand_hostlist(list_text, what=f"{list_name}={list_text!r}")
    nnodes = _first(env, _NNODES)
    if nnodes is not None and nnodes[1] != str(len(nodes)):
        raise SlurmError(f"SLURM step: {nnodes[0]}={nnodes[1]!r} but {list_name}={list_text!r} "
                         f"names {len(nodes)} nodes")
    found = _first(env, _TASKS_PER_NODE)
    if found is None and len(nodes) > 1:
        raise SlurmError(f"SLURM step: none of {', '.join(_TASKS_PER_NODE)} is set and "
                         f"{list_name} names {len(nodes)} nodes")
    tpn_name, tpn_text = found or (ntasks_name, str(ntasks))
    counts = expand_tasks_per_node(tpn_text, what=f"{tpn_name}={tpn_text!r}")
    if tpn_name == "SLURM_NTASKS_PER_NODE" and len(counts) == 1:
        counts *= len(nodes)  # one number for every node
    if len(counts) != len(nodes):
        raise SlurmError(f"SLURM step: {tpn_name}={tpn_text!r} gives {len(counts)} nodes but "
                         f"{list_name}={list_text!r} names {len(nodes)}")
    if sum(counts) != ntasks:
        raise SlurmError(f"SLURM step: {ntasks_name}={ntasks} but {tpn_name}={tpn_text!r} sums "
                         f"to {sum(counts)}")
    if procid >= ntasks:
        raise SlurmError(f"SLURM step: {proc_name}={procid} is outside 0..{ntasks - 1} "
                         f"({ntasks_name}={ntasks})")
    if nodeid >= len(nodes):
        raise SlurmError(f"SLURM step: {node_name}={nodeid} is outside 0..{len(nodes) - 1} "
                         f"({list_name}={list_text!r})")
    if localid >= counts[nodeid]:
        raise SlurmError(f"SLURM step: {local_name}={localid} but node {nodeid} has "
                         f"{counts[nodeid]} tasks ({tpn_name}={tpn_text!r})")
    _check_block_layout(env, counts, tpn_name)
    offset = sum(counts[:nodeid])
    if procid != offset + localid:
        raise SlurmError(
            f"SLURM step: {proc_name}={procid} on {node_name}={nodeid} with {local_name}="
            f"{localid}; the block layout of {tpn_name}={tpn_text!r} has rank {offset + localid} "
            "there: each node's tasks must be consecutive ranks (srun --distribution=block)")
    if tp is not None:
        bad = [i for i, c in enumerate(counts) if c % tp]
        if bad:
            raise SlurmError(
                f"SLURM step: tp={tp} must divide every node's task count, or a TP group would "
                f"span nodes; {tpn_name}={tpn_text!r} gives node {bad[0]} ({nodes[bad[0]]}) "
                f"{counts[bad[0]]} tasks: launch tasks per node as a multiple of tp")
    job = _first(env, ("SLURM_JOB_ID", "SLURM_JOBID"))
    step = _first(env, ("SLURM_STEP_ID", "SLURM_STEPID"))
    ids = (job[1] if job else None, step[1] if step else None)
    return SlurmStep(rank=procid, world_size=ntasks, local_rank=localid,
                     local_world_size=counts[nodeid], node_rank=nodeid, nodes=tuple(nodes),
                     tasks_per_node=tuple(counts),
                     master_addr=env.get("MASTER_ADDR", "").strip() or nodes[0],
                     master_port=_port(env, ids), job_id=ids[0], step_id=ids[1])


def adopt(*, tp: int | None = 1, environ: MutableMapping[str, str] | None = None
          ) -> SlurmStep | None:
    """Under an srun step of >= 2 tasks (and no torchrun variables): write torchrun's
    variables into ``environ`` (default ``os.environ``) and return the step; else None."""
    env = os.environ if environ is None else environ
    present = [k for k in TORCHRUN_VARS if k in env]
    if len(present) == len(TORCHRUN_VARS) or not is_slurm_step(env):
        return None  # torchrun's (srun starting torchrun), or no step: not ours to map
    if _int(env, _NTASKS, low=1)[1] < 2:
        return None  # a one-task step (srun --pty bash): the command starts its own ranks
    if present:
        raise SlurmError(f"under srun, {', '.join(f'{k}={env[k]!r}' for k in present)} is set "
                         f"but not all of {', '.join(TORCHRUN_VARS)}: set all three (they "
                         "then win over SLURM's variables) or none")
    step = read_step(env, tp=tp)
    env.update(step.torch_env())
    return step


def adopt_or_exit(prog: str, *, tp: int | None = 1) -> SlurmStep | None:
    """``adopt`` for a command line: a SlurmError exits with ``<prog>: error: <message>``."""
    try:
        return adopt(tp=tp)
    except SlurmError as exc:
        raise SystemExit(f"{prog}: error: {exc}") from None
