"""``python -m overlap.pp SCHEDULE PP_SIZE NUM_MICROBATCHES [NUM_VIRTUAL]``: print a schedule's
per-rank programs and its simulated timeline (unit costs F=1, B=2, I=W=1)."""

import sys

from overlap.pp.build import build_schedule
from overlap.pp.check import diagram, render_table


def main(argv: list[str]) -> None:
    if len(argv) not in (3, 4):
        raise SystemExit(__doc__.split(":")[0].strip("`"))
    sched = build_schedule(argv[0], pp_size=int(argv[1]), num_microbatches=int(argv[2]),
                           num_virtual=int(argv[3]) if len(argv) == 4 else 1)
    print(render_table(sched))
    print(diagram(sched))


if __name__ == "__main__":
    main(sys.argv[1:])
