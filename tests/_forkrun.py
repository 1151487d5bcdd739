"""Launch WORLD ranks of a program on this host as torchrun would, each rank forked from this process after
torch and cute_ep are imported: a launch costs one set of imports instead of one per rank plus torchrun's
own (about 3 s of CPU each on a 2-core machine, most of a small CPU test's launch).

    python tests/_forkrun.py WORLD [--each DIR] SCRIPT [ARGS...]      (SCRIPT may be -c CODE)

Every rank gets torchrun's launch variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT: MASTER_PORT from the environment if set, else a free port) and runs the program as
``__main__`` with the interpreter's normal exit (tests/_zygote.py ``run_program``). As torchrun's agent,
this process hosts the job's one TCPStore at MASTER_ADDR:MASTER_PORT and the ranks connect to it
(TORCHELASTIC_USE_AGENT_STORE): without it rank 0 hosted a new store at every process-group start, and a
program that starts several in a row (scripts/runtime_cycles.py) saw a peer reach the port while rank 0's
previous store was closing ("Failed to recv, got 0 bytes"): 3 of 14 runs of two test files at once
(`pytest -n 4`) on a 2-core machine, and 0 of 6 with the one store.

- Without ``--each``: the ranks write to this process's stdout and stderr; once one exits with a non-zero
  status the others get SIGTERM (as torchrun stops them), and this process exits 1 if any rank failed
  (torchrun's status whatever a worker returned), else 0.
- With ``--each DIR``: each rank's stdout and stderr go to DIR/rank<r>.out, its exit status to
  DIR/rank<r>.status (negative: the signal that killed it); no rank is stopped; this process exits 0.

The tests that check what torchrun itself prints or does still launch torchrun (tests/_launch.py
``torchrun``). Not a test module (the leading underscore keeps pytest from collecting it).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from _launch import free_port
from _zygote import fork_rank, import_once
from torch.distributed import TCPStore


def main() -> None:
    world, *rest = sys.argv[1:]
    each = None
    if rest[0] == "--each":
        each = Path(rest[1])
        each.mkdir(parents=True, exist_ok=True)
        rest = rest[2:]
    script, *args = rest
    master = (os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT") or free_port()))
    import_once()

    ranks: dict[int, int] = {}  # pid -> rank
    for rank in range(int(world)):
        outputs = {} if each is None else {each / f"rank{rank}.out": (1, 2)}
        ranks[fork_rank(rank, int(world), master, outputs, script, args, agent_store=True)] = rank
    # Started after the forks (no rank inherits the server's thread); the ranks' clients wait for it.
    store = TCPStore(master[0], master[1], is_master=True, wait_for_workers=False)  # noqa: F841 (kept open)
    failed = False
    while ranks:
        pid, status = os.wait()
        rank = ranks.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if each is not None:
            (each / f"rank{rank}.status").write_text(str(code))
        elif code != 0 and not failed:
            failed = True
            for other in ranks:  # as torchrun does: the launch has failed, stop the rest
                os.kill(other, signal.SIGTERM)
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
