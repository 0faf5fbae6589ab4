"""Hand-written device kernels (Pallas) behind jtp's stable interfaces."""

from jtp.kernels.ragged_paged_attention import ragged_paged_attention, supported

__all__ = ["ragged_paged_attention", "supported"]
