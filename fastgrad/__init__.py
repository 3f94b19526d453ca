"""fastgrad: fused, sync-free gradient management for PyTorch."""

__version__ = "0.1.0"
