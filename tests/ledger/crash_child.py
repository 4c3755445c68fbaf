"""Child process for the crash test: writes a ledger log forever, printing each completed iteration.

argv: LOG HELPERS_DIR [sync|background]; in background (group-commit) mode an iteration is printed only
after ``flush()`` made it durable.
"""

import sys

from kvcert.ledger import EventLog, Ledger
from kvcert.ledger.events import FaultReport

sys.path.insert(0, sys.argv[2])
from ledger_workload import run_workload  # noqa: E402

background = len(sys.argv) > 3 and sys.argv[3] == "background"
log = EventLog(sys.argv[1], background=background, max_pending=8)
ledger = Ledger(log=log)


def committed(i: int) -> None:
    # ten marker events in ONE transaction: replay must see all ten or none
    log.append_many(FaultReport("marker", "m", 0, i, str(j)) for j in range(10))
    ledger.flush()
    print(i, flush=True)


run_workload(ledger, 10**9, on_commit=committed)
