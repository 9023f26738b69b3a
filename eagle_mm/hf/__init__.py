"""The one adapter to transformers and torch internals: a target model's parts (the per-family table), feature capture,
multimodal positions, the cache, generation-config fields, dynamo marks and version differences."""
