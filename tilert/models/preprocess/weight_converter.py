"""``python -m tilert.models.preprocess.weight_converter --model_type ... --model_dir ... --save_dir ...``: the
published converter command, an alias of ``tilert convert`` (see :mod:`tilert.pd_vllm.aliases`)."""

import sys

from tilert.pd_vllm.aliases import run_alias, weight_converter_args

if __name__ == "__main__":
    sys.exit(run_alias(weight_converter_args))
