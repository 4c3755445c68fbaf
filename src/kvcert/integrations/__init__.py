"""Glue to model code (transformers): the certified cache and its attention function, the memory-path adapters
(MLA latents, top-k selectors, pooled entries, recurrent gates) and the live probe that runs a request through
them. Submodules are imported on use: each pulls in transformers."""

__all__ = [
    "attention_impl",
    "cache_config",
    "certified_layer",
    "forget_gates",
    "kappa_feeder",
    "live_probe",
    "mla",
    "model_attention",
    "observed_cache",
    "pooled_attention",
    "selector",
    "transformers",
]
