"""Test and benchmark helpers: float64 numpy reference attention and GPU timing.

Importing this package never imports a GPU framework; the timing helpers import torch
on first use.
"""

from .reference import alibi_slopes, attention_ref, to_numpy, to_numpy_f64

__all__ = ["alibi_slopes", "attention_ref", "to_numpy", "to_numpy_f64"]
