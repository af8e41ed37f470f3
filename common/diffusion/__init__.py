"""Shared parts of the diffusion recipes: sequence parallel attention, step caches, VAE tiling."""
