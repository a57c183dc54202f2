"""``python -m tilert.pd_vllm.decode_server ...``: the published decode-node command (see :mod:`.aliases`)."""

import sys

from tilert.pd_vllm.aliases import decode_server_args, run_alias

if __name__ == "__main__":
    sys.exit(run_alias(decode_server_args))
