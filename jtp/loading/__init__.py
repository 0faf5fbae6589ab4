"""Weights onto the mesh: tensor sources, safetensors and Orbax loaders, dummy weights."""
