"""CPU kernels for decode-sized work, shared by the target runner and the drafter (no model knowledge here)."""
