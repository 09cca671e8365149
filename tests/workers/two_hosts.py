"""The job's store as host A of tests/test_two_hosts.py sees it (the test process is outside both hosts' networks).

Waits until ``--joiners N`` processes wait to join, so that the scale-out scripted for them finds them ready at
its step. Endpoint and token come from
``$DYNATRAIN_ENDPOINT`` and ``$DYNATRAIN_TOKEN``, as for every process of the job.
"""

import argparse
import os
import sys
import time

from dynatrain.elastic import connect, pending_joiners
from dynatrain.elastic.manager import ENDPOINT_ENV, TOKEN_ENV


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--joiners", type=int, required=True)
    ap.add_argument("--timeout", type=float, default=120.0)
    args = ap.parse_args()
    store = connect(os.environ[ENDPOINT_ENV], os.environ[TOKEN_ENV], timeout=args.timeout)
    deadline = time.monotonic() + args.timeout
    while len(pending_joiners(store, [])) < args.joiners:
        if time.monotonic() > deadline:
            print(f"only {len(pending_joiners(store, []))} of {args.joiners} joiners registered within "
                  f"{args.timeout:.0f}s", file=sys.stderr)
            return 1
        time.sleep(0.1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
