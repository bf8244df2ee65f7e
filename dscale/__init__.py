"""dscale: distributed dynamic loss scaling for PyTorch."""
