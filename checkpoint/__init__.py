"""Checkpointing: async torch_dist (DCP) persistent tier and a local in-memory / node-local tier."""
