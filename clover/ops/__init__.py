"""Tensor math of Clover's mixers, separate from the layers that hold parameters (flash-linear-attention style)."""
