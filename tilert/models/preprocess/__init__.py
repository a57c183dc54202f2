"""The published ``tilert.models.preprocess.weight_converter`` entry point (see ``tilert.pd_vllm.aliases``)."""
