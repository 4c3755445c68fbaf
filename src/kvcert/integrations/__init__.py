"""Glue to model code (transformers): the certified cache and its attention function, the memory-path adapters
(MLA latents, top-k selectors, pooled entries, recurrent gates) and the live probe that runs a request through
them. Submodules are imported on use: each pulls in transformers."""

__all__ = [
    "attention_impl",
    "forget_gates",
    "live_probe",
    "mla",
    "observed_cache",
    "pooled_attention",
    "selector",
    "transformers",
]
