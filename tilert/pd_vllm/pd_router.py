"""``python -m tilert.pd_vllm.pd_router ...``: the published router command (see :mod:`.aliases`)."""

import sys

from tilert.pd_vllm.aliases import pd_router_args, run_alias

if __name__ == "__main__":
    sys.exit(run_alias(pd_router_args))
