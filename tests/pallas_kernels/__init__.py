"""Tests of the pallas_kernels package (interpret mode on CPU; gpu_only tests on a GPU)."""
