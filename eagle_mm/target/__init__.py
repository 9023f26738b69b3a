"""A target model's parts (the per-family table), feature capture, multimodal positions and version differences."""
