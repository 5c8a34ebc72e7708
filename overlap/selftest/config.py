"""SelftestConfig: the one definition of ``overlap-selftest``'s settings; the CLI is generated
from it (as ``overlap.train.config`` does), and checked before any process starts."""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch

from overlap import cli
from overlap.errors import ConfigError  # one for every command (re-exported)

__all__ = ["SelftestConfig", "ConfigError", "build_parser", "parse_args"]

DEVICES = ("auto", "cpu", "cuda")


_field = cli.field


@dataclasses.dataclass(kw_only=True, slots=True)
class SelftestConfig:
    world_size: int | None = _field(None, "local ranks to start (default: one per GPU on a GPU "
                                          "node, else 2); ignored under torchrun")
    device: str = _field("auto", "where the checks run: auto (cuda with >= 2 GPUs, else the "
                                 "CPU twins), cpu or cuda", choices=DEVICES)
    ranks_per_gpu: int | None = _field(None, "ranks that share one GPU (rank r on GPU r // N; "
                                             "default: env OVERLAP_RANKS_PER_GPU, else 1): one "
                                             "GPU runs the GPU checks at --ranks-per-gpu 2")
    json: str | None = _field(None, "also write the environment and every check's result to "
                                    "this JSON file", metavar="FILE")
    only: str | None = _field(None, "run only the checks whose name matches one of these "
                                    "comma-separated globs, e.g. 'tp.*,pp.*'",
                                metavar="GLOBS")
    op_timeout: float = _field(60.0, "seconds any op or wait inside a check may take",
                               metavar="SECONDS")
    peer_timeout: float = _field(2.0, "timeout of the missing-peer check: the op must raise "
                                      "within it (plus 10 s of slack for a loaded machine)",
                                 metavar="SECONDS")
    timeout: float = _field(600.0, "seconds before a hung local run is killed",
                            metavar="SECONDS")
    inject_failure: str | None = _field(None, "tests only: corrupt the named checks' results "
                                              "(comma-separated names)", hidden=True,
                                        metavar="NAMES")

    def validate(self) -> None:
        """Raise ConfigError (one line) for settings that cannot work."""
        if self.world_size is not None and (not isinstance(self.world_size, int)
                                            or self.world_size < 2):
            raise ConfigError(f"--world-size must be an integer >= 2 (the checks exchange data "
                              f"between ranks), got {self.world_size}")
        if self.ranks_per_gpu is not None:
            from overlap.dist.device import ranks_per_gpu

            try:
                ranks_per_gpu(self.ranks_per_gpu)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        for name in ("op_timeout", "peer_timeout", "timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be > 0 seconds, got "
                                  f"{getattr(self, name)}")
        if self.peer_timeout >= self.op_timeout:
            raise ConfigError(f"--peer-timeout ({self.peer_timeout}) must be less than "
                              f"--op-timeout ({self.op_timeout})")

    def selects(self, check: str) -> bool:
        if not self.only:
            return True
        return any(fnmatch.fnmatchcase(check, pat.strip()) for pat in self.only.split(","))

    def corrupts(self, check: str) -> bool:
        """Whether --inject-failure names this check (tests only)."""
        return check in {n.strip() for n in (self.inject_failure or "").split(",")}


_PROG = "overlap-selftest"
_DESCRIPTION = ("Detect this machine's devices, versions and GPU interconnect, then run "
                "every fused op x backend, the quantized collectives, the signal kernels, "
                "a pipeline step and a missing-peer timeout against their references. "
                "Exit code 0 iff every check passed. Without torchrun it starts its own "
                "local processes (one per GPU, or 2 CPU ranks on nccl_twin).")


_GROUPS = (("where the checks run", ("device", "world_size", "ranks_per_gpu")),
           ("what to run and report", ("only", "json")),
           ("timeouts", ("op_timeout", "peer_timeout", "timeout")))
EXAMPLES = """\
examples:
  overlap-selftest                             # every check; 2 CPU ranks without GPUs
  overlap-selftest --only 'tp.*,pp.*' --json selftest.json
  overlap-selftest --device cuda --ranks-per-gpu 2    # one GPU: two ranks on it
  torchrun --nproc-per-node 8 -m overlap.selftest     # one rank per GPU
"""


def build_parser() -> "argparse.ArgumentParser":
    return cli.build_parser(SelftestConfig, prog=_PROG, description=_DESCRIPTION,
                            groups=_GROUPS, epilog=EXAMPLES)


def parse_args(argv: list[str] | None = None) -> SelftestConfig:
    """Parse and validate; a bad value exits with status 2 and a one-line message."""
    return cli.parse(SelftestConfig, argv, prog=_PROG, description=_DESCRIPTION,
                     errors=(ConfigError,), groups=_GROUPS, epilog=EXAMPLES)
